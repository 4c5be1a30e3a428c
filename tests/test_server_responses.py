"""/v1/responses on a real server, driven by the official `openai` client: text, streamed events in
order, function tools (a forced ``function_call`` item, then its ``function_call_output`` fed back),
structured output through ``text.format``, and malformed requests answered with OpenAI error objects."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest
from api_server import Server, server_fixture

CONFORMANCE = Path(__file__).resolve().parent.parent / "conformance_tests"
if str(CONFORMANCE) not in sys.path:
    sys.path.insert(0, str(CONFORMANCE))

import tool_fixtures as tf  # noqa: E402

WEATHER = tf.responses_tool(tf.WEATHER_FN)


server = server_fixture("responses")


def test_text_response_and_its_stream_agree(server: Server) -> None:
    r = server.client.responses.create(
        model="smol",
        instructions="You are terse.",
        input="Name three fruits.",
        max_output_tokens=16,
        temperature=0,
    )
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text.strip() and r.usage.output_tokens <= 16 and r.usage.input_tokens > 5
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"

    events = list(
        server.client.responses.create(
            model="smol",
            instructions="You are terse.",
            input="Name three fruits.",
            max_output_tokens=16,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == text


def test_function_call_then_function_call_output(server: Server) -> None:
    question = tf.ask()
    r = server.client.responses.create(
        model="tools",
        input=question,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"}

    stream = list(
        server.client.responses.create(
            model="tools",
            input=question,
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=60,
            temperature=0,
            stream=True,
        )
    )
    arg_done = [e for e in stream if e.type == "response.function_call_arguments.done"]
    assert len(arg_done) == 1 and json.loads(arg_done[0].arguments) == args
    final = stream[-1].response
    assert [i.type for i in final.output] == ["function_call"]

    follow = question + [
        {
            "type": "function_call",
            "call_id": calls[0].call_id,
            "name": "get_weather",
            "arguments": calls[0].arguments,
        },
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature_c": 31}'},
    ]
    answer = server.client.responses.create(
        model="tools", input=follow, tools=[WEATHER], tool_choice="none", max_output_tokens=20, temperature=0
    )
    assert [i.type for i in answer.output] == ["message"] and answer.output_text.strip()
    alone = server.client.responses.create(
        model="tools", input=question, tools=[WEATHER], tool_choice="none", max_output_tokens=1, temperature=0
    )
    assert answer.usage.input_tokens > alone.usage.input_tokens + 10  # the call and its output were read


def test_text_format_json_schema(server: Server) -> None:
    schema = {
        "type": "object",
        "properties": {"fruit": {"type": "string", "maxLength": 12}, "count": {"type": "integer"}},
        "required": ["fruit", "count"],
        "additionalProperties": False,
    }
    r = server.client.responses.create(
        model="smol",
        input="Pick a fruit and a number, in JSON.",
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
        max_output_tokens=40,
        temperature=0,
    )
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
        ({"input": [{"type": "image", "url": "x"}]}, 400, "input"),
        ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "response_format"),
        ({"input": []}, 422, "input"),
        ({"input": 5}, 422, "input"),
        ({}, 400, "input"),
        ({"input": "hi", "max_output_tokens": 0}, 400, "max_tokens"),
        ({"input": "hi", "model": "nope"}, 404, "model"),
    ],
)
def test_malformed_responses_requests(server: Server, body: dict, status: int, param: str) -> None:
    r = server.http.post("/v1/responses", json={"model": "smol", **body}, headers=server.auth())
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
