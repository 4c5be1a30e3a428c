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

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from ctypes import byref, c_char, c_int32, c_size_t, c_void_p
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from colibri_backend import _native
from colibri_backend.adapters.chat_template import render_chat, template_from_tokenizer_config
from colibri_backend.adapters.gguf_metadata import read_metadata
from colibri_backend.adapters.sampling import SamplingParams
from colibri_backend.adapters.tokenizer import Tokenizer
from colibri_backend.backends import BaseModel, Capabilities, CapabilityError, SequenceSteps, as_sampling
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
from colibri_backend.errors import ContextFullError, EngineError, UnsupportedModelError
from colibri_backend.generation import (
    GenerationEvent,
    Step,
    check_max_tokens,
    check_prompt,
    generation_events,
    stop_list,
)
from colibri_backend.load_options import LoadOptions
from colibri_backend.models import resolve_model
from colibri_backend.optimum import belady
from colibri_backend.prefix_cache import Entry, PrefixCache, save_point
from colibri_backend.profile import profile_path
from colibri_backend.replay import interleave


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


class _NativeHandle:
    """A native object owned by Python: freed by ``close()`` (its library function ``FREE``), also as a
    context manager. Subclasses set ``lib`` and ``handle``."""

    FREE = ""
    lib: Any
    handle: c_void_p

    def close(self) -> None:
        if self.handle:
            getattr(self.lib, self.FREE)(self.handle)
            self.handle = c_void_p()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _NativeSampler(_NativeHandle):
    """colibri_sampler (the engine's own sampler) as a generation-loop Sampler; it has seen the
    prompt, since penalties count prompt tokens too, as in HF and llama.cpp. A context manager:
    the native handle is freed on exit."""

    FREE = "colibri_sampler_free"

    def __init__(self, lib: Any, sp: SamplingParams, n_vocab: int, prompt: Sequence[int]) -> None:
        self.lib = lib
        params = sp.to_native()
        self.handle = c_void_p()
        lib.check(lib.colibri_sampler_new(byref(params), n_vocab, byref(self.handle)), "sampler")
        self._out = c_int32(0)
        try:
            for tid, bias in (sp.logit_bias or {}).items():
                if not 0 <= tid < n_vocab:
                    raise ValueError(f"logit_bias token id {tid} is out of range")
                lib.check(
                    lib.colibri_sampler_set_logit_bias(self.handle, int(tid), float(bias)), "logit_bias"
                )
            for t in prompt:
                self.accept(int(t))
        except BaseException:
            self.close()
            raise

    def sample(self, logits: np.ndarray) -> int:
        self.lib.check(
            self.lib.colibri_sampler_sample(self.handle, _native.f32_ptr(logits), byref(self._out)), "sample"
        )
        return int(self._out.value)

    def accept(self, token: int) -> None:
        self.lib.check(self.lib.colibri_sampler_accept(self.handle, token), "sampler accept")

    def allow(self, mask: np.ndarray | None) -> None:
        words = 0 if mask is None else int(mask.shape[0])
        ptr = None if mask is None else mask.ctypes.data
        self.lib.check(self.lib.colibri_sampler_set_allowed(self.handle, ptr, words), "allowed tokens")


