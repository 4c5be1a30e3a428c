"""The native engine through its C API (ctypes): correctness against a float64 numpy reference on tiny
random GGUF models of every architecture, and the engine's contracts — no heap allocation per decode
step, context-full errors that change nothing, prefix reuse, chunked prefill, thread-count invariance,
routing records, clear errors for bad or unsupported files."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_reference import RefModel, make_tiny_model, reference_forward
from native_engine import LIB, Engine

from colibri_backend import _native as N
from colibri_backend.errors import ContextFullError, EngineError, ModelFormatError, UnsupportedModelError


def _tokens(ref: RefModel, n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(0, ref.hp["n_vocab"], n).tolist()


def _rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - ref).max() / np.abs(ref).max())


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _engine_vs_reference(
    path: Path, toks: list[int], want: np.ndarray, **engine: Any
) -> tuple[np.ndarray, float]:
    """KL(reference || engine) at every position of toks, and the share of positions whose argmax agrees."""
    eng = Engine(path, **engine)
    try:
        got = eng.eval(toks)
    finally:
        eng.close()
    lp, lq = _log_softmax(want), _log_softmax(got)
    return (np.exp(lp) * (lp - lq)).sum(-1), float((got.argmax(-1) == want.argmax(-1)).mean())


ARCHS = ["llama", "mixtral", "qwen2moe", "qwen3moe", "olmoe"]

# (arch, shape overrides): awkward shapes — head_dim != n_embd / n_head, GQA ratios 1, 2 and 4, partial
# rotary, tied output, renormalisation on and off against the architecture's default.
SHAPES = [
    ("llama", {}),
    ("llama", {"n_head": 8, "n_head_kv": 2, "head_dim": 12, "tied": True}),
    ("mixtral", {}),
    (
        "mixtral",
        {"n_head": 4, "n_head_kv": 4, "head_dim": 16, "n_expert": 8, "n_expert_used": 3, "tied": True},
    ),
    ("qwen2moe", {}),
    ("qwen2moe", {"norm": True, "n_ff_shexp": 48, "n_rot": 16}),
    ("qwen3moe", {}),
    (
        "qwen3moe",
        {"norm": False, "n_head": 8, "n_head_kv": 2, "head_dim": 20, "n_expert": 16, "n_expert_used": 4},
    ),
    ("olmoe", {}),
    ("olmoe", {"norm": True, "n_head_kv": 4, "tied": True, "n_rot": 8}),
]


@pytest.mark.parametrize(("arch", "shape"), SHAPES, ids=[f"{a}-{i}" for i, (a, _) in enumerate(SHAPES)])
def test_f32_logits_and_routing_match_reference(tmp_path: Path, arch: str, shape: dict) -> None:
    ref = make_tiny_model(tmp_path / "m.gguf", arch, **shape)
    toks = _tokens(ref, 64)
    want, want_ids, want_w = reference_forward(ref, toks)
    eng = Engine(tmp_path / "m.gguf", n_batch=24)  # three chunks: routing must cover all 64 tokens
    try:
        got = eng.eval(toks)
        assert _rel_err(got, want) <= 1e-4
        assert (got.argmax(-1) == want.argmax(-1)).all()
        if arch != "llama":
            ids, wts = eng.routing(64)
            assert ids.shape == (64, ref.hp["n_layer"], ref.hp["n_expert_used"])
            assert (ids == want_ids).all()
            np.testing.assert_allclose(wts, want_w, atol=1e-5)
    finally:
        eng.close()


@pytest.mark.parametrize("wtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("arch", ["llama", "mixtral", "qwen3moe"])
def test_quantized_weights_close_to_reference(tmp_path: Path, arch: str, wtype: str) -> None:
    # The reference runs the very values the file holds (dequantized) with an F16 KV cache; what remains
    # is the engine's own rounding: int8 activations for quantized weights, f32 accumulation.
    ref = make_tiny_model(tmp_path / "m.gguf", arch, wtype=wtype)
    toks = _tokens(ref, 64)
    want = reference_forward(ref, toks, kv_f16=True)[0]
    kl, top1 = _engine_vs_reference(tmp_path / "m.gguf", toks, want)
    if wtype in ("F16", "BF16"):
        assert kl.mean() <= 1e-4 and top1 == 1.0
    else:
        # int8 activations occasionally flip a near-tie in a random router, and a random model's
        # experts disagree wildly, so a few positions diverge; the typical position must not
        assert np.median(kl) <= 3e-3 and top1 >= 0.9


# The formats added with the K-quants, each on its own and in llama.cpp-style mixes (Q4_K_M: Q4_K with
# Q6_K for attn_v / ffn_down / output and Q5_0 / Q8_0 fallbacks; IQ4_XS with Q5_K and IQ4_NL). Rows are
# 256 wide so every super-block format fits; the router and norms stay F32.
K_SHAPE = {"n_embd": 256, "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_ff_exp": 256, "n_layer": 2}
MIXES = {
    "q4_k_m": (
        "Q4_K",
        {
            "blk.0.attn_v.weight": "Q6_K",
            "blk.1.attn_v.weight": "Q6_K",
            "output.weight": "Q6_K",
            "blk.0.ffn_down_exps.weight": "Q6_K",
            "blk.0.attn_q.weight": "Q5_0",
            "blk.1.attn_k.weight": "Q8_0",
        },
    ),
    "iq4_xs": ("IQ4_XS", {"blk.0.ffn_down_exps.weight": "Q5_K", "blk.1.attn_output.weight": "IQ4_NL"}),
    "q3_k_m": (
        "Q3_K",
        {"blk.0.attn_v.weight": "Q5_K", "blk.1.ffn_down_exps.weight": "Q4_K", "output.weight": "Q6_K"},
    ),
    "q2_k": (
        "Q2_K",
        {"blk.0.ffn_down_exps.weight": "Q3_K", "output.weight": "Q6_K", "blk.1.attn_q.weight": "Q4_1"},
    ),
    "q5_1": ("Q5_1", {"blk.0.attn_v.weight": "Q4_0"}),
    "mxfp4": ("MXFP4", {"blk.1.attn_v.weight": "Q5_0", "output.weight": "Q8_0"}),
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_k_quant_mixes_close_to_reference(tmp_path: Path, mix: str) -> None:
    wtype, overrides = MIXES[mix]
    ref = make_tiny_model(tmp_path / "m.gguf", "mixtral", wtype=wtype, tensor_types=overrides, **K_SHAPE)
    toks = _tokens(ref, 48)
    want = reference_forward(ref, toks, kv_f16=True)[0]
    kl, top1 = _engine_vs_reference(
        tmp_path / "m.gguf", toks, want, n_batch=20
    )  # prefill tiles, a partial chunk
    assert np.median(kl) <= 3e-3 and top1 >= 0.9, (float(np.median(kl)), float(top1))


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RefModel]:
    path = tmp_path_factory.mktemp("moe") / "mixtral_q8.gguf"
    return path, make_tiny_model(path, "mixtral", wtype="Q8_0", n_expert=8, n_expert_used=2)


def test_no_heap_allocation_per_decode_step(moe_file: tuple[Path, RefModel]) -> None:
    path, ref = moe_file
    eng = Engine(path, n_ctx=128, n_batch=16)
    try:
        before = eng.stats().allocs_total
        tok = _tokens(ref, 40)
        eng.eval(tok)  # prefill, in 3 chunks
        assert eng.stats().allocs_last_eval == 0
        nxt = 5
        for _ in range(50):
            nxt = int(eng.eval([nxt], all_logits=False)[0].argmax())
            assert eng.stats().allocs_last_eval == 0
        st = eng.stats()
        assert st.allocs_total == before
        assert st.n_decode_tokens == 50 and st.n_prompt_tokens == 40
        assert st.decode_seconds > 0 and st.prefill_seconds > 0
        assert 0 < st.scratch_peak_bytes <= st.scratch_bytes and st.kv_bytes > 0
    finally:
        eng.close()


def test_context_full_changes_nothing(moe_file: tuple[Path, RefModel]) -> None:
    path, ref = moe_file
    eng = Engine(path, n_ctx=32, n_batch=8)
    try:
        toks = _tokens(ref, 33)
        first = eng.eval(toks[:30])
        with pytest.raises(ContextFullError):
            eng.eval(toks[30:33])
        assert eng.n_past() == 30
        last = eng.eval(toks[30:32])
        assert eng.n_past() == 32
        with pytest.raises(ContextFullError):
            eng.eval(toks[32:33])
        eng.truncate(0)
        again = eng.eval(toks[:32])
        np.testing.assert_array_equal(again[:30], first)
        np.testing.assert_array_equal(again[30:], last)
    finally:
        eng.close()


def test_prefix_reuse_gives_identical_logits(moe_file: tuple[Path, RefModel]) -> None:
    path, ref = moe_file
    a, b = _tokens(ref, 24, seed=2), _tokens(ref, 12, seed=3)
    eng = Engine(path, n_batch=64)
    try:
        eng.eval(a)
        eng.truncate(10)
        reused = eng.eval(b)
        eng.truncate(0)
        fresh = eng.eval(a[:10] + b)
        np.testing.assert_array_equal(reused, fresh[10:])
        with pytest.raises(EngineError):
            eng.truncate(eng.n_past() + 1)
    finally:
        eng.close()


def test_all_logits_last_logits_and_chunking_agree(moe_file: tuple[Path, RefModel]) -> None:
    path, ref = moe_file
    toks = _tokens(ref, 37)
    big = Engine(path, n_batch=64)
    small = Engine(path, n_batch=5)
    try:
        all_rows = big.eval(toks)
        big.truncate(0)
        last = big.eval(toks, all_logits=False)
        np.testing.assert_array_equal(last[0], all_rows[-1])
        big_ids, big_w = big.routing(64)
        chunked = small.eval(toks)
        # same math; only the int8 blocks of the batched kernels may group sums differently
        np.testing.assert_allclose(chunked, all_rows, atol=1e-4 * np.abs(all_rows).max())
        assert (chunked.argmax(-1) == all_rows.argmax(-1)).all()
        small_ids, small_w = small.routing(64)
        assert small_ids.shape[0] == big_ids.shape[0] == len(toks)
        assert (small_ids == big_ids).all()
        np.testing.assert_allclose(small_w, big_w, atol=1e-5)
        # token by token (decode path) against the batch
        small.truncate(0)
        steps = np.concatenate([small.eval([t]) for t in toks])
        np.testing.assert_allclose(steps, all_rows, atol=1e-4 * np.abs(all_rows).max())
    finally:
        big.close()
        small.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2moe"])
def test_thread_counts_agree(tmp_path: Path, arch: str) -> None:
    ref = make_tiny_model(tmp_path / "m.gguf", arch, wtype="Q8_0")
    toks = _tokens(ref, 20)
    outs = []
    for threads in (1, 2, 3):
        eng = Engine(tmp_path / "m.gguf", threads=threads)
        try:
            outs.append(np.concatenate([eng.eval(toks[:12]), eng.eval(toks[12:13]), eng.eval(toks[13:])]))
        finally:
            eng.close()
    for other in outs[1:]:
        assert (other.argmax(-1) == outs[0].argmax(-1)).all()
        np.testing.assert_allclose(other, outs[0], atol=1e-5 * np.abs(outs[0]).max())


def test_routing_records_last_eval(tmp_path: Path) -> None:
    ref = make_tiny_model(tmp_path / "q3.gguf", "qwen3moe", n_expert=8, n_expert_used=3, norm=True)
    toks = _tokens(ref, 10)
    eng = Engine(tmp_path / "q3.gguf")
    try:
        eng.eval(toks)
        ids, wts = eng.routing(100)
        assert ids.shape == (10, ref.hp["n_layer"], 3)
        np.testing.assert_allclose(wts.sum(-1), 1.0, atol=1e-6)
        assert ((ids >= 0) & (ids < 8)).all()
        assert all(len(set(row)) == 3 for row in ids.reshape(-1, 3).tolist())
        eng.eval(toks[:1])
        one_ids, _ = eng.routing(100)
        assert one_ids.shape[0] == 1
        limited, _ = eng.routing(0)
        assert limited.shape[0] == 0
    finally:
        eng.close()
    ref = make_tiny_model(tmp_path / "ol.gguf", "olmoe", norm=False)
    eng = Engine(tmp_path / "ol.gguf")
    try:
        eng.eval(toks)
        _, wts = eng.routing(10)
        assert (wts.sum(-1) < 1.0).all()  # top-k of a softmax, not renormalised
        assert np.all(np.diff(wts, axis=-1) <= 0)  # largest first
    finally:
        eng.close()
    make_tiny_model(tmp_path / "dense.gguf", "llama")
    eng = Engine(tmp_path / "dense.gguf")
    try:
        eng.eval(toks)
        ids, _ = eng.routing(10)
        assert ids.shape[0] == 0
    finally:
        eng.close()


def test_model_info(tmp_path: Path) -> None:
    make_tiny_model(tmp_path / "q2.gguf", "qwen2moe", n_vocab=301, head_dim=24, n_ff_exp=64, n_ff_shexp=32)
    eng = Engine(tmp_path / "q2.gguf", n_ctx=100)
    try:
        i = eng.info
        assert i.arch == b"qwen2moe"
        assert (i.n_vocab, i.n_embd, i.n_layer, i.n_head, i.n_head_kv, i.head_dim) == (301, 64, 2, 4, 2, 24)
        assert (i.n_ff, i.n_expert, i.n_expert_used, i.n_ff_exp, i.n_ff_shexp) == (0, 6, 2, 64, 32)
        assert (i.bos_token_id, i.eos_token_id, i.n_ctx_train) == (1, 2, 512)
        assert i.n_params > 0 and i.file_bytes == (tmp_path / "q2.gguf").stat().st_size
        assert LIB.colibri_context_n_ctx(eng.ctx) == 100
    finally:
        eng.close()
    make_tiny_model(tmp_path / "mx.gguf", "mixtral")
    eng = Engine(tmp_path / "mx.gguf")
    try:
        assert eng.info.arch == b"mixtral"
    finally:
        eng.close()


def test_bad_arguments(moe_file: tuple[Path, RefModel]) -> None:
    path, ref = moe_file
    eng = Engine(path)
    try:
        with pytest.raises(EngineError, match="outside the vocabulary"):
            eng.eval([0, ref.hp["n_vocab"]])
        with pytest.raises(EngineError, match="outside the vocabulary"):
            eng.eval([-1])
        assert eng.n_past() == 0
        with pytest.raises(EngineError):
            eng.eval([])
    finally:
        eng.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"arch_name": "gpt2"}, UnsupportedModelError, "architecture 'gpt2'"),
        ({"skip_tensors": ("blk.1.attn_k.weight",)}, ModelFormatError, "blk.1.attn_k.weight is missing"),
        ({"skip_tensors": ("blk.0.ffn_up_exps.weight",)}, ModelFormatError, "ffn_up_exps.weight is missing"),
        (
            {"tensor_types": {"blk.0.attn_q.weight": "Q8_1"}},
            UnsupportedModelError,
            "attn_q.weight has type Q8_1",
        ),
    ],
)
def test_bad_models_give_clear_errors(tmp_path: Path, kwargs: dict, error: type, message: str) -> None:
    make_tiny_model(tmp_path / "bad.gguf", "mixtral", **kwargs)
    model = ctypes.c_void_p()
    status = LIB.colibri_model_open(str(tmp_path / "bad.gguf").encode(), ctypes.byref(model))
    assert status != N.OK and not model.value
    with pytest.raises(error, match=message):
        LIB.check(status)
