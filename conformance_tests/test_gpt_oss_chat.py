"""gpt-oss's real chat template (the jinja file of llama.cpp's tree, as the converter writes it into the
GGUF): Colibri's renderer (`render_chat`) against transformers' `apply_chat_template`, and the token ids of
that rendering (Colibri's GGUF tokenizer) against openai-harmony's own renderer for the same conversation.

The two formats describe the same conversations with these differences, facts checked below:
* a tool result: the template writes the message content through `tojson` (a JSON string literal); harmony
  writes a message's text as given, so the harmony message holds the quoted text to match;
* developer instructions without tools: the template ends them with a blank line, harmony does not;
* a function whose `parameters` is {}: the template writes `() => any`, harmony `(_: any) => any` (and
  `() => any` when it has no parameters at all);
* an assistant message with several tool calls: the template renders the first only ("max 1 tool call per
  message"); harmony has one message per call;
* a training rendering (no generation prompt, last turn an assistant's): the template keeps that turn's
  thinking; harmony's render_conversation_for_training drops it unless auto_drop_analysis is off.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from typing import Any

import gpt_oss_vocab as gv
import pytest
import tool_fixtures as tf

from colibri_backend.adapters.chat_template import render_chat
from colibri_backend.adapters.gguf_metadata import read_metadata
from colibri_backend.adapters.tokenizer import Tokenizer

WEATHER, TIME, NO_ARGS = tf.WEATHER_DOC, tf.TIME_DOC, tf.PING
call = tf.call


@dataclass
class Case:
    """A conversation as chat messages (what the template takes) and as harmony messages (`build`)."""

    name: str
    messages: list[dict[str, Any]]
    build: Any  # (openai_harmony module, system content) -> list of harmony Messages
    tools: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    generation_prompt: bool = True
    # where the two formats differ (see the module's docstring): (the template's text, harmony's text)
    differs: tuple[str, str] | None = None


# Developer instructions without tools: the template ends them with a blank line, harmony does not.
INSTRUCTIONS_END = ("\n\n<|end|>", "<|end|>")


def _system(h: Any, **extra: Any) -> Any:
    content = h.SystemContent.new().with_conversation_start_date(datetime.date.today().isoformat())
    if "reasoning_effort" in extra:
        content = content.with_reasoning_effort(h.ReasoningEffort(extra["reasoning_effort"].capitalize()))
    if "model_identity" in extra:
        content = content.with_model_identity(extra["model_identity"])
    for tool in extra.get("builtin_tools", []):
        content = content.with_tools(getattr(h.ToolNamespaceConfig, tool)())
    return h.Message.from_role_and_content(h.Role.SYSTEM, content)


def _developer(h: Any, instructions: str | None, tools: list[dict[str, Any]] | None) -> Any:
    content = h.DeveloperContent.new()
    if instructions:
        content = content.with_instructions(instructions)
    if tools:
        content = content.with_function_tools(
            [
                # no arguments: `parameters` {} to the template, None to harmony (which writes {} as `_: any`)
                h.ToolDescription.new(
                    t["function"]["name"],
                    t["function"]["description"],
                    parameters=t["function"]["parameters"] or None,
                )
                for t in tools
            ]
        )
    return h.Message.from_role_and_content(h.Role.DEVELOPER, content)


def _user(h: Any, text: str) -> Any:
    return h.Message.from_role_and_content(h.Role.USER, text)


def _assistant(h: Any, text: str, channel: str) -> Any:
    return h.Message.from_role_and_content(h.Role.ASSISTANT, text).with_channel(channel)


def _call(h: Any, name: str, args: dict[str, Any]) -> Any:
    return (
        h.Message.from_role_and_content(h.Role.ASSISTANT, json.dumps(args))
        .with_channel("commentary")
        .with_recipient(f"functions.{name}")
        .with_content_type("json")
    )


def _result(h: Any, name: str, text: str) -> Any:
    author = h.Author.new(h.Role.TOOL, f"functions.{name}")
    return (
        h.Message.from_author_and_content(author, json.dumps(text))  # the template's `content|tojson`
        .with_recipient("assistant")
        .with_channel("commentary")
    )


ASK = tf.ASK
CASES = [
    Case("user_only", [{"role": "user", "content": "Hi"}], lambda h: [_user(h, "Hi")]),
    Case(
        "system_prompt",
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
        lambda h: [_developer(h, "Answer in French.", None), _user(h, "Hi")],
        differs=INSTRUCTIONS_END,
    ),
    Case(
        "developer_role",
        [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
        lambda h: [_developer(h, "Be terse.", None), _user(h, "Hi")],
        differs=INSTRUCTIONS_END,
    ),
    Case(
        "tools_no_system",
        [{"role": "user", "content": ASK}],
        lambda h: [_developer(h, None, [WEATHER, TIME, NO_ARGS]), _user(h, ASK)],
        tools=[WEATHER, TIME, NO_ARGS],
    ),
    Case(
        "tools_and_system",
        [{"role": "system", "content": "Use tools."}, {"role": "user", "content": ASK}],
        lambda h: [_developer(h, "Use tools.", [WEATHER]), _user(h, ASK)],
        tools=[WEATHER],
    ),
    Case(
        "multi_turn_drops_old_reasoning",
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "thinking": "A greeting.", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ],
        lambda h: [
            _user(h, "Hi"),
            _assistant(h, "A greeting.", "analysis"),
            _assistant(h, "Hello!", "final"),
            _user(h, "Bye"),
        ],
    ),
    Case(
        "tool_call_with_reasoning_then_result",
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "thinking": "Need the tool.",
                "tool_calls": [call("get_weather", {"city": "Paris"})],
            },
            {"role": "tool", "content": "18C, clear"},
        ],
        lambda h: [
            _developer(h, "Be brief.", [WEATHER]),
            _user(h, ASK),
            _assistant(h, "Need the tool.", "analysis"),
            _call(h, "get_weather", {"city": "Paris"}),
            _result(h, "get_weather", "18C, clear"),
        ],
        tools=[WEATHER],
    ),
    Case(
        "tool_call_content_as_reasoning",
        [
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [call("get_weather", {"city": "Paris"})],
            },
            {"role": "tool", "content": '{"t": 18}'},
        ],
        lambda h: [
            _developer(h, None, [WEATHER]),
            _user(h, ASK),
            _assistant(h, "Checking.", "analysis"),
            _call(h, "get_weather", {"city": "Paris"}),
            _result(h, "get_weather", '{"t": 18}'),
        ],
        tools=[WEATHER],
    ),
    Case(
        "tool_round_then_final_answer",
        [
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "thinking": "Need the tool.",
                "tool_calls": [call("get_weather", {"city": "Paris"})],
            },
            {"role": "tool", "content": "18C"},
            {"role": "assistant", "content": "It is 18C in Paris."},
            {"role": "user", "content": "And the time?"},
        ],
        lambda h: [
            _developer(h, None, [WEATHER, TIME]),
            _user(h, ASK),
            _call(h, "get_weather", {"city": "Paris"}),  # the analysis before a later final is dropped
            _result(h, "get_weather", "18C"),
            _assistant(h, "It is 18C in Paris.", "final"),
            _user(h, "And the time?"),
        ],
        tools=[WEATHER, TIME],
    ),
    Case(
        "reasoning_effort_and_identity",
        [{"role": "user", "content": "Think hard."}],
        lambda h: [_user(h, "Think hard.")],
        extra={"reasoning_effort": "high", "model_identity": "You are Colibri, a small model."},
    ),
    Case(
        "low_effort",
        [{"role": "user", "content": "Quick."}],
        lambda h: [_user(h, "Quick.")],
        extra={"reasoning_effort": "low"},
    ),
    Case(
        "builtin_python_and_browser",
        [{"role": "user", "content": "Plot it."}],
        lambda h: [_user(h, "Plot it.")],
        extra={"builtin_tools": ["browser", "python"]},
    ),
    Case(
        "training_last_assistant_turn",
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "thinking": "Add them.", "content": "4"},
        ],
        lambda h: [_user(h, "2+2?"), _assistant(h, "Add them.", "analysis"), _assistant(h, "4", "final")],
        generation_prompt=False,
    ),
    Case(
        "unicode_content",
        [
            {"role": "system", "content": "Réponds en français 🇫🇷"},
            {"role": "user", "content": "日本語で？ 👍🏽"},
        ],
        lambda h: [_developer(h, "Réponds en français 🇫🇷", None), _user(h, "日本語で？ 👍🏽")],
        differs=INSTRUCTIONS_END,
    ),
]
IDS = [c.name for c in CASES]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> gv.Built:
    return gv.built(tmp_path_factory)


@pytest.fixture(scope="module")
def template(built: gv.Built) -> str:
    """The chat template as Colibri's converter wrote it into the GGUF: the sdist's file unchanged."""
    source = read_metadata(built.gguf("colibri"))["tokenizer.chat_template"]
    assert source == gv.chat_template()
    return source


@pytest.fixture(scope="module")
def hf(built: gv.Built) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(built.tokenizer_dir()))


@pytest.fixture(scope="module")
def ours(built: gv.Built) -> Tokenizer:
    path = built.gguf("colibri")
    return Tokenizer.from_gguf_metadata(read_metadata(path), source=str(path))


@pytest.fixture(scope="module")
def harmony(built: gv.Built) -> Any:
    return gv.harmony_encoding(built.enc_dir)


def _render(template: str, case: Case) -> str:
    return render_chat(
        template,
        case.messages,
        add_generation_prompt=case.generation_prompt,
        **({"tools": case.tools} if case.tools else {}),
        **case.extra,
    )


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_colibri_renders_as_transformers(template: str, hf: Any, case: Case) -> None:
    theirs = hf.apply_chat_template(
        case.messages,
        tools=case.tools,
        tokenize=False,
        add_generation_prompt=case.generation_prompt,
        **case.extra,
    )
    assert _render(template, case) == theirs


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_rendered_ids_are_harmonys(template: str, ours: Tokenizer, harmony: Any, case: Case) -> None:
    import openai_harmony as h

    conversation = h.Conversation.from_messages([_system(h, **case.extra), *case.build(h)])
    if case.generation_prompt:
        want = harmony.render_conversation_for_completion(conversation, h.Role.ASSISTANT)
    else:
        keep = h.RenderConversationConfig(auto_drop_analysis=False)
        want = harmony.render_conversation_for_training(conversation, keep)
    text = _render(template, case)
    if case.differs is not None:
        ours_part, theirs_part = case.differs
        assert text.count(ours_part) == 1
        text = text.replace(ours_part, theirs_part)
    got = ours.encode(text, add_special_tokens=False)
    assert got == want, (harmony.decode(got), harmony.decode(want))


def test_training_rendering_differs_only_by_harmonys_dropped_analysis(
    template: str, ours: Tokenizer, harmony: Any
) -> None:
    import openai_harmony as h

    case = next(c for c in CASES if c.name == "training_last_assistant_turn")
    conversation = h.Conversation.from_messages([_system(h), *case.build(h)])
    dropped = harmony.decode(harmony.render_conversation_for_training(conversation))
    rendered = _render(template, case)
    analysis = "<|start|>assistant<|channel|>analysis<|message|>Add them.<|end|>"
    assert analysis in rendered and analysis not in dropped
    assert rendered.replace(analysis, "") == dropped


def test_a_function_without_parameters(template: str, harmony: Any) -> None:
    """The template writes parameters {} as a function of no arguments; harmony writes that for None and
    `(_: any)` for {}."""
    import openai_harmony as h

    text = render_chat(template, [{"role": "user", "content": "Hi"}], tools=[NO_ARGS])
    assert "type ping = () => any;" in text

    def rendered(parameters: Any) -> str:
        tool = h.ToolDescription.new("ping", "Liveness", parameters=parameters)
        message = h.Message.from_role_and_content(
            h.Role.DEVELOPER, h.DeveloperContent.new().with_function_tools([tool])
        )
        return harmony.decode(harmony.render(message))

    assert "type ping = () => any;" in rendered(None)
    assert "type ping = (_: any) => any;" in rendered({})


def test_several_calls_in_one_message_render_the_first_only(template: str) -> None:
    messages = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "tool_calls": [call("get_weather", {"city": "Paris"}), call("get_time", {"zone": "CET"})],
        },
    ]
    text = render_chat(template, messages, tools=[WEATHER, TIME])
    assert "to=functions.get_weather" in text and "to=functions.get_time" not in text
