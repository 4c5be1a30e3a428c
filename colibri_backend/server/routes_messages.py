"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic Messages API): system prompt,
``tool_use`` / ``tool_result`` blocks, ``thinking`` blocks for reasoning, and the streaming events
``message_start``, ``content_block_start/delta/stop``, ``message_delta``, ``message_stop``. Errors here are
Anthropic-shaped (``{"type": "error", "error": {...}}``) and the key may come as ``x-api-key``."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from colibri_backend.errors import ColibriError
from colibri_backend.server.blocks import Block, BlockStream, Op, block_ops, final_blocks
from colibri_backend.server.chat_pipeline import chat_messages, prepare_chat, tool_choice_of, validate_tools
from colibri_backend.server.errors import APIError, bad_value
from colibri_backend.server.generation import check_prompt_chars, check_request, tokenize_off_loop
from colibri_backend.server.responses import _Stream
from colibri_backend.server.schemas import openapi_body, parse_request
from colibri_backend.server.schemas_messages import CountTokensRequest, MessagesRequest, to_chat
from colibri_backend.server.security import require_api_key

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _block(b: Block, done: bool) -> dict[str, Any]:
    if b.kind == "reasoning":
        return {"type": "thinking", "thinking": b.text if done else "", "signature": ""}
    if b.kind == "tool_call":
        assert b.call is not None
        return {
            "type": "tool_use",
            "id": b.call.id,
            "name": b.call.name,
            "input": json.loads(b.call.arguments) if done else {},
        }
    return {"type": "text", "text": b.text if done else ""}


def _message(
    mid: str, model: str, stream: BlockStream | None, usage: dict[str, Any] | None
) -> dict[str, Any]:
    done = stream is not None and usage is not None
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [_block(b, True) for b in stream.blocks] if done and stream else [],
        "stop_reason": _STOP.get(stream.finish_reason or "", "end_turn") if done and stream else None,
        "stop_sequence": None,
        "usage": _usage(usage),
    }


def _usage(usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage: input_tokens counts the prompt tokens evaluated, cache_read_input_tokens
    those restored from the prefix cache (together: the prompt)."""
    if usage is None:
        return {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0}
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "output_tokens": usage["completion_tokens"],
        "cache_read_input_tokens": cached,
    }


def _sse(kind: str, obj: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **obj}, ensure_ascii=False)}\n\n".encode()


def _ops(ops: list[Op]) -> list[bytes]:
    out = []
    for op in ops:
        b = op.block
        if op.op == "open":
            out.append(_sse("content_block_start", {"index": op.index, "content_block": _block(b, False)}))
            if b.kind == "tool_call":
                assert b.call is not None
                delta = {"type": "input_json_delta", "partial_json": b.call.arguments}
                out.append(_sse("content_block_delta", {"index": op.index, "delta": delta}))
        elif op.op == "delta":
            if b.kind == "reasoning":
                delta = {"type": "thinking_delta", "thinking": op.text}
            else:
                delta = {"type": "text_delta", "text": op.text}
            out.append(_sse("content_block_delta", {"index": op.index, "delta": delta}))
        else:
            if b.kind == "reasoning":
                sig = {"type": "signature_delta", "signature": ""}
                out.append(_sse("content_block_delta", {"index": op.index, "delta": sig}))
            out.append(_sse("content_block_stop", {"index": op.index}))
    return out


@router.post("/messages", openapi_extra=openapi_body(MessagesRequest))
async def create_message(request: Request) -> Response:
    state = request.app.state.colibri
    req = await parse_request(request, MessagesRequest)
    prepared, plan = await prepare_chat(state, to_chat(req), request)
    mid = f"msg_{uuid.uuid4().hex}"

    if not prepared.stream:
        last = await final_blocks(state, prepared, plan, request, "/v1/messages")
        return JSONResponse(_message(mid, req.model, *last))

    async def body() -> AsyncIterator[bytes]:
        yield _sse(
            "message_start",
            {
                "message": _message(
                    mid, req.model, None, {"prompt_tokens": prepared.prompt_tokens, "completion_tokens": 0}
                )
            },
        )
        try:
            async for stream, ops, usage in block_ops(state, prepared, plan, request, "/v1/messages"):
                for chunk in _ops(ops):
                    yield chunk
                if usage is not None:
                    stop = _STOP.get(stream.finish_reason or "", "end_turn")
                    delta = {"stop_reason": stop, "stop_sequence": None}
                    yield _sse(
                        "message_delta",
                        {"delta": delta, "usage": _usage(usage)},
                    )
                    yield _sse("message_stop", {})
        except APIError as err:
            yield _sse("error", {"error": err.anthropic_body()["error"]})

    return _Stream(body(), prepared.ticket)


@router.post("/messages/count_tokens", openapi_extra=openapi_body(CountTokensRequest))
async def count_tokens(request: Request) -> Response:
    state = request.app.state.colibri
    req = await parse_request(request, CountTokensRequest)
    chat = to_chat(req)
    checked = check_request(state, chat, "messages")
    model = checked.model
    tools = validate_tools(chat.tools)
    choice, _ = tool_choice_of(chat.tool_choice, tools)
    offered = tools if choice != "none" else None
    messages = chat_messages(chat.messages)
    check_prompt_chars(
        state, checked, sum(len(m["content"]) for m in messages) + len(json.dumps(offered or ""))
    )

    def tokenize() -> list[list[int]]:
        try:
            text = model.render_chat(messages, **({"tools": offered} if offered is not None else {}))
        except (ValueError, ColibriError) as exc:
            raise bad_value(str(exc), "messages") from None
        return [model.tokenize(text, add_special_tokens=False)]

    ids = await tokenize_off_loop(tokenize)
    return JSONResponse({"input_tokens": len(ids[0])})
