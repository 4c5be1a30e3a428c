"""Colibri against llama.cpp on files written by llama.cpp's own quantizer (llama_model_quantize).

For each type mix (Q2_K, Q3_K_M, Q4_K_M, Q4_K_S, Q5_K_M, Q6_K, Q5_0, Q5_1, IQ4_NL, IQ4_XS, MXFP4) and two
models — the trained MoE (tools/train_moe/release: realistic routing; rows of 128 and 256, so a mix of
K-quants and llama.cpp's Q5_0/Q5_1 fallbacks) and a tiny random Mixtral whose rows are all 256 long (so the
K-quants and IQ4_XS are used for every matrix) — plus Q4_K_M and Q6_K of a tiny LFM2-MoE and Q4_K_M of a
tiny dense LFM2, both with rows of 256, the F32 conversion is quantized by llama.cpp, then run
teacher-forced over N_WINDOWS windows of N_TOKENS tokens (fresh sequences) by llama.cpp (one batched pass per
window, and token by token) and by Colibri, and the file's exact math is computed (every tensor dequantized
by the gguf package to F32, run by Colibri's F32 path). Asserted, per file:

* faithfulness to the exact math (test_vs_llama_cpp's bar): KL(exact || Colibri) <= 1.5 x KL(exact ||
  llama.cpp) + 1e-3 and top-1 agreement with exact at most 2 points below llama.cpp's;
* issue 9's bar against llama.cpp: KL(llama.cpp || Colibri) at most 2 x llama.cpp's disagreement with itself,
  and Colibri's top-1 disagreement with llama.cpp at most 2 x llama.cpp's own top-1 disagreement + 2 points.
  llama.cpp's batched and token-by-token passes round activations identically, and on these files they agree
  to 0-4e-5 in KL (often bit for bit), which would demand bit-identity with llama.cpp's rounding; so its
  disagreement with itself is taken as the larger of that and its distance from the file's exact math (its own
  activation-quantization noise). Two engines that each miss the exact top token on a few percent of positions
  miss each other's on up to the sum of both, hence a disagreement rate bounded at twice llama.cpp's (the
  issue's "within 2 points of the self-agreement" assumed SmolLM2's 97.3%, where the two readings coincide).

The tiny model has random weights and a router with gain (tiny_models.ROUTER_GAIN): a quantization error that
crosses a near-tie of two router logits switches that token's experts, and such a token alone carries a KL of
1-4 nats, deciding a 128-token mean (both engines show such flips, at different tokens). For that model the
means are taken over the tokens after dropping the FLIP_TRIM largest per-token KLs per window from each
comparison; the trained MoE is held to plain means.

Also the round trip of issue 9 item 4: `colibri convert` -> llama.cpp quantize (Q8_0, Q4_K_M) -> both engines
load the result. The measured table is in docs/conformance.md.
"""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny_models as tm
from test_vs_llama_cpp import _check_quantized, colibri_logits, exact_windows

REPO = Path(__file__).resolve().parent.parent
RELEASE = REPO / "tools" / "train_moe" / "release"
N_TOKENS = 128  # positions per window
# windows per file: consecutive N_TOKENS-token slices of the text, each a fresh sequence. On one window a
# position is 0.78 points of top-1 agreement and the bars below allow 2 points (and the binomial standard
# error of a 95% agreement is 1.9 points), so a single rounding flip decides a case (Q6_K on mixtral256:
# 121/128 against a floor of 121.44); on 4 windows (512 positions) it is 0.2 points and the error 1.0
# (reference/quant_bar.py measures every case at 128 and 512 positions, docs/conformance.md).
N_WINDOWS = 4
KL_FACTOR = 2.0
TOP1_SLACK = 0.02
# issue 9's types, as llama_model_quantize ftype names (MXFP4 is llama.cpp's MXFP4_MOE mix)
TYPES = (
    "Q2_K",
    "Q3_K_M",
    "Q4_K_M",
    "Q4_K_S",
    "Q5_K_M",
    "Q6_K",
    "Q5_0",
    "Q5_1",
    "IQ4_NL",
    "IQ4_XS",
    "MXFP4_MOE",
)

