"""The native engine through its raw C API (ctypes), for tests that need more than colibri_backend.Model:
exact context parameters, routing records, stats and the memory plan."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from colibri_backend import _native as N

LIB = N.load_library()


class Engine:
    """One model and one context, through the raw C API."""

    def __init__(
        self, path: str | Path, threads: int = 2, n_ctx: int = 256, n_batch: int = 64, kv_type: int = 0
    ) -> None:
        params = N.ContextParamsC(threads, n_ctx, n_batch)
        params.kv_type = kv_type
        self._open(path, params)

    def _open(self, path: str | Path, params: N.ContextParamsC) -> None:
        """Opens the model and a context with exactly `params`; a test that varies other fields builds its
        own params and calls this from its __init__."""
        self.model = ctypes.c_void_p()
        self.ctx = ctypes.c_void_p()
        LIB.check(LIB.colibri_model_open(os.fsencode(path), ctypes.byref(self.model)))
        info = N.ModelInfoC()
        LIB.check(LIB.colibri_model_get_info(self.model, ctypes.byref(info)))
        self.info = info
        status = LIB.colibri_context_new(self.model, ctypes.byref(params), ctypes.byref(self.ctx))
        if status:
            LIB.colibri_model_close(self.model)
            LIB.check(status, "context")

    def close(self) -> None:
        LIB.colibri_context_free(self.ctx)
        LIB.colibri_model_close(self.model)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def eval(self, tokens: list[int], all_logits: bool = True) -> np.ndarray:
        toks = np.asarray(tokens, dtype=np.int32)
        out = np.zeros((len(toks) if all_logits else 1, self.info.n_vocab), dtype=np.float32)
        LIB.check(LIB.colibri_eval(self.ctx, N.i32_ptr(toks), len(toks), N.f32_ptr(out), int(all_logits)))
        return out

    def n_past(self) -> int:
        return int(LIB.colibri_n_past(self.ctx))

    def truncate(self, n: int) -> None:
        LIB.check(LIB.colibri_truncate(self.ctx, n))

    def stats(self) -> N.StatsC:
        s = N.StatsC()
        LIB.check(LIB.colibri_get_stats(self.ctx, ctypes.byref(s)))
        return s

    def routing(self, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        k = max(self.info.n_expert_used, 1)
        ids = np.full((max_tokens, self.info.n_layer, k), -1, dtype=np.int32)
        wts = np.zeros((max_tokens, self.info.n_layer, k), dtype=np.float32)
        n = ctypes.c_int32()
        LIB.check(
            LIB.colibri_get_routing(self.ctx, N.i32_ptr(ids), N.f32_ptr(wts), max_tokens, ctypes.byref(n))
        )
        return ids[: n.value], wts[: n.value]

    def plan(self) -> N.MemoryPlanC:
        p = N.MemoryPlanC()
        LIB.check(LIB.colibri_get_memory_plan(self.ctx, ctypes.byref(p)))
        return p

    def expert_stats(self) -> list[N.ExpertStatsC]:
        """Every expert's record, layer-major."""
        n_total = self.info.n_layer * self.info.n_expert
        arr = (N.ExpertStatsC * n_total)()
        n = ctypes.c_int32()
        LIB.check(LIB.colibri_get_expert_stats(self.ctx, arr, n_total, ctypes.byref(n)))
        return list(arr[: n.value])
