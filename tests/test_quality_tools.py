"""`colibri perplexity` (PPL, KL divergence) and `colibri imatrix` on the trained MoE (tools/train_moe).

The checkpoint is converted to F32 (the base) and Q8_0 once per session; every run uses a few chunks of 64
tokens, so the whole file takes seconds.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from colibri_backend import quality as q
from colibri_backend.cli import main

REPO = Path(__file__).resolve().parent.parent
RELEASE = REPO / "tools" / "train_moe" / "release"
CTX = 64
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps")
PROJECTIONS += ("ffn_down_exps",)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from colibri_backend.convert import convert

    d = tmp_path_factory.mktemp("quality")
    text = d / "text.txt"
    text.write_text((REPO / "docs" / "memory.md").read_text(encoding="utf-8")[:20000], encoding="utf-8")
    return {
        "f32": convert(RELEASE, d / "moe-f32.gguf", "f32", progress=False),
        "q8": convert(RELEASE, d / "moe-q8_0.gguf", "q8_0", progress=False),
        "text": text,
        "dir": d,
    }


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _write_base(
    files: dict[str, Path], base: Path, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The F32 file's KL-divergence base over the test text, written with `args`; its output discarded."""
    argv = ["perplexity", str(files["f32"]), str(files["text"]), *args, "--kl-divergence-base", str(base)]
    assert main(argv) == 0
    capsys.readouterr()


def _imatrix_argv(files: dict[str, Path], out: Path, chunks: int) -> list[str]:
    """`colibri imatrix` of the F32 file over `chunks` chunks of the test text, written to `out`."""
    return [
        "imatrix",
        str(files["f32"]),
        str(files["text"]),
        "-o",
        str(out),
        "--ctx",
        str(CTX),
        "--chunks",
        str(chunks),
    ]


# ---- the math -----------------------------------------------------------------------------------


def test_chunks_follow_llama_perplexity() -> None:
    chunks = q.make_chunks(list(range(10, 110)), 16, None, bos_id=1)
    assert chunks.shape == (6, 16)  # 100 // 16, the rest dropped
    assert (chunks[:, 0] == 1).all() and chunks[1, 1] == 10 + 16 + 1
    assert q.make_chunks(list(range(100)), 16, 2, None).shape == (2, 16)
    assert q.n_scored(16) == 7  # positions 8..14 predict tokens 9..15
    with pytest.raises(ValueError, match="at least one chunk"):
        q.make_chunks(list(range(10)), 16, None, None)


def test_kld_full_and_top_k_against_direct_formula() -> None:
    rng = np.random.default_rng(0)
    v, n = 50, 40
    base = q.log_softmax_rows(rng.normal(size=(n, v)) * 3)
    test = q.log_softmax_rows(np.log(np.exp(base)) + rng.normal(size=(n, v)) * 0.3)
    targets = rng.integers(0, v, size=n)
    direct = (np.exp(base) * (base - test)).sum(1)
    ids = np.broadcast_to(np.arange(v), (n, v))
    full = q.compare_rows(test, targets, -base[np.arange(n), targets], ids, base)
    np.testing.assert_allclose(full["kld"], direct, rtol=1e-9, atol=1e-12)
    assert (full["rest"] == 0).all()
    k = 8
    top = np.argsort(-base, axis=1)[:, :k]
    part = q.compare_rows(test, targets, -base[np.arange(n), targets], top, np.take_along_axis(base, top, 1))
    assert (part["kld"] <= direct + 1e-12).all() and part["kld"].mean() > 0.5 * direct.mean()
    assert (part["rest"] > 0).all()
    np.testing.assert_array_equal(full["same_top"], test.argmax(1) == base.argmax(1))
    np.testing.assert_allclose(
        full["dp"], np.exp(test[np.arange(n), targets]) - np.exp(base[np.arange(n), targets])
    )


def test_ppl_error_is_llama_cpp_formula() -> None:
    nll = np.linspace(1.0, 3.0, 101)
    s = q.ppl_summary(nll)
    assert math.isclose(s["ppl"], math.exp(2.0))
    assert math.isclose(s["ppl_error"], math.exp(2.0) * math.sqrt(nll.var() / 100))


# ---- the command -----------------------------------------------------------------------------------


