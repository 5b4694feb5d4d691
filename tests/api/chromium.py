"""Headless Chromium driven over the DevTools protocol, for the dashboard's tests.

Debian's `chromium` is launched with a fresh profile and --remote-debugging-port=0; the
port it picked is read from DevToolsActivePort in that profile, and one page target is
driven over its WebSocket (websockets' sync client): navigate, evaluate, screenshot.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
from websockets.sync.client import connect

from tests.waiting import stop_process

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,1000"]
# no network beyond this machine: every host name fails to resolve, 127.0.0.1 still answers
OFFLINE = ("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",)
VIEWPORT = (1280, 1000)
START_TIMEOUT_S = 60.0


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    def __init__(self, profile_dir: Path, extra_flags: tuple[str, ...] = ()) -> None:
        self.profile_dir = profile_dir
        self.log_path = profile_dir.parent / f"{profile_dir.name}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([chromium_path(), *FLAGS, *extra_flags, f"--user-data-dir={profile_dir}",
                                          "--remote-debugging-port=0", "about:blank"],
                                         stdout=log, stderr=subprocess.STDOUT)
        self.next_id = 0
        self.exits = ExitStack()
        try:
            port = self._wait_port()
            targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            page = next(t for t in targets if t["type"] == "page")
            self.ws = self.exits.enter_context(connect(page["webSocketDebuggerUrl"], max_size=64 << 20,
                                                       open_timeout=20))
            # the viewport, exactly (--window-size also counts the headless window's frame)
            self.call("Emulation.setDeviceMetricsOverride", width=VIEWPORT[0], height=VIEWPORT[1],
                      deviceScaleFactor=1, mobile=False)
        except BaseException:
            self.close()
            raise

    def _wait_port(self) -> int:
        marker = self.profile_dir / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            text = marker.read_text() if marker.exists() else ""
            if "\n" in text:
                return int(text.split("\n", 1)[0])
            time.sleep(0.1)
        raise TimeoutError(f"chromium did not open its DevTools port: {self.log_path.read_text()[-2000:]}")

    def call(self, method: str, **params) -> dict:
        """Send one command and return its result (events arriving meanwhile are skipped)."""
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def metrics(self) -> dict[str, str]:
        """Every data-metric element's text (a <select>'s value), by metric name."""
        return self.evaluate("Object.fromEntries([...document.querySelectorAll('[data-metric]')].map("
                             "e => [e.dataset.metric, e.tagName === 'SELECT' ? e.value : e.textContent]))")

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])

    def close(self) -> None:
        self.exits.close()
        stop_process(self.proc, 20)
