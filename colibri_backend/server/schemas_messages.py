"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` request bodies (Anthropic Messages API) and
their translation into a chat request."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from colibri_backend.server.errors import bad_value
from colibri_backend.server.schemas import ChatRequest, _Strict
from colibri_backend.server.schemas_responses import chat_request


class CountTokensRequest(_Strict):
    """POST /v1/messages/count_tokens."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def _text_of(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_value(f"{where} must be a string or a list of content blocks", "messages")
    parts = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise bad_value(f"{where}[{j}]: only text blocks are supported here (got {kind!r})", "messages")
        parts.append(b["text"])
    return "".join(parts)


def _messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise bad_value(f"{where}.role must be 'user' or 'assistant', got {role!r}", "messages")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_value(f"{where}.content must be a string or a list of content blocks", "messages")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            w = f"{where}.content[{j}]"
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise bad_value(f"{w}: a tool_use block needs id and name", "messages")
                args = json.dumps(b.get("input") or {})
                calls.append(
                    {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": args}}
                )
            elif kind == "tool_result" and role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise bad_value(f"{w}: a tool_result block needs its tool_use_id", "messages")
                result = _text_of(b.get("content") or "", f"{w}.content")
                if b.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier reasoning is not fed back, as chat templates drop it
            else:
                raise bad_value(f"{w}: block type {kind!r} is not supported in a {role} message", "messages")
        if texts or calls:
            msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if (
            not isinstance(t, dict)
            or not isinstance(t.get("name"), str)
            or t.get("type", "custom") != "custom"
        ):
            raise bad_value(
                f"tools[{i}]: only custom tools with a name and input_schema are supported", "tools"
            )
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(OpenAI tool_choice, parallel_tool_calls) of an Anthropic tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise bad_value(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice")


def to_chat(req: CountTokensRequest) -> ChatRequest:
    choice, parallel = _tool_choice(req.tool_choice)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": _messages(req),
        "tools": _tools(req.tools),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
    }
    if isinstance(req, MessagesRequest):
        if req.max_tokens < 1:
            raise bad_value(f"max_tokens must be at least 1, got {req.max_tokens}", "max_tokens")
        body.update(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stream=req.stream,
        )
    return chat_request({k: v for k, v in body.items() if v is not None}, "messages")
