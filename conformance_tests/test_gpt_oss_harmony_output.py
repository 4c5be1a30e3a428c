"""gpt-oss output (harmony) read back by the server: the token ids of real harmony completions, encoded by
openai-harmony itself with the real o200k vocabulary (gpt_oss_vocab, offline), fed to the server's parser
(`colibri_backend.server.tool_calls.HarmonyOutput`) one token at a time.

* The parts joined (`reasoning` from the analysis channel, `content` from final and from commentary to no
  one, tool calls from commentary to `functions.NAME`) equal openai-harmony's one-shot parse of the same ids
  (`parse_messages_from_completion_tokens`), for whole completions and for every prefix of them (max_tokens
  anywhere: in the analysis, in a header, in a call's JSON, whose text then comes back as content).
* Generation ends where harmony says an assistant's turn ends: the tokenizer Colibri builds from the gpt-oss
  GGUF stops on `<|return|>` and `<|call|>` (openai-harmony's stop_tokens_for_assistant_actions), not on
  `<|end|>`, which ends the analysis message before the answer.
* End to end: the real engine on the tiny gpt-oss checkpoint with the real vocabulary, its token choices
  forced to a harmony completion (a token mask per step), served in process and driven by the official
  `openai` and `anthropic` clients: Chat Completions (`reasoning_content`, `tool_calls` deltas), Responses
  (`reasoning` and `function_call` items), Messages (`thinking` and `tool_use` blocks), streamed and not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gpt_oss_vocab as gv
import numpy as np
import pytest
import tool_fixtures as tf

from colibri_backend.server.tool_calls import HarmonyOutput, Part


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> gv.Built:
    return gv.built(tmp_path_factory)


@pytest.fixture(scope="module")
def enc(built: gv.Built) -> Any:
    """openai-harmony's gpt-oss encoding (TIKTOKEN_ENCODINGS_BASE now names the checked o200k file, so the
    server's parser loads the same one)."""
    return gv.harmony_encoding(built.enc_dir)


# ------------------------------------------------------------------ completions, as harmony writes them


def _h() -> Any:
    import openai_harmony as h

    return h


def analysis(text: str) -> Any:
    h = _h()
    return h.Message.from_role_and_content(h.Role.ASSISTANT, text).with_channel("analysis")


def final(text: str) -> Any:
    h = _h()
    return h.Message.from_role_and_content(h.Role.ASSISTANT, text).with_channel("final")


def preamble(text: str) -> Any:
    """A commentary message to the user (no recipient): the model's plan before its calls."""
    h = _h()
    return h.Message.from_role_and_content(h.Role.ASSISTANT, text).with_channel("commentary")


def call(name: str, args: dict[str, Any]) -> Any:
    h = _h()
    return (
        h.Message.from_role_and_content(h.Role.ASSISTANT, json.dumps(args))
        .with_channel("commentary")
        .with_recipient(f"functions.{name}")
        .with_content_type("<|constrain|>json")
    )


def completion(enc: Any, messages: list[Any]) -> list[int]:
    """The ids a model writes after the prompt's `<|start|>assistant`: harmony's rendering of the turn
    (the last message ends with <|return|> or <|call|>) less the prompt's rendering."""
    h = _h()
    user = h.Message.from_role_and_content(h.Role.USER, tf.ASK)
    prompt = enc.render_conversation_for_completion(h.Conversation.from_messages([user]), h.Role.ASSISTANT)
    whole = enc.render_conversation_for_training(
        h.Conversation.from_messages([user, *messages]), h.RenderConversationConfig(auto_drop_analysis=False)
    )
    assert whole[: len(prompt)] == prompt
    return whole[len(prompt) :]


def model_text(enc: Any, text: str) -> list[int]:
    """A completion as the model's own text (the recipient after the channel, as gpt-oss writes it)."""
    return enc.encode(text, allowed_special="all")


WEATHER_CALL = {"city": "Paris"}
TIME_CALL = {"zone": "CET"}

COMPLETIONS: dict[str, Any] = {
    "analysis_then_final": lambda enc: completion(
        enc,
        [
            analysis("The user asks about Paris. Réponse brève, 日本語 👍🏽."),
            final("It is 18°C and sunny in Paris ☀️."),
        ],
    ),
    "final_without_analysis": lambda enc: completion(enc, [final("Hello! How can I help?")]),
    "analysis_then_call": lambda enc: completion(
        enc, [analysis("Need the weather tool."), call("get_weather", WEATHER_CALL)]
    ),
    "call_recipient_after_channel": lambda enc: model_text(
        enc,
        "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Paris"}<|call|>',
    ),
    "two_calls": lambda enc: completion(
        enc,
        [
            analysis("Two lookups."),
            call("get_weather", WEATHER_CALL),
            call("get_time", TIME_CALL),
        ],
    ),
    "preamble_then_call": lambda enc: completion(
        enc, [preamble("Let me check."), call("get_weather", WEATHER_CALL)]
    ),
    # a call to harmony's built-in browser, which no OpenAI request can offer: its text is the answer's
    "builtin_tool_call": lambda enc: model_text(
        enc,
        "<|channel|>analysis<|message|>Search it.<|end|>"
        "<|start|>assistant<|channel|>commentary to=browser.search <|constrain|>json"
        '<|message|>{"query":"Paris weather"}<|call|>',
    ),
}


