"""The live dashboard in headless Chromium against a real stack: the page renders, its
data-metric values move when load runs and when the policy is swapped from the page, and
a screenshot of it is a real PNG of the page."""

from __future__ import annotations

import struct
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.api.chromium import FLAGS, VIEWPORT, Chromium, chromium_path
from tests.services.conftest import wait_for

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(chromium_path() is None,
                                 reason="Debian's chromium is not installed (scripts/install.sh --test installs it)")]
NUM_REQUESTS, MAX_TOKENS = 4, 96


@pytest.fixture(scope="module")
def page(stack_api, tmp_path_factory):
    browser = Chromium(tmp_path_factory.mktemp("chromium") / "profile")
    try:
        browser.navigate(stack_api.base_url + "/dashboard")
        wait_for(lambda: browser.metrics().get("connection") == "connected"
                 and browser.metrics().get("kv_blocks_total", "-") != "-", 60, "the dashboard's first snapshot")
        yield browser
    finally:
        browser.close()


def test_page_says_what_the_stack_waits_for(api_alone, tmp_path):
    browser = Chromium(tmp_path / "profile")  # api_alone: an api with no back-end at all
    try:
        browser.navigate(api_alone.base_url + "/dashboard")
        wait_for(lambda: browser.metrics().get("connection") == "connected", 60, "the dashboard's first snapshot")
        m = browser.metrics()
        assert m["ready"] == "waiting for scheduler, kvstore, worker"
        assert m["policy"] == "-" and m["num_workers"] == "0" and m["num_requests_running"] == "-"
    finally:
        browser.close()


def _number(text: str) -> float:
    return float(text.rstrip("%"))


def test_index_links_the_dashboard(stack_api):
    index = httpx.get(stack_api.base_url + "/", timeout=10)
    assert index.status_code == 200 and 'href="/dashboard"' in index.text


def test_page_renders_the_stack_state(page):
    m = page.metrics()
    assert m["ready"] == "ready"
    assert m["policy"] == "fcfs"
    assert m["kv_blocks_total"] == "256"  # the backend's worker: --num-blocks 256
    assert m["num_workers"] == "1"
    assert page.evaluate("document.getElementById('title-0').textContent") == \
        "worker 0: 256 blocks of 16 tokens; running 0, waiting 0, preemptions 0"
    assert _number(m["kv_blocks_free"]) + _number(m["kv_blocks_cached"]) + _number(m["kv_blocks_in_use"]) \
        + _number(m["kv_blocks_shared"]) == 256
    assert page.evaluate("[...document.getElementById('policy-select').options].map(o => o.value)") \
        == ["fair", "fcfs", "priority", "sjf"]


def _assert_totals_are_the_legends_parts(m: dict[str, str]) -> None:
    """The header's used and total are the legend's parts, from the same snapshot."""
    parts = {k: int(m[f"kv_blocks_{k}"]) for k in ("free", "cached", "in_use", "shared")}
    assert int(m["kv_blocks_used"]) == parts["in_use"] + parts["shared"], m
    assert int(m["kv_blocks_total"]) == sum(parts.values()), m


