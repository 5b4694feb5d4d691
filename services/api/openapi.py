"""The OpenAPI schema (/openapi.json) and its docs page (/docs, Swagger UI from the fastapi-offline
package's assets under /docs/assets: no CDN, so it renders on a server without internet).

The routes parse their own bodies, so FastAPI cannot infer them: each route's body and responses are named here.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from pagedserve.services.api.protocol import ChatCompletionRequest, CompletionRequest


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Accepted(BaseModel):
    request_id: str


class RequestChoice(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None


class RequestRecord(BaseModel):
    request_id: str
    object: str = "request"
    created: int
    model: str
    status: str  # queued, running, finished, aborted, error
    text: str | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    choices: list[RequestChoice]
    usage: dict[str, Any]


class PolicyBody(BaseModel):
    name: str
    options: dict[str, Any] = {}


MODELS = (ErrorResponse, Accepted, RequestRecord, CompletionRequest, ChatCompletionRequest, PolicyBody)
_JSON = "application/json"
_ERRORS = {"400": "invalid input", "401": "missing or wrong API key", "404": "no such model or request",
           "413": "body over the size limit", "429": "waiting queue full for this tenant",
           "503": "not ready, or Redis unavailable (see Retry-After)"}
# (path, method) -> (request body model or None, success status, success model or description, error statuses)
ROUTES = {
    ("/v1/completions", "post"): (CompletionRequest, "200", "a completion, or an SSE stream when stream=true",
                                  ("400", "401", "404", "413", "429", "503")),
    ("/v1/chat/completions", "post"): (ChatCompletionRequest, "200",
                                       "a chat completion, or an SSE stream when stream=true",
                                       ("400", "401", "404", "413", "429", "503")),
    ("/v1/requests", "post"): ((CompletionRequest, ChatCompletionRequest), "202", Accepted, ("400", "401", "404", "413", "429", "503")),
    ("/v1/requests/{request_id}", "get"): (None, "200", RequestRecord, ("401", "404")),
    ("/v1/requests/{request_id}", "delete"): (None, "200", RequestRecord, ("401", "404")),
    ("/v1/requests/{request_id}/stream", "get"): (None, "200", "SSE: the record's events from Last-Event-ID or "
                                                  "?cursor=", ("400", "401", "404")),
    ("/admin/policy", "post"): (PolicyBody, "200", "the policy in force", ("400", "401", "503")),
}


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _components() -> dict:
    schemas: dict[str, Any] = {}
    for model in MODELS:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas


def build_schema(app: FastAPI) -> dict:
    schema = get_openapi(title="pagedserve", version="1", routes=app.routes,
                         description="OpenAI-compatible completions, REST request records and streams. "
                                     "WebSocket routes (/v1/stream, /v1/requests/{id}/stream) are not in OpenAPI.")
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {}).update(_components())
    components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, methods in schema.get("paths", {}).items():
        for method, operation in methods.items():
            operation.get("responses", {}).pop("422", None)  # FastAPI's default: ours is 400
            body, status, success, errors = ROUTES.get((path, method), (None, "200", None, ()))
            if body is not None:
                body_schema = {"oneOf": [_ref(m) for m in body]} if isinstance(body, tuple) else _ref(body)
                operation["requestBody"] = {"required": True, "content": {_JSON: {"schema": body_schema}}}
            if success is not None:
                described = isinstance(success, str)
                content = {} if described else {"content": {_JSON: {"schema": _ref(success)}}}
                operation["responses"] = {status: {"description": success if described else "success", **content}}
            for code in errors:
                operation["responses"][code] = {"description": _ERRORS[code],
                                                "content": {_JSON: {"schema": _ref(ErrorResponse)}}}
            if path.startswith(("/v1", "/admin")):
                operation["security"] = [{"bearer": []}]
    return schema


DOCS_ASSETS = "/docs/assets"


def install(app: FastAPI) -> None:
    """/openapi.json serves build_schema(), built once; /docs its Swagger UI from local assets."""
    cache: dict = {}

    def openapi() -> dict:
        if not cache:
            cache.update(build_schema(app))
        return cache

    app.openapi = openapi
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(files("fastapi_offline") / "static")), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} API",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon.png")
