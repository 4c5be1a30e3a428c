"""Sampling parameters: one dataclass, mapped from the front ends onto the native sampler.

Front ends speak different dialects: an OpenAI request (temperature 1 by default), a Hugging
Face GenerationConfig (do_sample=False means greedy; top_k 50 by default when sampling), the
`llm` tool's options. Each maps to SamplingParams, which maps to colibri_sampler_params.
docs/sampling.md has the table.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class SamplingParams:
    """How the next token is chosen. Defaults are greedy decoding with every filter off."""

    temperature: float = 0.0  # <= 0: greedy
    top_p: float = 1.0  # >= 1: off
    top_k: int = 0  # <= 0: off
    min_p: float = 0.0  # <= 0: off
    repetition_penalty: float = 1.0  # 1: off (HF / llama.cpp convention)
    presence_penalty: float = 0.0  # OpenAI convention
    frequency_penalty: float = 0.0  # OpenAI convention
    penalty_last_n: int = 0  # window of recent tokens the penalties look at; <= 0: all
    seed: int | None = None  # None: a fresh random seed per request
    logit_bias: dict[int, float] | None = None  # token id -> added logit (-inf bans)
    max_tokens: int | None = None  # None: the caller's default
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def finite(name: str) -> float:
            v = float(getattr(self, name))
            if math.isnan(v) or math.isinf(v):
                raise ValueError(f"{name} must be a finite number, got {v}")
            return v

        if finite("temperature") < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 <= finite("top_p") <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= finite("min_p") <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if finite("repetition_penalty") <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        finite("presence_penalty")
        finite("frequency_penalty")
        if int(self.top_k) != self.top_k:
            raise ValueError(f"top_k must be an integer, got {self.top_k}")
        if self.max_tokens is not None and int(self.max_tokens) < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.seed is not None and int(self.seed) != self.seed:
            raise ValueError(f"seed must be an integer, got {self.seed}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        if any(not isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be a string or a list of strings")
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def with_overrides(self, **kwargs: Any) -> SamplingParams:
        """A copy with the given fields replaced (None values are ignored)."""
        return replace(self, **{k: v for k, v in kwargs.items() if v is not None})

    def effective_seed(self) -> int:
        """The seed the native sampler gets: the given one, or fresh randomness."""
        if self.seed is not None:
            return int(self.seed) & 0xFFFFFFFFFFFFFFFF
        return int.from_bytes(os.urandom(8), "little")

    def to_native(self) -> Any:
        """colibri_sampler_params for the native sampler (logit_bias is applied separately)."""
        from colibri_backend._native import SamplerParamsC

        p = SamplerParamsC()
        p.temperature = float(self.temperature)
        p.top_k = int(self.top_k)
        p.top_p = float(self.top_p)
        p.min_p = float(self.min_p)
        p.repetition_penalty = float(self.repetition_penalty)
        p.presence_penalty = float(self.presence_penalty)
        p.frequency_penalty = float(self.frequency_penalty)
        p.penalty_last_n = int(self.penalty_last_n)
        p.seed = self.effective_seed()
        return p

    # ---- front ends ------------------------------------------------------------------

    @classmethod
    def from_openai(cls, request: Mapping[str, Any]) -> SamplingParams:
        """From an OpenAI (chat) completion request body.

        Standard fields: temperature (default 1), top_p, presence_penalty, frequency_penalty,
        seed, stop, logit_bias (token id as a string -> bias in [-100, 100]), max_tokens /
        max_completion_tokens. Extensions llama.cpp's server also accepts: top_k, min_p,
        repetition_penalty (alias repeat_penalty).
        """

        def get(*names: str) -> Any:
            for n in names:
                if request.get(n) is not None:
                    return request[n]
            return None

        temperature = get("temperature")
        temperature = 1.0 if temperature is None else float(temperature)
        if temperature > 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {temperature}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = request.get(name)
            if v is not None and not -2.0 <= float(v) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        bias_in = request.get("logit_bias") or {}
        if not isinstance(bias_in, Mapping):
            raise ValueError("logit_bias must be an object mapping token ids to biases")
        bias: dict[int, float] = {}
        for k, v in bias_in.items():
            try:
                tid = int(k)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias key {k!r} is not a token id") from None
            if not -100.0 <= float(v) <= 100.0:
                raise ValueError(f"logit_bias[{k}] must be in [-100, 100], got {v}")
            # OpenAI: -100 effectively bans a token, 100 effectively forces it.
            bias[tid] = -math.inf if float(v) <= -100.0 else float(v)
        stop = request.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        max_tokens = get("max_completion_tokens", "max_tokens")
        return cls(
            temperature=temperature,
            top_p=float(get("top_p") if get("top_p") is not None else 1.0),
            top_k=int(get("top_k") or 0),
            min_p=float(get("min_p") or 0.0),
            repetition_penalty=float(get("repetition_penalty", "repeat_penalty") or 1.0),
            presence_penalty=float(get("presence_penalty") or 0.0),
            frequency_penalty=float(get("frequency_penalty") or 0.0),
            seed=None if get("seed") is None else int(get("seed")),
            logit_bias=bias or None,
            max_tokens=None if max_tokens is None else int(max_tokens),
            stop=list(stop or []),
        )

    @classmethod
    def from_generation_config(cls, config: Any = None, **kwargs: Any) -> SamplingParams:
        """From a transformers GenerationConfig (or any object / mapping with its field names),
        with keyword arguments overriding it, as `model.generate(..., **kwargs)` does.

        do_sample False (the default) is greedy; when sampling, HF's defaults apply
        (temperature 1, top_k 50, top_p 1). max_new_tokens -> max_tokens, stop_strings -> stop.
        """
        values: dict[str, Any] = {}
        if config is not None:
            if isinstance(config, Mapping):
                values.update({k: v for k, v in config.items() if v is not None})
            else:
                for name in (
                    "do_sample",
                    "temperature",
                    "top_p",
                    "top_k",
                    "min_p",
                    "repetition_penalty",
                    "max_new_tokens",
                    "stop_strings",
                    "seed",
                    "sequence_bias",
                ):
                    v = getattr(config, name, None)
                    if v is not None:
                        values[name] = v
        values.update({k: v for k, v in kwargs.items() if v is not None})
        do_sample = bool(values.get("do_sample", False))
        stop = values.get("stop_strings", values.get("stop"))
        if isinstance(stop, str):
            stop = [stop]
        rep = float(values.get("repetition_penalty", 1.0))
        max_new = values.get("max_new_tokens", values.get("max_tokens"))
        if not do_sample:
            return cls(
                temperature=0.0,
                repetition_penalty=rep,
                seed=values.get("seed"),
                max_tokens=None if max_new is None else int(max_new),
                stop=list(stop or []),
            )
        return cls(
            temperature=float(values.get("temperature", 1.0)),
            top_p=float(values.get("top_p", 1.0)),
            top_k=int(values.get("top_k", 50)),
            min_p=float(values.get("min_p") or 0.0),
            repetition_penalty=rep,
            seed=values.get("seed"),
            max_tokens=None if max_new is None else int(max_new),
            stop=list(stop or []),
        )

    @classmethod
    def from_llm_options(cls, options: Any = None, **kwargs: Any) -> SamplingParams:
        """From the `llm` tool's prompt options (a pydantic Options object or a dict):
        temperature, top_p, top_k, min_p, repetition_penalty / repeat_penalty, seed, stop,
        max_tokens. Unset options keep Colibri's defaults (greedy when temperature is unset)."""
        values: dict[str, Any] = {}
        if options is not None:
            if isinstance(options, Mapping):
                raw = dict(options)
            elif hasattr(options, "model_dump"):
                raw = options.model_dump()
            else:
                raw = dict(vars(options))
            values.update({k: v for k, v in raw.items() if v is not None})
        values.update({k: v for k, v in kwargs.items() if v is not None})
        stop = values.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        return cls(
            temperature=float(values.get("temperature", 0.0)),
            top_p=float(values.get("top_p", 1.0)),
            top_k=int(values.get("top_k", 0)),
            min_p=float(values.get("min_p", 0.0)),
            repetition_penalty=float(values.get("repetition_penalty", values.get("repeat_penalty", 1.0))),
            presence_penalty=float(values.get("presence_penalty", 0.0)),
            frequency_penalty=float(values.get("frequency_penalty", 0.0)),
            seed=values.get("seed"),
            max_tokens=None if values.get("max_tokens") is None else int(values["max_tokens"]),
            stop=list(stop or []),
        )
