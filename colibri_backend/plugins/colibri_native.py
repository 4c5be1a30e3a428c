"""The ``colibri`` backend: Colibri's own native engine (colibri_backend.load).

It registers through the same entry-point group and hook as any third-party backend. The engine
does its own sampling, stop strings and logprobs (``Model.generate_tokens``); this wrapper adapts
it to the :class:`colibri_backend.backends.LoadedModel` protocol.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from colibri_backend.backends import BaseModel, Capabilities, GenerationEvent, as_sampling
from colibri_backend.config import ModelConfig
from colibri_backend.hookspecs import hookimpl


class ColibriModel(BaseModel):
    backend = "colibri"

    def __init__(self, cfg: ModelConfig) -> None:
        import colibri_backend

        load = colibri_backend.load
        accepted = inspect.signature(load).parameters
        kwargs: dict[str, Any] = {"threads": cfg.threads, "context_length": cfg.context_length}
        budget_ok = "memory_budget" in accepted
        if cfg.memory_budget is not None and budget_ok:
            kwargs["memory_budget"] = cfg.memory_budget
        for key, value in cfg.options.items():  # engine options (e.g. future streaming knobs) by name
            if key not in accepted:
                raise TypeError(
                    f"models.{cfg.alias}.options.{key}: colibri_backend.load() has no such "
                    f"parameter (it takes {', '.join(accepted)})"
                )
            kwargs[key] = value
        self._m = load(cfg.path, **kwargs)
        self.name = cfg.alias
        self.path = Path(self._m.path)
        self.context_length = int(self._m.context_length)
        self.chat_template = cfg.chat_template or self._m.chat_template
        info = getattr(self._m, "info", None)
        self.n_vocab = int(getattr(info, "n_vocab", 0)) or None
        self.capabilities = Capabilities(
            logits=True,
            logprobs=True,
            chat=self.chat_template is not None,
            streaming=True,
            memory_budget=budget_ok,
        )

    @property
    def engine(self) -> Any:
        """The underlying colibri_backend Model."""
        return self._m

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._m.tokenize(text, add_special_tokens=add_special_tokens))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._m.detokenize(list(ids))

    def token_text(self, token_id: int) -> str:
        return self._m.tokenizer.token_text(token_id)

    def special_tokens(self) -> dict[str, str]:
        tok = self._m.tokenizer
        return {"bos_token": tok.bos_token or "", "eos_token": tok.eos_token or ""}

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
        s = as_sampling(sampling)
        stops = list(stop) if stop is not None else list(s.stop or [])
        return self._m.generate_tokens(
            list(prompt_ids),
            max_tokens=max_tokens,
            sampling=s,
            stop=stops or None,
            logprobs=logprobs,
            constraint=constraint,
        )

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        return self._m.logits(list(token_ids))

    def stats(self) -> dict[str, Any]:
        return dict(self._m.stats())

    def close(self) -> None:
        m, self._m = getattr(self, "_m", None), None
        if m is not None:
            m.close()


class ColibriBackend:
    name = "colibri"
    description = "Colibri's native C engine (GGUF; MoE and dense llama-family models)"

    def unavailable_reason(self) -> str | None:
        try:
            from colibri_backend import _native

            _native.load_library()
        except Exception as exc:  # the shared library is missing, or its ABI does not match
            return f"native library not loadable: {type(exc).__name__}: {exc}"
        import colibri_backend

        if not hasattr(colibri_backend, "load"):
            return "colibri_backend.load is missing (the engine API is not installed)"
        return None

    def load(self, model: ModelConfig) -> ColibriModel:
        return ColibriModel(model)


@hookimpl
def colibri_register_backends(register):
    register(ColibriBackend())
