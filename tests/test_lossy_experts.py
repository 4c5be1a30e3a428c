"""The two opt-in, lossy expert options: fewer active experts by routing mass (expert_mass) and low-bit
copies of the experts read on a miss (lowbit_experts, MODEL.lowbit from `colibri quantize
--lowbit-sidecar`). On tiny random MoE models: mass 1 and a threshold below every weight are
bit-identical to exact; the experts a mass keeps at layer 0 match a computation by hand from the exact
routing; the sidecar's round trip, the copies a chunk of tokens takes (the largest weight over its tokens
below the threshold), refusals and the options' validation. The tiny models (no
tokenizer) run through the C API; the load options' path to C runs on the bundled model."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from engine_reference import make_tiny_model
from native_engine import LIB, Engine

import colibri_backend
from colibri_backend import LoadOptions
from colibri_backend import _native as N
from colibri_backend.errors import EngineError
from colibri_backend.models import default_model_path
from colibri_backend.quantize import write_lowbit_sidecar

TOKS = np.random.default_rng(7).integers(0, 301, 48).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lossy")
    out = {}
    # rows of 256 take Q2_K itself (no 32-block fallback); 8 experts, top-4
    shape = dict(wtype="Q8_0", n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=4)
    out["norm"] = root / "qwen3moe.gguf"
    make_tiny_model(out["norm"], "qwen3moe", **shape)
    out["raw"] = root / "qwen2moe.gguf"  # softmax top-k without renormalisation
    make_tiny_model(out["raw"], "qwen2moe", norm=False, **shape)
    out["other"] = root / "other.gguf"  # same shapes, other weights
    make_tiny_model(out["other"], "qwen3moe", seed=5, **shape)
    return out


class _Ctx(Engine):
    """A context with the lossy fields of colibri_context_params set."""

    def __init__(
        self,
        path: Path,
        slots: int = 0,
        n_batch: int = 64,
        mass: float = 0.0,
        lowbit: Path | None = None,
        weight: float = 0.0,
        n_seq: int = 1,
    ) -> None:
        p = N.ContextParamsC()
        LIB.colibri_context_default_params(ctypes.byref(p))
        p.n_threads, p.n_ctx, p.n_batch, p.expert_slots, p.expert_mass = 2, 64, n_batch, slots, mass
        p.n_seq_max = n_seq
        if lowbit is not None:
            p.lowbit_experts = str(lowbit).encode()
        p.lowbit_weight = weight
        self._open(path, p)

    def eval_batch(self, seqs: list[int], tokens: list[int]) -> np.ndarray:
        """One colibri_eval_batch call; the logits of each sequence's last token, in sequence order."""
        s, toks = np.asarray(seqs, dtype=np.int32), np.asarray(tokens, dtype=np.int32)
        out = np.zeros((len(set(seqs)), self.info.n_vocab), dtype=np.float32)
        LIB.check(
            LIB.colibri_eval_batch(self.ctx, N.i32_ptr(s), N.i32_ptr(toks), len(toks), None, N.f32_ptr(out))
        )
        return out


def _run(path: Path, **opts: object) -> tuple[np.ndarray, np.ndarray, np.ndarray, N.StatsC, int]:
    e = _Ctx(path, **opts)
    try:
        logits = e.eval(TOKS)
        ids, w = e.routing(len(TOKS))
        return logits, ids, w, e.stats(), int(e.plan().context_bytes)
    finally:
        e.close()


def _by_hand(w: np.ndarray, p: float, renorm: bool) -> tuple[np.ndarray, np.ndarray]:
    """Keep mask and weights of the rule: heaviest first until the share reaches p (at least one)."""
    keep = np.zeros(w.shape, dtype=bool)
    out = np.zeros_like(w)
    for t in range(w.shape[0]):
        order = np.argsort(-w[t], kind="stable")
        total, kept = w[t].sum(), 0.0
        for n, j in enumerate(order):
            if n > 0 and kept >= p * total:
                break
            keep[t, j] = True
            kept += w[t, j]
        out[t] = np.where(keep[t], w[t] * (total / kept if renorm else 1.0), 0.0)
    return keep, out


