"""From a chat request to an admitted generation: messages (with tool calls and tool results) rendered
through the model's own chat template with the offered ``tools``, ``tool_choice`` and ``response_format``
checked, the grammar that constrains the output when one is asked for, and the plan that tells the
response builders how to split the output (answer, reasoning, tool calls).

Shared by ``/v1/chat/completions``, ``/v1/responses`` and ``/v1/messages``: those two translate their
request into a :class:`ChatRequest` and come here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from colibri_backend.errors import ColibriError
from colibri_backend.server.errors import APIError, bad_value
from colibri_backend.server.generation import (
    Prepared,
    admit,
    check_prompt_chars,
    check_request,
    tokenize_off_loop,
)
from colibri_backend.server.schemas import MAX_TOP_LOGPROBS, ChatMessage, ChatRequest
from colibri_backend.server.state import ServerState
from colibri_backend.server.tool_calls import (
    OutputParser,
    family_of,
    forced_call_grammar,
    new_output_parser,
    token_lookup,
    vocabulary_of,
)

ROLES = ("system", "developer", "user", "assistant", "tool")


def content_text(content: Any, where: str) -> str:
    """A message's content as text (a list of text parts is joined; other parts are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_value(
                f"{where}.content[{j}]: only text parts are supported (got type {kind!r})", "messages"
            )
        if not isinstance(part.get("text"), str):
            raise bad_value(f"{where}.content[{j}].text must be a string", "messages")
        parts.append(part["text"])
    return "".join(parts)


def _arguments(value: Any, where: str) -> Any:
    """A tool call's arguments as templates expect them (a dict; OpenAI sends a JSON string)."""
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise bad_value(f"{where}.function.arguments must be a JSON string", "messages")
    try:
        parsed = json.loads(value) if value.strip() else {}
    except ValueError:
        raise bad_value(f"{where}.function.arguments is not valid JSON", "messages") from None
    return parsed


