"""/v1/messages and /v1/messages/count_tokens on a real server, driven by the official `anthropic`
client: system prompt, text, the streaming events, a forced ``tool_use`` block and its ``tool_result``
fed back, token counting, the ``x-api-key`` header, and Anthropic-shaped errors (never a 500)."""

from __future__ import annotations

import sys
from pathlib import Path

import anthropic
import pytest
from api_server import API_KEY, Server, server_fixture

CONFORMANCE = Path(__file__).resolve().parent.parent / "conformance_tests"
if str(CONFORMANCE) not in sys.path:
    sys.path.insert(0, str(CONFORMANCE))

import tool_fixtures as tf  # noqa: E402

WEATHER = tf.messages_tool(tf.WEATHER_FN)
ASK = tf.ask()


server = server_fixture("messages")


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0, timeout=120)


def test_message_and_its_stream_agree(client: anthropic.Anthropic) -> None:
    kw = dict(
        model="smol",
        max_tokens=16,
        system="You are terse.",
        messages=[{"role": "user", "content": "Name two colors."}],
        extra_body={"temperature": 0},
    )
    m = client.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.model == "smol"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens") and 0 < m.usage.output_tokens <= 16
    assert m.usage.input_tokens > 5

    with client.messages.stream(**kw) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(deltas) == m.content[0].text == final.content[0].text
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens


def test_raw_stream_event_order(client: anthropic.Anthropic) -> None:
    events = list(
        client.messages.create(
            model="smol", max_tokens=6, messages=[{"role": "user", "content": "Hi"}], stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds
    assert events[-2].usage.output_tokens >= 1


def test_tool_use_then_tool_result(client: anthropic.Anthropic) -> None:
    m = client.messages.create(
        model="tools",
        max_tokens=60,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    )
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1
    assert uses[0].name == "get_weather" and set(uses[0].input) == {"city"} and uses[0].id

    with client.messages.stream(
        model="tools",
        max_tokens=60,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input == uses[0].input

    follow = ASK + [
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "22 C and clear"}],
        },
    ]
    answer = client.messages.create(
        model="tools",
        max_tokens=20,
        messages=follow,
        tools=[WEATHER],
        tool_choice={"type": "none"},
        extra_body={"temperature": 0},
    )
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    counted = client.messages.count_tokens(model="tools", messages=follow, tools=[WEATHER])
    assert (
        counted.input_tokens
        > client.messages.count_tokens(model="tools", messages=ASK, tools=[WEATHER]).input_tokens
    )


def test_count_tokens_matches_the_prompt(client: anthropic.Anthropic) -> None:
    short = client.messages.count_tokens(model="smol", messages=[{"role": "user", "content": "Hi"}])
    long = client.messages.count_tokens(
        model="smol", system="Be kind.", messages=[{"role": "user", "content": "Hi " * 50}]
    )
    assert 0 < short.input_tokens < long.input_tokens
    m = client.messages.create(model="smol", max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
    # input_tokens counts what was evaluated; the rest of the prompt came from the prefix cache
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == short.input_tokens


def test_x_api_key_is_required(server: Server) -> None:
    bad = anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model="smol", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert info.value.body["type"] == "authentication_error" or info.value.response.json()["type"] == "error"


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error"),  # no max_tokens
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error"),
        ({"max_tokens": 4, "messages": []}, 422, "invalid_request_error"),
        ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, 400, "invalid_request_error"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "invalid_request_error",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            400,
            "invalid_request_error",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "bash_20250124"}],
            },
            400,
            "invalid_request_error",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "tool_choice": {"type": "maybe"},
            },
            400,
            "invalid_request_error",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "model": "nope"},
            404,
            "not_found_error",
        ),
        ({"max_tokens": "4", "messages": [{"role": "user", "content": "hi"}]}, 422, "invalid_request_error"),
    ],
)
def test_malformed_messages_are_anthropic_errors(server: Server, body: dict, status: int, kind: str) -> None:
    r = server.http.post("/v1/messages", json={"model": "smol", **body}, headers={"x-api-key": API_KEY})
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and err["error"]["message"]


def test_not_json_and_unknown_route_are_anthropic_errors(server: Server) -> None:
    r = server.http.post(
        "/v1/messages", content=b"{nope", headers={"x-api-key": API_KEY, "content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = server.http.post(
        "/v1/messages", content=b"hi", headers={"x-api-key": API_KEY, "content-type": "text/plain"}
    )
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"
    r = server.http.post("/v1/messages/count_tokens", json={"model": "smol"}, headers={"x-api-key": API_KEY})
    assert r.status_code == 400 and r.json()["type"] == "error"