FLIP_TRIM = 2  # per window
# A tiny MoE checkpoint with every row 256 long (hidden and expert widths), built like tiny_models.SPECS.
WIDE_SPECS = {
    "mixtral256": dataclasses.replace(
        tm.SPEC_BY_NAME["mixtral"],
        name="mixtral256",
        config={**tm.SPEC_BY_NAME["mixtral"].config, "hidden_size": 256, "intermediate_size": 256},
        seed=21,
    ),
    # LFM2-MoE with rows of 256 (short convolutions, attention, dense lead and experts): one K-quant mix and
    # Q6_K, so that its blocks run llama.cpp's K-quants too
    "lfm2moe256": dataclasses.replace(
        tm.SPEC_BY_NAME["lfm2moe"],
        name="lfm2moe256",
        config={
            **tm.SPEC_BY_NAME["lfm2moe"].config,
            "hidden_size": 256,
            "intermediate_size": 256,
            "moe_intermediate_size": 256,
        },
        seed=31,
    ),
    # dense LFM2 with rows of 256 (its FFN: 2/3 x 384 = 256)
    "lfm2_256": dataclasses.replace(
        tm.SPEC_BY_NAME["lfm2"],
        name="lfm2_256",
        config={**tm.SPEC_BY_NAME["lfm2"].config, "hidden_size": 256, "intermediate_size": 384},
        seed=34,
    ),
}
MODELS = ("trained_moe", "mixtral256")
EXTRA_CASES = (("Q4_K_M", "lfm2moe256"), ("Q6_K", "lfm2moe256"), ("Q4_K_M", "lfm2_256"))


def _llama_cpp() -> Any:
    llama_cpp = tm.reference_engine("llama_cpp")
    if llama_cpp is None:
        pytest.skip("llama-cpp-python is not installed (a failure under CI=true)")
    return llama_cpp


def llama_quantize(src: Path, dst: Path, ftype_name: str) -> Path:
    """llama.cpp's quantizer (llama_model_quantize): `src` -> `dst` as LLAMA_FTYPE_MOSTLY_<ftype_name>."""
    llama_cpp = _llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.nthread = tm.LLAMA_CPP_THREADS
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0 and dst.is_file(), f"llama_model_quantize({ftype_name}) failed with {rc}"
    return dst


def llama_cpp_logits(path: Path, ids: list[int], n_batch: int) -> np.ndarray:
    """Teacher-forced logits from llama.cpp, evaluated n_batch tokens per decode call."""
    n_ctx = max(64, len(ids))
    llm = tm.open_llama_cpp(
        path, logits_all=True, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=tm.LLAMA_CPP_THREADS
    )
    try:
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


class Sources:
    """F32 GGUFs of the models, made once per session."""

    def __init__(self, root: Path, zoo: Any) -> None:
        self.root, self.zoo = root, zoo
        self.cache: dict[str, Path] = {}

    def f32(self, name: str) -> Path:
        if name not in self.cache:
            from colibri_backend.convert import convert

            if name == "trained_moe":
                ckpt = RELEASE
            else:
                ckpt = tm.build_checkpoint(WIDE_SPECS[name], self.root / name, self.zoo.tokenizer_dir())
            self.cache[name] = convert(ckpt, self.root / f"{name}.f32.gguf", "f32", progress=False)
        return self.cache[name]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory, tiny_zoo: Any) -> Sources:
    return Sources(tmp_path_factory.mktemp("llama_quant"), tiny_zoo)


def _windows(colibri: Any, path: Path, n: int) -> list[list[int]]:
    """`n` windows of N_TOKENS token ids: consecutive slices of the same English text, each run as a fresh
    sequence (the first is the text's opening N_TOKENS tokens)."""
    with colibri.load(path, threads=tm.ENGINE_THREADS, context_length=256) as m:
        ids = m.tokenize(tm.english_text())
    assert len(ids) >= n * N_TOKENS
    return [ids[k * N_TOKENS : (k + 1) * N_TOKENS] for k in range(n)]


def _ids(colibri: Any, path: Path) -> list[int]:
    return _windows(colibri, path, 1)[0]


def kl_rows(ref: np.ndarray, test: np.ndarray) -> np.ndarray:
    lp, lq = tm.log_softmax(ref), tm.log_softmax(test)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def robust(ref: np.ndarray, test: np.ndarray, trim: int) -> tm.Comparison:
    """tm.compare, with the KL mean taken after dropping the `trim` largest per-token KLs."""
    cmp = tm.compare(ref, test)
    if trim:
        kl = np.sort(kl_rows(ref, test))[: ref.shape[0] - trim]
        cmp = dataclasses.replace(cmp, kl_mean=float(kl.mean()))
    return cmp


# Cases that miss a bar at N_WINDOWS windows, marked strict xfail. Q5_1-mixtral256 and IQ4_XS-trained_moe
# missed it on one window (128 positions) and pass on 4 with every kernel set (reference/quant_bar.py,
# docs/benchmarks.md, branch q6bar): none is known now.
KNOWN_SHORTFALLS: frozenset[tuple[str, str]] = frozenset()


