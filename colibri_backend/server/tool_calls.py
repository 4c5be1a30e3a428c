"""Model output split into what the client sees: answer text, reasoning, and tool calls.

Each model family writes tool calls its own way; the family is chosen from the chat template
(:func:`family_of`):

* ``hermes`` (Hermes, Qwen 2.5/3, SmolLM3, most ChatML tool templates): ``<tool_call>{"name": ..,
  "arguments": {..}}</tool_call>``, one block per call;
* ``llama3``: a bare JSON object ``{"name": .., "parameters": {..}}`` as the whole answer, or after
  ``<|python_tag|>``;
* ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` (or the newer
  ``name[ARGS]{..}`` form);
* ``harmony`` (gpt-oss): parsed by the ``openai-harmony`` package from the token ids; the ``analysis``
  channel is reasoning, ``final`` the answer, a ``commentary`` message to ``functions.NAME`` a call.

Reasoning between ``<think>`` and ``</think>`` (templates that mention them) comes out apart from the
answer. The parsers are incremental: text that could still be the start of a marker is held back, so
partial markup never reaches the answer's deltas; a call is emitted once it is complete.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


@dataclass
class Part:
    kind: Literal["content", "reasoning", "tool_call"]
    text: str = ""
    call: ToolCall | None = None


class OutputParser(ABC):
    """Fed one generated token at a time (its id and the text it adds); returns the parts now final."""

    @abstractmethod
    def feed(self, token_id: int, text: str) -> list[Part]: ...

    @abstractmethod
    def finish(self) -> list[Part]: ...


class PlainOutput(OutputParser):
    def feed(self, token_id: int, text: str) -> list[Part]:
        return [Part("content", text)] if text else []

    def finish(self) -> list[Part]:
        return []


# ---------------------------------------------------------------- families

FAMILIES = ("hermes", "llama3", "mistral", "harmony")


def family_of(template: str | None) -> str:
    """The tool-call family a chat template writes (hermes when the template does not say)."""
    t = template or ""
    if "<|channel|>" in t or "<|start|>" in t and "<|message|>" in t:
        return "harmony"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or "ipython" in t or "<|eom_id|>" in t:
        return "llama3"
    return "hermes"


def thinks(template: str | None) -> bool:
    """Whether the template's model writes ``<think>`` reasoning."""
    return "<think>" in (template or "") or "</think>" in (template or "")


@dataclass(frozen=True)
class _Markers:
    call_open: str | None
    call_close: str | None  # None: the call runs to the end of the output
    bare_json: bool = False  # a whole answer that is one JSON object may be a call (Llama 3)


_MARKERS = {
    "hermes": _Markers("<tool_call>", "</tool_call>"),
    "llama3": _Markers("<|python_tag|>", None, bare_json=True),
    "mistral": _Markers("[TOOL_CALLS]", None),
}

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def marker_strings(family: str) -> list[str]:
    """Markers a parser of ``family`` looks for; a backend that drops special tokens from the text has
    them put back by id (see :func:`new_output_parser`)."""
    m = _MARKERS.get(family)
    found = [THINK_OPEN, THINK_CLOSE]
    if m is not None:
        found += [s for s in (m.call_open, m.call_close) if s]
    return found


def _call_from(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def parse_calls(body: str) -> list[ToolCall] | None:
    """Tool calls in a call body (one JSON object, a JSON list of them, objects separated by ``;``, or
    Mistral's ``name[ARGS]{..}``); None when it is not one."""
    text = body.strip()
    if not text:
        return None
    if "[ARGS]" in text and not text.startswith(("[", "{")):
        name, _, args = text.partition("[ARGS]")
        call = _call_from({"name": name.strip(), "arguments": args.strip()})
        return [call] if call else None
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(text):
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        for item in items:
            call = _call_from(item)
            if call is None:
                return None
            calls.append(call)
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
    return calls or None


def _held(buf: str, markers: list[str]) -> int:
    """Length of the longest end of ``buf`` that could still grow into one of ``markers``."""
    hold = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), 0, -1):
            if buf.endswith(m[:k]):
                hold = max(hold, k)
                break
    return hold


