"""The fast api tier: the real app in-process (Starlette's TestClient, an httpx client on the
ASGI app) against the real Redis, with the scheduler side played by Responder.

Responder reads the real requests stream and answers each api with real DeltaBatch
messages, one per tick for all its running requests (as the scheduler does per step):
request R's output is TOKENS[:max_tokens] (resubmissions go on after output_token_ids),
`per_step` tokens a step, finish "length"; an abort ends it with "abort". paused() holds
every request where it is. It also keeps the heartbeats of a ready back-end alive.
"""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field

import redis
from fastapi.testclient import TestClient

from pagedserve.services.api.app import ApiConfig, create_app
from pagedserve.services.api.inputs import ModelInfo
from pagedserve.shared.codec import pack, unpack
from pagedserve.shared.messages import AbortRequest, DeltaBatch, RequestDelta, SubmitRequest
from pagedserve.shared.parallel_sampling import child_request_ids
from pagedserve.shared.streams import FIELD, Keys
from pagedserve.shared.tokenizer import load_tokenizer
from tests.services.conftest import REDIS_URL, wait_for

TEXT = " The quick brown fox jumps over the lazy dog, and then it runs far away into the green forest."
_tokenizer = None


def tokenizer():
    global _tokenizer
    if _tokenizer is None:
        _tokenizer = load_tokenizer("smollm2")
    return _tokenizer


def expected_text(max_tokens: int) -> str:
    return tokenizer().decode(tokens()[:max_tokens])


def tokens() -> list[int]:
    return tokenizer().encode(TEXT)


@dataclass
class _Running:
    submit: SubmitRequest
    api_id: str
    sent: list[int] = field(default_factory=list)


class Responder:
    def __init__(self, keys: Keys, per_step: int = 2, step_s: float = 0.01, ready: bool = True) -> None:
        self.keys, self.per_step, self.step_s = keys, per_step, step_s
        self.r = redis.Redis.from_url(REDIS_URL)
        self.running: dict[str, _Running] = {}
        self.submits: list[SubmitRequest] = []
        self.aborts: list[str] = []
        self.ready = ready
        self._paused = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._last = "0"

    def __enter__(self) -> Responder:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for name in ("scheduler", "kvstore", "worker:0"):
            self.r.delete(self.keys.heartbeat(name))
        self.r.close()

    @contextmanager
    def paused(self):
        self._paused.set()
        try:
            yield
        finally:
            self._paused.clear()

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            if self.ready and time.monotonic() >= next_beat:
                for name in ("scheduler", "kvstore", "worker:0"):
                    self.r.set(self.keys.heartbeat(name), "responder", px=5000)
                next_beat = time.monotonic() + 1.0
            reply = self.r.xread({self.keys.requests: self._last}, count=100, block=int(self.step_s * 1000))
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    self._last = entry_id
                    self._take(unpack(fields[FIELD]))
            if not self._paused.is_set():
                self._step()

    def _take(self, msg) -> None:
        if isinstance(msg, SubmitRequest):
            self.submits.append(msg)
            for request_id in child_request_ids(msg.request_id, msg.sampling.n):
                if request_id not in self.running:
                    self.running[request_id] = _Running(msg, msg.api_id, list(msg.output_token_ids))
        elif isinstance(msg, AbortRequest):
            self.aborts.append(msg.request_id)
            run = self.running.pop(msg.request_id, None)
            if run is not None:
                self._send({run.api_id: [RequestDelta(msg.request_id, [], "abort", len(run.submit.prompt_token_ids),
                                                      len(run.sent))]})

    def _step(self) -> None:
        out: dict[str, list[RequestDelta]] = {}
        for request_id, run in list(self.running.items()):
            max_tokens = run.submit.sampling.max_tokens
            new = tokens()[len(run.sent):min(len(run.sent) + self.per_step, max_tokens)]
            run.sent += new
            finish = "length" if len(run.sent) >= max_tokens else None
            if finish:
                del self.running[request_id]
            out.setdefault(run.api_id, []).append(
                RequestDelta(request_id, new, finish, len(run.submit.prompt_token_ids), len(run.sent)))
        self._send(out)

    def _send(self, out: dict[str, list[RequestDelta]]) -> None:
        for api_id, deltas in out.items():
            self.r.xadd(self.keys.api_deltas(api_id), {FIELD: pack(DeltaBatch(int(time.time() * 1e6), deltas))})


def api_config(prefix: str, **kw) -> ApiConfig:
    return ApiConfig(**{"redis_url": REDIS_URL, "prefix": prefix, **kw})


@contextmanager
def api_client(prefix: str, api_id: str | None = None, wait_ready: bool = True, **kw):
    """A replica: the app in-process, started (lifespan) and stopped around the block;
    wait_ready: once /ready says the (Responder's) back-end is there."""
    config = api_config(prefix, api_id=api_id or f"api-{uuid.uuid4().hex[:8]}", **kw)
    info = ModelInfo(served_name="smollm2", max_model_len=2048, vocab_size=tokenizer().vocab_size)
    app = create_app(config, tokenizer(), info)
    with TestClient(app) as client:
        if config.api_key:
            client.headers["Authorization"] = f"Bearer {config.api_key}"
        if wait_ready:
            wait_for(lambda: client.get("/ready").status_code == 200, 20, "the api to be ready")
        yield client


def wait_status(client: TestClient, request_id: str, status: str, timeout: float = 20.0) -> dict:
    def done():
        body = client.get(f"/v1/requests/{request_id}").json()
        return body if body.get("status") == status else None

    return wait_for(done, timeout, f"request {request_id} to be {status}")


class ServedApi:
    """A replica served by uvicorn on a free port, in a thread of this process: for what
    needs a real socket (a client that hangs up, a WebSocket library)."""

    def __init__(self, prefix: str, api_id: str | None = None, **kw) -> None:
        import socket

        import uvicorn

        self.keys = Keys(prefix)
        self.api_key = kw.get("api_key")
        config = api_config(prefix, api_id=api_id or f"api-{uuid.uuid4().hex[:8]}", **kw)
        info = ModelInfo(served_name="smollm2", max_model_len=2048, vocab_size=tokenizer().vocab_size)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(config, tokenizer(), info), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.redis = redis.Redis.from_url(REDIS_URL)

    def __enter__(self) -> ServedApi:
        self.thread.start()
        wait_for(lambda: self.server.started, 20, "the in-process api to listen")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.sock.close()
        self.redis.close()

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs):
        import httpx

        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=kwargs.pop("timeout", 60.0),
                            **kwargs)

    def requests_stream(self) -> list:
        return [unpack(fields[FIELD]) for _id, fields in self.redis.xrange(self.keys.requests)]

    def logs(self) -> str:
        return ""
