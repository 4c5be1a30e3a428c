"""The Python engine API: load a model, then tokenize, score and generate.

    import colibri_backend
    with colibri_backend.load("smollm2") as model:
        print(model.generate("def fibonacci(n):", max_tokens=64))

A Model owns one native model and one context (KV cache, thread pool, scratch). Calls on one
Model are serialized by its lock; use one Model per concurrent sequence. generate_tokens() is
the building block of everything else: it reuses the KV cache for the part of a new prompt
that matches what is cached, streams UTF-8-safe text, never lets a stop string leak, and can
report log-probabilities.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from ctypes import byref, c_int32, c_void_p
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from colibri_backend import _native
from colibri_backend.adapters.chat_template import render_chat, template_from_tokenizer_config
from colibri_backend.adapters.gguf_metadata import read_metadata
from colibri_backend.adapters.sampling import SamplingParams
from colibri_backend.adapters.tokenizer import Tokenizer
from colibri_backend.budget import (
    DEFAULT_PREFETCH,
    HASHED,
    parse_expert_slots,
    parse_kv_cache_type,
    parse_pin_experts,
    parse_policy,
    parse_prefetch,
    parse_share,
    plan_to_dict,
    resolve_budget,
)
from colibri_backend.digests import verify_model
from colibri_backend.errors import ContextFullError, EngineError
from colibri_backend.models import resolve_model
from colibri_backend.profile import profile_path

MAX_LOOKAHEAD_DEPTH = 8  # colibri.h: lookahead_depth 1..8


@dataclass(frozen=True)
class ModelInfo:
    """colibri_model_info: the model's architecture and dimensions."""

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    bos_token_id: int
    eos_token_id: int
    n_params: int
    file_bytes: int

    @classmethod
    def from_c(cls, c: _native.ModelInfoC) -> ModelInfo:
        values: dict[str, Any] = {}
        for f in fields(cls):
            v = getattr(c, f.name)
            values[f.name] = v.decode("utf-8", "replace") if isinstance(v, bytes) else int(v)
        return cls(**values)


@dataclass(frozen=True)
class GenerationEvent:
    """One generated token.

    text is the text this token releases: "" while it is held back (an incomplete UTF-8
    sequence, or what may be the start of a stop string), possibly several tokens' worth later.
    The last event of a generation has finish_reason "stop" (an end-of-sequence token or a stop
    string; the stop string itself is not in any text) or "length" (max_tokens or the context
    window reached). With max_tokens=0 the only event has token_id -1 and finish_reason "length".
    """

    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: dict[str, float] | None = None
    finish_reason: str | None = None


def _stop_cut(text: str, stops: Sequence[str]) -> int:
    """Index of the earliest stop string in text, or -1."""
    best = -1
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best < 0 or i < best):
            best = i
    return best


def _held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


def _log_softmax_at(
    logits: np.ndarray, token: int, top_n: int, tokenizer: Tokenizer
) -> tuple[float, dict[str, float] | None]:
    x = logits.astype(np.float64, copy=False)
    m = float(np.max(x))
    lse = m + math.log(float(np.sum(np.exp(x - m))))
    lp = float(x[token] - lse)
    if top_n <= 0:
        return lp, None
    n = min(top_n, x.size)
    idx = np.argpartition(-x, n - 1)[:n]
    idx = idx[np.argsort(-x[idx], kind="stable")]
    top: dict[str, float] = {}
    for i in idx:
        top.setdefault(tokenizer.token_text(int(i)), float(x[i] - lse))
    return lp, top


def resolve_warmup_routing(value: bool | str | os.PathLike[str] | None, model_path: Path) -> Path | None:
    """The routing profile a warmup_routing option names: False/None -> none, True -> the sidecar
    next to the model (MODEL.routing, which must exist), a path -> that file."""
    if value is None or value is False:
        return None
    if value is True:
        side = profile_path(model_path)
        if not side.is_file():
            raise FileNotFoundError(
                f"warmup_routing: there is no routing profile next to the model ({side}); make one with "
                f"`colibri profile {model_path} CORPUS...` or pass the path of a profile"
            )
        return side
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"warmup_routing must be True, False or a path, got {value!r}")
    path = Path(value).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"routing profile not found: {path}")
    return path


