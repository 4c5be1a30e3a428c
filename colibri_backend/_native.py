"""ctypes binding of native/include/colibri.h.

The structs below mirror the C header field for field; `check()` turns a colibri_status into
the matching exception from colibri_backend.errors, carrying colibri_last_error().

Where the library comes from, first match wins:
  1. $COLIBRI_LIB (a path to libcolibri.so),
  2. next to the package (a wheel, or `pip install -e .`, puts a copy in site-packages/colibri_backend/),
  3. <repo>/build/*/libcolibri.so (a development build tree).
Functions are bound on first use, so a library that lacks some symbol (a partial development
build) still serves the ones it has; calling a missing one raises EngineError naming it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from ctypes import (
    POINTER,
    Structure,
    c_char,
    c_char_p,
    c_double,
    c_float,
    c_int,
    c_int32,
    c_size_t,
    c_uint64,
    c_void_p,
)
from pathlib import Path
from typing import Any

import numpy as np

from colibri_backend.errors import (
    BudgetError,
    ContextFullError,
    EngineError,
    ModelFormatError,
    UnsupportedModelError,
)

ABI_VERSION = 8
LIB_NAME = "libcolibri.so"

# colibri_status values
OK = 0
E_INVALID_ARG = 1
E_IO = 2
E_FORMAT = 3
E_UNSUPPORTED = 4
E_NOMEM = 5
E_CONTEXT_FULL = 6
E_BUDGET = 7
E_INTERNAL = 8

STATUS_NAMES = {
    OK: "COLIBRI_OK",
    E_INVALID_ARG: "COLIBRI_E_INVALID_ARG",
    E_IO: "COLIBRI_E_IO",
    E_FORMAT: "COLIBRI_E_FORMAT",
    E_UNSUPPORTED: "COLIBRI_E_UNSUPPORTED",
    E_NOMEM: "COLIBRI_E_NOMEM",
    E_CONTEXT_FULL: "COLIBRI_E_CONTEXT_FULL",
    E_BUDGET: "COLIBRI_E_BUDGET",
    E_INTERNAL: "COLIBRI_E_INTERNAL",
}

_STATUS_ERRORS: dict[int, type[EngineError]] = {
    E_FORMAT: ModelFormatError,
    E_UNSUPPORTED: UnsupportedModelError,
    E_CONTEXT_FULL: ContextFullError,
    E_BUDGET: BudgetError,
}


class ModelInfoC(Structure):
    _fields_ = [
        ("arch", c_char * 32),
        ("n_vocab", c_int32),
        ("n_ctx_train", c_int32),
        ("n_embd", c_int32),
        ("n_layer", c_int32),
        ("n_head", c_int32),
        ("n_head_kv", c_int32),
        ("head_dim", c_int32),
        ("n_ff", c_int32),
        ("n_expert", c_int32),
        ("n_expert_used", c_int32),
        ("n_ff_exp", c_int32),
        ("n_ff_shexp", c_int32),
        ("bos_token_id", c_int32),
        ("eos_token_id", c_int32),
        ("n_params", c_uint64),
        ("file_bytes", c_uint64),
    ]


class ContextParamsC(Structure):
    _fields_ = [
        ("n_threads", c_int32),
        ("n_ctx", c_int32),
        ("n_batch", c_int32),
        ("memory_budget", c_uint64),
        ("expert_policy", c_int32),
        ("prefetch", c_int32),
        ("kv_type", c_int32),
        ("expert_slots", c_int32),
        ("lookahead_depth", c_int32),
        ("routing_profile", c_char_p),
        ("pin_experts", c_int32),
        ("route_prefilter_margin", c_float),
        ("drop_cold_share", c_float),
        ("n_seq_max", c_int32),
        ("backend", c_int32),
        ("expert_mass", c_float),
        ("lowbit_experts", c_char_p),
        ("lowbit_weight", c_float),
        ("lookahead_confidence", c_float),
    ]


# expert cache policies and prefetch flags (colibri.h)
POLICY_LFU = 0
POLICY_LRU = 1
POLICY_REUSE = 2
PREFETCH_NONE = 0
PREFETCH_LOOKAHEAD = 1
PREFETCH_TEMPORAL = 2
PREFETCH_HASHED = 4
# KV cache element types (colibri.h COLIBRI_KV_*)
KV_DEFAULT = 0
KV_F16 = 1
KV_INT8 = 2
# compute backends (colibri.h COLIBRI_BACKEND_*; native/src/backend.h)
BACKEND_DEFAULT = 0
BACKEND_CPU = 1
BACKEND_OPENCL = 2


class MemoryPlanC(Structure):
    _fields_ = [
        ("budget", c_uint64),
        ("metadata_bytes", c_uint64),
        ("resident_weight_bytes", c_uint64),
        ("model_table_bytes", c_uint64),
        ("kv_bytes", c_uint64),
        ("scratch_bytes", c_uint64),
        ("context_bytes", c_uint64),
        ("store_table_bytes", c_uint64),
        ("expert_total_bytes", c_uint64),
        ("expert_slot_bytes", c_uint64),
        ("expert_bytes", c_uint64),
        ("total_bytes", c_uint64),
        ("min_budget", c_uint64),
        ("n_expert_total", c_int32),
        ("n_expert_slots", c_int32),
        ("min_expert_slots", c_int32),
        ("all_resident", c_int32),
        ("fits", c_int32),
        ("state_bytes", c_uint64),
        ("device_buffer_bytes", c_uint64),
        ("device_staging_bytes", c_uint64),
        ("max_expert_slots", c_int32),
    ]


class ExpertStatsC(Structure):
    _fields_ = [
        ("layer", c_int32),
        ("expert", c_int32),
        ("calls", c_uint64),
        ("hits", c_uint64),
        ("misses", c_uint64),
        ("prefetch_issued", c_uint64),
        ("prefetch_used", c_uint64),
        ("prefetch_wasted", c_uint64),
        ("bytes_read", c_uint64),
        ("stall_seconds", c_double),
        ("resident", c_int32),
        ("reserved", c_int32),
    ]


class StatsC(Structure):
    _fields_ = [
        ("n_prompt_tokens", c_uint64),
        ("n_decode_tokens", c_uint64),
        ("prefill_seconds", c_double),
        ("decode_seconds", c_double),
        ("n_eval_calls", c_uint64),
        ("allocs_total", c_uint64),
        ("allocs_last_eval", c_uint64),
        ("kv_bytes", c_uint64),
        ("scratch_bytes", c_uint64),
        ("scratch_peak_bytes", c_uint64),
        ("weight_bytes", c_uint64),
        ("memory_budget", c_uint64),
        ("planned_bytes", c_uint64),
        ("expert_slots", c_uint64),
        ("expert_calls", c_uint64),
        ("expert_hits", c_uint64),
        ("expert_misses", c_uint64),
        ("prefetch_issued", c_uint64),
        ("prefetch_used", c_uint64),
        ("prefetch_wasted", c_uint64),
        ("expert_bytes_read", c_uint64),
        ("expert_stall_seconds", c_double),
        ("lookahead_predicted", c_uint64),
        ("lookahead_correct", c_uint64),
        ("lookahead_actual", c_uint64),
        ("temporal_predicted", c_uint64),
        ("temporal_correct", c_uint64),
        ("temporal_actual", c_uint64),
        ("hashed_predicted", c_uint64),
        ("hashed_correct", c_uint64),
        ("hashed_actual", c_uint64),
        ("prefetch_wasted_bytes", c_uint64),
        ("expert_stall_decode_seconds", c_double),
        ("prefilter_rows", c_uint64),
        ("prefilter_accepted", c_uint64),
        ("experts_pinned", c_int32),
        ("experts_dropped", c_int32),
        ("backend", c_int32),
        ("pipe_io_seconds", c_double),
        ("pipe_stage_seconds", c_double),
        ("pipe_compute_seconds", c_double),
        ("pipe_io_stage_overlap_seconds", c_double),
        ("pipe_stage_compute_overlap_seconds", c_double),
        ("pipe_io_compute_overlap_seconds", c_double),
        ("pipe_any_busy_seconds", c_double),
        ("pipe_span_seconds", c_double),
        ("pipe_io_intervals", c_uint64),
        ("pipe_stage_intervals", c_uint64),
        ("pipe_compute_intervals", c_uint64),
        ("device_uploaded_bytes", c_uint64),
        ("device_staged_bytes", c_uint64),
        ("device_jobs", c_uint64),
        ("device_cpu_jobs", c_uint64),
        ("device_errors", c_uint64),
        ("device_buffer_bytes", c_uint64),
        ("device_readback_bytes", c_uint64),
        ("prefetch_dropped", c_uint64),
        ("major_faults_prefill", c_uint64),
        ("major_faults_decode", c_uint64),
        ("experts_computed", c_uint64),
        ("lowbit_computed", c_uint64),
        ("lowbit_bytes_read", c_uint64),
    ]


class SamplerParamsC(Structure):
    _fields_ = [
        ("temperature", c_float),
        ("top_k", c_int32),
        ("top_p", c_float),
        ("min_p", c_float),
        ("repetition_penalty", c_float),
        ("presence_penalty", c_float),
        ("frequency_penalty", c_float),
        ("penalty_last_n", c_int32),
        ("seed", c_uint64),
    ]


# int (*)(void *user, uint64_t done, uint64_t total, const char *tensor)
QuantizeProgressC = ctypes.CFUNCTYPE(c_int, c_void_p, c_uint64, c_uint64, c_char_p)


class QuantizeParamsC(Structure):
    _fields_ = [
        ("type", c_char_p),
        ("n_threads", c_int32),
        ("allow_requantize", c_int32),
        ("n_imatrix", c_int32),
        ("imatrix_names", POINTER(c_char_p)),
        ("imatrix_values", POINTER(POINTER(c_float))),
        ("imatrix_sizes", POINTER(ctypes.c_int64)),
        ("progress", QuantizeProgressC),
        ("progress_user", c_void_p),
        ("expert_outliers", c_float),
        ("outlier_corpus", c_char_p),
    ]


class ImatrixInfoC(ctypes.Structure):
    """colibri_imatrix_info."""

    _fields_ = [("name", ctypes.c_char * 128), ("n_cols", c_int32), ("n_mat", c_int32)]


_f32p = POINTER(c_float)
_i32p = POINTER(c_int32)

# name -> (restype, argtypes). Opaque handles travel as void pointers.
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "colibri_abi_version": (c_int, []),
    "colibri_last_error": (c_char_p, []),
    "colibri_status_name": (c_char_p, [c_int]),
    "colibri_cpu_backend": (c_char_p, []),
    "colibri_set_cpu_backend": (c_int, [c_char_p]),
    "colibri_model_open": (c_int, [c_char_p, POINTER(c_void_p)]),
    "colibri_model_close": (None, [c_void_p]),
    "colibri_model_get_info": (c_int, [c_void_p, POINTER(ModelInfoC)]),
    "colibri_context_default_params": (None, [POINTER(ContextParamsC)]),
    "colibri_context_new": (c_int, [c_void_p, POINTER(ContextParamsC), POINTER(c_void_p)]),
    "colibri_context_free": (None, [c_void_p]),
    "colibri_plan": (c_int, [c_char_p, POINTER(ContextParamsC), POINTER(MemoryPlanC)]),
    "colibri_plan_model": (c_int, [c_void_p, POINTER(ContextParamsC), POINTER(MemoryPlanC)]),
    "colibri_get_memory_plan": (c_int, [c_void_p, POINTER(MemoryPlanC)]),
    "colibri_get_expert_stats": (c_int, [c_void_p, POINTER(ExpertStatsC), c_int32, _i32p]),
    "colibri_context_n_ctx": (c_int32, [c_void_p]),
    "colibri_n_past": (c_int32, [c_void_p]),
    "colibri_truncate": (c_int, [c_void_p, c_int32]),
    "colibri_state_size": (c_int, [c_void_p, c_int32, POINTER(c_size_t)]),
    "colibri_state_save": (c_int, [c_void_p, c_int32, c_void_p, c_size_t, POINTER(c_size_t)]),
    "colibri_state_load": (c_int, [c_void_p, c_void_p, c_size_t]),
    "colibri_seq_state_size": (c_int, [c_void_p, c_int32, c_int32, POINTER(c_size_t)]),
    "colibri_seq_state_save": (c_int, [c_void_p, c_int32, c_int32, c_void_p, c_size_t, POINTER(c_size_t)]),
    "colibri_seq_state_load": (c_int, [c_void_p, c_int32, c_void_p, c_size_t]),
    "colibri_state_reach": (c_int32, [c_void_p]),
    "colibri_eval": (c_int, [c_void_p, _i32p, c_int32, _f32p, c_int32]),
    # (ctx, seq_ids, tokens, n_tokens, want_logits uint8[n_tokens] or NULL, logits)
    "colibri_eval_batch": (c_int, [c_void_p, _i32p, _i32p, c_int32, c_void_p, _f32p]),
    "colibri_n_seq_max": (c_int32, [c_void_p]),
    "colibri_seq_n_past": (c_int32, [c_void_p, c_int32]),
    "colibri_seq_truncate": (c_int, [c_void_p, c_int32, c_int32]),
    "colibri_get_routing": (c_int, [c_void_p, _i32p, _f32p, c_int32, _i32p]),
    "colibri_get_stats": (c_int, [c_void_p, POINTER(StatsC)]),
    # (model, params, tokens or NULL, expert_ids [n_tokens][L][k], n_tokens, n_seq, out)
    "colibri_replay_routing": (
        c_int,
        [
            c_void_p,
            POINTER(ContextParamsC),
            POINTER(c_int32),
            POINTER(c_int32),
            c_int32,
            c_int32,
            POINTER(StatsC),
        ],
    ),
    # (model, params, tokens or NULL, expert_ids, lookahead_ids, lookahead_probs, depth, n_tokens, out)
    "colibri_replay_routing_lookahead": (
        c_int,
        [
            c_void_p,
            POINTER(ContextParamsC),
            POINTER(c_int32),
            POINTER(c_int32),
            POINTER(c_int32),
            POINTER(c_float),
            c_int32,
            c_int32,
            POINTER(StatsC),
        ],
    ),
    "colibri_record_lookahead": (c_int, [c_void_p, c_int32]),
    "colibri_get_lookahead": (c_int, [c_void_p, _i32p, _f32p, c_int32, _i32p, _i32p]),
    "colibri_reset_stats": (None, [c_void_p]),
    "colibri_device_name": (c_char_p, [c_void_p]),
    "colibri_debug_route_override": (c_int, [c_void_p, _i32p, _f32p, c_int32]),
    "colibri_debug_route_override_lookahead": (c_int, [c_void_p, _i32p, _f32p, c_int32]),
    "colibri_debug_route_override_tokens": (c_int, [c_void_p, _i32p]),
    "colibri_sampler_default_params": (None, [POINTER(SamplerParamsC)]),
    "colibri_sampler_new": (c_int, [POINTER(SamplerParamsC), c_int32, POINTER(c_void_p)]),
    "colibri_sampler_free": (None, [c_void_p]),
    "colibri_sampler_set_logit_bias": (c_int, [c_void_p, c_int32, c_float]),
    "colibri_sampler_accept": (c_int, [c_void_p, c_int32]),
    "colibri_sampler_reset": (None, [c_void_p]),
    "colibri_sampler_sample": (c_int, [c_void_p, _f32p, _i32p]),
    # (sampler, uint32 words of the allowed-token bitmask or NULL, number of words)
    "colibri_sampler_set_allowed": (c_int, [c_void_p, c_void_p, c_int32]),
    "colibri_dequantize": (c_int, [c_int32, c_void_p, c_size_t, _f32p, c_size_t]),
    "colibri_quantize_row": (c_int, [c_int32, _f32p, c_size_t, c_size_t, _f32p, c_void_p, c_size_t]),
    "colibri_quantize_default_params": (None, [POINTER(QuantizeParamsC)]),
    "colibri_quantize_types": (c_char_p, []),
    "colibri_quantize": (c_int, [c_char_p, c_char_p, POINTER(QuantizeParamsC)]),
    "colibri_imatrix_start": (c_int, [c_void_p]),
    "colibri_imatrix_stop": (None, [c_void_p]),
    "colibri_imatrix_count": (c_int32, [c_void_p]),
    "colibri_imatrix_get": (
        c_int,
        [c_void_p, c_int32, POINTER(ImatrixInfoC), POINTER(ctypes.c_double), POINTER(ctypes.c_uint64)],
    ),
    "colibri_write_digests": (c_int, [c_char_p]),
    "colibri_lowbit_write": (c_int, [c_char_p, c_char_p, c_char_p, c_int32]),
    "colibri_verify_file": (c_int, [c_char_p, c_char_p, c_size_t, _i32p]),
    "colibri_model_verify": (c_int, [c_void_p, c_char_p, c_size_t, _i32p]),
}


class Library:
    """A loaded libcolibri with its functions bound on first use (`lib.colibri_eval(...)`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._dll = ctypes.CDLL(str(path))
        except OSError as exc:
            raise EngineError("COLIBRI_E_IO", f"cannot load the Colibri library {path}: {exc}") from exc
        self._bound: dict[str, Any] = {}

    def has(self, name: str) -> bool:
        return hasattr(self._dll, name)

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("colibri_"):
            raise AttributeError(name)
        bound = self.__dict__.get("_bound", {})
        if name in bound:
            return bound[name]
        if name not in _SIGNATURES:
            raise AttributeError(f"{name} is not part of colibri.h")
        try:
            fn = getattr(self._dll, name)
        except AttributeError:
            raise EngineError(
                "COLIBRI_E_INTERNAL",
                f"{self.path} does not export {name}; rebuild the native library (pip install -e .)",
            ) from None
        restype, argtypes = _SIGNATURES[name]
        fn.restype = restype
        fn.argtypes = argtypes
        bound[name] = fn
        return fn

    def last_error(self) -> str:
        if not self.has("colibri_last_error"):
            return ""
        raw = self.colibri_last_error()
        return raw.decode("utf-8", "replace") if raw else ""

    def status_name(self, status: int) -> str:
        if status in STATUS_NAMES:
            return STATUS_NAMES[status]
        return f"COLIBRI_STATUS_{status}"

    def check(self, status: int, what: str = "") -> None:
        """Raise the exception matching a non-OK status, with the engine's message."""
        if status == OK:
            return
        message = self.last_error() or what
        if what and message != what:
            message = f"{what}: {message}"
        cls = _STATUS_ERRORS.get(status, EngineError)
        raise cls(self.status_name(status), message)


def _candidate_paths() -> list[Path]:
    env = os.environ.get("COLIBRI_LIB")
    if env:
        return [Path(env)]
    found: list[Path] = []
    import colibri_backend

    # An editable install lists both the site-packages copy and the source tree here.
    for entry in getattr(colibri_backend, "__path__", []):
        found.append(Path(entry) / LIB_NAME)
    repo = Path(__file__).resolve().parent.parent
    build = repo / "build"
    if build.is_dir():
        found.extend(sorted(build.glob(f"*/{LIB_NAME}"), key=lambda p: p.stat().st_mtime, reverse=True))
    return found


_lib: Library | None = None
_lib_lock = threading.Lock()


def find_library() -> Path:
    """Path of the libcolibri.so that load_library() would use."""
    env = os.environ.get("COLIBRI_LIB")
    candidates = _candidate_paths()
    for path in candidates:
        if path.is_file():
            return path
    if env:
        raise EngineError("COLIBRI_E_IO", f"COLIBRI_LIB={env} does not exist")
    where = ", ".join(str(p) for p in candidates) or "(nowhere)"
    raise EngineError(
        "COLIBRI_E_IO",
        f"the Colibri native library ({LIB_NAME}) was not found; looked in {where}. "
        "Install the package with `pip install .` (it builds the library) or set COLIBRI_LIB.",
    )


def load_library() -> Library:
    """Load libcolibri once per process and check its ABI version."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        lib = Library(find_library())
        if not lib.has("colibri_abi_version"):
            raise EngineError(
                "COLIBRI_E_INTERNAL",
                f"{lib.path} does not export colibri_abi_version: not a complete Colibri library build",
            )
        version = int(lib.colibri_abi_version())
        if version != ABI_VERSION:
            raise EngineError(
                "COLIBRI_E_INTERNAL",
                f"{lib.path} has ABI version {version} but this colibri_backend expects {ABI_VERSION}; "
                "reinstall the package so the library and the Python code match",
            )
        _lib = lib
        return lib


def cpu_backend() -> str:
    """Kernel set the engine chose at run time (scalar, avx2, avx512, neon, neon-dotprod, neon-i8mm)."""
    lib = load_library()
    return lib.colibri_cpu_backend().decode()


def set_cpu_backend(name: str) -> None:
    lib = load_library()
    lib.check(lib.colibri_set_cpu_backend(name.encode()), f"set_cpu_backend({name!r})")


def dequantize(type_id: int, raw: bytes | bytearray | memoryview | np.ndarray, n_elements: int) -> np.ndarray:
    """Dequantize n_elements of GGUF tensor type `type_id` from `raw` with the engine's code."""
    lib = load_library()
    if n_elements < 0:
        raise ValueError("n_elements must be >= 0")
    src = np.frombuffer(bytes(raw) if not isinstance(raw, np.ndarray) else raw.tobytes(), dtype=np.uint8)
    out = np.empty(n_elements, dtype=np.float32)
    src_ptr = src.ctypes.data_as(c_void_p) if src.size else None
    status = lib.colibri_dequantize(int(type_id), src_ptr, src.size, out.ctypes.data_as(_f32p), n_elements)
    lib.check(status, f"dequantize(type={type_id}, n={n_elements})")
    return out


def f32_ptr(a: np.ndarray) -> Any:
    return a.ctypes.data_as(_f32p)


def i32_ptr(a: np.ndarray) -> Any:
    return a.ctypes.data_as(_i32p)