class MarkupOutput(OutputParser):
    """Hermes, Llama 3 and Mistral tool calls and ``<think>`` reasoning, from the text."""

    def __init__(
        self,
        family: str,
        *,
        tools: bool,
        reasoning: bool,
        special: dict[int, str] | None = None,
        start_in_reasoning: bool = False,
    ) -> None:
        self.m = _MARKERS[family] if tools else _Markers(None, None)
        self.reasoning = reasoning
        self.special = special or {}
        self.mode: Literal["content", "reasoning", "call", "maybe_json"] = (
            "reasoning" if start_in_reasoning else "content"
        )
        self.buf = ""
        self.started = False  # some answer text (not whitespace) was seen
        self.after_call = False  # a call just ended

    def _opens(self) -> list[str]:
        out = [self.m.call_open] if self.m.call_open else []
        return out + ([THINK_OPEN] if self.reasoning else [])

    def feed(self, token_id: int, text: str) -> list[Part]:
        self.buf += self.special.get(token_id, text) if not text else text
        return self._drain(final=False)

    def finish(self) -> list[Part]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Part]:
        out: list[Part] = []
        while True:
            progressed = getattr(self, f"_step_{self.mode}")(out, final)
            if not progressed:
                return [p for p in out if p.text or p.call]

    def _step_content(self, out: list[Part], final: bool) -> bool:
        if self.after_call:  # whitespace between calls (or after the last) is layout, not answer
            rest = self.buf.lstrip()
            if not rest and not final:
                return False
            opener = self.m.call_open or ""
            if not rest or rest.startswith(opener) or (opener.startswith(rest) and not final):
                self.buf = rest
                if not rest or not rest.startswith(opener):
                    return False
            self.after_call = False
        if not self.started and self.m.bare_json:
            stripped = self.buf.lstrip()
            if stripped.startswith("{"):
                self.mode = "maybe_json"
                return True
            if stripped:
                self.started = True
            elif not final:
                return False
        opens = self._opens()
        hits = [(self.buf.find(o), o) for o in opens if o in self.buf]
        if hits:
            i, marker = min(hits)
            out.append(Part("content", self.buf[:i]))
            self.buf = self.buf[i + len(marker) :]
            self.mode = "reasoning" if marker == THINK_OPEN else "call"
            return True
        keep = 0 if final else _held(self.buf, opens)
        emit, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
        if emit.strip():
            self.started = True
        out.append(Part("content", emit))
        return False

    def _step_reasoning(self, out: list[Part], final: bool) -> bool:
        i = self.buf.find(THINK_CLOSE)
        if i >= 0:
            out.append(Part("reasoning", self.buf[:i]))
            self.buf = self.buf[i + len(THINK_CLOSE) :].lstrip("\n")
            self.mode = "content"
            return True
        keep = 0 if final else _held(self.buf, [THINK_CLOSE])
        out.append(Part("reasoning", self.buf[: len(self.buf) - keep]))
        self.buf = self.buf[len(self.buf) - keep :]
        return False

    def _step_call(self, out: list[Part], final: bool) -> bool:
        close = self.m.call_close
        if close is not None and close in self.buf:
            body, _, self.buf = self.buf.partition(close)
        elif final:
            body, self.buf = self.buf, ""
        else:
            return False
        calls = parse_calls(body)
        if calls is None:  # not a call after all: the model's text, as written
            out.append(Part("content", (self.m.call_open or "") + body + (close if not final else "")))
        else:
            out.extend(Part("tool_call", call=c) for c in calls)
            self.after_call = True
        self.started = True
        self.mode = "content"
        return bool(self.buf) or not final

    def _step_maybe_json(self, out: list[Part], final: bool) -> bool:
        if not final:
            return False
        calls = parse_calls(self.buf)
        if calls is None:
            out.append(Part("content", self.buf))
        else:
            out.extend(Part("tool_call", call=c) for c in calls)
        self.buf = ""
        self.started = True
        self.mode = "content"
        return False


# ---------------------------------------------------------------- harmony's vocabulary

# openai-harmony reads o200k_base.tiktoken (one ``base64(token bytes) rank`` line per token, ranks 0..199997)
# from $TIKTOKEN_ENCODINGS_BASE, or downloads it. Offline, Colibri writes that file from the gpt-oss model's
# own vocabulary, whose first 199998 tokens are o200k_base's ranks in byte-level form, and accepts it only
# when its SHA-256 is tiktoken's published hash for o200k_base: a file that loads is then the real one.
O200K_FILE = "o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_RANKS = 199998
_harmony_lock = threading.Lock()


def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted: printable Latin-1 bytes stand for themselves,
    the other 68 are shifted to U+0100 onwards in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in kept}
    shifted = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return {c: b for b, c in chars.items()}


def o200k_from_vocabulary(id_to_token: Callable[[int], str | None]) -> bytes:
    """o200k_base.tiktoken's contents from a gpt-oss vocabulary (token text by id, byte-level form);
    ValueError unless the result is, byte for byte, the published o200k_base file."""
    decoder = _byte_level_decoder()
    lines = []
    for rank in range(O200K_RANKS):
        text = id_to_token(rank)
        try:
            raw = bytes(decoder[c] for c in text or "")
        except KeyError:
            raw = b""
        if not raw:
            raise ValueError(f"token {rank} ({text!r}) is not a byte-level o200k_base token")
        lines.append(base64.b64encode(raw) + b" " + str(rank).encode() + b"\n")
    data = b"".join(lines)
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_SHA256:
        raise ValueError(
            f"the model's first {O200K_RANKS} tokens are not o200k_base (SHA-256 {digest}, "
            f"expected {O200K_SHA256})"
        )
    return data