@dataclass
class Parsed:
    reasoning: str
    content: str
    calls: list[tuple[str, Any]]


def _as_call(name: str, text: str) -> tuple[str, Any] | None:
    try:
        args = json.loads(text or "{}")
    except ValueError:
        return None
    return (name, args) if isinstance(args, dict) else None


def harmonys_parse(enc: Any, ids: list[int]) -> Parsed:
    """openai-harmony's one-shot parse, as the API reports it. Cut off inside a header, the parse refuses
    the ids; the messages before that header are then what was said. A call whose arguments are not a
    JSON object (cut off) is text."""
    h = _h()
    ends = {t for t in enc.stop_tokens()}  # <|end|>, <|call|>, <|return|>
    try:
        messages = enc.parse_messages_from_completion_tokens(ids, h.Role.ASSISTANT)
    except h.HarmonyError:
        last_end = max((i for i, t in enumerate(ids) if t in ends), default=-1)
        before = ids[: last_end + 1]
        messages = enc.parse_messages_from_completion_tokens(before, h.Role.ASSISTANT) if before else []
    out = Parsed("", "", [])
    for m in messages:
        text = "".join(c.text for c in m.content)
        recipient = m.recipient or ""
        if recipient.startswith("functions."):
            parsed = _as_call(recipient.removeprefix("functions."), text)
            if parsed is not None:
                out.calls.append(parsed)
            else:
                out.content += text
        elif m.channel == "analysis":
            out.reasoning += text
        else:
            out.content += text
    return out


def streamed(enc: Any, ids: list[int], tools: bool = True) -> tuple[Parsed, list[Part]]:
    parser = HarmonyOutput(tools)
    parts: list[Part] = []
    for t in ids:
        # the text the engine's decoder gives a token alone (special tokens: none)
        parts += parser.feed(t, "" if t >= gv.O200K_RANKS else enc.decode([t]))
    parts += parser.finish()
    out = Parsed("", "", [])
    for p in parts:
        if p.kind == "tool_call":
            assert p.call is not None
            out.calls.append((p.call.name, json.loads(p.call.arguments)))
        elif p.kind == "reasoning":
            out.reasoning += p.text
        else:
            out.content += p.text
    return out, parts


@pytest.mark.parametrize("name", list(COMPLETIONS))
def test_streamed_parts_are_harmonys_one_shot_parse(enc: Any, name: str) -> None:
    ids = COMPLETIONS[name](enc)
    got, parts = streamed(enc, ids)
    want = harmonys_parse(enc, ids)
    assert got == want
    assert want.reasoning or want.content or want.calls
    for p in parts:  # no header markup reaches a delta
        assert "<|" not in p.text and "functions." not in p.text and "commentary" not in p.text


def test_what_the_completions_hold(enc: Any) -> None:
    """The expectations above are not vacuous: each completion says what it was written to say."""
    parse = {name: harmonys_parse(enc, make(enc)) for name, make in COMPLETIONS.items()}
    assert parse["analysis_then_final"] == Parsed(
        "The user asks about Paris. Réponse brève, 日本語 👍🏽.", "It is 18°C and sunny in Paris ☀️.", []
    )
    assert parse["final_without_analysis"] == Parsed("", "Hello! How can I help?", [])
    weather = ("get_weather", WEATHER_CALL)
    assert parse["analysis_then_call"] == Parsed("Need the weather tool.", "", [weather])
    assert parse["call_recipient_after_channel"] == parse["analysis_then_call"]
    assert parse["two_calls"] == Parsed("Two lookups.", "", [weather, ("get_time", TIME_CALL)])
    assert parse["preamble_then_call"] == Parsed("", "Let me check.", [weather])
    assert parse["builtin_tool_call"] == Parsed("Search it.", '{"query":"Paris weather"}', [])


@pytest.mark.parametrize("name", ["analysis_then_final", "analysis_then_call", "two_calls"])
def test_every_cut_gives_harmonys_parse_of_the_prefix(enc: Any, name: str) -> None:
    """max_tokens after any token: in the analysis, in a header, in a call's JSON."""
    ids = COMPLETIONS[name](enc)
    for n in range(1, len(ids)):
        got, _ = streamed(enc, ids[:n])
        want = harmonys_parse(enc, ids[:n])
        # Cut inside a character (👍🏽 is several tokens), the one-shot parse ends with U+FFFD; the stream
        # sends whole characters only, so the half character is not sent.
        want.reasoning, want.content = want.reasoning.rstrip("\ufffd"), want.content.rstrip("\ufffd")
        assert got == want, (n, enc.decode(ids[:n]))


