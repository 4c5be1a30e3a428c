"""``GET /v1/models`` and ``GET /v1/models/{id}``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from colibri_backend.server.errors import APIError
from colibri_backend.server.schemas import ERROR_RESPONSES, ModelCard, ModelList
from colibri_backend.server.security import require_api_key
from colibri_backend.server.state import ModelSlot

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


def model_card(alias: str, slot: ModelSlot) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": alias,
        "object": "model",
        "created": slot.created,
        "owned_by": "colibri",
        "backend": slot.cfg.backend,
        "ready": slot.state == "ready",
    }
    if slot.model is not None:
        card["context_length"] = slot.model.context_length
    return card


@router.get("/models", responses={200: {"model": ModelList}, 401: ERROR_RESPONSES[401]})
async def list_models(request: Request) -> JSONResponse:
    slots = request.app.state.colibri.slots
    return JSONResponse({"object": "list", "data": [model_card(a, s) for a, s in slots.items()]})


@router.get(
    "/models/{model_id:path}",
    responses={200: {"model": ModelCard}, 401: ERROR_RESPONSES[401], 404: ERROR_RESPONSES[404]},
)
async def get_model(model_id: str, request: Request) -> JSONResponse:
    slot = request.app.state.colibri.slots.get(model_id)
    if slot is None:
        raise APIError(
            404, f"The model '{model_id}' does not exist", "invalid_request_error", "model", "model_not_found"
        )
    return JSONResponse(model_card(model_id, slot))
