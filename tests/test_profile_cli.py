"""Routing profiles (colibri_backend/profile.py, `colibri profile`): the file format of
native/src/profile.h byte for byte, checksum and model fingerprint checks, the candidate table
against counts made by hand from the engine's routing, and the command's outputs and errors.

The model is Colibri's bundled MoE (6 layers, 32 experts, top-4, 8192-token vocabulary): tiny, and it
has the tokenizer a text corpus needs.
"""

from __future__ import annotations

import shutil
import struct
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import colibri_backend
from colibri_backend import cli
from colibri_backend import profile as P
from colibri_backend.commands.profile import read_file_list
from colibri_backend.models import bundled_model_path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CONTEXT = 64


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the bundled model (profiles are written next to it)."""
    dst = tmp_path_factory.mktemp("profile_model") / "moe.gguf"
    shutil.copyfile(bundled_model_path("colibri-moe"), dst)
    return dst


@pytest.fixture(scope="module")
def model(model_path: Path):
    with colibri_backend.load(model_path, threads=2, memory_budget=0) as m:
        yield m


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two Python files in a directory tree, plus files a directory scan must skip."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "pkg").mkdir()
    shutil.copyfile(STDLIB / "fnmatch.py", root / "a.py")
    shutil.copyfile(STDLIB / "colorsys.py", root / "pkg" / "b.py")
    (root / "blob.bin").write_bytes(b"\x00\x01binary")  # not a text extension
    (root / "pkg" / "c.py").write_bytes(b"x = 1\x00\x00")  # NUL bytes: binary, skipped
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "d.py").write_text("skipped = True\n")
    return root


def random_profile(seed: int = 0, n_layer: int = 3, n_expert: int = 8, k: int = 2, n_buckets: int = 16):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, 500)
    ids = np.stack([np.stack([rng.permutation(n_expert)[:k] for _ in range(n_layer)]) for _ in tokens])
    return P.profile_from_routing(
        tokens, ids, n_expert, n_buckets=n_buckets, n_cand=4, model_bytes=12345, model_fingerprint=0xDEADBEEF
    )


# ---- format -----------------------------------------------------------------------------------


def test_fnv1a64_reference_values() -> None:
    # The published FNV-1a 64 test vectors.
    assert P.fnv1a64(b"") == 0xCBF29CE484222325
    assert P.fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert P.fnv1a64(b"foobar") == 0x85944171F73967E8


def test_bucket_hash_matches_profile_h() -> None:
    toks = [0, 1, 2, 7, 8191, 65535, 2**31 - 1]
    for nb in (1, 2, 1024, 8192, 1 << 20):
        want = [0 if nb == 1 else ((t * 0x9E3779B1) % 2**32) >> (32 - (nb.bit_length() - 1)) for t in toks]
        assert P.bucket_of(toks, nb).tolist() == want
    assert P.default_buckets(8192) == 8192 and P.default_buckets(8193) == 16384
    assert P.default_buckets(151_936) == 1 << 18 and P.default_buckets(5_000_000) == 1 << 20


def test_round_trip_and_layout(tmp_path: Path) -> None:
    prof = random_profile()
    path = P.write_profile(tmp_path / "x.routing", prof)
    raw = path.read_bytes()
    L, E, B, C = prof.n_layer, prof.n_expert, prof.n_buckets, prof.n_cand
    assert len(raw) == 56 + 4 * L * E + 2 * B * L * C + 8
    assert raw[:8] == b"CLBRPRF1"
    assert struct.unpack_from("<IIIIII", raw, 8) == (1, L, E, 2, B, C)
    assert struct.unpack_from("<QQQ", raw, 32) == (12345, 0xDEADBEEF, 500)
    assert np.frombuffer(raw, "<f4", L * E, 56).tolist() == prof.share.ravel().tolist()
    assert np.frombuffer(raw, "<u2", B * L * C, 56 + 4 * L * E).tolist() == prof.cand.ravel().tolist()
    assert struct.unpack_from("<Q", raw, len(raw) - 8)[0] == P.fnv1a64(raw[:-8])
    back = P.read_profile(path)
    assert back.n_tokens == 500 and back.n_expert_used == 2
    assert back.model_bytes == 12345 and back.model_fingerprint == 0xDEADBEEF
    assert np.array_equal(back.share, prof.share) and np.array_equal(back.cand, prof.cand)
    np.testing.assert_allclose(back.share.sum(axis=1), 2.0, rtol=1e-6)


def test_corruption_is_detected(tmp_path: Path) -> None:
    path = P.write_profile(tmp_path / "x.routing", random_profile())
    raw = bytearray(path.read_bytes())
    bad = tmp_path / "bad.routing"
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x01
    bad.write_bytes(flipped)
    with pytest.raises(ValueError, match="checksum"):
        P.read_profile(bad)
    bad.write_bytes(raw[:-1])
    with pytest.raises(ValueError, match="bytes"):
        P.read_profile(bad)
    bad.write_bytes(b"NOTAPRF1" + raw[8:])
    with pytest.raises(ValueError, match="magic"):
        P.read_profile(bad)
    # A repeated candidate with a valid checksum is still refused.
    body = bytearray(raw[:-8])
    off = 56 + 4 * 3 * 8
    body[off + 2 : off + 4] = body[off : off + 2]
    bad.write_bytes(bytes(body) + struct.pack("<Q", P.fnv1a64(bytes(body))))
    with pytest.raises(ValueError, match="twice"):
        P.read_profile(bad)
    with pytest.raises(FileNotFoundError):
        P.read_profile(tmp_path / "missing.routing")


def test_fingerprint_names_the_model(tmp_path: Path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + bytes(range(256)) * 5000)  # > 1 MiB: only the first MiB counts
    b.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 5000)
    fp, size = P.model_fingerprint(a)
    assert size == a.stat().st_size and fp == P.fnv1a64(a.read_bytes()[: 1 << 20])
    prof = random_profile()
    prof.model_bytes, prof.model_fingerprint = size, fp
    path = P.write_profile(tmp_path / "a.routing", prof)
    assert P.read_profile(path, model_path=a).n_tokens == prof.n_tokens
    with pytest.raises(ValueError, match="another model file"):
        P.read_profile(path, model_path=b)


def test_candidates_by_hand() -> None:
    # One layer, 4 experts, top-2, 2 buckets chosen by the hash: bucket(t) for n_buckets=2 is the
    # top bit of t * 0x9E3779B1 mod 2^32.
    b = P.bucket_of(np.arange(20), 2)
    t0 = [int(t) for t in np.arange(20) if b[t] == 0][:3]
    tokens = np.array(t0)
    ids = np.array([[[0, 1]], [[1, 2]], [[1, 0]]])  # bucket 0: expert 1 x3, 0 x2, 2 x1, 3 x0
    prof = P.profile_from_routing(tokens, ids, 4, n_buckets=2, n_cand=3)
    assert prof.share[0].tolist() == pytest.approx([2 / 3, 1.0, 1 / 3, 0.0])
    assert prof.cand[0, 0].tolist() == [1, 0, 2]
    assert prof.cand[1, 0].tolist() == [1, 0, 2]  # no token there: the layer's hottest
    # Equal counts in a bucket are ordered by the global share, then by id.
    ids = np.array([[[2, 3]], [[0, 3]], [[3, 0]]])  # global: 3 x3, 0 x2, 2 x1
    prof = P.profile_from_routing(tokens, ids, 4, n_buckets=2, n_cand=4)
    assert prof.cand[1, 0].tolist() == [3, 0, 2, 1]
    only = P.profile_from_routing(tokens[:1], np.array([[[2, 1]]]), 4, n_buckets=1, n_cand=4)
    assert only.cand[0, 0].tolist() == [1, 2, 0, 3]  # 1 and 2 once each: by id; 0 and 3 never


def test_bad_dimensions() -> None:
    tokens, ids = np.array([1]), np.array([[[0, 1]]])
    with pytest.raises(ValueError, match="power of two"):
        P.profile_from_routing(tokens, ids, 4, n_buckets=3, n_cand=2)
    with pytest.raises(ValueError, match="n_cand"):
        P.profile_from_routing(tokens, ids, 4, n_buckets=2, n_cand=1)
    with pytest.raises(ValueError, match="n_cand"):
        P.profile_from_routing(tokens, ids, 4, n_buckets=2, n_cand=5)
    with pytest.raises(ValueError, match="empty"):
        P.profile_from_routing(tokens[:0], ids[:0], 4, n_buckets=2, n_cand=2)
    with pytest.raises(ValueError, match="twice"):
        P.profile_from_routing(tokens, np.array([[[3, 3]]]), 4, n_buckets=2, n_cand=2)
    with pytest.raises(ValueError, match="outside"):
        P.profile_from_routing(tokens, np.array([[[0, 4]]]), 4, n_buckets=2, n_cand=2)


def test_chunks_spread_over_the_corpus() -> None:
    docs = [list(range(i * 1000, i * 1000 + 300)) for i in range(10)]  # 10 docs x 300 tokens
    chunks = P.chunk_documents(docs, 100)
    assert len(chunks) == 30 and all(c.size == 100 for c in chunks)
    picked = P.chunk_documents(docs, 100, max_tokens=450)
    assert sum(c.size for c in picked) == 450
    firsts = {int(c[0]) // 1000 for c in picked}
    assert min(firsts) == 0 and max(firsts) == 9  # from the first and the last document
    with pytest.raises(ValueError):
        P.chunk_documents(docs, 0)


def test_dense_model_is_refused() -> None:
    class Dense:
        path = Path("dense.gguf")
        context_length = 64
        info = type("Info", (), {"n_expert": 0, "n_expert_used": 0, "n_layer": 2})()

    with pytest.raises(ValueError, match="dense"):
        P.route_chunks(Dense(), [np.arange(4, dtype=np.int32)])
    with pytest.raises(ValueError, match="dense"):
        P.profile_for_model(Dense(), np.arange(4), np.zeros((4, 2, 1)))


# ---- the engine's routing and the command ---------------------------------------------------------


def hand_routing(model, files: list[Path]) -> tuple[list[int], np.ndarray]:
    """The corpus's tokens and routing the slow, independent way: each file tokenized, cut into
    CONTEXT-token chunks, each chunk through logits() + routing() (the trace path)."""
    tokens: list[int] = []
    routes = []
    for f in files:
        ids = model.tokenize(f.read_text(encoding="utf-8"), add_special_tokens=True)
        for s in range(0, len(ids), CONTEXT):
            chunk = ids[s : s + CONTEXT]
            model.logits(chunk)
            routes.append(model.routing()[0])
            tokens += chunk
    return tokens, np.concatenate(routes)


def test_profile_command_matches_hand_counts(
    model, model_path: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "c.routing"
    rc = cli.main(["profile", str(model_path), str(corpus), "-o", str(out), "--context", str(CONTEXT)])
    assert rc == 0
    captured = capsys.readouterr()
    prof = P.read_profile(out, model_path=model_path)  # fingerprint of this very file
    info = model.info
    assert (prof.n_layer, prof.n_expert, prof.n_expert_used) == (info.n_layer, info.n_expert, 4)
    assert prof.n_buckets == 8192 and prof.n_cand == 8  # defaults: vocabulary 8192, min(32, 2k)

    files = [corpus / "a.py", corpus / "pkg" / "b.py"]  # what the directory scan must keep, in order
    tokens, routes = hand_routing(model, files)
    assert prof.n_tokens == len(tokens)
    assert f"profiled {len(tokens)} tokens of 2 files" in captured.out
    assert "1 of the 3 corpus files were skipped" in captured.out  # pkg/c.py has NUL bytes
    assert "routing the corpus" in captured.err  # progress on stderr

    k, E = 4, info.n_expert
    glob = [Counter() for _ in range(info.n_layer)]
    per = {}
    for t, r in zip(tokens, routes, strict=True):
        bkt = ((t * 0x9E3779B1) % 2**32) >> (32 - 13)
        for layer in range(info.n_layer):
            for e in r[layer]:
                glob[layer][int(e)] += 1
                per.setdefault((bkt, layer), Counter())[int(e)] += 1
    for layer in range(info.n_layer):
        assert prof.share[layer].tolist() == pytest.approx([glob[layer][e] / len(tokens) for e in range(E)])
        for bkt in (b for (b, lay) in per if lay == layer):
            c = per[(bkt, layer)]
            want = sorted(range(E), key=lambda e: (-c[e], -glob[layer][e], e))[: prof.n_cand]
            assert prof.cand[bkt, layer].tolist() == want, (bkt, layer)
    unseen = sorted(set(range(8192)) - {b for b, _ in per})
    for layer in range(info.n_layer):
        hot = sorted(range(E), key=lambda e: (-glob[layer][e], e))[: prof.n_cand]
        assert prof.cand[unseen[0], layer].tolist() == hot and prof.cand[unseen[-1], layer].tolist() == hot
    # The printed recall@k on the corpus is the table's recall on the hand routing.
    recall = P.table_recall(prof, np.array(tokens), routes, k).mean()
    assert f"{100 * recall:5.1f}%" in captured.out


def test_sidecar_and_held_out(model_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    side = P.profile_path(model_path)
    assert side == model_path.with_name("moe.gguf.routing")
    side.unlink(missing_ok=True)
    held = STDLIB / "bisect.py"
    argv = ["profile", str(model_path), str(corpus / "a.py"), "--max-tokens", "300", "--buckets", "1024"]
    rc = cli.main(argv + ["--candidates", "5", "--held-out", str(held), "--quiet"])
    assert rc == 0
    out = capsys.readouterr()
    prof = P.read_profile(side, model_path=model_path)
    assert prof.n_tokens == 300 and prof.n_buckets == 1024 and prof.n_cand == 5
    assert "held-out (1 files)" in out.out and "recall@5" in out.out
    assert "routing the corpus" not in out.err  # --quiet
    side.unlink()


def test_command_errors(
    model_path: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["profile", str(model_path), str(tmp_path / "nope.txt")]) == 1
    assert "not found" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "data.bin").write_bytes(b"abc")
    assert cli.main(["profile", str(model_path), str(empty)]) == 1
    assert "no text files" in capsys.readouterr().err
    blank = tmp_path / "blank.txt"
    blank.write_text("   \n")
    assert cli.main(["profile", str(model_path), str(blank), "-o", str(tmp_path / "x.routing")]) == 1
    assert "empty" in capsys.readouterr().err
    assert cli.main(["profile", str(model_path)]) == 1
    assert "no corpus" in capsys.readouterr().err
    assert (
        cli.main(["profile", str(model_path), str(corpus), "--buckets", "1000", "-o", str(tmp_path / "y")])
        == 1
    )
    assert "power of two" in capsys.readouterr().err
    listing = tmp_path / "list.txt"
    listing.write_text(f"# the corpus\n{corpus / 'a.py'}\n\n")
    assert P.corpus_files(read_file_list(listing)) == [corpus / "a.py"]
    assert cli.main(["profile", str(model_path), "--files-from", str(tmp_path / "nolist")]) == 1
    assert "file list not found" in capsys.readouterr().err


def test_help_lists_the_extensions() -> None:
    helptext = cli.build_parser()._subparsers._group_actions[0].choices["profile"].description
    assert " ".join(P.TEXT_EXTENSIONS) in " ".join(helptext.split())


def test_bundled_profile() -> None:
    """The profile shipped next to the bundled model (docs/memory.md has the command that made it)."""
    gguf = bundled_model_path("colibri-moe")
    prof = P.read_profile(P.profile_path(gguf), model_path=gguf)
    assert prof.n_tokens == 300_000 and prof.n_buckets == 8192 and prof.n_cand == 8
    with colibri_backend.load("colibri-moe", threads=2, expert_slots="40%", warmup_routing=True) as m:
        s = m.stats()
        assert s["routing_profile"] == str(P.profile_path(gguf)) and s["expert_slots"] == 77
