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

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from colibri_backend.adapters.sampling import SamplingParams
from colibri_backend.errors import ColibriError
from colibri_backend.generation import (
    GenerationEvent,
    IncrementalDecoder,
    NumpySampler,
    Step,
    check_max_tokens,
    check_prompt,
    generation_events,
    stop_list,
)

if TYPE_CHECKING:
    from colibri_backend.config import ModelConfig


class SequenceSteps(Protocol):
    """Where one generation's forward steps run when it shares the engine with other generations
    (a sequence of colibri_backend.server.scheduler's batches): each call blocks until the batched
    step that carries it has run, and returns that sequence's next-token logits [n_vocab]."""

    # Prompt tokens the last prefill restored from a cache instead of evaluating them.
    cached_tokens: int

    def prefill(self, prompt: list[int]) -> np.ndarray: ...

    def decode(self, token: int) -> np.ndarray: ...


@dataclass(frozen=True)
class Capabilities:
    """What a loaded model can do beyond plain generation."""

    logits: bool = False  # teacher-forced logits at every position
    logprobs: bool = False  # log-probabilities of sampled and top tokens
    chat: bool = False  # has a chat template
    streaming: bool = True  # yields tokens as they are produced
    memory_budget: bool = False  # honours ModelConfig.memory_budget


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
    def _new_decoder(self, prompt_ids: list[int]) -> IncrementalDecoder: ...

    @abstractmethod
    def token_text(self, token_id: int) -> str:
        """The text of one token, for logprob listings."""

    def generate_tokens(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int,
        sampling: Any = None,
        stop: str | Sequence[str] | None = None,
        logprobs: int | None = None,
        constraint: Any = None,
    ) -> Iterator[GenerationEvent]:
        ids = check_prompt(prompt_ids, self.context_length)
        max_tokens = check_max_tokens(max_tokens)
        s = as_sampling(sampling)
        stops = stop_list(stop if stop is not None else s.stop)
        return self._generate(ids, max_tokens, s, stops, logprobs, constraint)

    def _generate(
        self,
        ids: list[int],
        max_tokens: int,
        s: Any,
        stops: list[str],
        logprobs: int | None,
        constraint: Any = None,
    ) -> Iterator[GenerationEvent]:
        self._n_requests += 1

        def prefill(prompt: list[int]) -> np.ndarray:
            t0 = time.perf_counter()
            logits = self._prefill(prompt)
            self._t_prefill += time.perf_counter() - t0
            self._n_prompt += len(prompt)
            return logits

        def decode(token: int) -> np.ndarray:
            t0 = time.perf_counter()
            logits = self._decode(token)
            self._t_decode += time.perf_counter() - t0
            self._n_decoded += 1
            return logits

        step = Step(
            prefill,
            decode,
            NumpySampler(s, ids),
            self._new_decoder(ids),
            self.token_text,
            self.eos_token_ids,
            constraint=constraint,
        )
        for ev in generation_events(
            step,
            ids,
            max_tokens=max_tokens,
            context_length=self.context_length,
            stop=stops,
            logprobs=logprobs,
        ):
            self._n_generated += 1
            yield ev

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