def test_mass_one_is_exact(models: dict[str, Path]) -> None:
    ref, ref_ids, ref_w, _, _ = _run(models["norm"])
    same, ids, w, st, _ = _run(models["norm"], mass=1.0)
    assert np.array_equal(ref, same)
    assert np.array_equal(ref_ids, ids) and np.array_equal(ref_w, w)
    assert st.experts_computed == len(TOKS) * ids.shape[1] * 4


@pytest.mark.parametrize("kind", ["norm", "raw"])
def test_mass_keeps_the_experts_computed_by_hand(models: dict[str, Path], kind: str) -> None:
    _, ref_ids, ref_w, _, _ = _run(models[kind])
    p = 0.6
    logits, ids, w, st, _ = _run(models[kind], mass=p)
    # layer 0's router sees the same input as in the exact run, so its choice is exactly computable
    keep, want = _by_hand(ref_w[:, 0].astype(np.float64), p, renorm=kind == "norm")
    assert np.array_equal(ids[:, 0], np.where(keep, ref_ids[:, 0], -1))
    np.testing.assert_allclose(w[:, 0], want, rtol=1e-5, atol=1e-7)
    assert 1 <= keep.sum(-1).min() and keep.sum(-1).mean() < 4
    n_kept = (ids >= 0).sum(-1)
    assert n_kept.min() >= 1 and n_kept.mean() < 4  # fewer, never none
    assert st.experts_computed == int(n_kept.sum())
    if kind == "norm":  # a normalising router's kept weights sum to 1 again
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
    assert np.isfinite(logits).all()


def test_mass_streamed_matches_resident(models: dict[str, Path]) -> None:
    a, ids_a, _, _, _ = _run(models["norm"], mass=0.7, n_batch=1)
    b, ids_b, _, st, _ = _run(models["norm"], slots=4, mass=0.7, n_batch=1)
    assert st.expert_slots == 4 and st.expert_misses > 0
    assert np.array_equal(ids_a, ids_b)
    assert np.array_equal(a, b)  # a store changes no value


ENTRY = 3 * 256 * 84  # one expert's copy: 3 matrices of 256 rows of 256 at Q2_K (84 bytes per 256)
WINDOW = (ENTRY + 2 * 4095) // 4096 * 4096  # its scratch: the page-aligned window it is read into in place


