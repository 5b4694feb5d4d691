"""/docs is Swagger UI from packaged assets: its page names no other host, its assets are served
here, and it renders every route in headless Chromium with every other host unreachable."""

from __future__ import annotations

import re

import httpx
import pytest

from pagedserve.services.api.openapi import DOCS_ASSETS
from tests.api.chromium import OFFLINE, Chromium, chromium_path
from tests.services.conftest import wait_for


def test_docs_page_loads_only_local_assets(api_alone):
    page = httpx.get(api_alone.base_url + "/docs", timeout=10)
    assert page.status_code == 200
    urls = re.findall(r"""(?:src|href)=["']([^"']+)|url: ["']([^"']+)""", page.text)
    urls = [a or b for a, b in urls]
    assert urls and all(u.startswith(("/docs/assets/", "/openapi.json")) for u in urls), urls
    for asset, kind in (("swagger-ui-bundle.js", "javascript"), ("swagger-ui.css", "css")):
        r = httpx.get(f"{api_alone.base_url}{DOCS_ASSETS}/{asset}", timeout=10)
        assert r.status_code == 200 and kind in r.headers["content-type"] and len(r.content) > 10_000


@pytest.mark.slow
@pytest.mark.skipif(chromium_path() is None,
                    reason="Debian's chromium is not installed (scripts/install.sh --test installs it)")
def test_docs_render_with_the_network_off(api_alone, tmp_path):
    paths = set(httpx.get(api_alone.base_url + "/openapi.json", timeout=10).json()["paths"])
    browser = Chromium(tmp_path / "profile", OFFLINE)
    try:
        browser.navigate(api_alone.base_url + "/docs")
        shown = "[...document.querySelectorAll('.opblock-summary-path')].map(e => e.dataset.path || e.textContent)"
        wait_for(lambda: len(browser.evaluate(shown) or []) >= len(paths), 60, "Swagger UI's operations")
        assert {p.replace("\u200b", "") for p in browser.evaluate(shown)} == paths
        assert browser.evaluate("document.querySelector('.information-container .title').textContent").startswith(
            "pagedserve")
    finally:
        browser.close()
