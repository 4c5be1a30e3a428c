"""Tools on /v1/chat/completions: a real server on loopback (SmolLM2, a template that renders tools)
driven by the official `openai` client, with the call forced by the grammar (``tool_choice`` required /
named) so the model's call is deterministic; and an in-process server on a scripted backend whose known
output checks the parser's streaming (deltas, reasoning, parallel calls) and what reaches the template."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from api_server import Server, server_fixture
from fastapi.testclient import TestClient

from colibri_backend.backends import Capabilities
from colibri_backend.config import Config, ModelConfig
from colibri_backend.generation import GenerationEvent
from colibri_backend.server import ServerState, create_app

CONFORMANCE = Path(__file__).resolve().parent.parent / "conformance_tests"
if str(CONFORMANCE) not in sys.path:
    sys.path.insert(0, str(CONFORMANCE))

import tool_fixtures as tf  # noqa: E402

WEATHER, TIME = tf.WEATHER, tf.TIME
ASK = tf.ask()


server = server_fixture("tools")


def collect_stream(chunks: Any) -> tuple[str, dict[int, dict[str, str]], list[str]]:
    """(content, calls by index, finish reasons) of a streamed chat completion."""
    content = ""
    calls: dict[int, dict[str, str]] = {}
    finishes = []
    for c in chunks:
        for ch in c.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += tc.id or ""
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    return content, calls, finishes


def test_streamed_forced_tool_call_then_tool_result_round_trip(server: Server) -> None:
    stream = server.client.chat.completions.create(
        model="tools",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        stream=True,
        max_tokens=60,
        temperature=0,
    )
    content, calls, finishes = collect_stream(stream)
    assert "<tool_call" not in content and "</" not in content
    assert finishes == ["tool_calls"] and list(calls) == [0]
    call = calls[0]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    args = json.loads(call["arguments"])
    assert set(args) == {"city"} and isinstance(args["city"], str)

    # the same request answered whole agrees with the stream
    whole = server.client.chat.completions.create(
        model="tools", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == [
        ("get_weather", args)
    ]

    # the tool's result goes back through the template; the model answers in text
    follow = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature_c": 18, "sky": "sunny"}'},
    ]
    answer = server.client.chat.completions.create(
        model="tools", messages=follow, tools=[WEATHER], max_tokens=24, temperature=0
    )
    assert answer.usage.prompt_tokens > whole.usage.prompt_tokens + 10  # the call and its result were read
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    if answer.choices[0].finish_reason != "tool_calls":
        assert answer.choices[0].message.content.strip()


def test_named_tool_choice_and_parallel_false(server: Server) -> None:
    r = server.client.chat.completions.create(
        model="tools",
        messages=[{"role": "user", "content": "What time is it in Tokyo, and the weather in Oslo?"}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    assert set(json.loads(calls[0].function.arguments)) == {"zone"}


def test_tool_choice_none_gives_text(server: Server) -> None:
    r = server.client.chat.completions.create(
        model="tools", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=12, temperature=0
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


BAD_REQUESTS = [
    ({"tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                    ],
                }
            ]
        },
        "messages",
    ),
    ({"messages": [{"role": "tool", "content": "18C"}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_REQUESTS)
def test_malformed_tool_requests_are_400(server: Server, extra: dict, param: str) -> None:
    body = {"model": "tools", "messages": ASK, "max_tokens": 4, **extra}
    r = server.http.post("/v1/chat/completions", json=body, headers=server.auth())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]


# ------------------------------------------------------------------ scripted backend, in process


class Scripted:
    """A chat model whose output is a fixed list of text pieces; it records what it was asked to render."""

    name, backend, context_length = "scripted", "fake", 512
    chat_template = "{{ '<think>' }}{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>"

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.capabilities = Capabilities(chat=True)
        self.rendered: list[tuple[list[dict], Any]] = []

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(1, max(2, len(text) // 4)))

    def detokenize(self, ids: Any) -> str:
        return ""

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: Any = None) -> str:
        self.rendered.append((messages, tools))
        return json.dumps(messages)

    def generate_tokens(
        self,
        prompt_ids: Any,
        *,
        max_tokens: int,
        sampling: Any = None,
        stop: Any = None,
        logprobs: Any = None,
    ) -> Iterator[GenerationEvent]:
        n = min(max_tokens, len(self.pieces))
        for i in range(n):
            finish = None if i < n - 1 else ("stop" if n == len(self.pieces) else "length")
            yield GenerationEvent(i, self.pieces[i], None, None, finish)

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


SCRIPT = [
    "<thi",
    "nk>Two lookups",
    " needed.</th",
    "ink>On it. <tool",
    '_call>{"name": "get_weather", ',
    '"arguments": {"city": "Oslo"}}</tool_',
    "call>\n<tool_call>",
    '{"name": "get_time", "arguments": {"zone": "JST"}}',
    "</tool_call>",
]


@pytest.fixture()
def scripted() -> Iterator[tuple[openai.OpenAI, Scripted, TestClient]]:
    model = Scripted(SCRIPT)
    cfg = Config(models={"s": ModelConfig(alias="s", path="x", backend="fake")}, default_model="s")
    state = ServerState(cfg, api_key=None, loader=lambda c: model)
    with TestClient(create_app(state)) as http:
        state.wait_loaded(10)
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
        yield client, model, http


def test_scripted_stream_splits_reasoning_text_and_two_calls(scripted: Any) -> None:
    client, _model, _http = scripted
    chunks = list(client.chat.completions.create(model="s", messages=ASK, tools=[WEATHER, TIME], stream=True))
    content, calls, finishes = collect_stream(chunks)
    reasoning = "".join(
        getattr(ch.delta, "reasoning_content", None) or "" for c in chunks for ch in c.choices
    )
    assert reasoning == "Two lookups needed." and content == "On it. "
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {"zone": "JST"}),
    ]
    assert finishes == ["tool_calls"]
    for c in chunks:  # no markup in any delta
        for ch in c.choices:
            assert "<" not in (ch.delta.content or "") and ">" not in (ch.delta.content or "")

    whole = client.chat.completions.create(
        model="s", messages=ASK, tools=[WEATHER, TIME], parallel_tool_calls=False
    )
    msg = whole.choices[0].message
    assert [t.function.name for t in msg.tool_calls] == ["get_weather"]
    assert msg.content == "On it. " and msg.model_extra["reasoning_content"] == "Two lookups needed."


def test_scripted_tool_results_reach_the_template_as_transformers_passes_them(scripted: Any) -> None:
    client, model, _http = scripted
    client.chat.completions.create(
        model="s",
        messages=[
            {"role": "developer", "content": "Be brief."},
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        ],
        tools=[WEATHER],
    )
    messages, tools = model.rendered[-1]
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[2]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    assert messages[3] == {"role": "tool", "content": "18C", "tool_call_id": "c1", "name": "get_weather"}
    assert tools == [WEATHER]
    client.chat.completions.create(model="s", messages=ASK, tools=[WEATHER], tool_choice="none")
    assert model.rendered[-1][1] is None  # tool_choice none: the template is not offered the tools


def test_scripted_without_tools_reports_the_markup_as_text(scripted: Any) -> None:
    client, _model, _http = scripted
    msg = client.chat.completions.create(model="s", messages=ASK).choices[0].message
    assert msg.tool_calls is None and "<tool_call>" in msg.content


def test_required_tool_on_a_backend_without_a_token_mask_still_answers(scripted: Any) -> None:
    _client, _model, http = scripted
    r = http.post(
        "/v1/chat/completions",
        json={"model": "s", "messages": ASK, "tools": [WEATHER], "tool_choice": "required"},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls"
    r = http.post(
        "/v1/chat/completions",
        json={"model": "s", "messages": ASK, "response_format": {"type": "json_object"}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_harmony_without_its_vocabulary_is_a_clear_503(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """gpt-oss output is parsed by openai-harmony, which needs its o200k vocabulary file; where it cannot
    be found the request says so instead of answering with raw channel markup."""
    from colibri_backend.server import tool_calls

    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))  # an empty directory: nothing to load
    tool_calls._harmony_encoding.cache_clear()
    model = Scripted(["hi"])
    model.chat_template = "<|start|>assistant<|channel|>final<|message|>"
    cfg = Config(models={"s": ModelConfig(alias="s", path="x", backend="fake")}, default_model="s")
    state = ServerState(cfg, api_key=None, loader=lambda c: model)
    with TestClient(create_app(state)) as http:
        state.wait_loaded(10)
        r = http.post("/v1/chat/completions", json={"model": "s", "messages": ASK})
    tool_calls._harmony_encoding.cache_clear()
    assert r.status_code == 503 and r.json()["error"]["code"] == "output_parser_unavailable"
    assert "harmony" in r.json()["error"]["message"]