def lowbit_sidecar_path(model_path: Path, n_expert: int) -> Path:
    """MODEL.lowbit, the low-bit expert copies lowbit_experts reads (which must exist)."""
    if n_expert <= 0:
        raise ValueError(
            f"lowbit_experts: {model_path} is a dense model; low-bit copies are of routed experts"
        )
    side = Path(f"{model_path}.lowbit")
    if not side.is_file():
        raise FileNotFoundError(
            f"lowbit_experts: there are no low-bit expert copies next to the model ({side}); write them with "
            f"`colibri quantize SOURCE {model_path} --lowbit-sidecar q2_k`"
        )
    return side


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
    lib: Any, model: c_void_p, info: ModelInfo, path: Path, options: LoadOptions
) -> tuple[_native.ContextParamsC, Path | None]:
    """colibri_context_params for an opened model from its LoadOptions (checked already; what
    depends on the model is resolved here), and the routing profile it uses. The struct holds the
    profile path's bytes itself (ctypes keeps a reference to the bytes assigned to a c_char_p field)."""
    o = options
    params = _native.ContextParamsC()
    lib.colibri_context_default_params(byref(params))
    params.n_threads = int(o.threads or 0)
    params.n_ctx = int(o.context_length or 0)
    if o.batch_size:
        params.n_batch = int(o.batch_size)
    params.memory_budget = resolve_budget(o.memory_budget)
    if o.memory_budget is None and params.memory_budget and not os.environ.get("COLIBRI_MEMORY_BUDGET"):
        # The default is a share of what the machine still allows, measured after the open model read
        # its metadata and resident weights into memory it owns (resident.c): give those bytes back, or
        # the plan would count them twice. COLIBRI_MEMORY_BUDGET is a budget given, not measured: it
        # covers everything, as an explicit memory_budget does.
        held = _native.MemoryPlanC()
        lib.check(lib.colibri_plan_model(model, byref(params), byref(held)), "plan")
        params.memory_budget += int(held.metadata_bytes) + int(held.resident_weight_bytes)
    params.expert_policy = parse_policy(o.expert_policy)
    params.kv_type = parse_kv_cache_type(o.kv_cache_type)
    params.expert_slots = parse_expert_slots(o.expert_slots, info.n_layer, info.n_expert, info.n_expert_used)
    if o.lookahead_depth:
        params.lookahead_depth = o.lookahead_depth
    if o.lookahead_confidence:
        params.lookahead_confidence = o.lookahead_confidence
    profile = resolve_warmup_routing(o.warmup_routing, path)
    if profile is not None and info.n_expert <= 0:
        raise ValueError(f"warmup_routing: {path} is a dense model; routing profiles are for MoE models")
    spec = o.prefetch if o.prefetch is not None else DEFAULT_PREFETCH
    flags = parse_prefetch(spec)
    if flags & HASHED and profile is None:
        if spec.strip().lower() != "all":
            raise ValueError(
                "prefetch 'hashed' needs a routing profile: pass warmup_routing (--warmup-routing) too"
            )
        flags &= ~HASHED  # "all" means every predictor that can run
    params.prefetch = flags
    margin = parse_share(o.route_prefilter_margin, "route_prefilter_margin")
    cold = parse_share(o.drop_cold_share, "drop_cold_share", upper=1.0)
    for name, on in (("route_prefilter_margin", margin > 0), ("drop_cold_share", cold > 0)):
        if on and profile is None:
            raise ValueError(f"{name} needs a routing profile: pass warmup_routing (--warmup-routing) too")
    params.route_prefilter_margin = margin
    params.drop_cold_share = cold
    if o.expert_mass is not None and info.n_expert <= 0:
        raise ValueError(f"expert_mass: {path} is a dense model; it applies to MoE models")
    params.expert_mass = o.expert_mass if o.expert_mass is not None and o.expert_mass < 1 else 0.0
    if o.lowbit_experts is not None:
        params.lowbit_experts = os.fsencode(lowbit_sidecar_path(path, info.n_expert))
        params.lowbit_weight = o.lowbit_experts
    params.n_seq_max = int(o.max_concurrency or 1)
    if o.device is not None:
        params.backend = _native.BACKEND_OPENCL if o.device == "opencl" else _native.BACKEND_CPU
    if profile is not None:
        params.routing_profile = os.fsencode(profile)
    if o.pin_experts:
        if profile is None:
            raise ValueError(
                "pin_experts needs a routing profile: pass warmup_routing (--warmup-routing) too"
            )
        # "auto" and the range check need the number of slots this budget gives.
        plan = _native.MemoryPlanC()
        lib.check(lib.colibri_plan_model(model, byref(params), byref(plan)), "plan")
        n_slots = 0 if plan.all_resident else int(plan.n_expert_slots)
        params.pin_experts = parse_pin_experts(o.pin_experts, n_slots, info.n_expert_used)
    return params, profile


DEFAULT_PREFIX_SHARE = 0.10  # of the memory budget, for the prefix cache
UNBUDGETED_PREFIX_BYTES = 1 << 30


def carve_prefix_cache(
    lib: Any, model: c_void_p, params: _native.ContextParamsC, options: LoadOptions
) -> int:
    """Bytes the prefix cache may hold (LoadOptions.prefix_cache_size), taken out of the budget the
    engine plans with (params.memory_budget, lowered in place), so the ledger's plan and the cache
    together stay within the memory budget. The default share is dropped when the rest of the budget
    would no longer hold the engine's minimum working set; an explicit size is the user's to size."""
    size, budget = options.prefix_cache_size, int(params.memory_budget)
    plan = _native.MemoryPlanC()
    if isinstance(size, str):  # a share of the budget, checked by LoadOptions
        want = int(budget * float(size[:-1]) / 100)
    elif size is not None:
        want = size
    else:
        want = int(budget * DEFAULT_PREFIX_SHARE) if budget else UNBUDGETED_PREFIX_BYTES
    if not budget or not want:
        return want
    if want >= budget:
        raise ValueError(
            f"prefix_cache_size ({want} bytes) leaves nothing of the memory budget ({budget} bytes)"
        )
    params.memory_budget = budget - want
    if size is None:
        lib.check(lib.colibri_plan_model(model, byref(params), byref(plan)), "plan")
        if not plan.fits:
            params.memory_budget = budget
            return 0
    return want


class _OpenModel(_NativeHandle):
    """A native model opened for a look (its info, a plan, a replay) without a context; closed on exit."""

    FREE = "colibri_model_close"

    def __init__(self, path: Path) -> None:
        self.lib = _native.load_library()
        self.handle = c_void_p()
        self.lib.check(
            self.lib.colibri_model_open(os.fsencode(path), byref(self.handle)), f"cannot open {path}"
        )
        try:
            info_c = _native.ModelInfoC()
            self.lib.check(self.lib.colibri_model_get_info(self.handle, byref(info_c)), "model info")
            self.info = ModelInfo.from_c(info_c)
        except BaseException:
            self.close()
            raise


def check_model_file(path: str | os.PathLike[str]) -> ModelInfo | None:
    """Open a GGUF with the engine's parser (every size, offset and type checked against the file) and
    close it again; its info, or None when the file is well formed but its architecture is not one the
    engine runs. A bad file raises ModelFormatError with the engine's precise message."""
    try:
        with _OpenModel(Path(path)) as m:
            return m.info
    except UnsupportedModelError:
        return None


