"""Colibri's 4-bit experts with F16 outlier channels (`colibri quantize --expert-outliers F`; native
outliers.h, quantize_outliers.c). On a tiny random qwen3moe whose experts have planted outlier input
columns (a few columns per expert 25x the others):

* the writer picks the planted columns, and dequant(W4)[:, cols] + correction reproduces the source
  columns to F16 rounding, for a K-quant and an IQ4_NL target;
* the engine's logits match a float reference built from the file (dequantized W4 plus the
  corrections) as closely as plain quantized files match theirs, and far closer than the reference
  without the corrections; against the F32 source they beat plain Q4_K_M on this model;
* streamed experts (a quarter of them in the store's slots) give bit-identical logits, prefill and
  decode; batched sequences give the bits each gives alone;
* the corrections stream with their expert only where the page padding of their slot regions adds at most
  1/4 to their bytes (a file at fraction 0.125, 16 KiB per expert and projection): the store reads them into
  the slot with the expert, the memory plan counts them in the slot size and the expert bytes, only their
  column lists in the resident weights. Smaller ones (2.5 KiB at 0.02) stay resident and the plan's slots
  and expert bytes are those of the file without them;
* bad input is a clear error: fraction out of range, a float target, a model without experts, an
  input that already has corrections, low-bit copies of such a file, damaged correction tensors at load.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from engine_reference import RefModel, load_gguf_reference, make_tiny_model, reference_forward
from native_engine import LIB, Engine

from colibri_backend import _native as N
from colibri_backend.errors import EngineError
from colibri_backend.quantize import quantize, write_lowbit_sidecar

SHAPE = dict(n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=2)  # rows of 256: Q4_K / IQ4_NL blocks
PLANTED = 2  # outlier columns planted per expert and tensor
FRACTION = 0.02  # round(0.02 * 256) = 5 columns kept per expert
LARGE = 0.125  # 32 columns: 256 rows x 32 x 2 = 16 KiB per expert, the least that streams (padding 1/4)
PAGE = 4096  # the store's O_DIRECT granule (experts.h STORE_IO_ALIGN)
TOKS = np.random.default_rng(3).integers(0, 301, 40).tolist()
EXPERT_KINDS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _expert_names(r: gguf.GGUFReader) -> list[str]:
    return [t.name for t in r.tensors if t.name.endswith("_exps.weight")]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("outliers")
    src = root / "f32.gguf"
    make_tiny_model(src, "qwen3moe", **SHAPE)
    r = gguf.GGUFReader(str(src), "r+")  # plant the outliers in place
    rng = np.random.default_rng(11)
    for t in r.tensors:
        if t.name.endswith("_exps.weight"):
            for e in range(t.data.shape[0]):
                cols = rng.choice(t.data.shape[2], PLANTED, replace=False)
                t.data[e][:, cols] *= 25.0
    r.data.flush()
    del r
    out = {"f32": src}
    out["q4_k_m"] = quantize(src, root / "q4_k_m.gguf", "q4_k_m", threads=2)
    out["q4_k_m+ol"] = quantize(src, root / "q4_k_m-ol.gguf", "q4_k_m", threads=2, expert_outliers=FRACTION)
    out["q4_k_m+ol-large"] = quantize(
        src, root / "q4_k_m-ol-large.gguf", "q4_k_m", threads=2, expert_outliers=LARGE
    )
    out["iq4_nl+ol"] = quantize(
        src,
        root / "iq4_nl-ol.gguf",
        "iq4_nl",
        threads=2,
        expert_outliers=FRACTION,
        outlier_corpus="test corpus",
    )
    return out


def _outliers(r: gguf.GGUFReader, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(cols [X][n], corrections [X][rows][n] float) of the expert tensor `name` (stored [X][n][rows])."""
    stem = name[: -len("weight")]
    by = {t.name: t for t in r.tensors}
    cols = np.asarray(by[stem + "colibri_outlier_cols"].data).astype(np.int64)
    corr = np.asarray(by[stem + "colibri_outlier_w"].data).astype(np.float64).transpose(0, 2, 1)
    return cols, corr


def _weights(r: gguf.GGUFReader, name: str) -> np.ndarray:
    t = next(t for t in r.tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)


