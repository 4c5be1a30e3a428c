"""``POST /v1/responses`` (OpenAI Responses API): output items (``reasoning``, ``message``,
``function_call``), function tools with ``function_call_output`` inputs, ``text.format`` structured output,
and the streaming events ``response.created`` ... ``response.completed``."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from colibri_backend.server.blocks import Block, BlockStream, Op, block_ops, final_blocks
from colibri_backend.server.chat_pipeline import prepare_chat
from colibri_backend.server.errors import APIError
from colibri_backend.server.responses import _Stream
from colibri_backend.server.schemas import openapi_body, parse_request
from colibri_backend.server.schemas_responses import ResponsesRequest, to_chat
from colibri_backend.server.security import require_api_key

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


def _item_id(block: Block, index: int, rid: str) -> str:
    prefix = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}[block.kind]
    return f"{prefix}_{rid[5:]}_{index}"


def _item(block: Block, index: int, rid: str, done: bool) -> dict[str, Any]:
    iid = _item_id(block, index, rid)
    status = "completed" if done else "in_progress"
    if block.kind == "reasoning":
        content = [{"type": "reasoning_text", "text": block.text}] if done else []
        return {"type": "reasoning", "id": iid, "summary": [], "content": content, "status": status}
    if block.kind == "tool_call":
        call = block.call
        assert call is not None
        return {
            "type": "function_call",
            "id": iid,
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments if done else "",
            "status": status,
        }
    content = [_text_part(block.text)] if done else []
    return {"type": "message", "id": iid, "role": "assistant", "status": status, "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _response(
    rid: str, req: ResponsesRequest, status: str, stream: BlockStream | None, usage: dict[str, Any] | None
) -> dict[str, Any]:
    output = [_item(b, i, rid, True) for i, b in enumerate(stream.blocks)] if stream else []
    incomplete = status == "completed" and stream is not None and stream.finish_reason == "length"
    out: dict[str, Any] = {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else status,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": req.model,
        "instructions": req.instructions,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "text": req.text or {"format": {"type": "text"}},
        "metadata": req.metadata or {},
        "usage": None,
    }
    if usage is not None:
        reasoning = stream.reasoning_tokens if stream else 0
        out["usage"] = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": usage["total_tokens"],
        }
    return out


class _Events:
    """Responses streaming events from block operations, numbered in order."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()

    def ops(self, ops: list[Op]) -> list[bytes]:
        out = []
        for op in ops:
            b, i = op.block, op.index
            iid = _item_id(b, i, self.rid)
            where = {"item_id": iid, "output_index": i}
            if op.op == "open":
                out.append(
                    self.event(
                        "response.output_item.added", output_index=i, item=_item(b, i, self.rid, False)
                    )
                )
                if b.kind == "text":
                    out.append(
                        self.event(
                            "response.content_part.added", **where, content_index=0, part=_text_part("")
                        )
                    )
                elif b.kind == "tool_call":
                    assert b.call is not None
                    out.append(
                        self.event("response.function_call_arguments.delta", **where, delta=b.call.arguments)
                    )
            elif op.op == "delta":
                kind = "response.output_text.delta" if b.kind == "text" else "response.reasoning_text.delta"
                out.append(self.event(kind, **where, content_index=0, delta=op.text))
            else:
                if b.kind == "text":
                    out.append(self.event("response.output_text.done", **where, content_index=0, text=b.text))
                    out.append(
                        self.event(
                            "response.content_part.done", **where, content_index=0, part=_text_part(b.text)
                        )
                    )
                elif b.kind == "reasoning":
                    out.append(
                        self.event("response.reasoning_text.done", **where, content_index=0, text=b.text)
                    )
                else:
                    assert b.call is not None
                    out.append(
                        self.event(
                            "response.function_call_arguments.done",
                            **where,
                            name=b.call.name,
                            arguments=b.call.arguments,
                        )
                    )
                out.append(
                    self.event("response.output_item.done", output_index=i, item=_item(b, i, self.rid, True))
                )
        return out


@router.post("/responses", openapi_extra=openapi_body(ResponsesRequest))
async def create_response(request: Request) -> Response:
    state = request.app.state.colibri
    req = await parse_request(request, ResponsesRequest)
    chat = to_chat(req)
    prepared, plan = await prepare_chat(state, chat, request)
    rid = f"resp_{uuid.uuid4().hex}"

    if not prepared.stream:
        last = await final_blocks(state, prepared, plan, request, "/v1/responses")
        return JSONResponse(_response(rid, req, "completed", *last))

    async def body() -> AsyncIterator[bytes]:
        ev = _Events(rid)
        yield ev.event("response.created", response=_response(rid, req, "in_progress", None, None))
        yield ev.event("response.in_progress", response=_response(rid, req, "in_progress", None, None))
        try:
            async for stream, ops, usage in block_ops(state, prepared, plan, request, "/v1/responses"):
                for chunk in ev.ops(ops):
                    yield chunk
                if usage is not None:
                    final = _response(rid, req, "completed", stream, usage)
                    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                    yield ev.event(kind, response=final)
        except APIError as err:
            yield ev.event("error", code=err.code, message=err.message, param=err.param)

    return _Stream(body(), prepared.ticket)
