"""POST /admin/prefix-cache/reset: the kvstore forgets every cached prefix hash (running requests
keep their blocks); 200 once its reply comes, 504 if not in time, 503 without Redis.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from pagedserve.services.api.edge import state_of
from pagedserve.services.api.loop import RedisUnavailable
from pagedserve.services.api.protocol import ApiError

router = APIRouter()


@router.post("/admin/prefix-cache/reset")
async def reset_prefix_cache(request: Request) -> dict:
    try:
        reply = await state_of(request).loop.reset_prefix_cache()
    except TimeoutError:
        raise ApiError(504, "the kvstore did not confirm the prefix cache reset", code="kvstore_timeout",
                       type="service_unavailable") from None
    except RedisUnavailable as e:
        raise ApiError(503, str(e), code="unavailable", type="service_unavailable") from None
    return {"status": "reset", "num_cached_blocks": reply.result.get("num_cached_blocks", 0),
            "num_prefix_cache_resets": reply.result.get("num_prefix_cache_resets", 0)}