def store_params(
    lib: Any,
    model: c_void_p,
    info: ModelInfo,
    path: Path,
    *,
    threads: int | None = None,
    context_length: int | None = None,
    batch_size: int | None = None,
    memory_budget: str | int | None = 0,
    expert_policy: str = "lfu",
    prefetch: str | None = None,
    kv_cache_type: str | None = None,
    expert_slots: str | int | None = None,
    lookahead_depth: int | None = None,
    warmup_routing: bool | str | os.PathLike[str] | None = False,
    pin_experts: str | int | None = None,
    route_prefilter_margin: float | None = None,
    drop_cold_share: float | None = None,
) -> tuple[_native.ContextParamsC, Path | None]:
    """colibri_context_params for an opened model from the Python-level options (see load()),
    and the routing profile it uses. The struct holds the profile path's bytes itself (ctypes
    keeps a reference to the bytes assigned to a c_char_p field)."""
    params = _native.ContextParamsC()
    lib.colibri_context_default_params(byref(params))
    params.n_threads = int(threads or 0)
    params.n_ctx = int(context_length or 0)
    if batch_size:
        params.n_batch = int(batch_size)
    params.memory_budget = resolve_budget(memory_budget)
    params.expert_policy = parse_policy(expert_policy)
    params.kv_type = parse_kv_cache_type(kv_cache_type)
    params.expert_slots = parse_expert_slots(expert_slots, info.n_layer, info.n_expert, info.n_expert_used)
    if lookahead_depth is not None and lookahead_depth != 0:
        if isinstance(lookahead_depth, bool) or not isinstance(lookahead_depth, int):
            raise ValueError(f"lookahead_depth must be a whole number, got {lookahead_depth!r}")
        if not 1 <= lookahead_depth <= MAX_LOOKAHEAD_DEPTH:
            raise ValueError(
                f"lookahead_depth must be between 1 and {MAX_LOOKAHEAD_DEPTH}, got {lookahead_depth}"
            )
        params.lookahead_depth = lookahead_depth
    profile = resolve_warmup_routing(warmup_routing, path)
    if profile is not None and info.n_expert <= 0:
        raise ValueError(f"warmup_routing: {path} is a dense model; routing profiles are for MoE models")
    spec = prefetch if prefetch is not None else DEFAULT_PREFETCH
    flags = parse_prefetch(spec)
    if flags & HASHED and profile is None:
        if spec.strip().lower() != "all":
            raise ValueError(
                "prefetch 'hashed' needs a routing profile: pass warmup_routing (--warmup-routing) too"
            )
        flags &= ~HASHED  # "all" means every predictor that can run
    params.prefetch = flags
    margin = parse_share(route_prefilter_margin, "route_prefilter_margin")
    cold = parse_share(drop_cold_share, "drop_cold_share", upper=1.0)
    for name, on in (("route_prefilter_margin", margin > 0), ("drop_cold_share", cold > 0)):
        if on and profile is None:
            raise ValueError(f"{name} needs a routing profile: pass warmup_routing (--warmup-routing) too")
    params.route_prefilter_margin = margin
    params.drop_cold_share = cold
    if profile is not None:
        params.routing_profile = os.fsencode(profile)
    if pin_experts is not None and pin_experts != 0:
        if profile is None:
            raise ValueError(
                "pin_experts needs a routing profile: pass warmup_routing (--warmup-routing) too"
            )
        # "auto" and the range check need the number of slots this budget gives.
        plan = _native.MemoryPlanC()
        lib.check(lib.colibri_plan_model(model, byref(params), byref(plan)), "plan")
        n_slots = 0 if plan.all_resident else int(plan.n_expert_slots)
        params.pin_experts = parse_pin_experts(pin_experts, n_slots, info.n_expert_used)
    return params, profile


