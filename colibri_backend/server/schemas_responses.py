"""``POST /v1/responses`` request body (OpenAI Responses API) and its translation into a chat request."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, ValidationError

from colibri_backend.server.errors import bad_value
from colibri_backend.server.schemas import ChatRequest, _Strict


class ResponsesRequest(_Strict):
    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


def _message_text(content: Any, where: str) -> Any:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return content  # parts are checked by chat_pipeline.content_text
    raise bad_value(f"{where}.content must be a string or a list of parts", "input")


def _input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            if not isinstance(item.get("role"), str):
                raise bad_value(f"{where} needs a role", "input")
            messages.append({"role": item["role"], "content": _message_text(item.get("content"), where)})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
                raise bad_value(
                    f"{where}: a function_call needs name, arguments and call_id strings", "input"
                )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise bad_value(f"{where}: a function_call_output needs its call_id", "input")
            if not isinstance(output, str):
                output = json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # earlier reasoning is not fed back, as chat templates drop it
        else:
            raise bad_value(f"{where}.type {kind!r} is not supported", "input")
    return messages


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad_value(f"tools[{i}]: only function tools are supported", "tools")
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t and t[k] is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_value("text.format must be an object", "text")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return fmt


def to_chat(req: ResponsesRequest) -> ChatRequest:
    """The chat request that generates this response."""
    if req.previous_response_id:
        raise bad_value(
            "previous_response_id is not supported: responses are not stored; send the whole input",
            "previous_response_id",
        )
    body: dict[str, Any] = {
        "model": req.model,
        "messages": _input_messages(req),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "tools": _tools(req.tools),
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text),
    }
    if not body["messages"]:
        raise bad_value("input holds no messages", "input")
    return chat_request({k: v for k, v in body.items() if v is not None}, "input")


def chat_request(body: dict[str, Any], param: str) -> ChatRequest:
    """A translated body as a :class:`ChatRequest`; what does not fit is the client's 400 on ``param``."""
    try:
        return ChatRequest.model_validate(body, strict=False)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise bad_value(f"{param}: {loc}: {first.get('msg')}", param) from None
