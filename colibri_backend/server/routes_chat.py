"""``POST /v1/chat/completions``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from colibri_backend.errors import ColibriError
from colibri_backend.server.errors import bad_value
from colibri_backend.server.generation import admit, check_prompt_chars, check_request, tokenize_off_loop
from colibri_backend.server.responses import ChatChoice, respond
from colibri_backend.server.schemas import (
    MAX_TOP_LOGPROBS,
    ChatCompletion,
    ChatCompletionChunk,
    ChatMessage,
    ChatRequest,
    openapi_body,
    parse_request,
    responses_for,
)
from colibri_backend.server.security import require_api_key

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


def content_text(content: Any, index: int) -> str:
    """A message's content as text (a list of text parts is joined; other parts are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad_value(
                f"messages[{index}].content[{j}]: only text parts are supported "
                f"(got type {part.get('type')!r})",
                "messages",
            )
        parts.append(part["text"])
    return "".join(parts)


def _messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    out = []
    for i, m in enumerate(messages):
        msg = {"role": m.role, "content": content_text(m.content, i)}
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out


def _chat_logprobs(req: ChatRequest, backend: str, reports_logprobs: bool) -> int | None:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_value("top_logprobs requires logprobs to be true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_value(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", "top_logprobs")
    if not req.logprobs:
        return None
    if not reports_logprobs:
        raise bad_value(f"backend {backend!r} does not report logprobs", "logprobs")
    return req.top_logprobs or 0


@router.post(
    "/chat/completions",
    openapi_extra=openapi_body(ChatRequest),
    responses=responses_for(ChatCompletion, ChatCompletionChunk),
)
async def chat_completions(request: Request) -> Response:
    state = request.app.state.colibri
    req = await parse_request(request, ChatRequest)
    checked = check_request(state, req, "messages")
    model = checked.model
    if req.tools or req.functions:
        raise bad_value("tools / function calling are not supported by this server", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_value('only response_format {"type": "text"} is supported', "response_format")
    logprobs = _chat_logprobs(req, checked.slot.cfg.backend, model.capabilities.logprobs)
    messages = _messages(req.messages)
    check_prompt_chars(state, checked, sum(len(m["content"]) for m in messages))

    def tokenize() -> list[list[int]]:
        try:
            prompt_text = model.render_chat(messages)
        except (ValueError, ColibriError) as exc:
            raise bad_value(str(exc), "messages") from None
        return [model.tokenize(prompt_text, add_special_tokens=False)]

    prepared = admit(state, checked, await tokenize_off_loop(tokenize), logprobs, req)
    return await respond(state, prepared, request, req.model, ChatChoice)