@pytest.mark.parametrize("kind", ["q4_k_m+ol", "iq4_nl+ol"])
def test_corrections_restore_the_outlier_columns(files: dict[str, Path], kind: str) -> None:
    src, out = gguf.GGUFReader(str(files["f32"])), gguf.GGUFReader(str(files[kind]))
    assert out.fields["colibri.outliers.version"].contents() == 1
    assert abs(out.fields["colibri.outliers.fraction"].contents() - FRACTION) < 1e-7
    corpus = out.fields["colibri.outliers.corpus"].contents()
    assert corpus == ("test corpus" if kind.startswith("iq4") else "none")
    names = _expert_names(out)
    assert len(names) == 3 * 2
    for name in names:
        w = _weights(src, name)
        dq = _weights(out, name)
        cols, corr = _outliers(out, name)
        n_expert, rows, n_cols = w.shape
        n = round(FRACTION * n_cols)
        assert cols.shape == (n_expert, n) and corr.shape == (n_expert, rows, n)
        energy = (w**2).sum(axis=1)  # [X][cols]: no imatrix, the column energy alone picks
        for e in range(n_expert):
            assert (np.diff(cols[e]) > 0).all()
            planted = np.argsort(-energy[e], kind="stable")[:PLANTED]
            assert set(planted) <= set(cols[e].tolist()), (name, e)
            got = dq[e][:, cols[e]] + corr[e]
            want = w[e][:, cols[e]]
            # F16 rounding of the correction, plus float32 arithmetic
            bound = np.abs(want - dq[e][:, cols[e]]) * 2.0**-11 + np.abs(want) * 2e-7 + 2.0**-24
            assert (np.abs(got - want) <= bound).all(), (name, e, float(np.abs(got - want).max()))
            # the 4-bit part alone misses them badly (they were zeroed before quantizing)
            assert np.abs(dq[e][:, cols[e]] - want).max() > 0.5 * np.abs(want).max()


def _corrected_reference(path: Path, apply: bool) -> RefModel:
    m = load_gguf_reference(path)
    r = gguf.GGUFReader(str(path))
    for name in _expert_names(r):
        if apply:
            cols, corr = _outliers(r, name)
            for e in range(cols.shape[0]):
                m.w[name][e][:, cols[e]] += corr[e]
    return m


