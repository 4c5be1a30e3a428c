"""`colibri quantize`: per-type round trips, llama.cpp's type mixes, loading in llama.cpp, bad input.

Round trips decode our blocks with the gguf package's dequantizer (the format's reference), so a
layout mistake shows up as a large error, and compare the error with gguf's own quantizer where it
has one. Mix rules are checked against llama.cpp's quantizer on the same tiny file, live.
"""

from __future__ import annotations

import ctypes
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from colibri_backend import _native
from colibri_backend.digests import verify_file
from colibri_backend.errors import EngineError
from colibri_backend.quantize import ImatrixError, quantize, quantize_types, read_imatrix

ROOT = Path(__file__).resolve().parent.parent
RELEASE = ROOT / "tools" / "train_moe" / "release"

# Relative MSE bounds on heavy-tailed rows (Gaussian times an exponential envelope). Each is ~1.3x
# what the quantizer reaches here, so a regression in a scale search (or a layout error, which
# costs orders of magnitude) fails, while run-to-run noise (the data is seeded) cannot.
REL_MSE_BOUND = {
    Q.Q8_0: 4.5e-5,
    Q.Q6_K: 4.5e-4,
    Q.Q5_K: 1.9e-3,
    Q.Q5_1: 1.7e-3,
    Q.Q5_0: 2.7e-3,
    Q.Q4_K: 7.5e-3,
    Q.Q4_1: 7.2e-3,
    Q.IQ4_NL: 8.2e-3,
    Q.IQ4_XS: 8.3e-3,
    Q.Q4_0: 1.07e-2,
    Q.MXFP4: 1.8e-2,
    Q.Q3_K: 3.1e-2,
    Q.Q2_K: 1.03e-1,
}
# gguf's quantizers are ggml's reference ("round with the extreme element on the end of the grid").
# Ours minimises a weighted error rather than the plain MSE measured here, so a 2% margin is allowed.
GGUF_MARGIN = 1.02

TYPE_ID = {"F32": 0, "F16": 1, "BF16": 30}