def test_a_call_cut_in_its_json_is_text_not_a_call(enc: Any) -> None:
    ids = COMPLETIONS["analysis_then_call"](enc)
    cut = ids[: len(ids) - 3]  # inside '{"city": "Paris"}'
    got, _ = streamed(enc, cut)
    assert got.reasoning == "Need the weather tool." and not got.calls
    assert got.content and '{"city": "Paris"}'.startswith(got.content)


def test_output_that_leaves_the_format_is_text(enc: Any) -> None:
    plain, _ = streamed(enc, model_text(enc, "Hello there<|return|>"))
    assert plain == Parsed("", "Hello there", [])
    after_end, _ = streamed(enc, model_text(enc, "<|channel|>final<|message|>Hi<|end|> and more<|return|>"))
    assert after_end == Parsed("", "Hi and more", [])


def test_without_tools_offered_no_call_is_reported(enc: Any) -> None:
    got, _ = streamed(enc, COMPLETIONS["analysis_then_call"](enc), tools=False)
    assert got == Parsed("Need the weather tool.", "", [])


# ------------------------------------------------------------------ where generation stops


@pytest.mark.parametrize("converter", ["colibri", "llama.cpp"])
def test_the_gguf_tokenizer_stops_where_harmony_ends_a_turn(
    built: gv.Built, enc: Any, converter: str
) -> None:
    from colibri_backend.adapters.gguf_metadata import read_metadata
    from colibri_backend.adapters.tokenizer import Tokenizer

    path = built.gguf(converter)
    tok = Tokenizer.from_gguf_metadata(read_metadata(path), source=str(path))
    turn_ends = set(enc.stop_tokens_for_assistant_actions())  # <|call|>, <|return|>
    (end,) = enc.encode("<|end|>", allowed_special="all")
    assert turn_ends <= tok.stop_token_ids and end not in tok.stop_token_ids


# ------------------------------------------------------------------ end to end: the engine, forced


