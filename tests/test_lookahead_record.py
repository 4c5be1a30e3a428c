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


def _live_lookahead(moe: Path, confidence: float) -> dict:
    """A teacher-forced decode of TOKENS, one decode step each, prefetching the lookahead's guesses
    two layers ahead under the confidence threshold."""
    options = store_options(SLOTS, "reuse", "lookahead")
    with colibri_backend.load(
        moe, **options, lookahead_depth=2, lookahead_confidence=confidence, threads=2
    ) as m:
        for i in range(len(TOKENS)):
            m.next_logits(TOKENS[: i + 1])
        return m.stats()


def _replayed_lookahead(moe: Path, trace: RoutingTrace, confidence: float) -> dict:
    return colibri_backend.replay_routing(
        moe,
        trace.tokens,
        trace.ids,
        lookahead_ids=trace.lookahead_ids,
        lookahead_probs=trace.lookahead_probs,
        **store_options(SLOTS, "reuse", "lookahead"),
        lookahead_depth=2,
        lookahead_confidence=confidence,
    )


@pytest.mark.parametrize("confidence", [0.0, 0.1])
def test_the_recorded_lookahead_replays_what_a_live_run_guesses(
    moe: Path, trace: RoutingTrace, confidence: float
) -> None:
    """A replay fed the trace's recorded guesses asks the store for what the live run's lookahead asked
    for: the same next-layer guesses, scored the same, under the same confidence threshold."""
    live = _live_lookahead(moe, confidence)
    r = _replayed_lookahead(moe, trace, confidence)
    keys = ("lookahead_predicted", "lookahead_correct", "lookahead_actual")
    assert tuple(r[k] for k in keys) == tuple(live[k] for k in keys)
    # what is scored is the depth-1 guesses at or above the threshold, for layers 1.. of every token
    probs = trace.lookahead_probs[:, : trace.n_layer - 1, 0]
    assert r["lookahead_predicted"] == int((probs >= confidence).sum())
    assert r["lookahead_actual"] == len(TOKENS) * (trace.n_layer - 1) * trace.ids.shape[2]
    assert r["prefetch_issued"] > 0


def test_a_confidence_threshold_asks_for_fewer_and_surer_reads(moe: Path, trace: RoutingTrace) -> None:
    every = _replayed_lookahead(moe, trace, 0.0)
    sure = _replayed_lookahead(moe, trace, 0.1)
    assert 0 < sure["lookahead_predicted"] < every["lookahead_predicted"]
    assert sure["lookahead_precision"] > every["lookahead_precision"]
    assert sure["prefetch_issued"] < every["prefetch_issued"]
    assert sure["prefetch_wasted_bytes"] < every["prefetch_wasted_bytes"]


def test_recorded_guesses_that_cannot_be_replayed_are_refused(moe: Path, trace: RoutingTrace) -> None:
    from colibri_backend.errors import EngineError

    with pytest.raises(EngineError, match="holds 1 layers of lookahead guesses; lookahead_depth 2"):
        colibri_backend.replay_routing(
            moe,
            trace.tokens,
            trace.ids,
            lookahead_ids=trace.lookahead_ids[:, :, :1],
            lookahead_probs=trace.lookahead_probs[:, :, :1],
            **store_options(SLOTS, "reuse", "lookahead"),
            lookahead_depth=2,
        )
    bad = trace.lookahead_ids.copy()
    bad[3, 1, 0, 2] = 99
    with pytest.raises(EngineError, match="token 3, layer 1, depth 1: guess 99"):
        colibri_backend.replay_routing(
            moe,
            trace.tokens,
            trace.ids,
            lookahead_ids=bad,
            lookahead_probs=trace.lookahead_probs,
            **store_options(SLOTS, "reuse", "lookahead"),
        )
    with pytest.raises(ValueError, match="must be \\[T, n_layer, depth, k\\]"):
        colibri_backend.replay_routing(
            moe,
            trace.tokens,
            trace.ids,
            lookahead_ids=trace.lookahead_ids[:5],
            lookahead_probs=trace.lookahead_probs[:5],
            **store_options(SLOTS, "reuse", "lookahead"),
        )
    for wrong in (1.0, -0.1, "often"):
        with pytest.raises(ValueError, match="lookahead_confidence"):
            colibri_backend.LoadOptions(lookahead_confidence=wrong)


def _decode_under(m: colibri_backend.Model, imposed: RoutingTrace) -> dict:
    """Impose the trace, prefill TOKENS (positions 0.. follow its rows; no prefetch in a prefill), then
    one decode step per token at positions T.. (rows 0..): the decode steps' counters."""
    from colibri_backend.trace import impose_trace

    impose_trace(m, imposed)
    m.next_logits(TOKENS)
    m.reset_stats()
    for i in range(len(TOKENS), 2 * len(TOKENS)):
        m.next_logits(TOKENS + TOKENS[: i - len(TOKENS) + 1])
    return m.stats()