def plan_memory(model: str | os.PathLike[str], options: LoadOptions | None = None) -> dict[str, int]:
    """The ledger's memory plan (bytes per category, expert slots, whether it fits, the minimum budget)
    for loading ``model`` (a path, checkpoint dir or known name) with ``options``, without loading it."""
    path = resolve_model(model).gguf
    options = options or LoadOptions()
    with _OpenModel(path) as m:
        if options.verify:
            verify_model(m.handle, path)
        params, _ = store_params(m.lib, m.handle, m.info, path, options)
        prefix_bytes = carve_prefix_cache(m.lib, m.handle, params, options)
        plan = _native.MemoryPlanC()
        m.lib.check(m.lib.colibri_plan_model(m.handle, byref(params), byref(plan)), f"plan for {path}")
        return {**plan_to_dict(plan), "prefix_cache_bytes": prefix_bytes}


class Model(BaseModel):
    """A loaded model with one inference context, and the ``colibri`` backend's loaded model (the
    backend protocol's LoadedModel, colibri_backend.backends). See colibri_backend.load()."""

    backend = "colibri"

    def __init__(
        self,
        path: str | os.PathLike[str],
        options: LoadOptions | None = None,
        *,
        hf_dir: str | os.PathLike[str] | None = None,
        name: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        """``options`` None: LoadOptions() (the defaults load() uses). ``name`` and ``chat_template``
        override what the file says (a configured alias's name and template)."""
        options = options if options is not None else LoadOptions()
        if not isinstance(options, LoadOptions):
            raise TypeError(f"options must be a LoadOptions, got {type(options).__name__}")
        self.options = options
        self._lock = threading.RLock()
        self._model = c_void_p()
        self._ctx = c_void_p()
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"model file not found: {path}")
        if not path.is_file():
            raise FileNotFoundError(f"not a model file: {path}")
        self.path = path
        self._lib = _native.load_library()
        lib = self._lib
        lib.check(lib.colibri_model_open(os.fsencode(path), byref(self._model)), f"cannot open {path}")
        try:
            if options.verify:
                verify_model(self._model, path)
            info_c = _native.ModelInfoC()
            lib.check(lib.colibri_model_get_info(self._model, byref(info_c)), "model info")
            self.info = ModelInfo.from_c(info_c)
            params, self.routing_profile = store_params(lib, self._model, self.info, path, options)
            prefix_bytes = carve_prefix_cache(lib, self._model, params, options)
            lib.check(lib.colibri_context_new(self._model, byref(params), byref(self._ctx)), "context")
            self.context_length: int = int(lib.colibri_context_n_ctx(self._ctx))
            state_reach = int(lib.colibri_state_reach(self._ctx))
            self.prefix_cache = PrefixCache(
                prefix_bytes,
                self._state_namespace(),
                options.kv_cache_dir,
                self.context_length,
                reach=state_reach if state_reach < self.context_length else None,
            )
            # Sequences the context holds (LoadOptions.max_concurrency): eval_batch's sequence ids.
            self.max_concurrency: int = int(lib.colibri_n_seq_max(self._ctx))
            self.batch_size: int = min(int(params.n_batch), self.context_length)  # tokens per chunk
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
            self.chat_template: str | None = chat_template or template or None
            self.name: str = name or str(meta.get("general.name") or path.stem)
            self.n_vocab = self.info.n_vocab
            self.capabilities = Capabilities(
                logits=True,
                logprobs=True,
                chat=self.chat_template is not None,
                streaming=True,
                memory_budget=True,
            )
        except BaseException:
            self.close()
            raise
        n_vocab = self.info.n_vocab
        self._logits = np.empty(n_vocab, dtype=np.float32)  # last-token logits of each step
        self._cached: list[int] = []  # tokens whose K/V are in the cache, in order
        self._last_eval_tokens = 0
        self._lookahead_depth = 0  # record_lookahead
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

    def _truncate(self, n: int) -> int:
        """Keep the first n cached tokens; returns how many were kept (fewer for a model with recurrent
        state, which resumes from its checkpoint or from 0: colibri_truncate)."""
        if n < len(self._cached):
            self._lib.check(self._lib.colibri_truncate(self._ctx, int(n)), "truncate")
            n = int(self._lib.colibri_n_past(self._ctx))
            del self._cached[n:]
        return min(n, len(self._cached))

    def _prefill(self, prompt: np.ndarray) -> int:
        """Bring the cache to `prompt`, evaluating only what is not cached already; the last
        token's logits land in self._logits. The prefix cache chooses what to reuse: what the
        context holds now, or a stored state sharing more of the prompt (restored first); the
        prompt's own state is offered to it on the way (at its save point). Returns how many prompt
        tokens were reused."""
        if prompt.size > self.context_length:
            raise ContextFullError(
                "COLIBRI_E_CONTEXT_FULL",
                f"the prompt has {prompt.size} tokens but the context holds {self.context_length}",
            )
        limit = int(prompt.size) - 1  # the last token is always re-run for logits
        while True:
            reuse = self.prefix_cache.best(prompt, np.asarray(self._cached, dtype=np.int32), limit)
            if reuse.entry is None or self._restore(reuse.entry):
                break
        self.prefix_cache.used(reuse.entry, reuse.n)
        n = reused = self._truncate(reuse.n)  # fewer than asked for a model with recurrent state
        mark = save_point(int(prompt.size), self.prefix_cache.reach)
        if n < mark < prompt.size:  # a recurrent state: stored as the prefill passes its position
            self._eval(prompt[n:mark], None, all_logits=False)
            self._remember(prompt[:mark])
            n = mark
        self._eval(prompt[n:], self._logits, all_logits=False)
        if mark == prompt.size:
            self._remember(prompt)
        return reused

    def _restore(self, entry: Entry, seq: int = 0) -> bool:
        """Load a stored state into sequence ``seq``; False (the entry dropped, the sequence unchanged)
        if its blob cannot be read or the engine refuses it."""
        blob = self.prefix_cache.blob(entry)
        if blob is None:
            return False
        status = self._lib.colibri_seq_state_load(self._ctx, int(seq), blob, len(blob))
        if status != _native.OK:
            self.prefix_cache.discard(entry, self._lib.last_error())
            return False
        if seq == 0:
            self._cached = entry.tokens.tolist()
        return True

    def _save_state(self, n: int, seq: int = 0) -> bytes:
        """The engine's state blob of sequence ``seq``'s first n tokens (colibri_seq_state_save)."""
        lib = self._lib
        size = c_size_t(0)
        lib.check(lib.colibri_seq_state_size(self._ctx, int(seq), int(n), byref(size)), "state size")
        buf = (c_char * size.value)()
        written = c_size_t(0)
        status = lib.colibri_seq_state_save(self._ctx, int(seq), int(n), buf, size.value, byref(written))
        lib.check(status, "state save")
        return bytes(memoryview(buf)[: written.value])

    def _remember(self, tokens: np.ndarray) -> None:
        """Offer sequence 0's state of ``tokens`` (which it holds now) to the prefix cache."""
        n = int(tokens.size)
        if len(self._cached) >= n and self._cached[:n] == tokens.tolist():
            self.prefix_cache.put(tokens, lambda: self._save_state(n))

    def _state_namespace(self) -> str:
        """What the prefix cache's entries are for: the digest of this context's empty state, which
        names the model, its shapes and the KV cache type (kv_io.c's header)."""
        return hashlib.blake2b(self._save_state(0), digest_size=8).hexdigest()

    # ---- several sequences (continuous batching; server/scheduler.py drives these) ------------

    def eval_batch(self, seq_ids: np.ndarray, tokens: np.ndarray, want: np.ndarray) -> np.ndarray:
        """One forward step over tokens of several sequences (colibri_eval_batch): token i is appended
        to sequence seq_ids[i]; returns the logits rows [n_wanted, n_vocab] of the tokens with want[i],
        in token order. Each row is bit-identical to that sequence's evaluated alone. On failure no
        sequence changes (the engine restores every position count)."""
        seqs = np.ascontiguousarray(seq_ids, dtype=np.int32)
        toks = self._check_ids(tokens)
        flags = np.ascontiguousarray(want, dtype=np.uint8)
        if not seqs.size == toks.size == flags.size:
            raise ValueError("seq_ids, tokens and want must have the same length")
        out = np.empty((int(np.count_nonzero(flags)), self.info.n_vocab), dtype=np.float32)
        with self._lock:
            self._check_open()
            lib = self._lib
            status = lib.colibri_eval_batch(
                self._ctx,
                _native.i32_ptr(seqs),
                _native.i32_ptr(toks),
                int(toks.size),
                flags.ctypes.data_as(c_void_p),
                _native.f32_ptr(out) if out.size else None,
            )
            lib.check(status, "eval_batch")
            if (seqs == 0).any():
                # Sequence 0 is also the single-sequence calls' cache: what it holds now matches no
                # prompt, so the next of those calls starts it afresh.
                self._cached = [-1] * int(lib.colibri_seq_n_past(self._ctx, 0))
            self._last_eval_tokens = int(toks.size)
        return out

    def seq_n_past(self, seq: int) -> int:
        """Tokens in sequence ``seq``'s cache."""
        with self._lock:
            self._check_open()
            n = int(self._lib.colibri_seq_n_past(self._ctx, int(seq)))
        if n < 0:
            raise ValueError(f"sequence {seq} is outside [0, {self.max_concurrency})")
        return n

    def seq_truncate(self, seq: int, n_past: int = 0) -> None:
        """Keep the first ``n_past`` tokens of sequence ``seq``'s cache (0 frees the sequence)."""
        with self._lock:
            self._check_open()
            self._lib.check(self._lib.colibri_seq_truncate(self._ctx, int(seq), int(n_past)), "seq_truncate")
            if seq == 0:
                del self._cached[n_past:]

    def seq_restore_prefix(self, seq: int, prompt: Sequence[int]) -> int:
        """Restore into the empty sequence ``seq`` the prefix cache's longest state for ``prompt``
        (never its last token, which is evaluated for logits); returns how many tokens it holds now."""
        ids = np.ascontiguousarray(prompt, dtype=np.int32)
        with self._lock:
            self._check_open()
            while True:
                reuse = self.prefix_cache.best(ids, np.empty(0, np.int32), int(ids.size) - 1)
                if reuse.entry is None or self._restore(reuse.entry, seq):
                    break
            n = 0
            if reuse.entry is not None:
                self._lib.check(self._lib.colibri_seq_truncate(self._ctx, int(seq), reuse.n), "seq_truncate")
                n = int(self._lib.colibri_seq_n_past(self._ctx, int(seq)))
                if seq == 0:
                    self._cached = [-1] * n  # as after eval_batch: matches no single-sequence prompt
            self.prefix_cache.used(reuse.entry, n)
            return n

    def prefix_save_point(self, n_prompt: int) -> int:
        """Where the state of a prompt of ``n_prompt`` tokens is stored (prefix_cache.save_point)."""
        return save_point(n_prompt, self.prefix_cache.reach)

    def seq_remember(self, seq: int, tokens: Sequence[int]) -> None:
        """Offer sequence ``seq``'s state of ``tokens`` (the first tokens it holds) to the prefix cache."""
        ids = np.ascontiguousarray(tokens, dtype=np.int32)
        with self._lock:
            self._check_open()
            entry = self.prefix_cache.put(ids, lambda: self._save_state(int(ids.size), seq), write=False)
        if entry is not None:  # the blob was made under the lock; its file is written off it
            self.prefix_cache.persist(entry)

    def _check_fits(self, n: int) -> None:
        if n > self.context_length:
            raise ContextFullError(
                "COLIBRI_E_CONTEXT_FULL", f"{n} tokens do not fit in the context of {self.context_length}"
            )

    # ---- scoring ----------------------------------------------------------------------------

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits of a fresh sequence: row i follows token i. Shape [n, n_vocab]."""
        ids = self._check_ids(token_ids)
        if ids.size == 0:
            return np.empty((0, self.info.n_vocab), dtype=np.float32)
        with self._lock:
            self._check_open()
            self._check_fits(ids.size)
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

    def record_lookahead(self, depth: int) -> None:
        """From the next evaluation on, also record the lookahead predictor's guesses for every token
        (lookahead()); depth 1..8 layers ahead, 0 stops. Costs depth router products per token and layer."""
        with self._lock:
            self._check_open()
            self._lib.check(self._lib.colibri_record_lookahead(self._ctx, int(depth)), "record lookahead")
            self._lookahead_depth = int(depth)

    def lookahead(self) -> tuple[np.ndarray, np.ndarray]:
        """The last evaluation's lookahead guesses (record_lookahead): (ids int32, probs float32), each
        [n_tokens, n_layer, depth, n_expert_used]: for layer l and depth d, the top k of layer l+d's router
        on layer l's FFN input, most likely first (-1 / 0 where layer l+d does not exist)."""
        with self._lock:
            self._check_open()
            depth = self._lookahead_depth
            if depth <= 0:
                raise ValueError("no lookahead record: call record_lookahead(depth) before evaluating")
            n, shape = self._last_eval_tokens, (self.info.n_layer, depth, self.info.n_expert_used)
            ids = np.zeros((n, *shape), dtype=np.int32)
            probs = np.zeros((n, *shape), dtype=np.float32)
            written, got_depth = c_int32(0), c_int32(0)
            self._lib.check(
                self._lib.colibri_get_lookahead(
                    self._ctx,
                    _native.i32_ptr(ids),
                    _native.f32_ptr(probs),
                    n,
                    byref(written),
                    byref(got_depth),
                ),
                "lookahead",
            )
            return ids[: written.value], probs[: written.value]

    def _debug_route_override(
        self,
        ids: np.ndarray | None,
        weights: np.ndarray | None = None,
        lookahead: tuple[np.ndarray, np.ndarray] | None = None,
        tokens: np.ndarray | None = None,
    ) -> None:
        """Benchmarks and tests only: impose a recorded routing ([T, n_layer, k] ids and weights; position p
        follows row p % T) on every later evaluation, and with ``lookahead`` (the trace's recorded guesses,
        ids and probs [T, n_layer, depth, k]) make the lookahead prefetch guess what the trace's model
        guessed, with ``tokens`` (the trace's [T] token ids) make the hashed predictor key on the trace's
        tokens; None turns it off. colibri_backend.trace.impose_trace is the checked way to call it."""
        with self._lock:
            self._check_open()
            if ids is None:
                status = self._lib.colibri_debug_route_override(self._ctx, None, None, 0)
                self._lib.check(status, "route override")
                return
            ids = np.ascontiguousarray(ids, dtype=np.int32)
            weights = np.ascontiguousarray(weights, dtype=np.float32)
            guesses = lookahead_arrays(ids, *lookahead) if lookahead is not None else None  # checked first
            if tokens is not None:
                tokens = np.ascontiguousarray(tokens, dtype=np.int32)
                if tokens.shape != ids.shape[:1]:
                    raise ValueError(
                        f"the trace's token ids have shape {tokens.shape}; "
                        f"its routing has {ids.shape[0]} rows"
                    )
            self._lib.check(
                self._lib.colibri_debug_route_override(
                    self._ctx, _native.i32_ptr(ids), _native.f32_ptr(weights), int(ids.shape[0])
                ),
                "route override",
            )
            if guesses is not None:
                la_ids, la_probs = guesses
                self._lib.check(
                    self._lib.colibri_debug_route_override_lookahead(
                        self._ctx, _native.i32_ptr(la_ids), _native.f32_ptr(la_probs), int(la_ids.shape[2])
                    ),
                    "route override lookahead",
                )
            if tokens is not None:
                self._lib.check(
                    self._lib.colibri_debug_route_override_tokens(self._ctx, _native.i32_ptr(tokens)),
                    "route override tokens",
                )

    def route(self, token_ids: Sequence[int]) -> np.ndarray:
        """Expert ids [n, n_layer, n_expert_used] the router chooses for `token_ids` evaluated as a
        fresh sequence (teacher-forced, no logits copied out). Dense models give n = 0 rows."""
        ids = self._check_ids(token_ids)
        with self._lock:
            self._check_open()
            self._check_fits(ids.size)
            self._reset_cache()
            if ids.size == 0:  # routing() would report the previous evaluation
                return np.zeros((0, self.info.n_layer, max(self.info.n_expert_used, 0)), dtype=np.int32)
            self._eval(ids, None, all_logits=False)
            return self.routing()[0]

    # ---- generation -------------------------------------------------------------------------

    def generate_tokens(
        self,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int | None = 128,
        sampling: SamplingParams | None = None,
        stop: str | Sequence[str] | None = None,
        logprobs: int | None = None,
        constraint: Any = None,
        steps: SequenceSteps | None = None,
    ) -> Iterator[GenerationEvent]:
        """Generate after `prompt_ids`, one GenerationEvent per token, by the rules every backend
        shares (colibri_backend.generation: max_tokens 0 prefills only; the prompt may fill the context).

        max_tokens None uses sampling.max_tokens, else 128. stop None uses sampling.stop.
        logprobs: None for none, 0 for the chosen token's log-probability, n > 0 also for the n
        most likely tokens (log-softmax of the raw logits, before penalties and filters).
        The KV cache is reused for the part of the prompt it already holds.
        constraint: a grammar's TokenConstraint (colibri_backend.grammar); only the tokens it allows
        are sampled, and generation stops when its grammar is complete.
        steps: run the forward steps there (a batch scheduler's sequence, which shares the context
        with other generations) instead of on sequence 0 under the model's lock; the prefix cache's
        entries are reused there too (seq_restore_prefix), the live context's are not.
        """
        sp = as_sampling(sampling)
        if max_tokens is None:
            max_tokens = sp.max_tokens if sp.max_tokens is not None else 128
        max_tokens = check_max_tokens(max_tokens)
        ids = check_prompt(prompt_ids, self.context_length)
        prompt = self._check_ids(ids)
        if logprobs is not None and logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {logprobs}")
        if constraint is not None and constraint.n_vocab != self.info.n_vocab:
            raise ValueError(
                f"the constraint's vocabulary ({constraint.n_vocab}) is not the model's ({self.info.n_vocab})"
            )
        return self._generate(
            ids,
            prompt,
            max_tokens,
            sp,
            stop_list(stop if stop is not None else sp.stop),
            logprobs,
            constraint,
            steps,
        )

    def _stop_ids(self, stops: list[str]) -> frozenset[int]:
        # Special tokens never appear in the text, so a stop string that is one (say "<|user|>")
        # stops on the token itself.
        tok = self.tokenizer
        ids = set(tok.stop_token_ids)
        for s in stops:
            if s in tok.special_tokens:
                sid = tok.token_to_id(s)
                if sid is not None:
                    ids.add(sid)
        return frozenset(ids)

    def _generate(
        self,
        ids: list[int],
        prompt: np.ndarray,
        max_tokens: int,
        sp: SamplingParams,
        stops: list[str],
        logprobs: int | None,
        constraint: Any = None,
        steps: SequenceSteps | None = None,
    ) -> Iterator[GenerationEvent]:
        # A scheduler's sequence takes the model's lock for each batched step itself.
        with self._lock if steps is None else contextlib.nullcontext():
            self._check_open()
            t_start = time.perf_counter()
            last = self._last = {
                "prompt_tokens": int(prompt.size),
                "cached_prompt_tokens": 0,
                "prefill_seconds": 0.0,
                "generated_tokens": 0,
                "decode_seconds": 0.0,
                "time_to_first_token": None,  # seconds; None until a token is sampled
            }
            step_buf = np.empty(1, dtype=np.int32)

            def prefill(_: list[int]) -> np.ndarray:
                if steps is None:
                    last["cached_prompt_tokens"] = self._prefill(prompt)
                    logits = self._logits
                else:
                    logits = steps.prefill(ids)
                    last["cached_prompt_tokens"] = steps.cached_tokens
                last["prefill_seconds"] = time.perf_counter() - t_start
                return logits

            def decode(token: int) -> np.ndarray:
                t0 = time.perf_counter()
                if steps is None:
                    step_buf[0] = token
                    self._eval(step_buf, self._logits, all_logits=False)
                    logits = self._logits
                else:
                    logits = steps.decode(token)
                last["decode_seconds"] += time.perf_counter() - t0
                return logits

            def first_token() -> None:
                last["time_to_first_token"] = time.perf_counter() - t_start

            with _NativeSampler(self._lib, sp, self.info.n_vocab, ids) as sampler:
                step = Step(
                    prefill,
                    decode,
                    sampler,
                    self.tokenizer.incremental_decoder(skip_special_tokens=True),
                    self.tokenizer.token_text,
                    self._stop_ids(stops),
                    first_token,
                    constraint,
                    lambda: last["cached_prompt_tokens"],
                )
                for ev in generation_events(
                    step,
                    ids,
                    max_tokens=max_tokens,
                    context_length=self.context_length,
                    stop=stops,
                    logprobs=logprobs,
                ):
                    last["generated_tokens"] += 1
                    yield ev

    @property
    def last_request(self) -> dict[str, Any]:
        """The last generation's figures (stats()["last"]): prompt_tokens, cached_prompt_tokens (the
        prompt's prefix the KV cache already held), prefill_seconds, generated_tokens, ..."""
        return dict(self._last)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id)

    def special_tokens(self) -> dict[str, str]:
        tok = self.tokenizer
        return {"bos_token": tok.bos_token or "", "eos_token": tok.eos_token or ""}

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text the model's chat template makes of `messages`."""
        if not self.chat_template:
            raise CapabilityError(
                f"model {self.name!r} has no chat template; set chat_template in its colibri.toml alias"
            )
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.tokenizer.bos_token,
            eos_token=self.tokenizer.eos_token,
            model_name=self.name,
            **extra,
        )

    apply_chat_template = render_chat  # the transformers spelling

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, Any]], **extra: Any) -> list[int]:
        # The template writes BOS and the role markers itself, so nothing is added around it.
        return self.tokenize(self.render_chat(messages, **extra), add_special_tokens=False)

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
            out["device"] = self._lib.colibri_device_name(self._ctx).decode(errors="replace")
            out["last"] = dict(self._last)
            out["memory_plan"] = self.memory_plan()
            out.update(self.prefix_cache.stats())
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
    out["pipeline"] = pipeline_timeline(s)
    return out


