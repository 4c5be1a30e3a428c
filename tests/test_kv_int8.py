"""The opt-in INT8 KV cache (kv_cache_type="int8"): per (position, KV head) one float scale and
head_dim int8 values. Teacher-forced logits against the F16 cache on a tiny random model and on
SmolLM2, the ledger's byte count, zero heap allocation per decode step, and clear errors."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
from engine_reference import RefModel, make_tiny_model
from native_engine import Engine
from smollm2 import smollm2_path

import colibri_backend
from colibri_backend import _native as N
from colibri_backend.budget import parse_kv_cache_type
from colibri_backend.errors import EngineError


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl_top1(ref: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, float]:
    """Per-position KL(ref || test) and the share of positions with the same argmax."""
    a, b = _log_softmax(ref), _log_softmax(test)
    kl = (np.exp(a) * (a - b)).sum(-1)
    return kl, float((a.argmax(-1) == b.argmax(-1)).mean())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RefModel]:
    # dense and F32: no router near-ties or int8 activations to amplify the KV rounding, so the
    # KL below is the cache's own
    path = tmp_path_factory.mktemp("kv8") / "llama_f32.gguf"
    return path, make_tiny_model(path, "llama", wtype="F32")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RefModel]:
    path = tmp_path_factory.mktemp("kv8moe") / "mixtral_q8.gguf"
    return path, make_tiny_model(path, "mixtral", wtype="Q8_0", n_expert=8, n_expert_used=2)


def test_tiny_int8_kv_close_to_f16(tiny: tuple[Path, RefModel]) -> None:
    path, ref = tiny
    toks = np.random.default_rng(3).integers(0, ref.hp["n_vocab"], 100).tolist()
    logits = {}
    for kv in (N.KV_F16, N.KV_INT8):
        eng = Engine(path, kv_type=kv, n_ctx=128, n_batch=16)
        try:
            logits[kv] = eng.eval(toks)
        finally:
            eng.close()
    kl, top1 = _kl_top1(logits[N.KV_F16], logits[N.KV_INT8])
    # Per-row int8 rounding errs by up to scale/2 (0.4% of the row's largest element), some 30x
    # F16's rounding, and KL grows with the square of the logit error: measured mean KL 5e-4,
    # max 3e-3 and top-1 99% here, against 8e-7 for F16 vs F32. A wrong scale or row layout
    # gives KL of order 1.
    assert kl.mean() < 2e-3, kl.mean()
    assert top1 >= 0.95


def test_tiny_int8_plan_bytes_and_no_alloc_per_step(tiny_moe: tuple[Path, RefModel]) -> None:
    path, ref = tiny_moe
    f16 = Engine(path, kv_type=N.KV_F16, n_ctx=128, n_batch=16)
    try:
        f16_kv = f16.plan().kv_bytes
        assert f16.stats().kv_bytes == f16_kv
    finally:
        f16.close()
    eng = Engine(path, kv_type=N.KV_INT8, n_ctx=128, n_batch=16)
    try:
        hd, nkv, nl = ref.hp["head_dim"], ref.hp["n_head_kv"], ref.hp["n_layer"]
        kv = eng.plan().kv_bytes
        assert kv == 2 * nl * nkv * 128 * (hd + 4)  # int8 values plus one float scale per row
        assert eng.stats().kv_bytes == kv
        assert kv / f16_kv == pytest.approx((hd + 4) / (2 * hd))
        eng.eval(np.random.default_rng(1).integers(0, ref.hp["n_vocab"], 40).tolist())
        assert eng.stats().allocs_last_eval == 0
        nxt = 5
        for _ in range(30):
            nxt = int(eng.eval([nxt], all_logits=False)[0].argmax())
            assert eng.stats().allocs_last_eval == 0
    finally:
        eng.close()


def test_bad_kv_type_is_a_clear_error(tiny: tuple[Path, RefModel]) -> None:
    path, _ = tiny
    with pytest.raises(EngineError, match="kv_type"):
        Engine(path, kv_type=7, n_ctx=128, n_batch=16)
    for bad in ("int4", "q8", 8, ""):
        with pytest.raises(ValueError, match="kv_cache_type"):
            parse_kv_cache_type(bad)  # type: ignore[arg-type]
    assert parse_kv_cache_type(None) == N.KV_DEFAULT
    assert parse_kv_cache_type("INT8") == N.KV_INT8


def _english() -> str:
    # CPython's own licence: a fixed, ~300-token-plus English text present wherever Python is.
    lic = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if not lic.is_file():
        pytest.skip(f"{lic} not found")
    return lic.read_text()


def test_smollm2_int8_kv_against_f16() -> None:
    with pytest.raises(ValueError, match="kv_cache_type"):
        colibri_backend.load(smollm2_path(), threads=2, context_length=64, kv_cache_type="fp8")
    logits, kv_bytes = {}, {}
    for kv in ("f16", "int8"):
        m = colibri_backend.load(smollm2_path(), threads=2, context_length=512, kv_cache_type=kv)
        try:
            ids = m.tokenize(_english())[:300]
            assert len(ids) == 300
            logits[kv] = m.logits(ids)
            kv_bytes[kv] = m.memory_plan()["kv_bytes"]
            hd = m.info.head_dim
        finally:
            m.close()
    kl, top1 = _kl_top1(logits["f16"], logits["int8"])
    # Measured on this text (docs/memory.md): mean KL 0.0066, p99 0.054, top-1 96%; one absmax
    # scale per 64-wide head row is coarse for SmolLM2. 0.02 leaves room for kernel-order changes,
    # not for a broken cache (a wrong scale or layout gives KL of order 1).
    assert kl.mean() < 0.02, kl.mean()
    assert top1 >= 0.95, top1
    assert kv_bytes["int8"] / kv_bytes["f16"] == pytest.approx((hd + 4) / (2 * hd))