def _cases() -> list[Any]:
    return [
        pytest.param(
            f,
            m,
            marks=[pytest.mark.xfail(strict=True, reason="known shortfall, docs/conformance.md")]
            if (f, m) in KNOWN_SHORTFALLS
            else [],
            id=f"{f}-{m}",
        )
        for f, m in [(f, m) for f in TYPES for m in MODELS] + list(EXTRA_CASES)
    ]


@pytest.mark.parametrize(("ftype", "model"), _cases())
def test_llama_cpp_quantized_file(
    sources: Sources, colibri: Any, tmp_path: Path, model: str, ftype: str
) -> None:
    src = sources.f32(model)
    qfile = llama_quantize(src, tmp_path / f"{model}.{ftype.lower()}.gguf", ftype)
    windows = _windows(colibri, qfile, N_WINDOWS)
    batched = np.concatenate([llama_cpp_logits(qfile, w, n_batch=len(w)) for w in windows])
    serial = np.concatenate([llama_cpp_logits(qfile, w, n_batch=1) for w in windows])
    ours = colibri_logits(colibri, qfile, windows)
    exact = exact_windows(colibri, qfile, windows, tmp_path)
    trim = 0 if model == "trained_moe" else FLIP_TRIM * N_WINDOWS
    self_noise = robust(batched, serial, trim)
    vs_llama = robust(batched, ours, trim)
    theirs_vs_exact = robust(exact, batched, trim)
    label = f"{model} {ftype}" + (f" (means without the {trim} largest KLs)" if trim else "")
    tm.report(self_noise.line(f"{label} llama.cpp batched vs token-by-token"))
    _check_quantized(vs_llama, robust(exact, ours, trim), theirs_vs_exact, label)
    noise_kl = max(self_noise.kl_mean, theirs_vs_exact.kl_mean)
    noise_miss = 1.0 - min(self_noise.top1_agreement, theirs_vs_exact.top1_agreement)
    assert vs_llama.kl_mean <= KL_FACTOR * noise_kl, (
        f"{label}: KL(llama.cpp || Colibri) {vs_llama.kl_mean:.4g} > {KL_FACTOR} x {noise_kl:.4g} "
        f"(llama.cpp's self-disagreement {self_noise.kl_mean:.4g}, "
        f"its distance from exact {theirs_vs_exact.kl_mean:.4g})"
    )
    assert 1.0 - vs_llama.top1_agreement <= KL_FACTOR * noise_miss + TOP1_SLACK, (
        f"{label}: top-1 disagreement with llama.cpp {1 - vs_llama.top1_agreement:.4f} > {KL_FACTOR} x "
        f"llama.cpp's own {noise_miss:.4f} + {TOP1_SLACK}"
    )


@pytest.mark.parametrize("ftype", ("Q8_0", "Q4_K_M"))
def test_convert_then_llama_quantize_loads_in_both_engines(
    sources: Sources, colibri: Any, tmp_path: Path, ftype: str
) -> None:
    """Issue 9 item 4: Colibri's converter output survives llama.cpp's quantizer (no general.alignment = 4096
    copied into a file padded to 32), and the result loads and runs in llama.cpp and in Colibri."""
    import gguf

    src = sources.f32("trained_moe")
    assert "general.alignment" not in gguf.GGUFReader(src).fields
    qfile = llama_quantize(src, tmp_path / f"trained_moe.{ftype.lower()}.gguf", ftype)
    fields = gguf.GGUFReader(qfile).fields
    align = int(fields["general.alignment"].contents()) if "general.alignment" in fields else 32
    assert align == 32
    ids = _ids(colibri, qfile)  # N_TOKENS positions: at 32, one near-tie moved the agreement by 3 points
    theirs = llama_cpp_logits(qfile, ids, n_batch=len(ids))
    with colibri.load(qfile, threads=tm.ENGINE_THREADS, context_length=256) as m:
        ours = m.logits(ids)
        # the expert store streams the same file through page-aligned direct-I/O windows: same logits
    with colibri.load(qfile, threads=tm.ENGINE_THREADS, context_length=256, expert_slots=4) as m:
        streamed = m.logits(ids)
    np.testing.assert_array_equal(ours, streamed)
    cmp = tm.compare(theirs, ours)
    tm.report(cmp.line(f"convert -> llama.cpp {ftype} -> Colibri vs llama.cpp"))
    assert cmp.top1_agreement >= 0.95 and cmp.kl_mean < 0.01