def pipeline_timeline(s: _native.StatsC) -> dict[str, Any]:
    """The streaming pipeline's timeline (native/src/timeline.h): per stage (io: the expert store's
    reads; stage: copies into device staging buffers; compute: the backend's products) its busy
    seconds and share of the span, and the seconds two stages were busy at once. All zero when
    nothing streams."""
    span = s.pipe_span_seconds
    stages = {}
    for name in ("io", "stage", "compute"):
        busy = getattr(s, f"pipe_{name}_seconds")
        stages[name] = {
            "busy_seconds": busy,
            "busy_share": busy / span if span > 0 else 0.0,
            "intervals": getattr(s, f"pipe_{name}_intervals"),
        }
    overlap = {
        "io_stage": s.pipe_io_stage_overlap_seconds,
        "stage_compute": s.pipe_stage_compute_overlap_seconds,
        "io_compute": s.pipe_io_compute_overlap_seconds,
    }
    busy_sum = sum(v["busy_seconds"] for v in stages.values())
    return {
        "span_seconds": span,
        "any_busy_seconds": s.pipe_any_busy_seconds,
        "stages": stages,
        "overlap_seconds": overlap,
        # busy time beyond the wall time some stage was busy: 0 when the stages ran one after another
        "overlapped_seconds": busy_sum - s.pipe_any_busy_seconds if busy_sum else 0.0,
    }


