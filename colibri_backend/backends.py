"""The backend protocol every inference engine plugs in through, and helpers backends share.

A *backend* (registered by a plugin, see :mod:`colibri_backend.hookspecs`) turns a configured
model alias into a *loaded model*. Front ends (the OpenAI server, the example app, the `llm`
plugin) only ever talk to a :class:`LoadedModel`, so the same application runs on Colibri's
native engine, llama.cpp or transformers by changing one configuration value.

Generation is token-level: :meth:`LoadedModel.generate_tokens` yields one
:class:`GenerationEvent` per sampled token, with the text it adds (UTF-8-safe, stop strings never
leak), its log-probability when asked, and a ``finish_reason`` on the last one. ``generate``,
``stream`` and ``chat`` are built on it by :class:`BaseModel`.
"""

from __future__ import annotations

import codecs
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from colibri_backend.adapters.sampling import SamplingParams
from colibri_backend.errors import ColibriError, ContextFullError

if TYPE_CHECKING:
    from colibri_backend.config import ModelConfig


@dataclass(frozen=True)
class Capabilities:
    """What a loaded model can do beyond plain generation."""

    logits: bool = False  # teacher-forced logits at every position
    logprobs: bool = False  # log-probabilities of sampled and top tokens
    chat: bool = False  # has a chat template
    streaming: bool = True  # yields tokens as they are produced
    memory_budget: bool = False  # honours ModelConfig.memory_budget


@dataclass
class GenerationEvent:
    """One sampled token. ``text`` is what it adds to the output (may be empty while a UTF-8
    sequence or a possible stop string is held back); ``finish_reason`` is set on the last event."""

    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: dict[str, float] | None = None
    finish_reason: str | None = None  # None | "stop" | "length"


def as_sampling(params: Any = None, **overrides: Any) -> SamplingParams:
    """SamplingParams from None (greedy), a SamplingParams, a dict of its fields, or keyword arguments
    (which win)."""
    if isinstance(params, SamplingParams):
        base = params
    elif isinstance(params, dict):
        base = SamplingParams(**params)
    elif params is None:
        base = SamplingParams()
    else:
        raise TypeError(f"sampling must be a SamplingParams or a dict, got {type(params).__name__}")
    return base.with_overrides(**overrides) if overrides else base


@runtime_checkable
class LoadedModel(Protocol):
    """A model a backend has loaded. Not thread-safe: one generation at a time."""

    name: str
    backend: str
    context_length: int
    capabilities: Capabilities

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def detokenize(self, ids: Sequence[int]) -> str: ...

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...

    def generate_tokens(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        sampling: Any = None,
        stop: Sequence[str] | None = None,
        logprobs: int | None = None,
        constraint: Any = None,
    ) -> Iterator[GenerationEvent]: ...

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, **kw: Any) -> str: ...

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 128, **kw: Any) -> Iterator[str]: ...

    def chat(self, messages: list[dict[str, Any]], max_tokens: int = 128, **kw: Any) -> str: ...

    def logits(self, token_ids: Sequence[int]) -> np.ndarray: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """What a plugin registers: a named factory of loaded models."""

    name: str
    description: str

    def unavailable_reason(self) -> str | None:
        """None when the backend can run here, else a one-line reason (e.g. its package is missing)."""

    def load(self, model: ModelConfig) -> LoadedModel:
        """Load the model alias ``model``."""


class CapabilityError(ColibriError):
    """The backend cannot do what was asked (for example logits from a backend without them)."""


def missing_module_reason(*modules: str, extra: str | None = None, try_import: bool = False) -> str | None:
    """None when every module is installed, else "Python package X is not installed (pip install ...)".

    With ``try_import`` the modules are imported too, so a package that is present but broken (a
    missing shared library) is reported with its error; leave it off for slow imports such as torch."""
    import importlib
    import importlib.util

    for mod in modules:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            hint = f"pip install 'colibri-backend[{extra}]'" if extra else f"pip install {mod}"
            return f"Python package {mod!r} is not installed ({hint})"
        if try_import:
            try:
                importlib.import_module(mod)
            except Exception as exc:
                return f"Python package {mod!r} is installed but fails to import: {type(exc).__name__}: {exc}"
    return None


