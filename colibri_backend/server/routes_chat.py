"""``POST /v1/chat/completions``: tools, tool_choice, parallel_tool_calls and response_format included
(see :mod:`colibri_backend.server.chat_pipeline`)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from colibri_backend.server.chat_output import ParsedChatChoice
from colibri_backend.server.chat_pipeline import prepare_chat
from colibri_backend.server.responses import respond
from colibri_backend.server.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatRequest,
    openapi_body,
    parse_request,
    responses_for,
)
from colibri_backend.server.security import require_api_key

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


@router.post(
    "/chat/completions",
    openapi_extra=openapi_body(ChatRequest),
    responses=responses_for(ChatCompletion, ChatCompletionChunk),
)
async def chat_completions(request: Request) -> Response:
    state = request.app.state.colibri
    req = await parse_request(request, ChatRequest)
    prepared, plan = await prepare_chat(state, req, request)
    return await respond(state, prepared, request, req.model, ParsedChatChoice.for_plan(plan))