def _log_softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) - x.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _kl(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    lp, lq = _log_softmax(ref), _log_softmax(got)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def _eval(path: Path, **kw: object) -> np.ndarray:
    eng = Engine(path, **kw)
    try:
        return eng.eval(TOKS)
    finally:
        eng.close()


def test_logits_match_the_corrected_reference(files: dict[str, Path]) -> None:
    path = files["q4_k_m+ol"]
    got = _eval(path, n_batch=16)
    want = reference_forward(_corrected_reference(path, True), TOKS, kv_f16=True)[0]
    without = reference_forward(_corrected_reference(path, False), TOKS, kv_f16=True)[0]
    kl, kl_without = _kl(want, got), _kl(without, got)
    # the engine's own rounding (int8 activations, f32 sums) is all that separates it from the reference
    assert np.median(kl) <= 3e-3 and (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9, float(np.median(kl))
    assert np.median(kl_without) > 10 * np.median(kl), (float(np.median(kl)), float(np.median(kl_without)))
    # against the F32 source the outlier format beats plain Q4_K_M on planted outliers (measured: mean KL
    # 0.94 against 1.48; every tensor of this random model is 4-bit, the attention included)
    f32 = _eval(files["f32"])
    kl_ol = _kl(f32, got).mean()
    kl_plain = _kl(f32, _eval(files["q4_k_m"])).mean()
    assert kl_ol < 0.8 * kl_plain, (float(kl_ol), float(kl_plain))


class _Ctx(Engine):
    """A context with expert slots and sequences set."""

    def __init__(self, path: Path, slots: int = 0, n_batch: int = 64, n_seq: int = 1) -> None:
        self.model = ctypes.c_void_p()
        self.ctx = ctypes.c_void_p()
        LIB.check(LIB.colibri_model_open(str(path).encode(), ctypes.byref(self.model)))
        self.info = N.ModelInfoC()
        LIB.check(LIB.colibri_model_get_info(self.model, ctypes.byref(self.info)))
        p = N.ContextParamsC()
        LIB.colibri_context_default_params(ctypes.byref(p))
        p.n_threads, p.n_ctx, p.n_batch, p.expert_slots, p.n_seq_max = 2, 128, n_batch, slots, n_seq
        status = LIB.colibri_context_new(self.model, ctypes.byref(p), ctypes.byref(self.ctx))
        if status:
            LIB.colibri_model_close(self.model)
            LIB.check(status)

    def __enter__(self) -> _Ctx:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def batch(self, seqs: list[int], toks: list[int], want: list[int]) -> np.ndarray:
        s, t = np.asarray(seqs, np.int32), np.asarray(toks, np.int32)
        w = np.asarray(want, np.uint8)
        out = np.zeros((int(w.sum()), self.info.n_vocab), np.float32)
        LIB.check(
            LIB.colibri_eval_batch(
                self.ctx,
                N.i32_ptr(s),
                N.i32_ptr(t),
                len(t),
                w.ctypes.data_as(ctypes.c_void_p),
                N.f32_ptr(out),
            )
        )
        return out


def _prefill_then_decode(path: Path, slots: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Logits of a prefill in chunks of 16 and of decode steps, and the expert bytes read from the file."""
    with _Ctx(path, slots=slots, n_batch=16) as e:
        pre = e.eval(TOKS[:24])
        dec = np.concatenate([e.eval([t]) for t in TOKS[24:]])
        return pre, dec, int(e.stats().expert_bytes_read)


def _region(n: int) -> int:
    """Slot bytes of a region of n file bytes: page rounded plus one page (experts.c store_region_size)."""
    return (n + PAGE - 1) // PAGE * PAGE + PAGE


@pytest.mark.parametrize("kind,streams", [("q4_k_m+ol", False), ("q4_k_m+ol-large", True)])
def test_streamed_experts_bit_identical_and_planned(files: dict[str, Path], kind: str, streams: bool) -> None:
    path = files[kind]
    n_total = 2 * SHAPE["n_expert"]
    pre, dec, _ = _prefill_then_decode(path, 0)
    spre, sdec, read = _prefill_then_decode(path, n_total // 4)  # a quarter of the experts in slots
    assert read > 0  # they did stream
    assert np.array_equal(pre, spre) and np.array_equal(dec, sdec)
    tensors = gguf.GGUFReader(str(path)).tensors
    cols = sum(int(t.n_bytes) for t in tensors if t.name.endswith(".colibri_outlier_cols"))
    corr = [t for t in tensors if t.name.endswith(".colibri_outlier_w")]
    corr_bytes = sum(int(t.n_bytes) for t in corr)
    # the rule (outliers.h outliers_stream): stream when padding to the slot region adds at most 1/4
    per_tensor = [int(t.n_bytes) // int(t.shape[2]) for t in corr]
    assert len(corr) == 6 and all(4 * (_region(b) - b) <= b for b in per_tensor) == streams
    region: dict[str, int] = {}  # per projection, the largest expert's correction window over the layers
    for t, b in zip(corr, per_tensor, strict=True):
        proj = t.name.split(".")[2]
        region[proj] = max(region.get(proj, 0), _region(b))
    assert len(region) == 3
    with _Ctx(path, slots=n_total // 4) as a, _Ctx(files["q4_k_m"], slots=n_total // 4) as b:
        pa, pb = a.plan(), b.plan()
        assert pa.n_expert_slots == n_total // 4 and not pa.all_resident
        if streams:  # in the expert bytes and, page-padded like each matrix, in the slot
            assert pa.resident_weight_bytes - pb.resident_weight_bytes == cols > 0
            assert pa.expert_total_bytes - pb.expert_total_bytes == corr_bytes > 0
            assert pa.expert_slot_bytes - pb.expert_slot_bytes == sum(region.values())
        else:  # resident weights, the slots and the expert bytes those of the file without them
            assert pa.resident_weight_bytes - pb.resident_weight_bytes == cols + corr_bytes > cols > 0
            assert (
                pa.expert_total_bytes == pb.expert_total_bytes
                and pa.expert_slot_bytes == pb.expert_slot_bytes
            )
            assert pa.total_bytes - pb.total_bytes == pa.resident_weight_bytes - pb.resident_weight_bytes + (
                pa.model_table_bytes - pb.model_table_bytes
            ) + (pa.metadata_bytes - pb.metadata_bytes)
    # and every read of an expert brings its three matrices, and their corrections when they stream
    streamed = ("_exps.weight", "_exps.colibri_outlier_w") if streams else ("_exps.weight",)
    per_expert = [
        sum(int(t.n_bytes) for t in tensors if t.name.startswith(f"blk.{il}.") and t.name.endswith(streamed))
        // SHAPE["n_expert"]
        for il in range(2)
    ]
    with _Ctx(path, slots=n_total // 4, n_batch=16) as e:
        e.eval(TOKS)
        got = [(s.layer, int(s.bytes_read)) for s in e.expert_stats() if s.bytes_read]
    assert got and all(n % per_expert[il] == 0 for il, n in got), (got, per_expert)


def test_batched_sequences_bit_identical_to_alone(files: dict[str, Path]) -> None:
    path = files["q4_k_m+ol"]
    prompts = [TOKS[:9], TOKS[9:23], TOKS[23:28]]
    alone = []
    for p in prompts:
        with _Ctx(path) as e:
            first = e.eval(p)[-1]
            alone.append((first, e.eval([int(first.argmax())])[0]))
    with _Ctx(path, n_seq=3) as e:
        seqs = [i for i, p in enumerate(prompts) for _ in p]
        toks = [t for p in prompts for t in p]
        want = [int(j == len(p) - 1) for p in prompts for j in range(len(p))]
        firsts = e.batch(seqs, toks, want)
        nexts = e.batch([0, 1, 2], [int(f.argmax()) for f in firsts], [1, 1, 1])
    for i in range(3):
        assert np.array_equal(firsts[i], alone[i][0]) and np.array_equal(nexts[i], alone[i][1]), i


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "colibri_backend.cli", "quantize", *args, "--no-progress"]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_cli_refusals_leave_no_file(files: dict[str, Path], tmp_path: Path) -> None:
    src, out = files["f32"], tmp_path / "out.gguf"
    for bad in ("0.5", "-0.01", "nan"):
        r = _cli(str(src), str(out), "--type", "q4_k_m", "--expert-outliers", bad)
        assert r.returncode == 1 and "--expert-outliers must be in (0, 0.25]" in r.stderr, r.stderr
    with pytest.raises(EngineError, match=r"outside \(0, 0.25\]"):
        quantize(src, out, "q4_k_m", expert_outliers=0.3)
    with pytest.raises(EngineError, match="correct a quantized type; f16 is not one"):
        quantize(src, out, "f16", expert_outliers=0.01)
    dense = tmp_path / "dense.gguf"
    make_tiny_model(dense, "llama", n_expert=0, n_embd=256, n_ff=256)
    r = _cli(str(dense), str(out), "--type", "q4_k_m", "--expert-outliers", "0.01")
    assert r.returncode == 1 and "has no routed expert tensors" in r.stderr, r.stderr
    # an outlier file cannot be requantized: its corrections belong to its own quantization
    r = _cli(str(files["q4_k_m+ol"]), str(out), "--type", "q4_0", "--allow-requantize")
    assert r.returncode == 1 and "already carries outlier corrections" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense.gguf"]
    # low-bit copies would be of the 4-bit part, which lacks the outlier columns
    with pytest.raises(EngineError, match="outlier-channel experts.*copies of them are not supported"):
        write_lowbit_sidecar(files["q4_k_m+ol"], "q2_k")
    assert not Path(f"{files['q4_k_m+ol']}.lowbit").exists()
    ok = _cli(str(src), str(out), "--type", "q4_k_m", "--expert-outliers", "0.01", "--threads", "2")
    assert ok.returncode == 0, ok.stderr
    assert any(".colibri_outlier_w" in t.name for t in gguf.GGUFReader(str(out)).tensors)


def _damaged(files: dict[str, Path], tmp_path: Path, what: str, kind: str) -> Path:
    bad = tmp_path / f"{what}.gguf"
    bad.write_bytes(files[kind].read_bytes())
    r = gguf.GGUFReader(str(bad), "r+")
    by = {t.name: t for t in r.tensors}
    if what == "cols":
        by["blk.1.ffn_up_exps.colibri_outlier_cols"].data[3][0] = 256
    else:
        by["blk.0.ffn_down_exps.colibri_outlier_w"].data[2][1][5] = np.float16(np.inf)
    r.data.flush()
    return bad


@pytest.mark.parametrize("kind", ["q4_k_m+ol", "q4_k_m+ol-large"])  # resident and streamed corrections
@pytest.mark.parametrize(
    "what,message",
    [
        ("cols", "expert 3's columns are not increasing in \\[0, 256\\)"),
        ("w", "holds a NaN or infinite value"),
    ],
)
def test_damaged_corrections_refused_at_load(
    files: dict[str, Path], tmp_path: Path, what: str, message: str, kind: str
) -> None:
    bad = _damaged(files, tmp_path, what, kind)
    with pytest.raises(EngineError, match=message):
        Engine(bad)
