"""The api's FastAPI app: the factory, health/readiness/metrics, and error handling.

A client error is an OpenAI-style 4xx that changes nothing; a 500 only ever means a bug here.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.services.api import admin_routes, dashboard_routes, openai_routes, openapi, policy_routes, stream_routes
from pagedserve.services.api.admission import AdmissionGate, RequestLimits
from pagedserve.services.api.edge import ApiState, AuthMiddleware, error_response
from pagedserve.services.api.inputs import ModelInfo
from pagedserve.services.api.loop import ApiLoop
from pagedserve.services.api.metrics import ApiMetrics
from pagedserve.services.api.protocol import ApiError
from pagedserve.services.api.readiness import Readiness, ReadyGate
from pagedserve.services.api.request import ApiRequest
from pagedserve.shared.streams import Keys

log = logging.getLogger("pagedserve.api")


@dataclass
class ApiConfig:
    model: str = "smollm2"  # what to load the tokenizer and context length for
    served_model_name: str | None = None  # the name clients use; defaults to model
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "pagedserve"
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    max_prompt_tokens: int | None = None  # per-request limits (400 past them); None: the context
    max_output_tokens: int | None = None
    api_id: str | None = None  # the scheduler sends this api's deltas by it: keep it across restarts
    record_ttl_s: int = 3600  # how long a request record stays in Redis after its last write

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model


def create_app(config: ApiConfig, tokenizer, info: ModelInfo) -> FastAPI:
    """The app; its lifespan starts the Redis loop and, on shutdown, aborts what runs here.
    info: what it serves, the one source of the context length (main.load_model_info)."""
    limits = RequestLimits(config.max_prompt_tokens, config.max_output_tokens)
    loop = ApiLoop(config.redis_url, Keys(config.prefix), api_id=config.api_id, admission=AdmissionGate(),
                   record_ttl_s=config.record_ttl_s)
    metrics = ApiMetrics(loop.api_id)
    state = ApiState(loop=loop, tokenizer=tokenizer, info=info, metrics=metrics,
                     max_body_bytes=config.max_body_bytes, limits=limits, api_key=config.api_key)
    loop.adopt = lambda request_id, meta, submit: state.open(ApiRequest.adopted(request_id, meta, submit), listen=False)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await loop.start()
        history = dashboard_routes.start_history(app)  # the dashboard's charts: the last 5 minutes
        log.info("api ready to serve %s (context %d tokens) on prefix %r", info.served_name, info.max_model_len,
                 config.prefix)
        try:
            yield
        finally:
            history.cancel()
            await loop.stop()

    app = FastAPI(title="pagedserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.api = state
    readiness = Readiness(loop)
    app.add_middleware(ReadyGate, readiness=readiness)
    app.add_middleware(AuthMiddleware, api_key=config.api_key)
    app.include_router(openai_routes.router)
    app.include_router(stream_routes.router)
    app.include_router(policy_routes.router)
    app.include_router(admin_routes.router)
    app.include_router(dashboard_routes.router)
    _add_error_handlers(app, metrics)
    openapi.install(app)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "api_id": loop.api_id}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        missing = await readiness.missing(fresh=True)
        if missing:
            return JSONResponse({"status": "not ready", "missing": missing}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        stats = await loop.read_stats(("scheduler", "kvstore", "launcher"))
        return Response(metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    return app


def _add_error_handlers(app: FastAPI, metrics: ApiMetrics) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        log.info("rejected %s %s: %d %s", request.method, request.url.path, error.status, error.message)
        return error_response(error, metrics)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(ApiError(400, f"invalid request: {error.errors()[:1]}"), metrics)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        return error_response(ApiError(error.status_code, str(error.detail), code=code), metrics)

    @app.exception_handler(RedisError)
    @app.exception_handler(OSError)
    async def redis_error(request: Request, error: Exception) -> JSONResponse:
        log.warning("%s %s: redis unavailable: %s", request.method, request.url.path, error)
        return error_response(ApiError(503, f"redis unavailable: {error}", code="unavailable",
                                       type="service_unavailable", headers={"Retry-After": "2"}), metrics)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse({"error": {"message": "internal server error", "type": "server_error", "param": None,
                                       "code": "internal_error"}}, status_code=500)