def _o200k_cache() -> Path:
    from colibri_backend.models import cache_dir

    return cache_dir() / "tiktoken" / O200K_FILE


def _sha256_of(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _load_harmony(base: str | None) -> Any:
    """HARMONY_GPT_OSS with TIKTOKEN_ENCODINGS_BASE set to `base` for the load only (None: as the
    environment has it; openai-harmony then downloads the file when it has no copy)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    if base is None:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    before = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = base
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if before is None:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = before


@lru_cache(maxsize=1)
def _harmony_encoding() -> Any:
    """The encoding from $TIKTOKEN_ENCODINGS_BASE when set, else from Colibri's cache when it holds the
    checked file; ValueError when neither has it and the download fails."""
    errors = []
    if os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        try:
            return _load_harmony(None)
        except Exception as exc:
            errors.append(f"TIKTOKEN_ENCODINGS_BASE={os.environ['TIKTOKEN_ENCODINGS_BASE']}: {exc}")
    cached = _o200k_cache()
    if _sha256_of(cached) == O200K_SHA256:
        return _load_harmony(str(cached.parent))
    if not errors:
        try:
            return _load_harmony(None)
        except Exception as exc:  # no network: the file cannot be fetched
            errors.append(str(exc))
    raise ValueError(f"openai-harmony cannot load the gpt-oss encoding (o200k_base): {'; '.join(errors)}")


def harmony_encoding(vocabulary: Callable[[int], str | None] | None = None) -> Any:
    """openai-harmony's gpt-oss encoding. Where it cannot find o200k_base.tiktoken and `vocabulary` (the
    model's token text by id) is given, the file is written from that vocabulary into Colibri's cache,
    checked against the published hash, and loaded from there; ValueError naming both failures otherwise."""
    with _harmony_lock:
        try:
            return _harmony_encoding()
        except ValueError as exc:
            if vocabulary is None:
                raise
            first = exc
        try:
            data = o200k_from_vocabulary(vocabulary)
        except ValueError as exc:
            raise ValueError(f"{first}; and the model's vocabulary cannot stand in for it: {exc}") from None
        path = _o200k_cache()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        _harmony_encoding.cache_clear()
        return _harmony_encoding()


class HarmonyOutput(OutputParser):
    """gpt-oss output through openai-harmony's streaming parser (token ids in, channels out).

    Output that leaves the format is not lost: text written where a message header should be, with no
    header token in it (a model that answers without a channel), is the answer's text at the end; and
    from a token the parser refuses (text after a message's end, say) on, the rest is answer text."""

    HEADER_TOKENS = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>")

    def __init__(self, tools: bool, vocabulary: Callable[[int], str | None] | None = None) -> None:
        from openai_harmony import HarmonyError, Role, StreamableParser, StreamState

        encoding = harmony_encoding(vocabulary)
        self.parser = StreamableParser(encoding, role=Role.ASSISTANT)
        self.harmony_error = HarmonyError
        self.content_state = StreamState.CONTENT
        self.header_ids = {encoding.encode(t, allowed_special="all")[0] for t in self.HEADER_TOKENS}
        self.tools = tools
        self.n_messages = 0
        self.header: list[tuple[int, str]] = []  # (id, text) fed since the last message's content began
        self.left_format = False

    def feed(self, token_id: int, text: str) -> list[Part]:
        if self.left_format:
            return [Part("content", text)] if text else []
        p = self.parser
        try:
            p.process(int(token_id))
        except self.harmony_error:
            self.left_format = True
            return self._header_text(also=text)
        if p.state == self.content_state:
            self.header.clear()
        else:
            self.header.append((int(token_id), text))
        out: list[Part] = []
        delta = p.last_content_delta or ""
        recipient = p.current_recipient or ""
        if delta:
            if recipient.startswith("functions.") and self.tools:
                pass  # a call's arguments: taken whole from the finished message
            elif p.current_channel == "analysis":
                out.append(Part("reasoning", delta))
            elif not recipient.startswith("functions."):
                # the final answer, commentary to the user, and a message to a tool the request cannot
                # have offered (harmony's built-in browser or python): the model's text, not dropped
                out.append(Part("content", delta))
        out += self._completed()
        return out

    def _header_text(self, also: str = "") -> list[Part]:
        """What was fed where a header should be, as answer text, when no header token is in it."""
        if any(tid in self.header_ids for tid, _ in self.header):
            text = also
        else:
            text = "".join(t for _, t in self.header) + also
        self.header.clear()
        return [Part("content", text)] if text else []

    def _completed(self) -> list[Part]:
        out: list[Part] = []
        for msg in self.parser.messages[self.n_messages :]:
            recipient = msg.recipient or ""
            if self.tools and recipient.startswith("functions."):
                text = "".join(getattr(c, "text", "") for c in msg.content)
                call = _call_from({"name": recipient[len("functions.") :], "arguments": text or "{}"})
                # Arguments that are not a JSON object (cut off by max_tokens, or malformed) are the
                # model's text, as the other families return an unfinished call: not dropped.
                out.append(Part("tool_call", call=call) if call is not None else Part("content", text))
        self.n_messages = len(self.parser.messages)
        return out

    def finish(self) -> list[Part]:
        if self.left_format:
            return []
        try:
            # ends a message cut off in its content (max_tokens) as openai-harmony's one-shot parse does
            self.parser.process_eos()
        except self.harmony_error:  # cut off before a message's content: a header, or text in its place
            return self._header_text()
        return self._completed()


def new_output_parser(
    template: str | None,
    *,
    tools: bool,
    token_to_id: Callable[[str], int | None] | None = None,
    prompt_text: str = "",
    vocabulary: Callable[[int], str | None] | None = None,
) -> OutputParser:
    """The parser for a model's output: tool calls when ``tools`` (the request offered tools and did not
    say ``tool_choice: none``), reasoning when the template thinks. ``vocabulary`` (token text by id)
    lets the harmony parser find its o200k file offline (:func:`harmony_encoding`)."""
    family = family_of(template)
    reasoning = thinks(template)
    if family == "harmony":
        return HarmonyOutput(tools, vocabulary)
    if not tools and not reasoning:
        return PlainOutput()
    special: dict[int, str] = {}
    if token_to_id is not None:
        for marker in marker_strings(family):
            tid = token_to_id(marker)
            if tid is not None:
                special[tid] = marker
    start = reasoning and prompt_text.rstrip().endswith(THINK_OPEN)
    return MarkupOutput(family, tools=tools, reasoning=reasoning, special=special, start_in_reasoning=start)


def token_lookup(model: Any) -> Callable[[str], int | None] | None:
    """A model's token id by its text (None where it has no such token), or None without a tokenizer."""
    tok = getattr(model, "tokenizer", None)
    fn = getattr(tok, "token_to_id", None) or getattr(tok, "convert_tokens_to_ids", None)
    if fn is None:
        return None

    def lookup(text: str) -> int | None:
        tid = fn(text)
        unk = getattr(tok, "unk_token_id", None)
        return tid if isinstance(tid, int) and tid != unk else None

    return lookup


def vocabulary_of(model: Any) -> Callable[[int], str | None] | None:
    """A model's token text by id (what the harmony parser writes its o200k file from), if it has one."""
    tok = getattr(model, "tokenizer", None)
    return getattr(tok, "id_to_token", None) or getattr(tok, "convert_ids_to_tokens", None)


def output_parser_for(model: Any, *, tools: bool, prompt_text: str = "") -> OutputParser:
    """:func:`new_output_parser` for ``model``'s own chat template and tokenizer."""
    return new_output_parser(
        getattr(model, "chat_template", None),
        tools=tools,
        token_to_id=token_lookup(model),
        prompt_text=prompt_text,
        vocabulary=vocabulary_of(model),
    )


def forced_call_grammar(family: str, tools: list[dict[str, Any]], parallel: bool) -> str | None:
    """A Lark grammar that makes the model write one (or, when ``parallel``, up to one per tool) call(s)
    to ``tools`` in ``family``'s markup: ``tool_choice`` ``required`` or a named function. None for a
    family whose markup is special tokens the grammar cannot spell (mistral, harmony)."""
    if family not in ("hermes", "llama3"):
        return None
    key = "parameters" if family == "llama3" else "arguments"  # Llama 3 names the arguments "parameters"
    variants = []
    for t in tools:
        fn = t["function"]
        params = dict(fn.get("parameters") or {"type": "object"})
        if "properties" in params:  # as strict function calling does: only the declared arguments
            params.setdefault("additionalProperties", False)
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, key: params},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema["x-guidance"] = {"whitespace_flexible": False}  # compact JSON: fewer tokens, no runaway spaces
    call = "%json " + json.dumps(schema)
    if family == "llama3":
        return f"start: call\ncall: {call}\n"
    one = '"<tool_call>" call "</tool_call>"'
    # At most one call per tool offered: a small model decoding greedily would otherwise repeat its
    # call until max_tokens, leaving a cut-off call at the end.
    more = len(tools) - 1 if parallel else 0
    body = f'{one} ("\\n" {one}){{0,{more}}}' if more else one
    return f"start: {body}\ncall: {call}\n"