def test_an_imposed_trace_brings_its_lookahead_guesses(moe: Path, trace: RoutingTrace) -> None:
    """impose_trace hands the lookahead prefetch the trace's recorded guesses instead of the file's own
    router: guesses rotated by one expert are what a live decode under the override asks for and scores,
    exactly as the replay of those rotated guesses does, and they score worse than the true ones."""
    rotated_ids = np.where(trace.lookahead_ids >= 0, (trace.lookahead_ids + 1) % 32, -1).astype(np.int32)
    rotated = RoutingTrace(
        trace.ids, trace.weights, trace.tokens, dict(trace.meta), rotated_ids, trace.lookahead_probs
    )
    options = store_options(SLOTS, "reuse", "lookahead")
    with colibri_backend.load(moe, **options, lookahead_depth=2, lookahead_confidence=0.06, threads=2) as m:
        live = _decode_under(m, rotated)
    r = _replayed_lookahead(moe, rotated, 0.06)
    keys = ("lookahead_predicted", "lookahead_correct", "lookahead_actual")
    assert tuple(live[k] for k in keys) == tuple(r[k] for k in keys)
    truth = _replayed_lookahead(moe, trace, 0.06)
    assert r["lookahead_predicted"] == truth["lookahead_predicted"]  # the same probabilities pass
    assert r["lookahead_correct"] < truth["lookahead_correct"]
    with pytest.raises(ValueError, match="do not fit the routing"):
        with colibri_backend.load(moe, **options, threads=2) as m:
            m._debug_route_override(trace.ids, trace.weights, (rotated_ids[:3], trace.lookahead_probs[:3]))


def _hashed(moe: Path, trace: RoutingTrace) -> dict:
    """The hashed predictor's counters replayed on `trace` (its tokens key the bundled profile's table)."""
    return colibri_backend.replay_routing(
        moe, trace.tokens, trace.ids, **store_options(SLOTS, "reuse", "hashed"), warmup_routing=True
    )


def test_an_imposed_trace_brings_its_tokens_to_the_hashed_predictor(moe: Path, trace: RoutingTrace) -> None:
    """Under impose_trace the hashed predictor keys its routing profile on the trace's tokens, not on the
    tokens the context evaluates: a live decode of TOKENS under a trace whose tokens are TOKENS rotated
    guesses and scores exactly what the replay of that trace does, which differs from the replay keyed on
    TOKENS themselves."""
    from colibri_backend.errors import EngineError

    shifted = RoutingTrace(trace.ids, trace.weights, np.roll(trace.tokens, 7), dict(trace.meta))
    options = store_options(SLOTS, "reuse", "hashed")
    with colibri_backend.load(moe, **options, warmup_routing=True, threads=2) as m:
        live = _decode_under(m, shifted)
        keys = ("hashed_predicted", "hashed_correct", "hashed_actual")
        replayed = _hashed(moe, shifted)
        assert tuple(live[k] for k in keys) == tuple(replayed[k] for k in keys)
        assert live["hashed_predicted"] == len(TOKENS) * trace.n_layer * trace.ids.shape[2]
        assert _hashed(moe, trace)["hashed_correct"] != live["hashed_correct"]  # the tokens matter
        with pytest.raises(ValueError, match="token ids have shape"):
            m._debug_route_override(trace.ids, trace.weights, tokens=trace.tokens[:-1])
        bad = trace.tokens.copy()
        bad[4] = -3
        with pytest.raises(EngineError, match="token 4 has the negative id -3"):
            m._debug_route_override(trace.ids, trace.weights, tokens=bad)


def test_colibri_replay_replays_the_recorded_lookahead(
    moe: Path, trace: RoutingTrace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from colibri_backend.cli import main

    path = trace.save(tmp_path / "t.npz")
    argv = ["replay", str(moe), str(path), "--expert-slots", SLOTS, "--prefetch", "lookahead", "--json"]
    assert main([*argv, "--lookahead-depth", "2", "--lookahead-confidence", "0.08"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = _replayed_lookahead(moe, trace, 0.08)
    assert got["lookahead_predicted"] == want["lookahead_predicted"] > 0
    assert got["lookahead_precision"] == pytest.approx(want["lookahead_precision"])
    assert got["options"]["lookahead_confidence"] == 0.08
    plain = RoutingTrace(trace.ids, trace.weights, trace.tokens, dict(trace.meta)).save(tmp_path / "p.npz")
    assert main(["replay", str(moe), str(plain), "--expert-slots", SLOTS, "--prefetch", "lookahead"]) == 1
    assert "holds no recorded lookahead guesses" in capsys.readouterr().err
