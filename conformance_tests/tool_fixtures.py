"""The tool fixtures of the server tests (tests/test_server_*.py) and of the chat-template conformance tests,
in one place: each function once, and in the shape each API sends it.

Two flavours of the same functions:
* `WEATHER_FN`, `TIME_FN` (served): string arguments with a `maxLength`, so a small model whose call is forced
  by the grammar cannot run its argument on until max_tokens; `required` says which argument it must write.
* `WEATHER_DOC_FN`, `TIME_DOC_FN`, `PING_FN` (rendered): described arguments, an `enum`, a boolean and a
  function without parameters, the schema features a chat template has to write out.

The shapes: `chat_tool` (Chat Completions and `apply_chat_template`: `{"type": "function", "function": ...}`),
`responses_tool` (Responses: flat), `messages_tool` (Anthropic Messages: `input_schema`). `ASK` is the user's
question that asks for the weather tool; `ask()` is it as a one-message conversation.

tests/ imports this module with conformance_tests/ on sys.path, as it does tiny_models.
"""

from __future__ import annotations

from typing import Any

WEATHER_FN: dict[str, Any] = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
    },
}
TIME_FN: dict[str, Any] = {
    "name": "get_time",
    "description": "The time in a time zone",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 20}},
        "required": ["zone"],
    },
}

WEATHER_DOC_FN: dict[str, Any] = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["c", "f"]},
        },
        "required": ["city"],
    },
}
TIME_DOC_FN: dict[str, Any] = {
    "name": "get_time",
    "description": "The time in a time zone",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string"}, "hour24": {"type": "boolean"}},
    },
}
PING_FN: dict[str, Any] = {"name": "ping", "description": "Liveness", "parameters": {}}


def chat_tool(fn: dict[str, Any]) -> dict[str, Any]:
    """A function as Chat Completions (and transformers' apply_chat_template) take it."""
    return {"type": "function", "function": fn}


def responses_tool(fn: dict[str, Any]) -> dict[str, Any]:
    """A function as the Responses API takes it (flat)."""
    return {"type": "function", **fn}


def messages_tool(fn: dict[str, Any]) -> dict[str, Any]:
    """A function as Anthropic's Messages API takes it."""
    return {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}


WEATHER = chat_tool(WEATHER_FN)
TIME = chat_tool(TIME_FN)
WEATHER_DOC = chat_tool(WEATHER_DOC_FN)
TIME_DOC = chat_tool(TIME_DOC_FN)
PING = chat_tool(PING_FN)

ASK = "What is the weather like in Paris right now?"


def ask(text: str = ASK) -> list[dict[str, Any]]:
    """`text` as the one user message of a conversation."""
    return [{"role": "user", "content": text}]


def call(name: str, args: dict[str, Any], call_id: str | None = None) -> dict[str, Any]:
    """An assistant's tool call as chat templates take it (arguments as an object)."""
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    if call_id is not None:
        out["id"] = call_id
    return out