def test_lowbit_sidecar_round_trip(models: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    shutil.copy(models["norm"], path)
    side = write_lowbit_sidecar(path, "q2_k", threads=2)
    assert side == Path(f"{path}.lowbit")
    assert side.stat().st_size == 96 + 2 * 8 * ENTRY  # 2 layers x 8 experts + the header

    exact, _, _, st0, ctx0 = _run(path, slots=4, n_batch=1)
    # a threshold below every weight never takes a copy: exact
    same, _, _, st, ctx1 = _run(path, slots=4, n_batch=1, lowbit=side, weight=1e-9)
    assert st.lowbit_computed == 0
    assert np.array_equal(exact, same)
    assert ctx1 - ctx0 == 4 * WINDOW  # the ledger counts the scratch of top-k copies (page windows)
    # every missing expert from its copy: close to exact, not equal, with fewer bytes read
    low, _, _, st, _ = _run(path, slots=4, n_batch=1, lowbit=side, weight=1.0)
    assert st.lowbit_computed > 0
    assert st.lowbit_bytes_read == st.lowbit_computed * ENTRY
    assert st.expert_bytes_read + st.lowbit_bytes_read < st0.expert_bytes_read
    a = exact - exact.max(-1, keepdims=True)
    b = low - low.max(-1, keepdims=True)
    la = a - np.log(np.exp(a).sum(-1, keepdims=True))
    lb = b - np.log(np.exp(b).sum(-1, keepdims=True))
    kl = (np.exp(la) * (la - lb)).sum(-1)
    assert float(np.abs(exact - low).max()) > 0
    # Q2_K of Gaussian random weights errs by ~30% per weight: every missing expert of every decode
    # step from its copy measured mean KL 0.27 here (IQ4_XS: 0.02, the share of the squared errors).
    assert float(kl.mean()) < 0.6, kl.mean()
    # a prefill chunk below every weight: exact
    pre_exact = _run(path, slots=4, n_batch=64)[0]
    pre, _, _, st, _ = _run(path, slots=4, n_batch=64, lowbit=side, weight=1e-9)
    assert st.lowbit_computed == 0 and np.array_equal(pre, pre_exact)
    # a decode step that takes copies allocates nothing
    e = _Ctx(path, slots=4, lowbit=side, weight=1.0)
    try:
        e.eval(TOKS[:8])
        before = e.stats().lowbit_computed
        for t in TOKS[8:16]:
            e.eval([t], all_logits=False)
            assert e.stats().allocs_last_eval == 0
        assert e.stats().lowbit_computed > before
    finally:
        e.close()


def _cached_pages(path: Path) -> tuple[int, int]:
    """(pages of path in the page cache, pages of path), from mincore(2) over a map that touches nothing."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    c = ctypes
    libc.mmap.argtypes = [c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_int, c.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size, page = path.stat().st_size, os.sysconf("SC_PAGE_SIZE")
    n = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        vec = ctypes.create_string_buffer(n)
        try:
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw), n


def _drop_cached(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # written pages are dirty until written back, and dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_lowbit_copies_are_not_kept_in_the_page_cache(models: dict[str, Path], tmp_path: Path) -> None:
    """Issue 11 item 5, nothing cached twice: a copy read into the scratch leaves no page of the sidecar
    in the page cache (only the header page the load's check reads), so under a cgroup cap the copies do
    not compete with the slots; the output is the same with the file in the page cache or not."""
    path = tmp_path / "m.gguf"
    shutil.copy(models["norm"], path)
    side = write_lowbit_sidecar(path, "q2_k", threads=2)
    _drop_cached(side)
    cached, pages = _cached_pages(side)
    assert cached == 0, f"{tmp_path}'s file system keeps {cached} of {pages} pages after DONTNEED (tmpfs?)"
    low, _, _, st, _ = _run(path, slots=4, n_batch=1, lowbit=side, weight=1.0)
    assert st.lowbit_bytes_read >= 8 * os.sysconf("SC_PAGE_SIZE")  # the copies span many pages
    cached, _ = _cached_pages(side)
    assert cached <= 1, f"{cached} of {pages} pages of the sidecar stay cached after the copies were read"
    # the same copies read again with the sidecar in the page cache (someone else read it): the same logits
    with side.open("rb") as f:
        f.read()
    again, _, _, st2, _ = _run(path, slots=4, n_batch=1, lowbit=side, weight=1.0)
    assert st2.lowbit_computed == st.lowbit_computed and np.array_equal(low, again)


def test_lowbit_copies_in_a_chunk_of_tokens(models: dict[str, Path], tmp_path: Path) -> None:
    """A chunk of several tokens (a prefill, a batched decode step) takes an expert's copy when the expert
    has no slot and its largest routing weight over the chunk's tokens is below the threshold."""
    path = tmp_path / "m.gguf"
    shutil.copy(models["norm"], path)
    side = write_lowbit_sidecar(path, "q2_k", threads=2)
    exact, ids0, w0, _, _ = _run(path, slots=4, n_batch=64)
    # a threshold between the experts' largest weights at layer 0, so that some take copies and some not
    chosen = [w0[:, 0][ids0[:, 0] == e] for e in range(8)]
    top = sorted(float(w.max()) for w in chosen if w.size)
    weight = (top[1] + top[2]) / 2
    got, ids, w, st, _ = _run(path, slots=4, n_batch=64, lowbit=side, weight=weight)
    # one chunk of 48 tokens in a fresh store of 4 slots: no expert of layer 0 has a slot when it is routed,
    # and layer 1 finds only layer 0's experts in them, so the copies taken are those of the rule
    want = 0
    for layer in range(ids.shape[1]):
        for e in range(8):
            mine = w[:, layer][ids[:, layer] == e]
            want += int(mine.size > 0 and float(mine.max()) < weight)
    assert 2 <= st.lowbit_computed == want < 16
    assert st.lowbit_bytes_read == st.lowbit_computed * ENTRY
    assert not np.array_equal(got, exact) and np.isfinite(got).all()
    # every missing expert from its copy: more copies than the scratch holds at once (top-k), in turns
    _, _, _, st, _ = _run(path, slots=4, n_batch=64, lowbit=side, weight=1.0)
    assert st.lowbit_computed == 16
    # a batched decode step (two sequences, one token each) is such a chunk; below every weight it stays
    # bit-identical to each sequence alone
    for weight, copies in ((1e-9, False), (1.0, True)):
        e = _Ctx(path, slots=4, lowbit=side, weight=weight, n_seq=2)
        try:
            rows = e.eval_batch([0] * 8 + [1] * 8, TOKS[:8] + TOKS[8:16])
            before = e.stats().lowbit_computed
            step = e.eval_batch([0, 1], [TOKS[20], TOKS[21]])
            assert (e.stats().lowbit_computed > before) == copies
        finally:
            e.close()
        if not copies:
            for seq, prompt in ((0, TOKS[:8]), (1, TOKS[8:16])):
                alone = _Ctx(path, slots=4, lowbit=side, weight=weight)
                try:
                    assert np.array_equal(alone.eval(prompt, all_logits=False)[0], rows[seq])
                    assert np.array_equal(alone.eval([TOKS[20 + seq]], all_logits=False)[0], step[seq])
                finally:
                    alone.close()


@pytest.mark.parametrize(("qtype", "entry", "bound"), [("q2_k", ENTRY, 0.4), ("iq4_xs", 3 * 256 * 136, 0.12)])
def test_lowbit_copy_is_the_expert(
    models: dict[str, Path], tmp_path: Path, qtype: str, entry: int, bound: float
) -> None:
    """Each entry is its expert's three matrices at the low-bit type, in (layer, expert) order."""
    import gguf

    path = tmp_path / "m.gguf"
    shutil.copy(models["norm"], path)
    data = write_lowbit_sidecar(path, qtype).read_bytes()
    assert len(data) == 96 + 2 * 8 * entry
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    code = {"q2_k": 10, "iq4_xs": 23}[qtype]  # ggml type ids
    for layer, e in ((0, 0), (1, 5)):
        at = 96 + (layer * 8 + e) * entry
        for i, name in enumerate(("gate", "up", "down")):
            t = tensors[f"blk.{layer}.ffn_{name}_exps.weight"]
            want = gguf.quants.dequantize(np.asarray(t.data)[e], t.tensor_type).astype(np.float32)
            got = np.zeros(want.size, dtype=np.float32)
            part = data[at + i * entry // 3 : at + (i + 1) * entry // 3]
            LIB.check(LIB.colibri_dequantize(code, part, len(part), N.f32_ptr(got), got.size))
            rel = np.sqrt(((got - want.reshape(-1)) ** 2).mean() / (want**2).mean())
            assert rel < bound, (layer, e, name, rel)


def test_lowbit_sidecar_of_another_model_refused(models: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    shutil.copy(models["norm"], path)
    other = write_lowbit_sidecar(models["other"], "iq4_xs", threads=1)
    with pytest.raises(EngineError, match="written for another model"):
        _run(path, slots=4, lowbit=other, weight=0.5)


def test_lowbit_read_error_is_an_error_and_the_next_step_works(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """A copy that cannot be read (the sidecar cut short after it was checked) fails the step with an I/O
    error naming the layer and expert, in a decode step and in a chunk, leaves the position where it was,
    and once the file is whole again the next steps take copies as before."""
    path = tmp_path / "m.gguf"
    shutil.copy(models["norm"], path)
    side = write_lowbit_sidecar(path, "q2_k", threads=2)
    data = side.read_bytes()
    e = _Ctx(path, slots=4, lowbit=side, weight=1.0)
    try:
        e.eval(TOKS[:8])
        with side.open("r+b") as f:
            f.truncate(96)  # the header only: every copy's read comes up short
        for step in ([TOKS[8]], TOKS[8:12]):
            with pytest.raises(EngineError, match="low-bit sidecar: reading layer"):
                e.eval(step)
            assert e.n_past() == 8
        side.write_bytes(data)
        before = e.stats().lowbit_computed
        assert np.isfinite(e.eval([TOKS[8]])).all() and np.isfinite(e.eval(TOKS[9:12])).all()
        assert e.n_past() == 12 and e.stats().lowbit_computed > before
    finally:
        e.close()


def test_lowbit_sidecar_damaged_refused(models: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    shutil.copy(models["norm"], path)
    side = write_lowbit_sidecar(path, "q2_k")
    data = side.read_bytes()
    cases = [
        (data[:-100], "truncated: .* its header says"),
        (data[:40], "truncated: 40 bytes"),
        (data + b"x", "longer than its entries"),
        (data[:50] + bytes([data[50] ^ 1]) + data[51:], "checksum"),
        (b"GGUF" + data[4:], "not a low-bit expert sidecar"),
    ]
    for damaged, message in cases:
        side.write_bytes(damaged)
        with pytest.raises(EngineError, match=message):
            _run(path, slots=4, lowbit=side, weight=0.5)
    with pytest.raises(EngineError, match="needs lowbit_weight > 0"):
        _run(path, slots=4, lowbit=side, weight=0.0)
    with pytest.raises(EngineError, match="needs a lowbit_experts sidecar"):
        _run(path, slots=4, weight=0.5)
    with pytest.raises(EngineError, match=r"expert_mass 1.5 is not in \(0, 1\]"):
        _run(path, mass=1.5)


def test_lowbit_write_refuses_bad_input(models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="choose one of"):
        write_lowbit_sidecar(models["norm"], "q8_0")
    with pytest.raises(FileNotFoundError):
        write_lowbit_sidecar(tmp_path / "missing.gguf")
    dense = tmp_path / "dense.gguf"
    make_tiny_model(dense, "llama", wtype="Q8_0")
    with pytest.raises(EngineError, match="no routed experts"):
        write_lowbit_sidecar(dense)
    assert not Path(f"{dense}.lowbit").exists()
    f32 = tmp_path / "f32.gguf"  # float experts: the copies would need other activations
    make_tiny_model(f32, "qwen3moe", wtype="F32", n_embd=256, n_ff_exp=256, n_expert=8, n_expert_used=4)
    side = write_lowbit_sidecar(f32)
    with pytest.raises(EngineError, match="float type"):
        _run(f32, slots=4, lowbit=side, weight=0.5)


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"expert_mass": 0}, r"expert_mass must be in \(0, 1\]"),
        ({"expert_mass": 1.5}, r"expert_mass must be in \(0, 1\]"),
        ({"expert_mass": "x"}, "expert_mass must be a number"),
        ({"expert_mass": True}, "expert_mass must be a number"),
        ({"lowbit_experts": 0}, "lowbit_experts must be a routing weight > 0"),
        ({"lowbit_experts": -1}, "lowbit_experts must be a finite number >= 0"),
        ({"lowbit_experts": float("nan")}, "lowbit_experts must be a finite number"),
    ],
)
def test_options_validated(opts: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoadOptions(**opts)


def test_load_options_reach_the_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The bundled model through colibri_backend.load and the CLI: the options are applied, the
    sidecar is found next to the model, and a missing one is a clear error."""
    from colibri_backend.cli import main

    path = tmp_path / "bundled.gguf"
    shutil.copy(default_model_path(), path)
    ids = list(range(40, 72))
    m = colibri_backend.load(path, context_length=64, memory_budget=0)
    ref = m.logits(ids)
    m.close()
    m = colibri_backend.load(path, context_length=64, memory_budget=0, expert_mass=0.5)
    fewer = m.logits(ids)
    kept = (m.routing()[0] >= 0).sum(-1)
    m.close()
    assert kept.min() >= 1 and kept.mean() < 2  # top-2, some tokens keep one
    assert not np.array_equal(ref, fewer)
    with pytest.raises(FileNotFoundError, match="lowbit-sidecar"):
        colibri_backend.load(path, context_length=64, expert_slots=4, lowbit_experts=0.5)
    rc = main(
        [
            "quantize",
            str(default_model_path()),
            str(tmp_path / "re.gguf"),
            "--type",
            "q8_0",
            "--allow-requantize",
            "--lowbit-sidecar",
            "q2_k",
            "--no-progress",
        ]
    )
    assert rc == 0
    re_path = tmp_path / "re.gguf"
    assert Path(f"{re_path}.lowbit").is_file()
    m = colibri_backend.load(re_path, context_length=64, expert_slots=4, batch_size=1, lowbit_experts=0.5)
    m.logits(ids)
    assert m.stats()["lowbit_computed"] > 0
    m.close()
    with pytest.raises(SystemExit) as exc:
        main(["run", str(path), "--expert-mass", "2", "-p", "x"])
    assert exc.value.code == 2
    assert "expert_mass must be in (0, 1]" in capsys.readouterr().err