def _options(options: LoadOptions | None, keywords: dict[str, Any], default: LoadOptions) -> LoadOptions:
    """A LoadOptions from an object or from keyword arguments (one or the other)."""
    if options is not None:
        if keywords:
            raise TypeError(f"give a LoadOptions or keyword options, not both ({', '.join(keywords)})")
        if not isinstance(options, LoadOptions):
            raise TypeError(f"options must be a LoadOptions, got {type(options).__name__}")
        return options
    return replace(default, **keywords) if keywords else default


def lookahead_arrays(
    ids: np.ndarray, lookahead_ids: np.ndarray, lookahead_probs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Recorded lookahead guesses as the C API takes them (int32 ids, float32 probabilities), checked to be
    [T, n_layer, depth, k] for the routing ids [T, n_layer, k] they were recorded with."""
    la_ids = np.ascontiguousarray(lookahead_ids, dtype=np.int32)
    la_probs = np.ascontiguousarray(lookahead_probs, dtype=np.float32)
    shape = la_ids.shape
    if len(shape) != 4 or la_probs.shape != shape or shape[:2] != ids.shape[:2] or shape[3] != ids.shape[2]:
        raise ValueError(
            f"lookahead guesses {shape} and {la_probs.shape} do not fit the routing {ids.shape}: they "
            "must be [T, n_layer, depth, k]"
        )
    return la_ids, la_probs


def replay_routing(
    model: str | os.PathLike[str],
    tokens: Sequence[int] | np.ndarray,
    expert_ids: np.ndarray,
    options: LoadOptions | None = None,
    *,
    streams: int = 1,
    lookahead_ids: np.ndarray | None = None,
    lookahead_probs: np.ndarray | None = None,
    **keywords: Any,
) -> dict[str, Any]:
    """Replay a recorded routing (expert_ids [T, n_layer, k], tokens [T]; a RoutingTrace's ids and
    tokens) through the expert store ``options`` (a LoadOptions, or its fields as keywords) set up,
    each token one decode step, without running the model (colibri_replay_routing). Returns the
    counters as Model.stats() names them (expert_hits, expert_misses, prefetch_*,
    expert_stall_seconds, hashed_*, ...). The lookahead predictor needs hidden states: it is
    replayed only from recorded guesses, ``lookahead_ids`` and ``lookahead_probs`` [T, n_layer, D, k]
    (a RoutingTrace's; colibri_replay_routing_lookahead), with prefetch "lookahead" and its
    lookahead_depth (at most D) and lookahead_confidence. The store
    must stream: give expert_slots or a memory_budget smaller than the model (the default here is 0,
    which holds every expert and is refused).

    ``streams`` N > 1 replays the routing as N sequences decoding together (colibri_backend.replay.interleave:
    N consecutive parts of the trace, one token of each per step), every step one batched decode step whose
    layers take the union of the N tokens' experts (colibri_replay_routing with n_seq N; no prefetch, as
    live).
    The optimum is then Belady's on those unions."""
    opts = _options(options, keywords, LoadOptions(memory_budget=0))
    path = resolve_model(model).gguf
    ids = np.ascontiguousarray(expert_ids, dtype=np.int32)
    toks = np.ascontiguousarray(tokens, dtype=np.int32)
    if ids.ndim != 3 or toks.shape != (ids.shape[0],):
        raise ValueError(f"expert_ids {ids.shape} and tokens {toks.shape} must be [T, n_layer, k] and [T]")
    if streams < 1:
        raise ValueError(f"streams must be at least 1, got {streams}")
    guesses = None
    if lookahead_ids is not None or lookahead_probs is not None:
        if lookahead_ids is None or lookahead_probs is None or streams > 1:
            raise ValueError("lookahead guesses need both lookahead_ids and lookahead_probs, and streams 1")
        guesses = lookahead_arrays(ids, lookahead_ids, lookahead_probs)
    batch = interleave(ids, streams) if streams > 1 else None
    with _OpenModel(path) as m:
        if opts.verify:
            verify_model(m.handle, path)
        info = m.info
        if info.n_expert <= 0:
            raise ValueError(f"{path} is a dense model: there is no expert routing to replay")
        if ids.shape[1:] != (info.n_layer, info.n_expert_used):
            raise ValueError(
                f"the routing has {ids.shape[1]} layers x top-{ids.shape[2]}; {path} has "
                f"{info.n_layer} layers x top-{info.n_expert_used}"
            )
        params, profile = store_params(m.lib, m.handle, info, path, opts)
        carve_prefix_cache(m.lib, m.handle, params, opts)  # the serving engine's expert budget
        out = _native.StatsC()
        if guesses is not None:
            status = m.lib.colibri_replay_routing_lookahead(
                m.handle,
                byref(params),
                _native.i32_ptr(toks),
                _native.i32_ptr(ids),
                _native.i32_ptr(guesses[0]),
                _native.f32_ptr(guesses[1]),
                guesses[0].shape[2],
                toks.size,
                byref(out),
            )
        elif batch is None:  # one decode step per token: the token ids serve the hashed predictor
            status = m.lib.colibri_replay_routing(
                m.handle, byref(params), _native.i32_ptr(toks), _native.i32_ptr(ids), toks.size, 1, byref(out)
            )
        else:
            n = batch.shape[0] * streams
            status = m.lib.colibri_replay_routing(
                m.handle, byref(params), None, _native.i32_ptr(batch), n, streams, byref(out)
            )
        m.lib.check(status, "replay")
        result = stats_to_dict(out)
        result["n_tokens"] = int(toks.size if batch is None else batch.shape[0] * streams)
        result["streams"] = streams
        result["routing_profile"] = str(profile) if profile else None
        best = belady(ids if batch is None else batch, info.n_expert, int(result["expert_slots"]))
        result["optimal_misses"] = best.misses
        result["optimal_hit_rate"] = best.hit_rate
        result["optimal_hit_rate_preloaded"] = best.hit_rate_preloaded
        return result


def load(
    model: str | os.PathLike[str],
    options: LoadOptions | None = None,
    *,
    name: str | None = None,
    chat_template: str | None = None,
    **keywords: Any,
) -> Model:
    """Load a model: a GGUF path, a Hugging Face checkpoint directory (converted once and
    cached) or a known name such as "smollm2".

    ``options`` is a LoadOptions (colibri_backend.load_options: threads, context_length,
    memory_budget, the expert store's settings, ...); its fields may be given as keywords instead:
    ``load("smollm2", threads=2, memory_budget="1G")``. Each is checked once, when the LoadOptions is
    made. ``name`` and ``chat_template`` override what the file says."""
    opts = _options(options, keywords, LoadOptions())
    resolved = resolve_model(model)
    return Model(
        resolved.gguf,
        opts,
        hf_dir=resolved.hf_dir,
        name=name or resolved.name or None,
        chat_template=chat_template,
    )
