"""The live dashboard: GET / (links), /dashboard (static HTML), /dashboard/snapshot (JSON, the page
polls it), /dashboard/history (the charts' last 5 minutes) and /dashboard/events (SSE every
SNAPSHOT_INTERVAL_S, for other clients); open without the API key, as /metrics is.
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib.metadata import entry_points
from importlib.resources import files

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from pagedserve.services.api.dashboard_history import HISTORY_S, SAMPLE_INTERVAL_S, History, Sample, sample_forever
from pagedserve.services.api.dashboard_snapshot import build_snapshot
from pagedserve.services.api.edge import state_of

router = APIRouter()
SNAPSHOT_INTERVAL_S = 1.0
POLICY_GROUP = "pagedserve.policies"
INDEX = """<!doctype html><html><head><meta charset="utf-8"><title>pagedserve</title></head>
<body style="font-family: system-ui, sans-serif; margin: 2em">
<h1>pagedserve</h1><p>An LLM server with a paged KV cache, serving <code>{model}</code>.</p>
<ul><li><a href="/dashboard">Live dashboard</a>: KV blocks, requests, policy, throughput</li>
<li><a href="/ready">/ready</a>: 200 once a worker has loaded the model</li>
<li><a href="/metrics">/metrics</a>: Prometheus</li>
<li><a href="/v1/models">/v1/models</a>: the OpenAI-compatible API (POST /v1/chat/completions)</li></ul>
</body></html>"""


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index(request: Request) -> HTMLResponse:
    return HTMLResponse(INDEX.format(model=state_of(request).info.served_name))


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard() -> HTMLResponse:
    return HTMLResponse(files("pagedserve.services.api.dashboard").joinpath("index.html").read_text(encoding="utf-8"))


@router.get("/dashboard/snapshot", include_in_schema=False)
async def snapshot(request: Request) -> dict:
    return await _snapshot(request)


@router.get("/dashboard/history", include_in_schema=False)
async def history(request: Request) -> dict:
    """{"horizon_s", "interval_s", "points": [{t, tps, ttft}]}: what the charts draw on load."""
    return {"horizon_s": HISTORY_S, "interval_s": SAMPLE_INTERVAL_S,
            "points": request.app.state.dashboard_history.points()}


def start_history(app: FastAPI) -> asyncio.Task:
    """Samples throughput and TTFT into app.state.dashboard_history until the task is cancelled."""
    app.state.dashboard_history = History()

    async def take() -> Sample:
        state = app.state.api
        sched = (await state.loop.read_stats(("scheduler",))).get("scheduler", {})
        tokens = sched.get("generation_tokens_total")
        return Sample(time.time(), float(tokens) if isinstance(tokens, (int, float)) else 0.0,
                      *_ttft(state.metrics))

    return asyncio.create_task(sample_forever(app.state.dashboard_history, take))


@router.get("/dashboard/events", include_in_schema=False)
async def events(request: Request) -> StreamingResponse:
    async def stream():
        while not await request.is_disconnected():
            yield f"data: {json.dumps(await _snapshot(request))}\n\n"
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _snapshot(request: Request) -> dict:
    state = state_of(request)
    stats = await state.loop.read_stats(("scheduler", "kvstore", "block_map"))
    policies = sorted({ep.name for ep in entry_points(group=POLICY_GROUP)})
    missing = await state.loop.missing_services()
    return build_snapshot(stats, *_ttft(state.metrics), policies, time.time(), missing)


def _ttft(metrics) -> tuple[float, float]:
    """This api's time-to-first-token sum (s) and count."""
    histogram = metrics.time_to_first_token
    return histogram.sum, float(sum(histogram.counts))