class Model:
    """A loaded model with one inference context. See colibri_backend.load()."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        threads: int | None = None,
        context_length: int | None = None,
        batch_size: int | None = None,
        hf_dir: str | os.PathLike[str] | None = None,
        name: str | None = None,
        memory_budget: str | int | None = 0,
        expert_policy: str = "lfu",
        prefetch: str | None = None,
        kv_cache_type: str | None = None,
        expert_slots: str | int | None = None,
        lookahead_depth: int | None = None,
        warmup_routing: bool | str | os.PathLike[str] | None = False,
        pin_experts: str | int | None = None,
        route_prefilter_margin: float | None = None,
        drop_cold_share: float | None = None,
        verify: bool = False,
    ) -> None:
        self._lock = threading.RLock()
        self._model = c_void_p()
        self._ctx = c_void_p()
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"model file not found: {path}")
        if not path.is_file():
            raise FileNotFoundError(f"not a model file: {path}")
        if threads is not None and threads < 0:
            raise ValueError(f"threads must be >= 0, got {threads}")
        if context_length is not None and context_length < 0:
            raise ValueError(f"context_length must be >= 0, got {context_length}")
        self.path = path
        self._lib = _native.load_library()
        lib = self._lib
        lib.check(lib.colibri_model_open(os.fsencode(path), byref(self._model)), f"cannot open {path}")
        try:
            if verify:
                verify_model(self._model, path)
            info_c = _native.ModelInfoC()
            lib.check(lib.colibri_model_get_info(self._model, byref(info_c)), "model info")
            self.info = ModelInfo.from_c(info_c)
            params, self.routing_profile = store_params(
                lib,
                self._model,
                self.info,
                path,
                threads=threads,
                context_length=context_length,
                batch_size=batch_size,
                memory_budget=memory_budget,
                expert_policy=expert_policy,
                prefetch=prefetch,
                kv_cache_type=kv_cache_type,
                expert_slots=expert_slots,
                lookahead_depth=lookahead_depth,
                warmup_routing=warmup_routing,
                pin_experts=pin_experts,
                route_prefilter_margin=route_prefilter_margin,
                drop_cold_share=drop_cold_share,
            )
            lib.check(lib.colibri_context_new(self._model, byref(params), byref(self._ctx)), "context")
            self.context_length: int = int(lib.colibri_context_n_ctx(self._ctx))
            self.threads = params.n_threads
            meta = read_metadata(path)
            # Everything but the (large) vocabulary arrays, for callers that want to look.
            self.metadata: dict[str, Any] = {
                k: v for k, v in meta.items() if not k.startswith("tokenizer.ggml.")
            }
            self.hf_dir = Path(hf_dir) if hf_dir is not None else None
            if self.hf_dir is not None and (self.hf_dir / "tokenizer.json").is_file():
                tok = Tokenizer.from_tokenizer_json(self.hf_dir / "tokenizer.json")
            else:
                tok = Tokenizer.from_gguf(path, meta)
            self.tokenizer: Tokenizer = tok
            template = meta.get("tokenizer.chat_template")
            for d in (self.hf_dir, path.parent):
                if not template and d is not None:
                    template = template_from_tokenizer_config(d / "tokenizer_config.json")
            self.chat_template: str | None = template or None
            self.name: str = name or str(meta.get("general.name") or path.stem)
        except BaseException:
            self.close()
            raise
        n_vocab = self.info.n_vocab
        self._logits = np.empty(n_vocab, dtype=np.float32)  # last-token logits of each step
        self._cached: list[int] = []  # tokens whose K/V are in the cache, in order
        self._last_eval_tokens = 0
        self._last: dict[str, Any] = {}

    # ---- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Free the context and the model. Safe to call twice."""
        with self._lock:
            lib = getattr(self, "_lib", None)
            if lib is None:
                return
            if self._ctx:
                lib.colibri_context_free(self._ctx)
                self._ctx = c_void_p()
            if self._model:
                lib.colibri_model_close(self._model)
                self._model = c_void_p()

    @property
    def closed(self) -> bool:
        return not self._ctx

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<colibri Model {self.name!r} {self.info.arch} {self.path}>"

    def _check_open(self) -> None:
        if not self._ctx:
            raise EngineError("COLIBRI_E_INVALID_ARG", "the model is closed")

    # ---- tokens ---------------------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(list(ids), dtype=np.int64)
        if arr.ndim != 1:
            raise ValueError("token ids must be a flat sequence of integers")
        if arr.size and (arr.min() < 0 or arr.max() >= self.info.n_vocab):
            bad = int(arr[(arr < 0) | (arr >= self.info.n_vocab)][0])
            raise ValueError(f"token id {bad} is out of range for a vocabulary of {self.info.n_vocab}")
        return arr.astype(np.int32)

    # ---- native calls (hold the lock) -------------------------------------------------------

    def _eval(self, ids: np.ndarray, out: np.ndarray | None, all_logits: bool) -> None:
        lib = self._lib
        ptr = _native.f32_ptr(out) if out is not None else None
        status = lib.colibri_eval(self._ctx, _native.i32_ptr(ids), int(ids.size), ptr, int(all_logits))
        if status != _native.OK:
            # The cache may hold part of the batch now; forget it rather than trust it.
            self._reset_cache()
            lib.check(status, "eval")
        self._cached.extend(int(t) for t in ids)
        self._last_eval_tokens = int(ids.size)

    def _reset_cache(self) -> None:
        self._lib.colibri_truncate(self._ctx, 0)
        self._cached = []

    def _truncate(self, n: int) -> None:
        if n < len(self._cached):
            self._lib.check(self._lib.colibri_truncate(self._ctx, int(n)), "truncate")
            del self._cached[n:]

    def _prefill(self, prompt: np.ndarray) -> int:
        """Bring the cache to `prompt`, evaluating only what is not cached already; the last
        token's logits land in self._logits. Returns how many prompt tokens were reused."""
        if prompt.size > self.context_length:
            raise ContextFullError(
                "COLIBRI_E_CONTEXT_FULL",
                f"the prompt has {prompt.size} tokens but the context holds {self.context_length}",
            )
        common = 0
        limit = min(len(self._cached), int(prompt.size) - 1)  # the last token is always re-run for logits
        while common < limit and self._cached[common] == prompt[common]:
            common += 1
        self._truncate(common)
        self._eval(prompt[common:], self._logits, all_logits=False)
        return common

    # ---- scoring ----------------------------------------------------------------------------

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits of a fresh sequence: row i follows token i. Shape [n, n_vocab]."""
        ids = self._check_ids(token_ids)
        if ids.size == 0:
            return np.empty((0, self.info.n_vocab), dtype=np.float32)
        with self._lock:
            self._check_open()
            if ids.size > self.context_length:
                raise ContextFullError(
                    "COLIBRI_E_CONTEXT_FULL",
                    f"{ids.size} tokens do not fit in the context of {self.context_length}",
                )
            out = np.empty((ids.size, self.info.n_vocab), dtype=np.float32)
            self._reset_cache()
            self._eval(ids, out, all_logits=True)
            return out

    def next_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits after the last of `token_ids` (float32 [n_vocab]), evaluating only the part the
        KV cache does not already hold. The cache then holds `token_ids`."""
        ids = self._check_ids(token_ids)
        if ids.size == 0:
            raise ValueError("cannot compute logits of an empty sequence")
        with self._lock:
            self._check_open()
            self._prefill(ids)
            return self._logits.copy()

    def routing(self) -> tuple[np.ndarray, np.ndarray]:
        """Experts chosen in the last evaluation: (ids int32, weights float32), each shaped
        [n_tokens, n_layer, n_expert_used]. Dense models give n_tokens = 0."""
        with self._lock:
            self._check_open()
            k = max(self.info.n_expert_used, 0)
            n_layer = self.info.n_layer
            n = self._last_eval_tokens if self.info.n_expert > 0 else 0
            ids = np.zeros((n, n_layer, k), dtype=np.int32)
            weights = np.zeros((n, n_layer, k), dtype=np.float32)
            if n == 0 or k == 0:
                return ids[:0], weights[:0]
            written = c_int32(0)
            self._lib.check(
                self._lib.colibri_get_routing(
                    self._ctx, _native.i32_ptr(ids), _native.f32_ptr(weights), n, byref(written)
                ),
                "routing",
            )
            return ids[: written.value], weights[: written.value]

    def route(self, token_ids: Sequence[int]) -> np.ndarray:
        """Expert ids [n, n_layer, n_expert_used] the router chooses for `token_ids` evaluated as a
        fresh sequence (teacher-forced, no logits copied out). Dense models give n = 0 rows."""
        ids = self._check_ids(token_ids)
        with self._lock:
            self._check_open()
            if ids.size > self.context_length:
                raise ContextFullError(
                    "COLIBRI_E_CONTEXT_FULL",
                    f"{ids.size} tokens do not fit in the context of {self.context_length}",
                )
            self._reset_cache()
            if ids.size == 0:  # routing() would report the previous evaluation
                return np.zeros((0, self.info.n_layer, max(self.info.n_expert_used, 0)), dtype=np.int32)
            self._eval(ids, None, all_logits=False)
            return self.routing()[0]

    # ---- generation -------------------------------------------------------------------------

    def _new_sampler(self, sp: SamplingParams) -> c_void_p:
        lib = self._lib
        params = sp.to_native()
        handle = c_void_p()
        lib.check(lib.colibri_sampler_new(byref(params), self.info.n_vocab, byref(handle)), "sampler")
        try:
            for tid, bias in (sp.logit_bias or {}).items():
                if not 0 <= tid < self.info.n_vocab:
                    raise ValueError(f"logit_bias token id {tid} is out of range")
                lib.check(lib.colibri_sampler_set_logit_bias(handle, int(tid), float(bias)), "logit_bias")
        except BaseException:
            lib.colibri_sampler_free(handle)
            raise
        return handle

    def generate_tokens(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int | None = 128,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] | None = None,
        logprobs: int | None = None,
    ) -> Iterator[GenerationEvent]:
        """Generate after `prompt_ids`, one GenerationEvent per token (see GenerationEvent).

        max_tokens None uses sampling.max_tokens, else 128. stop None uses sampling.stop.
        logprobs: None for none, 0 for the chosen token's log-probability, n > 0 also for the n
        most likely tokens (log-softmax of the raw logits, before penalties and filters).
        """
        sp = sampling or SamplingParams()
        if max_tokens is None:
            max_tokens = sp.max_tokens if sp.max_tokens is not None else 128
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        stops = [s for s in (list(stop) if stop is not None else list(sp.stop)) if s]
        prompt = self._check_ids(prompt_ids)
        if prompt.size == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if logprobs is not None and logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {logprobs}")
        return self._generate(prompt, int(max_tokens), sp, stops, logprobs)

    def _generate(
        self, prompt: np.ndarray, max_tokens: int, sp: SamplingParams, stops: list[str], logprobs: int | None
    ) -> Iterator[GenerationEvent]:
        with self._lock:
            self._check_open()
            lib = self._lib
            tok = self.tokenizer
            t_start = time.perf_counter()
            reused = self._prefill(prompt)
            t_prefill = time.perf_counter()
            self._last = {
                "prompt_tokens": int(prompt.size),
                "cached_prompt_tokens": reused,
                "prefill_seconds": t_prefill - t_start,
                "generated_tokens": 0,
                "decode_seconds": 0.0,
                "time_to_first_token": math.nan,
            }
            if max_tokens == 0:
                yield GenerationEvent(-1, "", finish_reason="length")
                return
            sampler = self._new_sampler(sp)
            try:
                for t in prompt:  # penalties see the prompt too, as in HF and llama.cpp
                    lib.check(lib.colibri_sampler_accept(sampler, int(t)), "sampler accept")
                decoder = tok.incremental_decoder(skip_special_tokens=True)
                # Special tokens never appear in the text, so a stop string that is one (say
                # "<|user|>") stops on the token itself.
                stop_ids = set(tok.stop_token_ids)
                for s in stops:
                    if s in tok.special_tokens:
                        sid = tok.token_to_id(s)
                        if sid is not None:
                            stop_ids.add(sid)
                pending = ""
                out_tok = c_int32(0)
                step_buf = np.empty(1, dtype=np.int32)
                logits_ptr = _native.f32_ptr(self._logits)
                for step in range(max_tokens):
                    lib.check(lib.colibri_sampler_sample(sampler, logits_ptr, byref(out_tok)), "sample")
                    token = int(out_tok.value)
                    if step == 0:
                        self._last["time_to_first_token"] = time.perf_counter() - t_start
                    lp: float | None = None
                    top: dict[str, float] | None = None
                    if logprobs is not None:
                        lp, top = _log_softmax_at(self._logits, token, logprobs, tok)
                    lib.check(lib.colibri_sampler_accept(sampler, token), "sampler accept")
                    self._last["generated_tokens"] = step + 1
                    if token in stop_ids:
                        yield GenerationEvent(token, pending + decoder.flush(), lp, top, "stop")
                        return
                    pending += decoder.add(token)
                    cut = _stop_cut(pending, stops)
                    if cut >= 0:
                        yield GenerationEvent(token, pending[:cut], lp, top, "stop")
                        return
                    if step == max_tokens - 1 or len(self._cached) >= self.context_length:
                        pending += decoder.flush()
                        cut = _stop_cut(pending, stops)
                        if cut >= 0:
                            yield GenerationEvent(token, pending[:cut], lp, top, "stop")
                        else:
                            yield GenerationEvent(token, pending, lp, top, "length")
                        return
                    hold = _held_suffix(pending, stops)
                    emit = pending[: len(pending) - hold]
                    pending = pending[len(pending) - hold :]
                    yield GenerationEvent(token, emit, lp, top, None)
                    t0 = time.perf_counter()
                    step_buf[0] = token
                    self._eval(step_buf, self._logits, all_logits=False)
                    self._last["decode_seconds"] += time.perf_counter() - t0
            finally:
                lib.colibri_sampler_free(sampler)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt, add_special_tokens=True)
        return [int(t) for t in prompt]

    def stream(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        logit_bias: Mapping[int, float] | None = None,
    ) -> Iterator[str]:
        """Text deltas as they are generated (whole characters; stop strings never appear)."""
        sp = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            seed=seed,
            logit_bias=dict(logit_bias) if logit_bias else None,
        )
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        ids = self._prompt_ids(prompt)
        for ev in self.generate_tokens(ids, max_tokens=max_tokens, sampling=sp, stop=stops):
            if ev.text:
                yield ev.text

    def generate(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        logit_bias: Mapping[int, float] | None = None,
    ) -> str:
        """The generated text (without the prompt, without the stop string)."""
        return "".join(
            self.stream(
                prompt,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                repetition_penalty=repetition_penalty,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                seed=seed,
                stop=stop,
                logit_bias=logit_bias,
            )
        )

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text the model's chat template makes of `messages`."""
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.tokenizer.bos_token,
            eos_token=self.tokenizer.eos_token,
            model_name=self.name,
            **extra,
        )

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, Any]], **extra: Any) -> list[int]:
        # The template writes BOS and the role markers itself, so nothing is added around it.
        return self.tokenize(self.apply_chat_template(messages, **extra), add_special_tokens=False)

    def chat_stream(
        self, messages: Sequence[Mapping[str, Any]], max_tokens: int = 128, **kwargs: Any
    ) -> Iterator[str]:
        """stream() over the chat-templated prompt of `messages`."""
        return self.stream(self.chat_prompt_ids(messages), max_tokens=max_tokens, **kwargs)

    def chat(self, messages: Sequence[Mapping[str, Any]], max_tokens: int = 128, **kwargs: Any) -> str:
        """The assistant's reply to `messages` (OpenAI-style role/content dicts)."""
        return "".join(self.chat_stream(messages, max_tokens=max_tokens, **kwargs))

    # ---- counters ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Engine counters (tokens, timings, allocations, memory) plus the last request's figures."""
        with self._lock:
            self._check_open()
            s = _native.StatsC()
            self._lib.check(self._lib.colibri_get_stats(self._ctx, byref(s)), "stats")
            out = stats_to_dict(s)
            out["routing_profile"] = str(self.routing_profile) if self.routing_profile else None
            out["prefill_tokens_per_second"] = (
                s.n_prompt_tokens / s.prefill_seconds if s.prefill_seconds > 0 else 0.0
            )
            out["decode_tokens_per_second"] = (
                s.n_decode_tokens / s.decode_seconds if s.decode_seconds > 0 else 0.0
            )
            out["n_past"] = int(self._lib.colibri_n_past(self._ctx))
            out["context_length"] = self.context_length
            out["cpu_backend"] = _native.cpu_backend()
            out["last"] = dict(self._last)
            out["memory_plan"] = self.memory_plan()
            out["expert_layers"] = self._expert_layers()
            return out

    def memory_plan(self) -> dict[str, int]:
        """The ledger's plan this context was created with (bytes per category, slots, fits)."""
        with self._lock:
            self._check_open()
            plan = _native.MemoryPlanC()
            self._lib.check(self._lib.colibri_get_memory_plan(self._ctx, byref(plan)), "memory plan")
            return plan_to_dict(plan)

    def expert_stats(self) -> list[dict[str, Any]]:
        """Counters of every (layer, expert) of the expert store; empty when all experts are resident."""
        with self._lock:
            self._check_open()
            n_total = self.info.n_layer * self.info.n_expert
            if n_total == 0:
                return []
            arr = (_native.ExpertStatsC * n_total)()
            n = c_int32()
            self._lib.check(
                self._lib.colibri_get_expert_stats(self._ctx, arr, n_total, byref(n)), "expert stats"
            )
            names = [f for f, _ in _native.ExpertStatsC._fields_ if f != "reserved"]
            return [{f: getattr(arr[i], f) for f in names} for i in range(n.value)]

    def _expert_layers(self) -> list[dict[str, Any]]:
        """expert_stats() summed per layer, with hit rate and stall time."""
        per: list[dict[str, Any]] = []
        keys = ("calls", "hits", "misses", "prefetch_issued", "prefetch_used", "prefetch_wasted")
        keys += ("bytes_read",)
        for e in self.expert_stats():
            while len(per) <= e["layer"]:
                per.append({"layer": len(per), **{k: 0 for k in keys}, "stall_seconds": 0.0, "resident": 0})
            row = per[e["layer"]]
            for k in keys:
                row[k] += e[k]
            row["stall_seconds"] += e["stall_seconds"]
            row["resident"] += e["resident"]
        for row in per:
            row["hit_rate"] = row["hits"] / row["calls"] if row["calls"] else 0.0
        return per

    def reset_stats(self) -> None:
        with self._lock:
            self._check_open()
            self._lib.colibri_reset_stats(self._ctx)


