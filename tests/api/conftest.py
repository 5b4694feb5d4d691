"""Real api processes for the api tests: `python -m pagedserve.services.api.main` on a free port.

`api_alone` runs an api (with an API key) on a fresh prefix and no back-end at all: enough
for validation, auth, REST bookkeeping and the abort messages a client leaving produces.
`stack_api` runs an api on the prefix of the real back-end stack (tests/services/conftest).
A failing test gets the api's log (and the back-end's) in its report.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from pagedserve.services.launcher.embedded_redis import free_port
from pagedserve.shared.codec import unpack
from pagedserve.shared.redis_connect import sync_client
from pagedserve.shared.streams import FIELD, Keys
from tests.services.conftest import DEFAULT_ARGS, REDIS_URL, ServiceStack, delete_prefix, start_backend, wait_for
from tests.waiting import stop_process

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"
START_TIMEOUT_S = 180.0


class ApiProcess:
    def __init__(self, log_dir: Path, prefix: str, api_key: str | None = None, args: list[str] | None = None,
                 redis_url: str = REDIS_URL, port: int | None = None):
        self.prefix, self.api_key = prefix, api_key
        self.keys = Keys(prefix)
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"api-{self.port}-{uuid.uuid4().hex[:4]}.log"
        cmd = [sys.executable, "-m", "pagedserve.services.api.main", "--port", str(self.port), "--prefix", prefix,
               "--redis-url", redis_url, *(args or [])]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("PAGEDSERVE_API_KEY", None)
        if api_key:
            env["PAGEDSERVE_API_KEY"] = api_key  # through the environment, as a deployment would
        with open(self.log_path, "w") as log_file:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        self.redis = sync_client(redis_url)  # plain or redis+sentinel://

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=kwargs.pop("timeout", 60.0),
                            **kwargs)

    def ws_url(self, path: str) -> str:
        return self.base_url.replace("http://", "ws://") + path

    def wait_healthy(self) -> None:
        def healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"api exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                return httpx.get(self.base_url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, START_TIMEOUT_S, "the api to answer /health", interval=0.2)

    def wait_ready(self) -> None:
        """Once it answers /health and its back-end is ready (/ready 200)."""
        self.wait_healthy()
        with self.client() as c:
            wait_for(lambda: c.get("/ready").status_code == 200, START_TIMEOUT_S, "/ready", interval=0.2)

    def requests_stream(self) -> list:
        """Every message the api put on the requests stream (SubmitRequest/AbortRequest)."""
        return [unpack(fields[FIELD]) for _id, fields in self.redis.xrange(self.keys.requests)]

    def logs(self, tail: int = 80) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return f"--- {self.log_path.name} ---\n" + "\n".join(lines[-tail:])

    def close(self) -> None:
        stop_process(self.proc, 30)
        self.redis.close()


@contextlib.contextmanager
def hanging_call(api, path: str, body: dict):
    """A POST of body to path of api (an ApiProcess or a ServedApi) on a socket of its own, its answer
    never read: the client hangs up (closes the connection) when the block ends, whatever the
    request's state then."""
    payload = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {
        "Host": "127.0.0.1", "Content-Type": "application/json", "Content-Length": len(payload), **api.headers}.items())
    with socket.create_connection(("127.0.0.1", api.port), timeout=60) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + payload)
        yield sock


def _delete_prefix(prefix: str) -> None:
    delete_prefix(prefix)


@pytest.fixture(scope="module")
def api_alone(tmp_path_factory):
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    api = ApiProcess(tmp_path_factory.mktemp("api"), prefix, api_key=API_KEY, args=["--max-body-bytes", "65536"])
    try:
        api.wait_healthy()
        yield api
    finally:
        api.close()
        _delete_prefix(prefix)


@pytest.fixture(scope="session")
def backend(tmp_path_factory):
    """One back-end for every api module that does not need its own configuration (starting a
    worker loads the model); its worker is named 0, as the dashboard's map is keyed by worker id.
    Tests that share it leave it idle and compare counters before and after, never absolute."""
    stack = start_backend(tmp_path_factory.mktemp("stack"), args={"worker": [*DEFAULT_ARGS["worker"], "--worker-id", "0"]})
    yield stack
    stack.close()


@pytest.fixture(scope="session")
def stack_api(backend: ServiceStack, tmp_path_factory):
    api = ApiProcess(tmp_path_factory.mktemp("api"), backend.keys.prefix)
    try:
        api.wait_ready()
        yield api
    finally:
        api.close()


@pytest.fixture(scope="module")
def oai(stack_api):
    """The official openai client on stack_api."""
    with openai.OpenAI(base_url=stack_api.base_url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    args = getattr(item, "funcargs", {})
    for name in ("api_alone", "stack_api"):
        if isinstance(args.get(name), ApiProcess):
            report.sections.append((f"{name} log", args[name].logs()))
    if isinstance(args.get("backend"), ServiceStack):
        report.sections.append(("back-end logs", args["backend"].logs()))
