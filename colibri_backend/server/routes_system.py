"""``GET /health`` and ``GET /metrics``: unauthenticated, for probes and scrapers."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from colibri_backend.server.metrics import CONTENT_TYPE

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = request.app.state.colibri
    models = {
        a: {"state": s.state, "backend": s.cfg.backend, **({"error": s.error} if s.error else {})}
        for a, s in state.slots.items()
    }
    if state.shutting_down:
        status = "shutting_down"
    elif all(s.state == "ready" for s in state.slots.values()):
        status = "ok"
    elif any(s.state == "loading" for s in state.slots.values()):
        status = "loading"
    else:
        status = "error"
    return JSONResponse({"status": status, "models": models}, status_code=200 if status == "ok" else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.colibri.metrics.render(), media_type=CONTENT_TYPE)