def _assistant_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise bad_value(f"{where}.tool_calls must be a list", "messages")
    calls = []
    for k, call in enumerate(raw):
        w = f"{where}.tool_calls[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_value(
                f"{w} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", "messages"
            )
        calls.append(
            {
                "id": str(call.get("id") or f"call_{k}"),
                "type": "function",
                "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments", "{}"), w)},
            }
        )
    return calls


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates take them (transformers' conventions for tool calls/results)."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, for tool results that omit it
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role not in ROLES:
            raise bad_value(f"{where}.role must be one of {', '.join(ROLES)}, got {m.role!r}", "messages")
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        msg["content"] = content_text(m.content, where)
        if m.name:
            msg["name"] = m.name
        extra = m.model_extra or {}
        if m.role == "assistant" and extra.get("tool_calls"):
            msg["tool_calls"] = _assistant_calls(extra["tool_calls"], where)
            names.update({c["id"]: c["function"]["name"] for c in msg["tool_calls"]})
        if m.role == "tool":
            call_id = extra.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad_value(f"{where}: a tool message needs its tool_call_id", "messages")
            msg["tool_call_id"] = call_id
            if "name" not in msg and call_id in names:
                msg["name"] = names[call_id]
        out.append(msg)
    return out


def validate_tools(raw: list[Any] | None) -> list[dict[str, Any]] | None:
    """OpenAI function tools, checked, as transformers' apply_chat_template passes them."""
    if not raw:
        return None
    tools = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_value(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools"
            )
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_value(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        tool = {"name": fn["name"], "parameters": params}
        if isinstance(fn.get("description"), str):
            tool["description"] = fn["description"]
        tools.append({"type": "function", "function": tool})
    if len({t["function"]["name"] for t in tools}) != len(tools):
        raise bad_value("tools: two tools have the same name", "tools")
    return tools


def tool_choice_of(raw: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """("none" | "auto" | "required", the named function or None)."""
    if raw is None:
        return ("auto" if tools else "none"), None
    if raw in ("none", "auto", "required"):
        if raw == "required" and not tools:
            raise bad_value("tool_choice 'required' needs tools", "tool_choice")
        return raw, None
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_value(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools or []}:
        raise bad_value(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return "required", name


def response_schema(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema ``response_format`` asks for (None: free text)."""
    if not fmt:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        from colibri_backend.grammar import ANY_OBJECT_SCHEMA

        return ANY_OBJECT_SCHEMA
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_value(
                "response_format.json_schema.schema must be a JSON schema object", "response_format"
            )
        return schema
    raise bad_value(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        "response_format",
    )


@dataclass
class ChatPlan:
    """How a chat request's output is read back."""

    template: str | None
    parse_tools: bool
    parallel: bool
    prompt_text: str = ""
    token_to_id: Any = None
    vocabulary: Any = None  # token text by id: the harmony parser's o200k file, offline

    def parser(self) -> OutputParser:
        return new_output_parser(
            self.template,
            tools=self.parse_tools,
            token_to_id=self.token_to_id,
            prompt_text=self.prompt_text,
            vocabulary=self.vocabulary,
        )


def chat_logprobs(req: ChatRequest, backend: str, reports_logprobs: bool) -> int | None:
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


async def prepare_chat(state: ServerState, req: ChatRequest, request: Request) -> tuple[Prepared, ChatPlan]:
    """Check, render, tokenize (off the event loop) and admit a chat request."""
    checked = check_request(state, req, "messages")
    model = checked.model
    if req.functions:
        raise bad_value("the legacy 'functions' field is not supported; send 'tools'", "functions")
    tools = validate_tools(req.tools)
    choice, named = tool_choice_of(req.tool_choice, tools)
    parallel = req.parallel_tool_calls is not False
    schema = response_schema(req.response_format)
    if schema is not None and choice == "required":
        raise bad_value(
            "response_format json cannot be combined with a required tool call", "response_format"
        )
    logprobs = chat_logprobs(req, checked.slot.cfg.backend, model.capabilities.logprobs)
    messages = chat_messages(req.messages)
    offered = tools if choice != "none" else None
    chars = sum(len(m["content"]) + len(json.dumps(m.get("tool_calls", ""))) for m in messages)
    check_prompt_chars(state, checked, chars + len(json.dumps(offered or "")))
    template = getattr(model, "chat_template", None)
    plan = ChatPlan(
        template,
        offered is not None,
        parallel,
        token_to_id=token_lookup(model),
        vocabulary=vocabulary_of(model),
    )
    grammar: list[Any] = []

    def tokenize() -> list[list[int]]:
        from colibri_backend.grammar import Grammar, GrammarError, can_constrain

        try:
            kw = {"tools": offered} if offered is not None else {}
            text = model.render_chat(messages, **kw)
        except (ValueError, ColibriError) as exc:
            raise bad_value(str(exc), "messages") from None
        plan.prompt_text = text
        try:
            plan.parser()  # a parser that cannot start (harmony without its vocabulary) fails here
        except ValueError as exc:
            raise APIError(503, str(exc), "server_error", None, "output_parser_unavailable") from None
        try:
            if schema is not None:
                grammar.append(Grammar.from_json_schema(model, schema))
            elif choice == "required" and offered and can_constrain(model):
                # Without a token mask the model is only asked (by the template) to call a tool.
                chosen = [t for t in offered if named is None or t["function"]["name"] == named]
                lark = forced_call_grammar(family_of(template), chosen, parallel and named is None)
                if lark is not None:
                    grammar.append(Grammar.from_lark(model, lark))
        except GrammarError as exc:
            param = "response_format" if schema is not None else "tools"
            raise APIError(400, str(exc), "invalid_request_error", param, "invalid_schema") from None
        return [model.tokenize(text, add_special_tokens=False)]

    prompts = await tokenize_off_loop(tokenize)
    constraint = grammar[0].constraint if grammar else None
    return admit(state, checked, prompts, logprobs, req, constraint), plan