def test_values_move_under_load(page, stack_api):
    """Batches of requests keep coming until the page has shown each value move (a batch may end
    between two snapshots), so it waits on what it observes, never on how fast the work goes."""
    before = page.metrics()
    seen = {"num_requests_running": 0.0, "kv_blocks_used": 0.0, "tokens_per_s": 0.0}

    def complete(i: int) -> dict:
        body = {"model": "smollm2", "prompt": f"Request number {i} tells a long story:", "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}
        return httpx.post(stack_api.base_url + "/v1/completions", json=body, timeout=300).json()

    futures = []
    deadline = time.monotonic() + 300
    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        while not all(seen.values()):
            assert time.monotonic() < deadline, f"the page never showed the load: {seen}"
            if not all(seen.values()) and all(f.done() for f in futures):
                futures += [pool.submit(complete, i) for i in range(len(futures), len(futures) + NUM_REQUESTS)]
            m = page.metrics()
            _assert_totals_are_the_legends_parts(m)
            for name in seen:
                if m[name] != "-":
                    seen[name] = max(seen[name], _number(m[name]))
            time.sleep(0.2)
        replies = [f.result() for f in futures]  # each bounded by its own timeout, however slow the machine
    assert [r["usage"]["completion_tokens"] for r in replies] == [MAX_TOKENS] * len(futures)
    expected = int(before["generation_tokens_total"]) + len(futures) * MAX_TOKENS
    wait_for(lambda: page.metrics()["generation_tokens_total"] == str(expected), 30,
             f"generation_tokens_total to reach {expected}")
    wait_for(lambda: page.metrics()["kv_blocks_used"] == "0", 30, "every block to be freed")
    # the finished requests' full blocks stay cached until the pool needs them
    wait_for(lambda: page.metrics()["kv_blocks_cached"] not in ("-", "0"), 30, "cached free blocks in the map")
    assert page.metrics()["ttft_ms"] is not None
    _assert_totals_are_the_legends_parts(page.metrics())


def test_a_new_page_draws_the_last_minutes_at_once(page, stack_api, tmp_path):
    """After the load above, a page opened now gets the server's history: its chart has points
    with tokens/s above 0 before its own second snapshot."""
    points = httpx.get(stack_api.base_url + "/dashboard/history", timeout=10).json()["points"]
    assert any(p["tps"] > 0 for p in points)
    browser = Chromium(tmp_path / "profile")
    try:
        browser.navigate(stack_api.base_url + "/dashboard")
        drawn = "Array.isArray(history) ? history.filter(h => h.tps > 0).length : 0"  # window.history until loaded
        wait_for(lambda: browser.evaluate(drawn) > 0, 30, "the history")
    finally:
        browser.close()


def test_policy_swap_from_the_page(page, stack_api):
    page.evaluate("document.getElementById('policy-select').value = 'sjf';"
                  "document.getElementById('policy-options').value = '{\"aging\": 3}';"
                  "document.getElementById('policy-swap').click()")
    try:
        wait_for(lambda: page.metrics()["policy_result"] == "now sjf", 30, "the swap's answer on the page")
        wait_for(lambda: page.metrics()["policy"] == "sjf", 30, "the page to show sjf in force")
        assert page.metrics()["policy_options"] == '{"aging":3}'
        assert httpx.get(stack_api.base_url + "/admin/policy", timeout=10).json()["policy"] == {
            "name": "sjf", "options": {"aging": 3}}
    finally:
        httpx.post(stack_api.base_url + "/admin/policy", json={"name": "fcfs"}, timeout=30)
    wait_for(lambda: page.metrics()["policy"] == "fcfs", 30, "the page to show fcfs again")


def test_screenshot_is_a_png_of_the_page(page, tmp_path):
    png = page.screenshot()
    (tmp_path / "dashboard.png").write_bytes(png)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == VIEWPORT
    assert len(png) > 20_000  # a blank page of that size is a few kB
    # the block map is drawn: 4x4 pixels a block in one of the four state colours
    drawn = page.evaluate("(() => { const c = document.querySelector('canvas.map');"
                          "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
                          "const colours = new Set(['228,228,228', '111,168,220', '87,187,138', '230,145,56']);"
                          "let n = 0; for (let i = 0; i < d.length; i += 4)"
                          "  if (d[i+3] === 255 && colours.has(`${d[i]},${d[i+1]},${d[i+2]}`)) n++;"
                          "return n; })()")
    assert drawn == 16 * 256


def test_a_screenshot_tool_waiting_for_idle_finishes(api_alone, tmp_path):
    """chromium --virtual-time-budget waits until the page's network is idle: the page polls, so it
    is between polls, and the screenshot is taken (an endless event stream never let it finish)."""
    png = tmp_path / "dashboard.png"
    done = subprocess.run([chromium_path(), *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                           "--virtual-time-budget=5000", f"--screenshot={png}", api_alone.base_url + "/dashboard"],
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