class Script:
    """A token constraint (colibri_backend.grammar.TokenConstraint's interface) that allows exactly the
    next id of `ids`, then `ids[-1]` for ever: the engine samples the script."""

    def __init__(self, ids: list[int], n_vocab: int) -> None:
        self.ids = ids
        self.n_vocab = n_vocab
        self.at = 0
        self.mask = np.zeros((n_vocab + 31) // 32, dtype=np.uint32)

    def fill(self) -> np.ndarray:
        tok = self.ids[min(self.at, len(self.ids) - 1)]
        self.mask[:] = 0
        self.mask[tok // 32] = np.uint32(1 << (tok % 32))
        return self.mask

    def consume(self, token: int) -> None:
        assert token == self.ids[min(self.at, len(self.ids) - 1)]
        self.at += 1

    @property
    def done(self) -> bool:
        return False


class Forced:
    """The real Colibri model, its generation forced to `script` (set by the test)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.script: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def generate_tokens(self, prompt_ids: Any, **kw: Any) -> Iterator[Any]:
        assert kw.get("constraint") is None
        kw["constraint"] = Script(self.script, self._model.info.n_vocab)
        return self._model.generate_tokens(prompt_ids, **kw)


@pytest.fixture(scope="module")
def served(built: gv.Built, enc: Any) -> Iterator[tuple[Forced, Any]]:
    from fastapi.testclient import TestClient

    import colibri_backend
    from colibri_backend.config import Config, ModelConfig
    from colibri_backend.server import ServerState, create_app

    model = Forced(colibri_backend.load(built.gguf("colibri"), threads=1, context_length=1024))
    cfg = Config(models={"g": ModelConfig(alias="g", path="x", backend="fake")}, default_model="g")
    state = ServerState(cfg, api_key=None, loader=lambda c: model)
    with TestClient(create_app(state)) as http:
        state.wait_loaded(60)
        yield model, http
    model._model.close()


# Text the model would write after its turn's end: it must never reach the client.
AFTER_TURN = "<|start|>assistant<|channel|>final<|message|>LEAKED<|return|>"


def _openai(http: Any) -> Any:
    import openai

    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


def _chat_stream(client: Any, **kw: Any) -> tuple[str, str, dict[int, dict[str, str]], list[str]]:
    reasoning = content = ""
    calls: dict[int, dict[str, str]] = {}
    finishes = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    return reasoning, content, calls, finishes


def test_served_reasoning_then_answer(served: tuple[Forced, Any], enc: Any) -> None:
    model, http = served
    want = harmonys_parse(enc, COMPLETIONS["analysis_then_final"](enc))
    model.script = COMPLETIONS["analysis_then_final"](enc) + model_text(enc, AFTER_TURN)
    client = _openai(http)
    kw: dict[str, Any] = dict(model="g", messages=tf.ask(), max_tokens=200, temperature=0)
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "stop"  # at <|return|>, not at the analysis' <|end|>
    assert msg.content == want.content and msg.model_extra["reasoning_content"] == want.reasoning
    assert msg.tool_calls is None
    assert _chat_stream(client, **kw) == (want.reasoning, want.content, {}, ["stop"])

    r = client.responses.create(model="g", input=tf.ask(), max_output_tokens=200, temperature=0)
    assert [i.type for i in r.output] == ["reasoning", "message"] and r.status == "completed"
    assert r.output[0].content[0].text == want.reasoning and r.output_text == want.content
    deltas: dict[str, str] = {}
    for ev in client.responses.create(model="g", input=tf.ask(), max_output_tokens=200, stream=True):
        if ev.type.endswith("_text.delta"):
            deltas[ev.type] = deltas.get(ev.type, "") + ev.delta
    assert deltas == {
        "response.reasoning_text.delta": want.reasoning,
        "response.output_text.delta": want.content,
    }

    import anthropic

    claude = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http, max_retries=0)
    m = claude.messages.create(model="g", max_tokens=200, messages=tf.ask())
    blocks = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content]
    assert blocks == [("thinking", want.reasoning), ("text", want.content)]
    assert m.stop_reason == "end_turn"
    pieces: dict[str, str] = {}
    for ev in claude.messages.create(model="g", max_tokens=200, messages=tf.ask(), stream=True):
        if ev.type == "content_block_delta" and ev.delta.type in ("thinking_delta", "text_delta"):
            text = getattr(ev.delta, "thinking", None) or getattr(ev.delta, "text", None) or ""
            pieces[ev.delta.type] = pieces.get(ev.delta.type, "") + text
    assert pieces == {"thinking_delta": want.reasoning, "text_delta": want.content}


def test_served_tool_call(served: tuple[Forced, Any], enc: Any) -> None:
    model, http = served
    model.script = COMPLETIONS["call_recipient_after_channel"](enc) + model_text(enc, AFTER_TURN)
    client = _openai(http)
    kw: dict[str, Any] = dict(model="g", messages=tf.ask(), tools=[tf.WEATHER], max_tokens=200)
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None  # stopped at <|call|>
    assert choice.message.model_extra["reasoning_content"] == "Need the weather tool."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", WEATHER_CALL)
    ]
    reasoning, content, calls, finishes = _chat_stream(client, **kw)
    assert (reasoning, content, finishes) == ("Need the weather tool.", "", ["tool_calls"])
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", WEATHER_CALL)
    ]

    r = client.responses.create(
        model="g", input=tf.ask(), tools=[tf.responses_tool(tf.WEATHER_FN)], max_output_tokens=200
    )
    assert [i.type for i in r.output] == ["reasoning", "function_call"]
    assert r.output[1].name == "get_weather" and json.loads(r.output[1].arguments) == WEATHER_CALL
    done = [
        ev.arguments
        for ev in client.responses.create(
            model="g",
            input=tf.ask(),
            tools=[tf.responses_tool(tf.WEATHER_FN)],
            max_output_tokens=200,
            stream=True,
        )
        if ev.type == "response.function_call_arguments.done"
    ]
    assert [json.loads(a) for a in done] == [WEATHER_CALL]

    import anthropic

    claude = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http, max_retries=0)
    m = claude.messages.create(
        model="g", max_tokens=200, messages=tf.ask(), tools=[tf.messages_tool(tf.WEATHER_FN)]
    )
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[1].name == "get_weather" and m.content[1].input == WEATHER_CALL
    with claude.messages.stream(
        model="g", max_tokens=200, messages=tf.ask(), tools=[tf.messages_tool(tf.WEATHER_FN)]
    ) as stream:
        streamed_message = stream.get_final_message()
    assert [b.type for b in streamed_message.content] == ["thinking", "tool_use"]
    assert streamed_message.content[1].input == WEATHER_CALL and streamed_message.stop_reason == "tool_use"


def test_served_call_cut_by_max_tokens(served: tuple[Forced, Any], enc: Any) -> None:
    model, http = served
    ids = COMPLETIONS["analysis_then_call"](enc)
    model.script = ids
    client = _openai(http)
    r = client.chat.completions.create(
        model="g", messages=tf.ask(), tools=[tf.WEATHER], max_tokens=len(ids) - 3
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.model_extra["reasoning_content"] == "Need the weather tool."
    assert choice.message.content and '{"city": "Paris"}'.startswith(choice.message.content)
