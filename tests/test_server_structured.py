"""Structured output on a real server (SmolLM2 on Colibri's engine, the official `openai` client):
``response_format`` json_schema (strict) output that validates against its schema on 50 varied prompts
and schemas, streamed and not; json_object; schemas llguidance rejects answered 400 with its message."""

from __future__ import annotations

import json

import jsonschema
import pytest
from api_server import Server, server_fixture

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 20},
            "rating": {"type": "number", "minimum": 0, "maximum": 5},
            "genre": {"enum": ["drama", "comedy", "horror"]},
        },
        "required": ["title", "rating", "genre"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "item": {"type": "string", "maxLength": 12},
            "price": {
                "type": "object",
                "properties": {"amount": {"type": "integer"}, "currency": {"const": "EUR"}},
                "required": ["amount", "currency"],
                "additionalProperties": False,
            },
        },
        "required": ["item", "price"],
        "additionalProperties": False,
    },
]
TOPICS = [
    "a pirate",
    "a dentist in Rome",
    "my grandmother",
    "a robot",
    "a famous painter",
    "a cat",
    "a football coach",
    "a baker from Lyon",
    "an astronaut",
    "a young student",
]


def prompts() -> list[tuple[str, dict]]:
    out = []
    for i in range(50):
        schema = SCHEMAS[i % len(SCHEMAS)]
        topic = TOPICS[(i // len(SCHEMAS)) % len(TOPICS)]
        out.append((f"Answer in JSON about {topic}.", schema))
    return out


server = server_fixture("structured")


def fmt(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_json_schema_output_validates_on_50_prompts(server: Server) -> None:
    for i, (prompt, schema) in enumerate(prompts()):
        r = server.client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": prompt}],
            response_format=fmt(schema),
            max_tokens=80,
            temperature=0.8,
            seed=i,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (prompt, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_streamed_json_schema_and_json_object(server: Server) -> None:
    schema = SCHEMAS[3]
    chunks = server.client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Review a film in JSON."}],
        response_format=fmt(schema),
        max_tokens=80,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    r = server.client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Describe a dog as a JSON object."}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert r.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize(
    ("response_format", "needle"),
    [
        (fmt({"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "no-such-type"),
        (fmt({"type": "string", "pattern": "(unclosed"}), ""),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "not an object"}}, "schema"),
        ({"type": "yaml"}, "yaml"),
    ],
)
def test_bad_schemas_are_400_with_the_reason(server: Server, response_format: dict, needle: str) -> None:
    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": response_format,
    }
    r = server.http.post("/v1/chat/completions", json=body, headers=server.auth())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and needle in err["message"] and err["message"]
