"""GET /admin/policy (in force) and POST /admin/policy {"name", "options"}: a swap takes effect
between two steps (running requests keep their blocks); 400 if refused, 504 if no scheduler answers.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from pagedserve.services.api.edge import read_body, state_of
from pagedserve.services.api.loop import RedisUnavailable
from pagedserve.services.api.protocol import ApiError, parse_json_object

router = APIRouter()
MAX_BODY_BYTES = 16 << 10


@router.get("/admin/policy")
async def get_policy(request: Request) -> dict:
    stats = await state_of(request).loop.read_stats()
    policy = stats.get("scheduler", {}).get("policy")
    if not isinstance(policy, dict):
        raise ApiError(503, "no scheduler has reported its policy yet", code="unavailable",
                       type="service_unavailable")
    return {"policy": policy}


@router.post("/admin/policy")
async def set_policy(request: Request) -> dict:
    name, options = _parse(await read_body(request, MAX_BODY_BYTES))
    try:
        reply = await state_of(request).loop.set_policy(name, options)
    except TimeoutError:
        raise ApiError(504, "the scheduler did not answer the policy change", code="scheduler_timeout",
                       type="service_unavailable") from None
    except RedisUnavailable as e:
        raise ApiError(503, str(e), code="unavailable", type="service_unavailable") from None
    if not reply.ok:
        raise ApiError(400, f"policy change refused: {reply.error}", code="invalid_policy", param="name")
    return {"policy": reply.result}


def _parse(raw: bytes) -> tuple[str, dict]:
    body = parse_json_object(raw)
    name, options = body.get("name"), body.get("options", {})
    if not isinstance(name, str) or not name:
        raise ApiError(400, "'name' must be the name of an installed policy (see `pagedserve policies`)",
                       param="name")
    if not isinstance(options, dict):
        raise ApiError(400, "'options' must be a JSON object", param="options")
    return name, options