def test_perplexity_base_and_kld(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from colibri_backend import load

    base_file = files["dir"] / "base.kld"
    common = ["--ctx", str(CTX), "--chunks", "4", "--threads", "2", "--quiet", "--json"]
    r = _json(
        capsys,
        [
            "perplexity",
            str(files["f32"]),
            str(files["text"]),
            *common,
            "--kl-divergence-base",
            str(base_file),
        ],
    )
    assert r["chunks"] == 4 and r["n_tokens"] == 4 * q.n_scored(CTX)
    # the PPL is exp(mean NLL) of the second halves, recomputed here from the engine's logits
    with load(files["f32"], threads=2, context_length=CTX) as m:
        bos = m.tokenizer.bos_token_id if m.tokenizer.add_bos else None
        chunks = q.make_chunks(m.tokenize(files["text"].read_text(encoding="utf-8")), CTX, 4, bos)
        nll = []
        for c in chunks:
            lp = q.log_softmax_rows(m.logits(c))
            nll += [-lp[j, c[j + 1]] for j in range(CTX // 2, CTX - 1)]
        n_vocab = m.info.n_vocab
    assert math.isclose(r["ppl"], math.exp(np.mean(nll)), rel_tol=1e-9)
    assert base_file.stat().st_size == q.file_bytes(4, CTX, n_vocab, n_vocab)
    assert r["kl_divergence_base"]["full"] is True

    # against itself: zero up to float16 storage; the Q8_0 file: small but measurable
    same = _json(capsys, ["perplexity", str(files["f32"]), *common, "--kl-divergence", str(base_file)])[
        "kl_divergence"
    ]
    assert same["kld_mean"] < 1e-4 and same["same_top"] > 0.98 and abs(same["ppl_ratio"] - 1) < 1e-3
    q8 = _json(
        capsys,
        ["perplexity", str(files["q8"]), str(files["text"]), *common, "--kl-divergence", str(base_file)],
    )
    k = q8["kl_divergence"]
    assert k["kld_mean"] > same["kld_mean"] and k["kld_mean"] < 0.05
    assert k["kld_percentiles"]["99"] >= k["kld_percentiles"]["50"] >= k["kld_min"]
    assert 0.9 < k["same_top"] <= 1.0 and math.isclose(k["ppl_ratio"], k["ppl"] / k["ppl_base"], rel_tol=1e-9)

    # the text output prints llama-perplexity's blocks
    assert (
        main(
            ["perplexity", str(files["q8"]), "--ctx", str(CTX), "--quiet", "--kl-divergence", str(base_file)]
        )
        == 0
    )
    out = capsys.readouterr().out
    for line in ("Mean PPL(Q)", "Mean    KLD:", "99.9%   KLD:", "Median  KLD:", "Same top p:", "RMS Δp"):
        assert line in out

    # top-K base: smaller, and a KLD no larger than the full one
    small = files["dir"] / "base16.kld"
    _json(
        capsys,
        [
            "perplexity",
            str(files["f32"]),
            str(files["text"]),
            *common,
            "--kl-divergence-base",
            str(small),
            "--kl-top-k",
            "16",
        ],
    )
    assert small.stat().st_size == q.file_bytes(4, CTX, 16, n_vocab) < base_file.stat().st_size
    k16 = _json(capsys, ["perplexity", str(files["q8"]), *common, "--kl-divergence", str(small)])[
        "kl_divergence"
    ]
    assert k16["kld_mean"] <= k["kld_mean"] * 1.01 and k16["base_rest_mass_mean"] > 0


def test_perplexity_refuses_bad_bases(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    base_file = files["dir"] / "base-bad.kld"
    args = ["--ctx", str(CTX), "--chunks", "2", "--quiet", "--threads", "2"]
    _write_base(files, base_file, args, capsys)
    data = bytearray(base_file.read_bytes())

    truncated = files["dir"] / "truncated.kld"
    truncated.write_bytes(bytes(data[:-10]))
    assert main(["perplexity", str(files["q8"]), *args, "--kl-divergence", str(truncated)]) == 1
    assert "truncated or corrupt" in capsys.readouterr().err

    other = files["dir"] / "other-vocab.kld"
    bad = bytearray(data)
    bad[28] ^= 0xFF  # a byte of the vocabulary fingerprint (header: 8 + 5 * 4 bytes before it)
    other.write_bytes(bytes(bad))
    assert main(["perplexity", str(files["q8"]), *args, "--kl-divergence", str(other)]) == 1
    assert "another tokenizer" in capsys.readouterr().err

    wrong_vocab = files["dir"] / "vocab.kld"
    bad = bytearray(data)
    struct.pack_into("<I", bad, 12, struct.unpack_from("<I", bad, 12)[0] + 1)
    wrong_vocab.write_bytes(bytes(bad))
    assert main(["perplexity", str(files["q8"]), *args, "--kl-divergence", str(wrong_vocab)]) == 1
    assert "truncated or corrupt" in capsys.readouterr().err  # the size no longer fits the header

    other_text = files["dir"] / "other.txt"
    other_text.write_text("something else entirely " * 400, encoding="utf-8")
    assert (
        main(["perplexity", str(files["q8"]), str(other_text), *args, "--kl-divergence", str(base_file)]) == 1
    )
    assert "does not tokenize to the chunks" in capsys.readouterr().err
    assert main(["perplexity", str(files["q8"]), *args]) == 1
    assert "give a TEXT_FILE" in capsys.readouterr().err
    assert not list(files["dir"].glob("*.part"))


def test_kld_refuses_another_models_vocabulary(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from colibri_backend.models import resolve_model

    base_file = files["dir"] / "base-vocab.kld"
    args = ["--ctx", str(CTX), "--chunks", "1", "--quiet", "--threads", "2"]
    _write_base(files, base_file, args, capsys)
    smollm2 = resolve_model("smollm2").gguf
    assert main(["perplexity", str(smollm2), *args, "--kl-divergence", str(base_file)]) == 1
    assert "vocabulary" in capsys.readouterr().err


# ---- imatrix --------------------------------------------------------------------------------------


def test_imatrix_file_and_statistics(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    import gguf

    from colibri_backend import load
    from colibri_backend.imatrix import read_imatrix

    out = files["dir"] / "moe.imatrix.gguf"
    argv = _imatrix_argv(files, out, 3)
    assert main([*argv, "--threads", "2", "--quiet"]) == 0
    assert "PPL" in capsys.readouterr().out

    # the file as llama.cpp's reader sees it: keys, names, F32 shapes [n_cols, n_mat] and [1, n_mat]
    r = gguf.GGUFReader(out)
    assert r.fields["general.type"].contents() == "imatrix"
    assert (
        r.fields["imatrix.chunk_count"].contents() == 3 and r.fields["imatrix.chunk_size"].contents() == CTX
    )
    assert r.fields["imatrix.datasets"].contents() == [str(files["text"])]
    assert "general.architecture" not in r.fields
    names = [t.name for t in r.tensors]  # per weight, sorted by its name: in_sum2 then counts (as llama.cpp)
    weight_names = [n.removesuffix(".in_sum2") for n in names[::2]]
    assert weight_names == sorted(weight_names) and names[1::2] == [n + ".counts" for n in weight_names]
    model = gguf.GGUFReader(files["f32"])
    weights = {t.name: t for t in model.tensors}
    n_layer, n_expert, k = 6, 32, 4
    for layer in range(n_layer):
        for proj in PROJECTIONS:
            name = f"blk.{layer}.{proj}.weight"
            s, c = (next(t for t in r.tensors if t.name == name + sfx) for sfx in (".in_sum2", ".counts"))
            n_mat = n_expert if proj.endswith("_exps") else 1
            assert (
                s.tensor_type == gguf.GGMLQuantizationType.F32
                and c.tensor_type == gguf.GGMLQuantizationType.F32
            )
            assert list(s.shape) == [int(weights[name].shape[0]), n_mat] and list(c.shape) == [1, n_mat]
    assert not any(t.name.startswith(("output.", "token_embd.")) for t in r.tensors)

    im = read_imatrix(out)
    with load(files["f32"], threads=2, context_length=CTX) as m:
        bos = m.tokenizer.bos_token_id if m.tokenizer.add_bos else None
        chunks = q.make_chunks(m.tokenize(files["text"].read_text(encoding="utf-8")), CTX, 3, bos)
        routes = np.concatenate([m.route(c) for c in chunks])  # [tokens, layer, k]
    n_tok = chunks.size
    for layer in range(n_layer):
        assert im.entries[f"blk.{layer}.attn_q.weight"].counts.tolist() == [n_tok]
        want = np.bincount(routes[:, layer].reshape(-1), minlength=n_expert)
        for proj in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            assert im.entries[f"blk.{layer}.{proj}.weight"].counts.tolist() == want.tolist()
        assert want.sum() == n_tok * k
        q_, k_ = im.entries[f"blk.{layer}.attn_q.weight"], im.entries[f"blk.{layer}.attn_k.weight"]
        np.testing.assert_array_equal(q_.sums, k_.sums)  # one input, two matrices
    # layer 0's attention input is RMSNorm(embedding) * attn_norm, computed here from the file's weights
    emb = np.asarray(weights["token_embd.weight"].data, dtype=np.float64)
    norm = np.asarray(weights["blk.0.attn_norm.weight"].data, dtype=np.float64)
    x = emb[chunks.reshape(-1)]
    x = x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-5) * norm
    np.testing.assert_allclose(im.entries["blk.0.attn_q.weight"].sums[0], (x * x).sum(0), rtol=1e-4)


def test_imatrix_refuses_a_streaming_budget(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = files["dir"] / "streamed.imatrix.gguf"
    argv = _imatrix_argv(files, out, 1)
    assert main([*argv, "--quiet", "--expert-slots", "4"]) == 1
    assert "every expert resident" in capsys.readouterr().err
    assert not out.exists() and not list(files["dir"].glob("*.part"))
