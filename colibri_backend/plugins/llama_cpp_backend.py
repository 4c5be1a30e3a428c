"""The ``llama_cpp`` backend: llama.cpp through llama-cpp-python, for GGUF files.

llama.cpp computes the logits; sampling, stop strings, logprobs and UTF-8 handling are the shared
ones of :class:`colibri_backend.backends.StepModel`, so a seeded request samples the same way on
this backend as on the others. ``llama_cpp`` is imported only when a model is loaded.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator, Sequence
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
from colibri_backend.generation import IncrementalDecoder, bytes_decoder
from colibri_backend.hookspecs import hookimpl

DEFAULT_CONTEXT = 2048
_PARAMS_LOCK = threading.Lock()


def _import_llama_cpp() -> Any:
    """Import llama_cpp with OpenMP told to sleep, not spin, while it waits for work.

    llama.cpp's CPU backend runs on OpenMP; with the default active wait policy its threads spin
    between ops, and on a machine whose cores are shared (a server next to other processes, CI) a
    decode step then takes seconds instead of milliseconds (measured here: 6.7 s/token spinning,
    under 30 ms passive). The variable must be set before the OpenMP runtime loads; an explicit
    OMP_WAIT_POLICY in the environment wins."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import llama_cpp

    return llama_cpp


@contextlib.contextmanager
def _without_extra_buffers(llama_cpp: Any, disable: bool) -> Iterator[None]:
    """Load with llama_model_params.use_extra_bufts off: no AMX / repacked weight buffers.

    llama-cpp-python 0.3.36 built on a CPU that advertises AMX repacks Q4/Q8 weights into AMX
    buffers, and its first decode then dies with SIGSEGV where the kernel does not grant AMX tile
    state to the process (seen on this project's machines). Llama() has no argument for the field,
    so its default-params function is wrapped for the duration of the load. Set
    ``options.extra_buffers = true`` on an alias to keep llama.cpp's default.
    """
    if not disable:
        yield
        return
    lowlevel = llama_cpp.llama_cpp
    with _PARAMS_LOCK:
        original = lowlevel.llama_model_default_params

        def params() -> Any:
            p = original()
            if hasattr(p, "use_extra_bufts"):
                p.use_extra_bufts = False
            return p

        lowlevel.llama_model_default_params = params
        try:
            yield
        finally:
            lowlevel.llama_model_default_params = original


