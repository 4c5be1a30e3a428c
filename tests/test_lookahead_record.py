"""The lookahead predictor's guesses recorded into routing traces (colibri_record_lookahead): k distinct
guesses per reachable layer, kept by both trace formats, none for a layer without a router; and a live
teacher-forced decode under the reuse policy gives the counters its trace's replay gives, logits unchanged
by the store. On the bundled colibri-moe (6 layers, 32 experts, top-4)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from replay_policies import replay, store_options  # noqa: E402

import colibri_backend  # noqa: E402
from colibri_backend.models import resolve_model  # noqa: E402
from colibri_backend.trace import RoutingTrace, load_trace, record_trace  # noqa: E402

TEXT = "def mean(data):\n    n = len(data)\n    if n < 1:\n        raise ValueError('mean requires data')\n"
SLOTS = "25%"  # 48 of 192 experts: the cache decides often
TOKENS: list[int] = []


@pytest.fixture(scope="module")
def moe() -> Path:
    return resolve_model("colibri-moe").gguf


@pytest.fixture(scope="module")
def trace(moe: Path) -> RoutingTrace:
    with colibri_backend.load(moe, memory_budget=0, threads=2) as m:
        TOKENS[:] = m.tokenize(TEXT * 3, add_special_tokens=False)
        return record_trace(
            m, token_ids=TOKENS, lookahead_depth=5
        )  # every layer ahead of the first: min(8, layers - 1)


def test_the_record_holds_k_distinct_guesses_per_reachable_layer(trace: RoutingTrace) -> None:
    la, p = trace.lookahead_ids, trace.lookahead_probs
    assert la is not None and p is not None
    T, L, D, k = la.shape
    assert (T, L, D, k) == (len(TOKENS), 6, 5, 4) and trace.meta["lookahead_depth"] == 5 and T > 30
    for il in range(L):
        for d in range(1, D + 1):
            g, q = la[:, il, d - 1], p[:, il, d - 1]
            if il + d >= L:  # past the last layer: nothing guessed
                assert (g == -1).all() and (q == 0).all()
                continue
            assert ((g >= 0) & (g < 32)).all() and all(len(set(row)) == k for row in g)
            assert ((q > 0) & (q <= 1)).all() and (np.diff(q, axis=1) <= 0).all()
    # a guess one layer ahead agrees with the routing far more often than chance (4 of 32)
    hits = [len(set(la[t, il, 0]) & set(trace.ids[t, il + 1])) for t in range(T) for il in range(L - 1)]
    assert np.mean(hits) / k > 0.3


def test_traces_keep_the_record_and_old_ones_still_read(trace: RoutingTrace, tmp_path: Path) -> None:
    for name in ("t.npz", "t.jsonl"):
        back = load_trace(trace.save(tmp_path / name))
        assert back.lookahead_ids is not None and back.lookahead_probs is not None
        assert np.array_equal(back.lookahead_ids, trace.lookahead_ids)
        assert np.array_equal(back.lookahead_probs, trace.lookahead_probs)
    plain = RoutingTrace(trace.ids, trace.weights, trace.tokens, dict(trace.meta))
    for name in ("p.npz", "p.jsonl"):
        back = load_trace(plain.save(tmp_path / name))
        assert back.lookahead_ids is None and "lookahead_depth" not in back.meta
    with pytest.raises(ValueError, match="lookahead"):
        RoutingTrace(trace.ids, trace.weights, trace.tokens, {}, trace.lookahead_ids[:, :, :, :1], None)


def test_live_decode_and_replay_agree_and_logits_do_not_change(moe: Path, trace: RoutingTrace) -> None:
    with colibri_backend.load(moe, memory_budget=0, threads=2) as m:
        want = [m.next_logits(TOKENS[: i + 1]) for i in range(len(TOKENS))]
    with colibri_backend.load(moe, **store_options(SLOTS, "reuse"), threads=2) as m:
        for i in range(len(TOKENS)):  # every token one decode step, as a replay runs it
            assert np.array_equal(m.next_logits(TOKENS[: i + 1]), want[i]), f"the store changed token {i}"
        s = m.stats()
    r = replay(moe, trace, SLOTS, "reuse")
    assert (r["expert_hits"], r["expert_misses"]) == (s["expert_hits"], s["expert_misses"])
    assert r["expert_misses"] > 0  # 25% of the experts: the store decides


def test_a_leading_dense_layer_records_no_guesses(tmp_path: Path) -> None:
    """DeepSeek-V2's layer 0 is dense: its rows hold no guesses, the routed layers' rows do, and its trace
    replays (the dense layer does not touch the store)."""
    import sys

    from colibri_backend.convert import convert

    conformance = Path(__file__).resolve().parent.parent / "conformance_tests"
    if str(conformance) not in sys.path:
        sys.path.insert(0, str(conformance))
    import tiny_models as tm

    spec = tm.SPEC_BY_NAME["deepseek_v2"]
    ckpt = tm.build_checkpoint(spec, tmp_path / "ckpt", tm.build_tokenizer(tmp_path / "tok"))
    gguf = convert(ckpt, tmp_path / "m.gguf", out_type="f32", progress=False)
    ids = tm.token_ids(ckpt, 40)
    with colibri_backend.load(gguf, memory_budget=0, threads=2) as m:
        L, lead = m.info.n_layer, spec.config["first_k_dense_replace"]
        tr = record_trace(m, token_ids=ids, lookahead_depth=L - 1)
    la = tr.lookahead_ids
    assert la is not None and lead == 1 and L >= 2
    assert (la[:, :lead] == -1).all() and (tr.lookahead_probs[:, :lead] == 0).all()
    for il in range(lead, L):
        for d in range(1, L):
            assert ((la[:, il, d - 1] >= 0) == (il + d < L)).all()
    s = replay(gguf, tr, "50%", "reuse")
    assert s["expert_calls"] == len(ids) * (L - lead) * m.info.n_expert_used
