"""Routing traces (colibri_backend.trace, `colibri trace`): file round trips, shapes, renormalised weights,
bad files, and agreement with the router of the transformers model on the same text.

The reference model is Colibri's own trained MoE (tools/train_moe/release, converted to F32 GGUF here), or,
in a checkout without it, the conformance suite's tiny random Mixtral.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import colibri_backend
from colibri_backend import cli
from colibri_backend.convert import convert
from colibri_backend.trace import RoutingTrace, file_sha256, load_trace, record_trace

ROOT = Path(__file__).resolve().parent.parent
RELEASE = ROOT / "tools" / "train_moe" / "release"
CONFORMANCE = ROOT / "conformance_tests"
N_TOKENS = 192  # within the trained context (1024)
SET_AGREEMENT_MIN = 0.99
WEIGHT_TOL = 1e-4


def _checkpoint(root: Path) -> Path:
    if (RELEASE / "config.json").is_file():
        return RELEASE
    if str(CONFORMANCE) not in sys.path:
        sys.path.insert(0, str(CONFORMANCE))
    import tiny_models

    tok = tiny_models.build_tokenizer(root / "tokenizer")
    return tiny_models.build_checkpoint(tiny_models.SPEC_BY_NAME["mixtral"], root / "mixtral", tok)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("trace_ckpt"))


@pytest.fixture(scope="module")
def f32_gguf(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trace_gguf") / "moe.f32.gguf"
    return convert(checkpoint, out, out_type="f32", progress=False)


@pytest.fixture(scope="module")
def model(f32_gguf: Path):
    with colibri_backend.load(f32_gguf, threads=2) as m:
        yield m


def _python_text() -> str:
    """Real Python source (a standard-library module), available offline."""
    return (Path(sysconfig.get_paths()["stdlib"]) / "_threading_local.py").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def trace(model) -> RoutingTrace:
    ids = model.tokenize(_python_text(), add_special_tokens=False)[:N_TOKENS]
    assert len(ids) == N_TOKENS
    return record_trace(model, token_ids=ids)


def test_shapes_and_meta(trace: RoutingTrace, model, f32_gguf: Path) -> None:
    info = model.info
    assert trace.ids.shape == (N_TOKENS, info.n_layer, info.n_expert_used)
    assert trace.weights.shape == trace.ids.shape and trace.weights.dtype == np.float32
    assert trace.tokens.shape == (N_TOKENS,) and trace.ids.dtype == np.int32
    assert trace.ids.min() >= 0 and trace.ids.max() < info.n_expert
    # the k experts of one (token, layer) are distinct
    srt = np.sort(trace.ids, axis=-1)
    assert (np.diff(srt, axis=-1) > 0).all()
    # Mixtral renormalises the top-k softmax: the weights of a (token, layer) sum to 1
    np.testing.assert_allclose(trace.weights.sum(-1), 1.0, atol=1e-5)
    assert (trace.weights > 0).all()
    m = trace.meta
    assert m["model_sha256"] == file_sha256(f32_gguf)
    assert Path(m["model_path"]) == f32_gguf.resolve()
    assert (m["arch"], m["n_layer"], m["n_expert"], m["n_expert_used"]) == (
        "mixtral",
        info.n_layer,
        info.n_expert,
        info.n_expert_used,
    )
    assert m["n_tokens"] == N_TOKENS


@pytest.mark.parametrize("suffix", [".npz", ".jsonl"])
def test_round_trip(trace: RoutingTrace, tmp_path: Path, suffix: str) -> None:
    path = trace.save(tmp_path / f"t{suffix}")
    back = load_trace(path)
    np.testing.assert_array_equal(back.ids, trace.ids)
    np.testing.assert_array_equal(back.weights, trace.weights)  # bit-exact, also through JSON
    np.testing.assert_array_equal(back.tokens, trace.tokens)
    assert back.meta["format"] == "colibri-routing-trace" and back.meta["version"] == 1
    assert {k: back.meta[k] for k in trace.meta} == trace.meta


def test_against_transformers_router(trace: RoutingTrace, checkpoint: Path) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    k = trace.k
    with torch.no_grad():
        out = hf(torch.tensor([trace.tokens.tolist()]), output_router_logits=True)
    assert len(out.router_logits) == trace.n_layer
    same_sets = 0
    max_wdiff = 0.0
    for layer, logits in enumerate(out.router_logits):
        probs = torch.softmax(logits.float(), dim=-1)  # [T, n_expert]
        top_w, top_i = torch.topk(probs, k, dim=-1)
        top_w = (top_w / top_w.sum(-1, keepdim=True)).numpy()
        top_i = top_i.numpy()
        for t in range(trace.n_tokens):
            ours = dict(zip(trace.ids[t, layer].tolist(), trace.weights[t, layer].tolist(), strict=True))
            theirs = dict(zip(top_i[t].tolist(), top_w[t].tolist(), strict=True))
            if set(ours) == set(theirs):
                same_sets += 1
                max_wdiff = max(max_wdiff, max(abs(ours[e] - theirs[e]) for e in ours))
    agreement = same_sets / (trace.n_tokens * trace.n_layer)
    print(f"\n[trace] top-{k} sets identical at {agreement:.2%} of (token, layer); max |dw| {max_wdiff:.2e}")
    assert agreement >= SET_AGREEMENT_MIN
    assert max_wdiff <= WEIGHT_TOL


def test_windows(model, trace: RoutingTrace) -> None:
    """A long text is traced in windows, each one a fresh sequence."""
    win = 64
    w = record_trace(model, token_ids=trace.tokens.tolist(), window=win)
    assert w.meta["window"] == win and w.n_tokens == trace.n_tokens
    # the first window is causal-identical to the same positions of a single-window trace
    np.testing.assert_array_equal(w.ids[:win], trace.ids[:win])
    # the second window routes as if its first token started the text
    alone = record_trace(model, token_ids=trace.tokens[win : 2 * win].tolist())
    np.testing.assert_array_equal(w.ids[win : 2 * win], alone.ids)
    np.testing.assert_array_equal(w.weights[win : 2 * win], alone.weights)
    with pytest.raises(ValueError, match="window"):
        record_trace(model, token_ids=[1, 2, 3], window=model.context_length + 1)


def test_text_matches_token_ids(model) -> None:
    text = "def fibonacci(n):\n    return n"
    a = record_trace(model, text=text)
    b = record_trace(model, token_ids=model.tokenize(text, add_special_tokens=False))
    np.testing.assert_array_equal(a.ids, b.ids)
    assert a.meta["source"] == "text" and b.meta["source"] == "token_ids"
    with pytest.raises(ValueError, match="exactly one"):
        record_trace(model, text=text, token_ids=[1])
    with pytest.raises(ValueError, match="no tokens"):
        record_trace(model, text="")


def test_cli(f32_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src.py"
    src.write_text("import os\n\n\ndef main():\n    print(os.getcwd())\n", encoding="utf-8")
    out = tmp_path / "trace.jsonl"
    rc = cli.main(["trace", "--model", str(f32_gguf), "--file", str(src), "-o", str(out), "--threads", "2"])
    assert rc == 0
    assert "traced" in capsys.readouterr().err
    lines = out.read_text(encoding="utf-8").splitlines()
    header, first = json.loads(lines[0]), json.loads(lines[1])
    assert header["source"] == str(src) and header["n_tokens"] == len(lines) - 1
    assert first["pos"] == 0 and isinstance(first["piece"], str) and first["piece"]
    t = load_trace(out)
    assert t.n_tokens == header["n_tokens"]
    with colibri_backend.load(f32_gguf, threads=2) as m:
        assert t.tokens.tolist() == m.tokenize(src.read_text(encoding="utf-8"), add_special_tokens=False)


def test_cli_errors(f32_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trace", "--model", str(f32_gguf), "--text", "x", "-o", str(tmp_path / "t.csv")]) == 1
    assert ".npz or .jsonl" in capsys.readouterr().err
    missing = tmp_path / "nope.py"
    assert (
        cli.main(["trace", "--model", str(f32_gguf), "--file", str(missing), "-o", str(tmp_path / "t.npz")])
        == 1
    )
    assert "not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --text or --file is required
        cli.main(["trace", "-o", str(tmp_path / "t.npz")])


def test_dense_model_is_refused(tmp_path: Path) -> None:
    class Dense:  # what record_trace reads of a dense model
        path = tmp_path / "dense.gguf"
        info = type("Info", (), {"n_expert": 0, "n_expert_used": 0})()

    with pytest.raises(ValueError, match="not a mixture-of-experts"):
        record_trace(Dense(), token_ids=[1, 2])


def test_bad_files(trace: RoutingTrace, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.npz or \.jsonl"):
        load_trace(tmp_path / "t.txt")
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "absent.npz")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip archive")
    with pytest.raises(ValueError, match="not a readable routing trace"):
        load_trace(junk)
    other = tmp_path / "other.npz"
    np.savez(other, ids=trace.ids, weights=trace.weights, tokens=trace.tokens, meta=np.array("{}"))
    with pytest.raises(ValueError, match="not a Colibri routing trace"):
        load_trace(other)
    good = trace.save(tmp_path / "t.jsonl")
    lines = good.read_text(encoding="utf-8").splitlines()
    cut = tmp_path / "cut.jsonl"
    cut.write_text("\n".join(lines[:10]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="truncated"):
        load_trace(cut)
    future = tmp_path / "future.jsonl"
    future.write_text("\n".join([json.dumps({**json.loads(lines[0]), "version": 99}), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="version 99"):
        load_trace(future)
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("\n".join([lines[0], lines[2], lines[1], *lines[3:]]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="out of order"):
        load_trace(shuffled)
    with pytest.raises(ValueError, match="shape"):
        RoutingTrace(trace.ids, trace.weights[:, :, :1], trace.tokens)


def test_npz_members_that_are_not_arrays(tmp_path: Path) -> None:
    """np.load hands a member that is not a .npy file back as raw bytes; a 1-d meta is no header either."""
    import zipfile

    ok = {"ids": np.zeros((1, 1, 1), np.int32), "weights": np.zeros((1, 1, 1), np.float32)}
    ok["tokens"] = np.zeros(1, np.int32)
    raw = tmp_path / "raw.npz"
    np.savez(raw, **ok)
    with zipfile.ZipFile(raw, "a") as z:
        z.writestr("meta.npy", b"not an array")
    with pytest.raises(ValueError, match="not arrays"):
        load_trace(raw)
    one_d = tmp_path / "one_d.npz"
    np.savez(one_d, **ok, meta=np.array(["{}", "{}"]))
    with pytest.raises(ValueError, match="not a single string"):
        load_trace(one_d)