def _rows(n_rows: int = 48, n: int = 512, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    env = 1 + 0.3 * rng.standard_exponential((n_rows, n))
    return (rng.standard_normal((n_rows, n)) * env * 0.02).astype(np.float32)


def _quantize_rows(qtype: int, x: np.ndarray, imp: np.ndarray | None = None) -> np.ndarray:
    lib = _native.load_library()
    bs, ts = gguf.GGML_QUANT_SIZES[Q(qtype)]
    rows, n = x.shape
    out = np.zeros(rows * (n // bs) * ts, dtype=np.uint8)
    imp_p = None if imp is None else _native.f32_ptr(imp)
    st = lib.colibri_quantize_row(qtype, _native.f32_ptr(x), rows, n, imp_p, out.ctypes.data, out.nbytes)
    lib.check(st, "quantize_row")
    return out.reshape(rows, -1)


def _rel(err: np.ndarray, x: np.ndarray, w: np.ndarray | float = 1.0) -> float:
    return float((err**2 * w).mean() / (x**2 * w).mean())


@pytest.mark.parametrize("qtype", list(REL_MSE_BOUND), ids=lambda t: t.name)
def test_round_trip_error(qtype: Q) -> None:
    x = _rows()
    y = gguf.quants.dequantize(_quantize_rows(int(qtype), x), qtype)
    rel = _rel(y - x, x)
    assert rel < REL_MSE_BOUND[qtype], f"{qtype.name}: relative MSE {rel:.3e}"
    try:
        ref = gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype)
    except NotImplementedError:
        return
    assert rel <= GGUF_MARGIN * _rel(ref - x, x), f"{qtype.name}: {rel:.3e} vs gguf's {_rel(ref - x, x):.3e}"


@pytest.mark.parametrize("qtype", list(REL_MSE_BOUND), ids=lambda t: t.name)
def test_importance_lowers_weighted_error(qtype: Q) -> None:
    """With an imatrix, the error weighted by that importance falls (that is what it is for)."""
    x = _rows(seed=1)
    imp = (np.random.default_rng(2).standard_exponential(x.shape[1]) ** 2).astype(np.float32)
    plain = gguf.quants.dequantize(_quantize_rows(int(qtype), x), qtype)
    weighted = gguf.quants.dequantize(_quantize_rows(int(qtype), x, imp), qtype)
    e_plain, e_weighted = _rel(plain - x, x, imp), _rel(weighted - x, x, imp)
    # MXFP4's scale is a power of two: little freedom to trade; the others gain 15% or more
    factor = 0.99 if qtype == Q.MXFP4 else 0.85
    assert e_weighted < factor * e_plain, f"{qtype.name}: {e_weighted:.3e} vs {e_plain:.3e} without"


# llama.cpp's quantizer on the same real weights (the trained MoE's layer-2 experts' ffn_down, 512
# columns), every tensor at the default type (`pure`). Measured ratios ours / llama.cpp: 0.79..0.99
# without an importance matrix, 0.70..1.04 with one (Q2_K with an imatrix is the 1.04). The bound
# 1.08 keeps the "within 10% of llama.cpp" with a margin for the KL-vs-MSE difference.
LLAMA_PURE = {Q.Q4_0: 2, Q.Q4_1: 3, Q.Q5_0: 8, Q.Q5_1: 9, Q.Q8_0: 7, Q.Q2_K: 10, Q.Q3_K: 12, Q.Q4_K: 15}
LLAMA_PURE |= {Q.Q5_K: 17, Q.Q6_K: 18, Q.IQ4_NL: 25, Q.IQ4_XS: 30, Q.MXFP4: 38}


@pytest.fixture(scope="module")
def real_rows(moe_f32: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[np.ndarray, Path]:
    t = {t.name: t for t in gguf.GGUFReader(str(moe_f32)).tensors}["blk.2.ffn_down_exps.weight"]
    x = np.array(t.data, dtype=np.float32).reshape(-1, 512)[:384]
    path = tmp_path_factory.mktemp("one") / "one.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in (("block_count", 1), ("context_length", 64), ("embedding_length", 512)):
        w.add_uint32(f"llama.{k}", v)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_feed_forward_length(512)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(128)
    w.add_tensor("blk.0.ffn_down.weight", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return x, path


@pytest.mark.parametrize("qtype", list(LLAMA_PURE), ids=lambda t: t.name)
def test_error_against_llama_cpp(qtype: Q, real_rows: tuple[np.ndarray, Path], tmp_path: Path) -> None:
    import llama_cpp

    x, src = real_rows
    imp = (np.random.default_rng(3).standard_exponential(512) ** 2).astype(np.float32)
    for im in (None, imp):
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype, p.pure, p.nthread = LLAMA_PURE[qtype], True, 2
        arr = (llama_cpp.llama_model_imatrix_data * 2)()
        if im is not None:
            arr[0].name, arr[0].data, arr[0].size = b"blk.0.ffn_down.weight", _native.f32_ptr(im), im.size
            p.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        dst = tmp_path / "q.gguf"
        assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) == 0
        t = gguf.GGUFReader(str(dst)).tensors[0]
        assert t.tensor_type == qtype
        theirs = gguf.quants.dequantize(np.array(t.data), qtype).reshape(x.shape)
        ours = gguf.quants.dequantize(_quantize_rows(int(qtype), x, im), qtype)
        w = 1.0 if im is None else im
        e_ours, e_theirs = _rel(ours - x, x, w), _rel(theirs - x, x, w)
        what = f"{qtype.name} imatrix={im is not None}"
        assert e_ours <= 1.08 * e_theirs, f"{what}: {e_ours:.3e} vs llama.cpp's {e_theirs:.3e}"


def test_float_types_exact() -> None:
    x = _rows(4, 64)
    x[0, :4] = [np.inf, -np.inf, 65504.0, 1e-8]
    f16 = _quantize_rows(TYPE_ID["F16"], x)
    assert np.array_equal(f16.view(np.float16).reshape(x.shape), x.astype(np.float16))
    bf16 = _quantize_rows(TYPE_ID["BF16"], x)
    assert np.array_equal(bf16.reshape(-1), gguf.quants.quantize(x, Q.BF16).reshape(-1))


def test_quantize_row_rejects_bad_shapes() -> None:
    lib = _native.load_library()
    x = np.zeros(100, dtype=np.float32)
    out = np.zeros(1000, dtype=np.uint8)
    st = lib.colibri_quantize_row(int(Q.Q4_K), _native.f32_ptr(x), 1, 100, None, out.ctypes.data, out.nbytes)
    assert st != 0 and "multiple" in lib.last_error()
    st = lib.colibri_quantize_row(int(Q.Q8_0), _native.f32_ptr(x), 1, 64, None, out.ctypes.data, 10)
    assert st != 0


def test_help_lists_the_engine_types() -> None:
    from colibri_backend.commands.quantize import _TYPES_HELP

    assert tuple(_TYPES_HELP.split(", ")) == quantize_types()


# ---- type mixes ------------------------------------------------------------------------------


def _mix_model(path: Path, *, cols: int, n_expert: int, n_head_kv: int, tied: bool, n_layer: int = 8) -> None:
    """A GGUF whose tensors have llama.cpp's names and the given row lengths but only a few rows:
    the mix rules look at names, row lengths, layer and expert counts, never at the values."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layer)
    w.add_context_length(64)
    w.add_embedding_length(cols)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(cols // 4)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(2)

    def t(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))

    t("token_embd.weight", 16, cols)
    t("output_norm.weight", cols)
    if not tied:
        t("output.weight", 16, cols)
    for i in range(n_layer):
        p = f"blk.{i}."
        t(p + "attn_norm.weight", cols)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t(p + name + ".weight", 4, cols)
        t(p + "ffn_norm.weight", cols)
        t(p + "ffn_gate_inp.weight", n_expert, cols)
        t(p + "ffn_gate_exps.weight", n_expert, 2, cols)
        t(p + "ffn_up_exps.weight", n_expert, 2, cols)
        t(p + "ffn_down_exps.weight", n_expert, 2, 256)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


LLAMA_FTYPE = {"q8_0": 7, "q6_k": 18, "q5_k_m": 17, "q4_k_m": 15, "q4_k_s": 14, "q3_k_m": 12, "q2_k": 10}
LLAMA_FTYPE |= {"iq4_xs": 30, "q4_0": 2, "mxfp4": 38, "q5_0": 8, "q3_k_l": 13, "iq4_nl": 25}


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def _llama_quantize(src: Path, dst: Path, ftype: int, imatrix: dict[str, np.ndarray] | None = None) -> None:
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.nthread = 2
    keep: list[object] = []
    if imatrix:
        arr = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (k, v) in enumerate(imatrix.items()):
            a = np.ascontiguousarray(v, dtype=np.float32)
            keep.append(a)
            arr[i].name, arr[i].data, arr[i].size = k.encode(), _native.f32_ptr(a), a.size
        p.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep.append(arr)
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) == 0


@pytest.fixture(scope="module")
def mix_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mix")
    models = {
        "8exp-gqa4": dict(cols=256, n_expert=8, n_head_kv=1, tied=False),
        "4exp-tied-160": dict(cols=160, n_expert=4, n_head_kv=4, tied=True),
    }
    out = {}
    for name, kw in models.items():
        out[name] = d / f"{name}.gguf"
        _mix_model(out[name], **kw)
    return out


@pytest.mark.parametrize("qtype", sorted(LLAMA_FTYPE))
def test_mix_matches_llama_cpp(qtype: str, mix_models: dict[str, Path], tmp_path: Path) -> None:
    for name, src in mix_models.items():
        imat = {"blk.0.ffn_down_exps.weight": np.ones(256 * (8 if "8exp" in name else 4), np.float32)}
        for im in (None, imat) if qtype in ("iq4_xs", "q4_0") else (None,):
            ours, theirs = tmp_path / f"o-{name}.gguf", tmp_path / f"l-{name}.gguf"
            quantize(src, ours, qtype, imatrix=im, threads=2)
            _llama_quantize(src, theirs, LLAMA_FTYPE[qtype], im)
            a, b = _types(ours), _types(theirs)
            diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
            assert not diff, f"{qtype} on {name} (imatrix: {im is not None}): ours vs llama.cpp {diff}"


def test_q4_k_m_mix_by_rule(mix_models: dict[str, Path], tmp_path: Path) -> None:
    """The rules themselves (so the test does not rest on llama.cpp alone): 8 layers, 8 experts."""
    out = quantize(mix_models["8exp-gqa4"], tmp_path / "q.gguf", "q4_k_m", threads=1)
    ty = _types(out)
    assert ty["output.weight"] == "Q6_K" and ty["token_embd.weight"] == "Q4_K"
    assert ty["blk.0.ffn_gate_inp.weight"] == "F32" and ty["blk.0.attn_norm.weight"] == "F32"
    assert ty["blk.3.attn_v.weight"] == "Q8_0" and ty["blk.3.attn_k.weight"] == "Q8_0"  # 8 experts
    assert ty["blk.3.attn_output.weight"] == "Q5_K" and ty["blk.3.attn_q.weight"] == "Q4_K"
    more = [i for i in range(8) if ty[f"blk.{i}.ffn_down_exps.weight"] == "Q6_K"]
    assert more == [0, 3, 6, 7]  # use_more_bits: first 1/8, last 1/8, every third in between
    assert ty["blk.1.ffn_gate_exps.weight"] == "Q4_K"
    r = gguf.GGUFReader(str(out))
    assert int(r.fields["general.file_type"].parts[-1][0]) == 15
    assert "general.alignment" not in r.fields
    # 160 columns are no multiple of 256: Q4_K falls back to Q5_0, Q6_K to Q8_0
    ty = _types(quantize(mix_models["4exp-tied-160"], tmp_path / "t.gguf", "q4_k_m", threads=1))
    assert ty["blk.1.attn_q.weight"] == "Q5_0" and ty["token_embd.weight"] == "Q8_0"


def test_progress_and_cancel(mix_models: dict[str, Path], tmp_path: Path) -> None:
    seen: list[tuple[int, int, str]] = []
    quantize(mix_models["8exp-gqa4"], tmp_path / "p.gguf", "q8_0", progress=lambda *a: seen.append(a))
    done = [s[0] for s in seen]
    assert done == sorted(done) and done[-1] == seen[-1][1] > 0
    assert {s[2] for s in seen} >= {"token_embd.weight", "blk.7.ffn_down_exps.weight"}

    def stop(done: int, total: int, tensor: str) -> None:
        if tensor.startswith("blk.3"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        quantize(mix_models["8exp-gqa4"], tmp_path / "c.gguf", "q8_0", progress=stop)
    assert _leftovers(tmp_path) == ["p.gguf", "p.gguf.digests"]


def test_non_finite_weights_refused(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "nan.gguf"), "llama")
    w.add_block_count(1)
    x = np.ones((4, 64), np.float32)
    x[2, 5] = np.nan
    w.add_tensor("blk.0.attn_q.weight", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(EngineError, match="row 2 holds a NaN"):
        quantize(tmp_path / "nan.gguf", tmp_path / "out.gguf", "q8_0")
    assert _leftovers(tmp_path) == ["nan.gguf"]


# ---- the real model: llama.cpp loads our output ------------------------------------------------


@pytest.fixture(scope="module")
def moe_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from colibri_backend.convert import convert

    d = tmp_path_factory.mktemp("moe")
    raw = convert(RELEASE, d / "raw.gguf", out_type="f32", progress=False)
    return quantize(raw, d / "moe-f32.gguf", "f32")  # rewritten with 32-byte alignment (issue 9 item 4)


def _llama_logits(path: Path, ids: list[int]) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, n_threads=2, verbose=False)
    llm.eval(ids)
    out = np.array(llm.scores[: len(ids)], dtype=np.float64)
    llm.close()
    return out


def _kld(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    la = a - np.log(np.exp(a - a.max(-1, keepdims=True)).sum(-1, keepdims=True)) - a.max(-1, keepdims=True)
    lb = b - np.log(np.exp(b - b.max(-1, keepdims=True)).sum(-1, keepdims=True)) - b.max(-1, keepdims=True)
    kl = (np.exp(la) * (la - lb)).sum(-1)
    return float(kl.mean()), float((a.argmax(-1) == b.argmax(-1)).mean())


def test_output_loads_in_llama_cpp(moe_f32: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    text = (ROOT / "colibri_backend" / "budget.py").read_text()[:2000]
    ids = Tokenizer.from_file(str(RELEASE / "tokenizer.json")).encode(text).ids[:96]
    base = _llama_logits(moe_f32, ids)
    results = {}
    for qtype in ("q4_k_m", "q6_k", "iq4_xs"):
        out = quantize(moe_f32, tmp_path / f"{qtype}.gguf", qtype, threads=2)
        results[qtype] = _kld(base, _llama_logits(out, ids))
    # measured: Q6_K ~0.001, Q4_K_M / IQ4_XS ~0.01 (the model's rows are 128 wide: mostly Q5_0 / IQ4_NL)
    assert results["q6_k"][0] < 0.01 and results["q6_k"][1] > 0.95, results
    assert results["q4_k_m"][0] < 0.05 and results["q4_k_m"][1] > 0.85, results
    assert results["iq4_xs"][0] < 0.06 and results["iq4_xs"][1] > 0.85, results


# ---- refusals and imatrix files ----------------------------------------------------------------


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_requantize_refused_then_allowed(moe_f32: Path, tmp_path: Path) -> None:
    q8 = quantize(moe_f32, tmp_path / "q8.gguf", "q8_0", threads=2)
    with pytest.raises(EngineError, match="already quantized.*allow-requantize"):
        quantize(q8, tmp_path / "again.gguf", "q4_0")
    assert _leftovers(tmp_path) == ["q8.gguf", "q8.gguf.digests"]
    out = quantize(q8, tmp_path / "again.gguf", "q4_0", allow_requantize=True, threads=2)
    assert _types(out)["blk.0.ffn_up_exps.weight"] == "Q4_0"


def test_cli_refusals_leave_no_file(moe_f32: Path, tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "colibri_backend.cli", "quantize", *args, "--no-progress"]
        return subprocess.run(cmd, capture_output=True, text=True)

    out = tmp_path / "out.gguf"
    r = cli(str(moe_f32), str(out), "--type", "q4_k_xl")
    assert r.returncode == 1 and "unknown type 'q4_k_xl'" in r.stderr and "q4_k_m" in r.stderr
    # an imatrix for another model: wrong tensor name, then wrong column count
    other = tmp_path / "other.imatrix"
    _write_legacy_imatrix(other, {"blk.0.attn_q.weight": np.ones(64, np.float32)})
    r = cli(str(moe_f32), str(out), "--type", "q4_k_m", "--imatrix", str(other))
    assert r.returncode == 1 and "another model" in r.stderr and "128" in r.stderr
    _write_legacy_imatrix(other, {"blk.9.attn_q.weight": np.ones(128, np.float32)})
    r = cli(str(moe_f32), str(out), "--type", "q4_k_m", "--imatrix", str(other))
    assert r.returncode == 1 and "names no tensor" in r.stderr
    # a truncated input
    cut = tmp_path / "cut.gguf"
    data = moe_f32.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    r = cli(str(cut), str(out), "--type", "q4_k_m")
    assert r.returncode == 1 and "error" in r.stderr
    assert _leftovers(tmp_path) == ["cut.gguf", "other.imatrix"]
    r = cli(str(tmp_path / "missing.gguf"), str(out), "--type", "q8_0")
    assert r.returncode == 1 and "does not exist" in r.stderr
    ok = cli(str(moe_f32), str(out), "--type", "q8_0", "--threads", "2")
    assert ok.returncode == 0, ok.stderr
    assert _types(out)["output.weight"] == "Q8_0"


def test_sigterm_leaves_no_file(moe_f32: Path, tmp_path: Path) -> None:
    import signal
    import time

    out = tmp_path / "out.gguf"
    cmd = [sys.executable, "-m", "colibri_backend.cli", "quantize", str(moe_f32), str(out)]
    cmd += ["--type", "iq4_xs", "--threads", "1", "--no-progress"]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("out.gguf.part-*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "finished before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 130
    assert _leftovers(tmp_path) == []


def _write_legacy_imatrix(path: Path, entries: dict[str, np.ndarray], ncall: int = 4) -> None:
    """llama.cpp's legacy .dat: values stored as (mean * ncall), trailer with chunk count and dataset."""
    b = bytearray(struct.pack("<i", len(entries)))
    for name, v in entries.items():
        raw = name.encode()
        b += struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, v.size)
        b += (np.asarray(v, np.float32) * ncall).astype("<f4").tobytes()
    b += struct.pack("<i", 7) + struct.pack("<i", 4) + b"test"
    path.write_bytes(bytes(b))


def test_read_imatrix_both_formats(tmp_path: Path) -> None:
    vals = {"blk.0.ffn_down_exps.weight": np.arange(1, 9, dtype=np.float32), "output.weight": np.ones(3)}
    legacy = tmp_path / "i.dat"
    _write_legacy_imatrix(legacy, vals)
    got = read_imatrix(legacy)
    assert set(got) == set(vals) and np.allclose(got["blk.0.ffn_down_exps.weight"], vals[next(iter(vals))])

    # GGUF: two experts with 4 columns each; expert 1 never ran (count 0 -> importance 1)
    g = tmp_path / "i.gguf"
    w = gguf.GGUFWriter(str(g), "imatrix")
    w.add_string("general.type", "imatrix")
    sums = np.array([[2, 4, 6, 8], [5, 5, 5, 5]], np.float32)
    w.add_tensor("blk.0.ffn_up_exps.weight.in_sum2", sums)
    w.add_tensor("blk.0.ffn_up_exps.weight.counts", np.array([[2], [0]], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got = read_imatrix(g)
    assert np.array_equal(got["blk.0.ffn_up_exps.weight"], [1, 2, 3, 4, 1, 1, 1, 1])

    bad = tmp_path / "bad.dat"
    bad.write_bytes(legacy.read_bytes()[:30])
    with pytest.raises(ImatrixError, match="truncated"):
        read_imatrix(bad)


def test_convert_to_a_quantized_type(tmp_path: Path) -> None:
    out = tmp_path / "moe-q5_k_m.gguf"
    cmd = [sys.executable, "-m", "colibri_backend.cli", "convert", str(RELEASE), "-o", str(out)]
    r = subprocess.run(cmd + ["--type", "q5_k_m", "--no-progress"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _types(out)["blk.5.ffn_down_exps.weight"] == "Q6_K"  # last layer: more bits
    assert _leftovers(tmp_path) == ["moe-q5_k_m.gguf", "moe-q5_k_m.gguf.digests"]
    assert verify_file(out) == []  # the sidecar is the quantized file's, not the temporary F32's
    r = subprocess.run(cmd + ["--type", "q9_z"], capture_output=True, text=True)
    assert r.returncode == 1 and "unknown --type" in r.stderr


def test_benchmark_statistics() -> None:
    """The quality script's statistics: zero KL for identical logits, the known KL of two small ones."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import quant_quality as qq

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 7)).astype(np.float32)
    targets = rng.integers(0, 7, 50)
    same = qq.kl_stats(qq.log_softmax(logits), logits, targets)
    assert abs(same["kld_mean"]) < 1e-12 and same["top1"] == 1.0
    p = np.exp(qq.log_softmax(logits))
    assert same["ppl"] == pytest.approx(np.exp(-np.log(p[np.arange(50), targets]).mean()))
    two = np.array([[0.0, 0.0]]), np.array([[np.log(3.0), 0.0]])  # P = (1/2, 1/2), Q = (3/4, 1/4)
    st = qq.kl_stats(qq.log_softmax(two[0]), two[1], np.array([0]))
    assert st["kld_mean"] == pytest.approx(0.5 * np.log(0.5 / 0.75) + 0.5 * np.log(0.5 / 0.25))
