"""The ``transformers`` backend: PyTorch + transformers' AutoModelForCausalLM, the reference.

Loads a Hugging Face checkpoint directory, or a GGUF file through transformers' own GGUF reader
(dequantized to float32). Sampling, stop strings and logprobs are the shared ones of
:class:`colibri_backend.backends.StepModel`. torch and transformers are imported only on load.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from colibri_backend.backends import (
    Capabilities,
    StepModel,
    default_threads,
    missing_module_reason,
    resolve_model_path,
)
from colibri_backend.config import ModelConfig
from colibri_backend.errors import ColibriError
from colibri_backend.generation import IncrementalDecoder
from colibri_backend.hookspecs import hookimpl

DEFAULT_CONTEXT = 2048


class TransformersModel(StepModel):
    backend = "transformers"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = resolve_model_path(cfg.path)
        kwargs: dict[str, Any] = {}
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ColibriError(
                    f"backend 'transformers' loads a checkpoint directory or a GGUF file; "
                    f"{str(path)!r} is neither"
                )
            source = str(path.parent)
            kwargs["gguf_file"] = path.name
            # transformers' GGUF reader needs accelerate; say so before transformers fails deep inside.
            reason = missing_module_reason("accelerate", "psutil")
            if reason is not None:
                raise ColibriError(
                    f"backend 'transformers' reads GGUF files only with accelerate installed: "
                    f"{reason}; or point it at a Hugging Face checkpoint directory"
                )
        else:
            source = str(path)
        opts = dict(cfg.options)
        dtype = getattr(torch, str(opts.pop("dtype", "float32")))
        self._torch = torch
        torch.set_num_threads(cfg.threads or default_threads())
        self.tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        self.model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs, **opts).eval()
        self.name = cfg.alias
        self.path = Path(path)
        self.n_vocab = int(self.model.config.vocab_size)
        trained = getattr(self.model.config, "max_position_embeddings", None) or DEFAULT_CONTEXT
        self.context_length = int(cfg.context_length or min(int(trained), DEFAULT_CONTEXT))
        self.chat_template = cfg.chat_template or getattr(self.tokenizer, "chat_template", None) or None
        eos: set[int] = set()
        for src in (getattr(self.model.generation_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, (list, tuple)):
                eos.update(int(t) for t in src)
        self.eos_token_ids = frozenset(eos)
        self.capabilities = Capabilities(
            logits=True,
            logprobs=True,
            chat=self.chat_template is not None,
            streaming=True,
            memory_budget=False,
        )
        self._past: Any = None
        # transformers 5.x names the KV cache argument `cache`; older releases `past_key_values`.
        import inspect

        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def special_tokens(self) -> dict[str, str]:
        return {"bos_token": self.tokenizer.bos_token or "", "eos_token": self.tokenizer.eos_token or ""}

    def _new_decoder(self, prompt_ids: list[int]) -> IncrementalDecoder:
        # A few prompt ids as context, so the first token's leading space decodes right.
        return IncrementalDecoder(self.detokenize, context=prompt_ids)

    def _forward(self, ids: list[int], past: Any) -> tuple[np.ndarray, Any]:
        torch = self._torch
        kw = {self._cache_arg: past} if past is not None else {}
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True, logits_to_keep=1, **kw
            )
        cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        return out.logits[0, -1].float().numpy(), cache

    def _prefill(self, prompt_ids: list[int]) -> np.ndarray:
        logits, self._past = self._forward(prompt_ids, None)
        return logits

    def _decode(self, token_id: int) -> np.ndarray:
        logits, self._past = self._forward([token_id], self._past)
        return logits

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        torch = self._torch
        ids = [int(t) for t in token_ids]
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
        return out.logits[0].float().numpy()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "backend": self.backend, "context_length": self.context_length}

    def close(self) -> None:
        self._past = None
        self.model = None


class TransformersBackend:
    name = "transformers"
    description = "PyTorch + transformers AutoModelForCausalLM (reference; checkpoint dirs and GGUF)"

    def unavailable_reason(self) -> str | None:
        return missing_module_reason("torch", "transformers", extra="transformers")

    def load(self, model: ModelConfig) -> TransformersModel:
        return TransformersModel(model)


@hookimpl
def colibri_register_backends(register):
    register(TransformersBackend())
