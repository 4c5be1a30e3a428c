"""The output parsers of server/tool_calls.py: tool calls per model family, ``<think>`` reasoning, fed
in every possible split so no partial markup ever reaches the answer text; the family chosen from the
template; the forced-call grammar accepted by llguidance."""

from __future__ import annotations

import json

import numpy as np
import pytest

from colibri_backend.adapters.sampling import SamplingParams
from colibri_backend.generation import NumpySampler
from colibri_backend.server.tool_calls import (
    MarkupOutput,
    Part,
    family_of,
    forced_call_grammar,
    new_output_parser,
    parse_calls,
)


def run(parser, pieces: list[str], ids: list[int] | None = None) -> list[Part]:
    parts: list[Part] = []
    for i, piece in enumerate(pieces):
        parts += parser.feed(ids[i] if ids else i, piece)
    return parts + parser.finish()


def merged(parts: list[Part]) -> tuple[str, str, list[tuple[str, dict]]]:
    content = "".join(p.text for p in parts if p.kind == "content")
    reasoning = "".join(p.text for p in parts if p.kind == "reasoning")
    calls = [(p.call.name, json.loads(p.call.arguments)) for p in parts if p.kind == "tool_call"]
    return content, reasoning, calls


def splits(text: str) -> list[list[str]]:
    """The text cut into 1-, 2-, 3- and 5-character pieces, and cut once at every position."""
    out = [[text[i : i + n] for i in range(0, len(text), n)] for n in (1, 2, 3, 5)]
    out += [[text[:k], text[k:]] for k in range(1, len(text))]
    return out


HERMES = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.mark.parametrize("pieces", splits(HERMES))
def test_hermes_call_in_any_split_never_leaks_markup(pieces: list[str]) -> None:
    parser = MarkupOutput("hermes", tools=True, reasoning=False)
    parts = run(parser, pieces)
    for p in parts:
        assert "<" not in p.text and "tool_call" not in p.text
    assert merged(parts) == ("Let me check. ", "", [("get_weather", {"city": "Paris"})])


THINK = "<think>The user wants weather.</think>It is sunny."


@pytest.mark.parametrize("pieces", splits(THINK))
def test_think_reasoning_separated_in_any_split(pieces: list[str]) -> None:
    parts = run(MarkupOutput("hermes", tools=True, reasoning=True), pieces)
    assert merged(parts) == ("It is sunny.", "The user wants weather.", [])
    assert all("think>" not in p.text for p in parts)


def test_two_hermes_calls_and_text_between() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call>'
    )
    content, _, calls = merged(run(MarkupOutput("hermes", tools=True, reasoning=False), list(text)))
    assert calls == [("a", {"x": 1}), ("b", {"y": [2]})] and content.strip() == ""


def test_a_broken_call_is_returned_as_text_not_lost() -> None:
    text = "<tool_call>{not json}</tool_call> ok"
    content, _, calls = merged(run(MarkupOutput("hermes", tools=True, reasoning=False), [text]))
    assert calls == [] and content == "<tool_call>{not json}</tool_call> ok"
    unfinished = '<tool_call>{"name": "a", "argu'
    content, _, calls = merged(run(MarkupOutput("hermes", tools=True, reasoning=False), list(unfinished)))
    assert calls == [] and content == unfinished


def test_llama3_bare_json_and_python_tag() -> None:
    text = '{"name": "lookup", "parameters": {"q": "colibri"}}'
    assert merged(run(MarkupOutput("llama3", tools=True, reasoning=False), list(text))) == (
        "",
        "",
        [("lookup", {"q": "colibri"})],
    )
    # <|python_tag|> is a special token the decoder drops from the text: recognised by its id
    parser = new_output_parser(
        "{{ '<|python_tag|>' }} ipython",
        tools=True,
        token_to_id=lambda s: 7 if s == "<|python_tag|>" else None,
    )
    parts = run(parser, ["", '{"name": "f", "parameters": {}}'], ids=[7, 8])
    assert merged(parts) == ("", "", [("f", {})])
    # an answer that merely starts with a brace is text
    assert merged(run(MarkupOutput("llama3", tools=True, reasoning=False), ["{curly} answer"])) == (
        "{curly} answer",
        "",
        [],
    )


def test_mistral_list_and_args_forms() -> None:
    text = '[TOOL_CALLS][{"name": "a", "arguments": {"k": "v"}}, {"name": "b", "arguments": {}}]'
    assert merged(run(MarkupOutput("mistral", tools=True, reasoning=False), list(text)))[2] == [
        ("a", {"k": "v"}),
        ("b", {}),
    ]
    assert parse_calls('get_time[ARGS]{"tz": "UTC"}')[0].name == "get_time"


def test_without_tools_markup_is_plain_text() -> None:
    parser = new_output_parser("<tool_call>", tools=False)
    assert merged(run(parser, [HERMES])) == (HERMES, "", [])


def test_family_from_template() -> None:
    assert family_of("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert family_of("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert family_of("<|start_header_id|>ipython<|end_header_id|>") == "llama3"
    assert family_of("<|start|>assistant<|channel|>final<|message|>") == "harmony"
    assert family_of(None) == "hermes"


def test_forced_call_grammar_compiles_and_holds_the_schema() -> None:
    import llguidance

    tools = [
        {
            "type": "function",
            "function": {
                "name": "a",
                "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
            },
        },
        {"type": "function", "function": {"name": "b"}},
    ]
    for family, parallel in (("hermes", True), ("hermes", False), ("llama3", False)):
        lark = forced_call_grammar(family, tools, parallel)
        assert lark is not None
        assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark)) == ""
        assert '"const": "a"' in lark and '"additionalProperties": false' in lark
    assert forced_call_grammar("mistral", tools, False) is None


def test_numpy_sampler_honours_the_allowed_mask() -> None:
    logits = np.linspace(0, 5, 70).astype(np.float32)  # token 69 best
    mask = np.zeros(3, dtype=np.uint32)
    mask[1] = 1 << 3  # token 35 only
    greedy = NumpySampler(SamplingParams(temperature=0), [1])
    greedy.allow(mask)
    assert greedy.sample(logits) == 35
    greedy.allow(None)
    assert greedy.sample(logits) == 69
    sampled = NumpySampler(SamplingParams(temperature=1.0, seed=3), [1])
    mask[0] = 1 << 4
    sampled.allow(mask)
    assert {sampled.sample(logits) for _ in range(200)} == {4, 35}