class LlamaCppModel(StepModel):
    backend = "llama_cpp"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        llama_cpp = _import_llama_cpp()

        path = resolve_model_path(cfg.path, want_gguf=True)
        if not path.is_file() or path.suffix.lower() != ".gguf":
            raise ColibriError(f"backend 'llama_cpp' loads GGUF files; {str(path)!r} is not one")
        opts = dict(cfg.options)
        threads = cfg.threads or default_threads()
        extra_buffers = bool(opts.pop("extra_buffers", False))
        self._prefix_cache = bool(opts.pop("prefix_cache", False))
        with _without_extra_buffers(llama_cpp, not extra_buffers):
            self._llama = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=cfg.context_length or int(opts.pop("n_ctx", DEFAULT_CONTEXT)),
                n_threads=threads,
                n_threads_batch=threads,
                n_batch=int(opts.pop("n_batch", 512)),
                logits_all=False,
                verbose=bool(opts.pop("verbose", False)),
                **opts,
            )
        self._lib = llama_cpp
        self.name = cfg.alias
        self.path = Path(path)
        self.context_length = int(self._llama.n_ctx())
        self.n_vocab = int(self._llama.n_vocab())
        meta = self._llama.metadata
        self.chat_template = cfg.chat_template or meta.get("tokenizer.chat_template") or None
        vocab = self._llama._model.vocab
        eog = {int(self._llama.token_eos())}
        for tok in range(self.n_vocab):
            if llama_cpp.llama_vocab_is_eog(vocab, tok):
                eog.add(tok)
        eog.discard(-1)
        self.eos_token_ids = frozenset(eog)
        self._bos = int(self._llama.token_bos())
        self._eos = int(self._llama.token_eos())
        self.capabilities = Capabilities(
            logits=True,
            logprobs=True,
            chat=self.chat_template is not None,
            streaming=True,
            memory_budget=False,
        )
        self._piece_cache: dict[int, bytes] = {}

    # -- tokens
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # special=True: control tokens written in the text (chat markup) are parsed as tokens, as
        # Hugging Face tokenizers do.
        return list(self._llama.tokenize(text.encode("utf-8"), add_bos=add_special_tokens, special=True))

    def _raw_piece(self, tok: int, special: bool) -> bytes:
        # llama_token_to_piece returns the piece's length (negative: the buffer was too small);
        # the wrapper in llama_cpp._internals returns the whole fixed-size buffer, NULs included.
        vocab = self._llama._model.vocab
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._lib.llama_token_to_piece(vocab, tok, buf, size, 0, special)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def _piece(self, tok: int) -> bytes:
        b = self._piece_cache.get(tok)
        if b is None:
            b = self._raw_piece(tok, special=False)
            self._piece_cache[tok] = b
        return b

    def detokenize(self, ids: Sequence[int]) -> str:
        return b"".join(self._piece(int(t)) for t in ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self._piece(token_id).decode("utf-8", errors="replace")

    def special_tokens(self) -> dict[str, str]:
        def text(tok: int) -> str:
            if tok < 0:
                return ""
            return self._raw_piece(tok, special=True).decode("utf-8", errors="replace")

        return {"bos_token": text(self._bos), "eos_token": text(self._eos)}

    def _new_decoder(self, prompt_ids: list[int]) -> IncrementalDecoder:
        return IncrementalDecoder(bytes_decoder(self._piece))

    # -- forward
    def _last_logits(self) -> np.ndarray:
        ptr = self._lib.llama_get_logits_ith(self._llama._ctx.ctx, -1)
        arr = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
        return arr.copy()

    def _prefill(self, prompt_ids: list[int]) -> np.ndarray:
        llm = self._llama
        n_keep = 0
        if self._prefix_cache:
            # Reuse the KV cache for the prefix the previous request shared; the last prompt token is
            # evaluated again so its logits are fresh. Off by default: llama.cpp's logits depend on
            # how the prompt was batched (up to 0.6 apart on SmolLM2 Q4_1 between one 36-token batch
            # and a cached prefix + 1 token), so reuse would make a seeded request's output depend
            # on the requests before it.
            old = llm.input_ids[: llm.n_tokens]
            limit = min(len(old), len(prompt_ids) - 1)
            while n_keep < limit and int(old[n_keep]) == prompt_ids[n_keep]:
                n_keep += 1
        llm.n_tokens = n_keep
        llm.eval(prompt_ids[n_keep:])
        return self._last_logits()

    def _decode(self, token_id: int) -> np.ndarray:
        self._llama.eval([token_id])
        return self._last_logits()

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = [int(t) for t in token_ids]
        if len(ids) > self.context_length:
            raise ColibriError(f"{len(ids)} tokens do not fit the context of {self.context_length}")
        out = np.empty((len(ids), self.n_vocab), dtype=np.float32)
        self._llama.reset()
        # One token per eval: without logits_all llama.cpp returns the logits of the batch's last
        # token only, and logits_all would allocate n_ctx x n_vocab floats up front.
        for i, tok in enumerate(ids):
            self._llama.eval([tok])
            out[i] = self._last_logits()
        return out

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "backend": self.backend, "context_length": self.context_length}

    def close(self) -> None:
        llm, self._llama = getattr(self, "_llama", None), None
        if llm is not None:
            llm.close()


class LlamaCppBackend:
    name = "llama_cpp"
    description = "llama.cpp through llama-cpp-python (GGUF files)"

    def unavailable_reason(self) -> str | None:
        reason = missing_module_reason("llama_cpp", extra="llama-cpp")
        if reason is not None:
            return reason
        try:
            _import_llama_cpp()
        except Exception as exc:  # installed but broken (e.g. its shared library is missing)
            return f"Python package 'llama_cpp' is installed but fails to import: {type(exc).__name__}: {exc}"
        return None

    def load(self, model: ModelConfig) -> LlamaCppModel:
        return LlamaCppModel(model)


@hookimpl
def colibri_register_backends(register):
    register(LlamaCppBackend())