def stats_to_dict(s: _native.StatsC) -> dict[str, Any]:
    """colibri_stats as a dict, plus the expert store's hit rate and each predictor's precision
    (correct / predicted) and recall (correct / actual); 0.0 where nothing was counted."""
    out: dict[str, Any] = {name: getattr(s, name) for name, _ in _native.StatsC._fields_}
    out["expert_hit_rate"] = s.expert_hits / s.expert_calls if s.expert_calls else 0.0
    for src in ("lookahead", "temporal", "hashed"):
        correct = out[f"{src}_correct"]
        out[f"{src}_precision"] = correct / out[f"{src}_predicted"] if out[f"{src}_predicted"] else 0.0
        out[f"{src}_recall"] = correct / out[f"{src}_actual"] if out[f"{src}_actual"] else 0.0
    return out


def replay_routing(
    model: str | os.PathLike[str],
    tokens: Sequence[int] | np.ndarray,
    expert_ids: np.ndarray,
    *,
    memory_budget: str | int | None = 0,
    expert_slots: str | int | None = None,
    expert_policy: str = "lfu",
    prefetch: str | None = None,
    lookahead_depth: int | None = None,
    warmup_routing: bool | str | os.PathLike[str] | None = False,
    pin_experts: str | int | None = None,
    threads: int | None = None,
    context_length: int | None = None,
    batch_size: int | None = None,
    kv_cache_type: str | None = None,
    verify: bool = False,
) -> dict[str, Any]:
    """Replay a recorded routing (expert_ids [T, n_layer, k], tokens [T]; a RoutingTrace's ids and
    tokens) through the expert store these options set up, each token one decode step, without
    running the model (colibri_replay_routing). Returns the counters as Model.stats() names them
    (expert_hits, expert_misses, prefetch_*, expert_stall_seconds, hashed_*, ...). Lookahead needs
    hidden states and is not replayed. The store must stream: give expert_slots or a memory_budget
    smaller than the model (0, the default here, holds every expert and is refused)."""
    resolved = resolve_model(model)
    path = resolved.gguf
    ids = np.ascontiguousarray(expert_ids, dtype=np.int32)
    toks = np.ascontiguousarray(tokens, dtype=np.int32)
    if ids.ndim != 3 or toks.shape != (ids.shape[0],):
        raise ValueError(f"expert_ids {ids.shape} and tokens {toks.shape} must be [T, n_layer, k] and [T]")
    lib = _native.load_library()
    handle = c_void_p()
    lib.check(lib.colibri_model_open(os.fsencode(path), byref(handle)), f"cannot open {path}")
    try:
        if verify:
            verify_model(handle, path)
        info_c = _native.ModelInfoC()
        lib.check(lib.colibri_model_get_info(handle, byref(info_c)), "model info")
        info = ModelInfo.from_c(info_c)
        if info.n_expert <= 0:
            raise ValueError(f"{path} is a dense model: there is no expert routing to replay")
        if ids.shape[1:] != (info.n_layer, info.n_expert_used):
            raise ValueError(
                f"the routing has {ids.shape[1]} layers x top-{ids.shape[2]}; {path} has "
                f"{info.n_layer} layers x top-{info.n_expert_used}"
            )
        params, _profile = store_params(
            lib,
            handle,
            info,
            path,
            threads=threads,
            context_length=context_length,
            batch_size=batch_size,
            memory_budget=memory_budget,
            expert_policy=expert_policy,
            prefetch=prefetch,
            kv_cache_type=kv_cache_type,
            expert_slots=expert_slots,
            lookahead_depth=lookahead_depth,
            warmup_routing=warmup_routing,
            pin_experts=pin_experts,
        )
        out = _native.StatsC()
        lib.check(
            lib.colibri_replay_routing(
                handle, byref(params), _native.i32_ptr(toks), _native.i32_ptr(ids), int(toks.size), byref(out)
            ),
            "replay",
        )
        result = stats_to_dict(out)
        result["n_tokens"] = int(toks.size)
        result["routing_profile"] = str(_profile) if _profile else None
        return result
    finally:
        lib.colibri_model_close(handle)