def resolve_model_path(spec: str, want_gguf: bool = False) -> Path:
    """A model file or directory from a configured path or a known model name ("smollm2").

    With ``want_gguf`` a Hugging Face checkpoint directory is converted (once, cached) and the GGUF
    returned, for backends that only read GGUF."""
    p = Path(spec).expanduser()
    if p.is_file() or (p.is_dir() and not want_gguf):
        return p
    from colibri_backend.models import resolve_model

    return Path(resolve_model(spec).gguf)


def default_threads() -> int:
    """Threads to use when the configuration names none: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------- chat templates


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render a Hugging Face style jinja chat template (through the project's adapter)."""
    from colibri_backend.adapters import chat_template as ct

    return ct.render_chat(
        template,
        messages,
        bos_token=bos_token,
        eos_token=eos_token,
        add_generation_prompt=add_generation_prompt,
        **({"tools": tools} if tools is not None else {}),
    )


# ---------------------------------------------------------------- text helpers


class StopMatcher:
    """Holds back text that could still become a stop string, so stop strings never leak."""

    def __init__(self, stop: Iterable[str] | None) -> None:
        self.stops = [s for s in (stop or []) if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        if not self.stops:
            return text, False
        self.pending += text
        first = -1
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0 and (first < 0 or i < first):
                first = i
        if first >= 0:
            out, self.pending = self.pending[:first], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class ByteDecoder:
    """UTF-8-safe text deltas from per-token byte pieces (llama.cpp style vocabularies)."""

    def __init__(self, piece: Callable[[int], bytes]) -> None:
        self.piece = piece
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        return self.dec.decode(self.piece(token_id))

    def flush(self) -> str:
        return self.dec.decode(b"", final=True)


class TextDiffDecoder:
    """UTF-8-safe text deltas from a whole-sequence decoder (Hugging Face tokenizers): decodes the
    generated ids after a few prompt ids of context, so leading spaces come out right, and holds
    text back while it ends in an incomplete character (U+FFFD)."""

    def __init__(self, decode: Callable[[list[int]], str], context_ids: Sequence[int]) -> None:
        self.decode = decode
        self.context = list(context_ids)[-4:]
        self.base = decode(self.context) if self.context else ""
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded generated text already emitted

    def _text(self) -> str:
        full = self.decode(self.context + self.ids)
        return full[len(self.base) :] if full.startswith(self.base) else self.decode(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self._text()
        if text.endswith("\ufffd"):
            return ""
        out = text[self.emitted :]
        self.emitted = len(text)
        return out

    def flush(self) -> str:
        text = self._text()
        out = text[self.emitted :]
        self.emitted = len(text)
        return out


# ---------------------------------------------------------------- sampling


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64, copy=False)
    m = float(np.max(x))
    return x - m - np.log(np.sum(np.exp(x - m)))


def sample_token(
    logits: np.ndarray, s: SamplingParams, history: Sequence[int], rng: np.random.Generator
) -> int:
    """Pick the next token the way colibri_sampler does: logit bias; repetition, presence and
    frequency penalties over the last ``penalty_last_n`` tokens of prompt + output (all when <= 0);
    then greedy (temperature 0) or top-k, top-p, min-p and temperature sampling."""
    x = np.array(logits, dtype=np.float64, copy=True)
    for tok, bias in (s.logit_bias or {}).items():
        if 0 <= tok < x.shape[0]:
            x[tok] += bias
    window = history[-s.penalty_last_n :] if s.penalty_last_n > 0 else history
    if len(window) and (s.repetition_penalty != 1.0 or s.presence_penalty or s.frequency_penalty):
        ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        if s.repetition_penalty != 1.0:
            v = x[ids]
            x[ids] = np.where(v > 0, v / s.repetition_penalty, v * s.repetition_penalty)
        if s.presence_penalty or s.frequency_penalty:
            x[ids] -= s.presence_penalty + s.frequency_penalty * counts
    if s.temperature <= 0.0:
        return int(np.argmax(x))
    order = np.argsort(-x, kind="stable")
    if s.top_k and s.top_k > 0:
        order = order[: s.top_k]
    cand = x[order]
    if s.top_p < 1.0:
        p = np.exp(cand - cand[0])
        p /= p.sum()
        keep = int(np.searchsorted(np.cumsum(p), s.top_p) + 1)
        order, cand = order[:keep], cand[:keep]
    if s.min_p > 0.0:
        keep = max(1, int(np.sum(np.exp(cand - cand[0]) >= s.min_p)))
        order, cand = order[:keep], cand[:keep]
    p = np.exp((cand - cand[0]) / s.temperature)
    p /= p.sum()
    return int(order[rng.choice(len(order), p=p)])


# ---------------------------------------------------------------- base classes


class BaseModel(ABC):
    """Shared front of a loaded model: generate / stream / chat on top of ``generate_tokens``."""

    name: str
    backend: str
    context_length: int
    capabilities: Capabilities
    chat_template: str | None = None

    @abstractmethod
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str: ...

    @abstractmethod
    def generate_tokens(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        sampling: Any = None,
        stop: Sequence[str] | None = None,
        logprobs: int | None = None,
        constraint: Any = None,
    ) -> Iterator[GenerationEvent]: ...

    def special_tokens(self) -> dict[str, str]:
        """bos_token / eos_token text for chat templates."""
        return {}

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text of ``messages`` (and the ``tools`` offered, as transformers passes them)."""
        if not self.chat_template:
            raise CapabilityError(
                f"model {self.name!r} has no chat template; set chat_template in its colibri.toml alias"
            )
        sp = self.special_tokens()
        return render_chat_template(
            self.chat_template,
            messages,
            bos_token=sp.get("bos_token", ""),
            eos_token=sp.get("eos_token", ""),
            add_generation_prompt=add_generation_prompt,
            tools=tools,
        )

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        return self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]

    def stream(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        stop: Sequence[str] | None = None,
        sampling: Any = None,
        **sampling_kw: Any,
    ) -> Iterator[str]:
        """Text deltas of a completion of ``prompt``."""
        s = as_sampling(sampling, **sampling_kw)
        ids = self._prompt_ids(prompt)
        for ev in self.generate_tokens(ids, max_tokens=max_tokens, sampling=s, stop=stop):
            if ev.text:
                yield ev.text

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        stop: Sequence[str] | None = None,
        sampling: Any = None,
        **sampling_kw: Any,
    ) -> str:
        """The completion of ``prompt``."""
        parts = self.stream(prompt, max_tokens=max_tokens, stop=stop, sampling=sampling, **sampling_kw)
        return "".join(parts)

    def chat_stream(self, messages: list[dict[str, Any]], max_tokens: int = 128, **kw: Any) -> Iterator[str]:
        ids = self.tokenize(self.render_chat(messages), add_special_tokens=False)
        return self.stream(ids, max_tokens=max_tokens, **kw)

    def chat(self, messages: list[dict[str, Any]], max_tokens: int = 128, **kw: Any) -> str:
        """The assistant's reply to ``messages``, through the model's chat template."""
        return "".join(self.chat_stream(messages, max_tokens=max_tokens, **kw))

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        raise CapabilityError(f"backend {self.backend!r} does not provide logits")

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None

    def __enter__(self) -> BaseModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StepModel(BaseModel):
    """A backend that can prefill a prompt and decode one token at a time, returning the next
    token's logits; generation, sampling, stop strings and logprobs are done here, identically for
    every such backend."""

    eos_token_ids: frozenset[int] = frozenset()

    def __init__(self) -> None:
        self._n_generated = 0
        self._n_prompt = 0
        self._t_prefill = 0.0
        self._t_decode = 0.0
        self._n_decoded = 0
        self._n_requests = 0

    @abstractmethod
    def _prefill(self, prompt_ids: list[int]) -> np.ndarray:
        """Start a fresh sequence with ``prompt_ids``; logits [n_vocab] for the next token."""

    @abstractmethod
    def _decode(self, token_id: int) -> np.ndarray:
        """Append one token; logits [n_vocab] for the next one."""

    @abstractmethod
    def _new_decoder(self, prompt_ids: list[int]) -> ByteDecoder | TextDiffDecoder: ...

    @abstractmethod
    def token_text(self, token_id: int) -> str:
        """The text of one token, for logprob listings."""

    def _top(self, lp: np.ndarray, k: int) -> dict[str, float]:
        idx = np.argpartition(-lp, k - 1)[:k] if k < lp.shape[0] else np.arange(lp.shape[0])
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        out: dict[str, float] = {}
        for i in idx:
            out.setdefault(self.token_text(int(i)), float(lp[i]))
        return out

    def generate_tokens(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        sampling: Any = None,
        stop: Sequence[str] | None = None,
        logprobs: int | None = None,
        constraint: Any = None,
    ) -> Iterator[GenerationEvent]:
        import time

        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.context_length:
            raise ContextFullError(
                "CONTEXT_FULL", f"the prompt has {len(ids)} tokens; the context holds {self.context_length}"
            )
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        max_tokens = min(max_tokens, self.context_length - len(ids))
        s = as_sampling(sampling)
        rng = np.random.default_rng(s.effective_seed())
        matcher = StopMatcher(stop if stop is not None else s.stop)
        decoder = self._new_decoder(ids)
        self._n_requests += 1
        t0 = time.perf_counter()
        logits = self._prefill(ids)
        self._t_prefill += time.perf_counter() - t0
        self._n_prompt += len(ids)
        history = list(ids)
        generated: list[int] = []
        while True:
            # A grammar's constraint bans tokens before the bias: the same result as the native
            # sampler's mask after it (-inf plus any bias is -inf).
            tok = sample_token(logits if constraint is None else constraint.apply(logits), s, history, rng)
            if constraint is not None:
                constraint.consume(tok)
            generated.append(tok)
            history.append(tok)
            self._n_generated += 1
            lp = top = None
            if logprobs is not None:
                full = log_softmax(logits)
                lp = float(full[tok])
                top = self._top(full, logprobs) if logprobs > 0 else {}
            if tok in self.eos_token_ids:
                yield GenerationEvent(
                    tok, matcher.feed(decoder.flush())[0] + matcher.flush(), lp, top, "stop"
                )
                return
            text, stopped = matcher.feed(decoder.add(tok))
            if stopped:
                yield GenerationEvent(tok, text, lp, top, "stop")
                return
            grammar_done = constraint is not None and constraint.done
            if grammar_done or len(generated) >= max_tokens:
                tail, stopped = matcher.feed(decoder.flush())
                text += tail
                yield GenerationEvent(
                    tok,
                    text + ("" if stopped else matcher.flush()),
                    lp,
                    top,
                    "stop" if stopped or grammar_done else "length",
                )
                return
            yield GenerationEvent(tok, text, lp, top, None)
            t0 = time.perf_counter()
            logits = self._decode(tok)
            self._t_decode += time.perf_counter() - t0
            self._n_decoded += 1

    def stats(self) -> dict[str, Any]:
        return {
            "requests": self._n_requests,
            "prompt_tokens": self._n_prompt,
            "generated_tokens": self._n_generated,
            "prefill_seconds": round(self._t_prefill, 6),
            "decode_seconds": round(self._t_decode, 6),
            "decode_tokens_per_second": (
                round(self._n_decoded / self._t_decode, 3) if self._t_decode else 0.0
            ),
        }