def load(
    model: str | os.PathLike[str],
    threads: int | None = None,
    context_length: int | None = None,
    batch_size: int | None = None,
    memory_budget: str | int | None = None,
    expert_policy: str = "lfu",
    prefetch: str | None = None,
    kv_cache_type: str | None = None,
    expert_slots: str | int | None = None,
    lookahead_depth: int | None = None,
    warmup_routing: bool | str | os.PathLike[str] | None = False,
    pin_experts: str | int | None = None,
    route_prefilter_margin: float | None = None,
    drop_cold_share: float | None = None,
    verify: bool = False,
) -> Model:
    """Load a model: a GGUF path, a Hugging Face checkpoint directory (converted once and
    cached) or a known name such as "smollm2".

    memory_budget: bytes or a size string ("512M", "1.5G") for everything the engine holds;
    None: a share of the available memory or cgroup limit (colibri_backend.budget); 0: no limit.
    Experts that do not fit are streamed from the file (expert_policy "lfu" or "lru"; prefetch
    "lookahead", "temporal", "hashed", comma lists of them, "all" or "none"; default "none", which
    was faster on every capped run measured, docs/benchmarks.md). Output is identical at any budget.

    Expert store (docs/memory.md, "Routing profiles and store options"):
    expert_slots: slots counted in experts instead of bytes: an int, or "40%" of the model's
    n_layer * n_expert routed experts (rounded up, at least top-k); None: from the budget.
    lookahead_depth: layers ahead the lookahead predictor looks (1..8; None: 1).
    warmup_routing: a routing profile (`colibri profile`) to warm the slots with and to feed the
    hashed predictor: True = MODEL.routing next to the model (an error if there is none), or a path.
    pin_experts: keep this many of the profile's hottest experts in slots for good; "auto" = half
    of the slots left after the top-k working set, (slots - k) // 2.
    route_prefilter_margin (lossy, opt-in): route among the profile's candidates only when the
    logit gap is at least this; 0 off. drop_cold_share (lossy, opt-in): never route to experts whose
    profile share is below this; 0 off. Both need a profile.

    kv_cache_type: None (F16, or F32 for an F32 model), "f16", or "int8" (per-position, per-head
    scaled int8: about half the KV memory of F16, slightly different logits; docs/memory.md).

    verify: check every resident tensor against the file's digests (MODEL.digests, `colibri verify`)
    before anything runs; ModelFormatError naming the bad tensors. Streamed experts are checked when
    read whenever the digests exist (docs/robustness.md)."""
    resolved = resolve_model(model)
    return Model(
        resolved.gguf,
        threads=threads,
        context_length=context_length,
        batch_size=batch_size,
        memory_budget=memory_budget,
        expert_policy=expert_policy,
        prefetch=prefetch,
        kv_cache_type=kv_cache_type,
        expert_slots=expert_slots,
        lookahead_depth=lookahead_depth,
        warmup_routing=warmup_routing,
        pin_experts=pin_experts,
        route_prefilter_margin=route_prefilter_margin,
        drop_cold_share=drop_cold_share,
        verify=verify,
        hf_dir=resolved.hf_dir,
        name=resolved.name or None,
    )
