"""The benchmark-only routing override (colibri_debug_route_override, colibri_backend.trace.impose_trace), and
decode steps that compute experts in the order their bytes arrive.

The override must really replace the router's choice (the recorded routing equals the imposed rows, position
p taking row p % T), reject bad traces without losing the previous state, and, under a budget that streams,
keep every token and logit bit-identical to the unbudgeted run with the same override: the decode loop now
computes resident experts first and missing ones as they arrive, so this is the test of that too.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri_backend
from colibri_backend.adapters.sampling import SamplingParams
from colibri_backend.errors import EngineError
from colibri_backend.trace import RoutingTrace, impose_trace

REPO = Path(__file__).resolve().parents[1]
V1_TRACE = REPO / "benchmarks" / "traces" / "colibri-moe-v1-heldout.npz"

PROMPT = [int(t) for t in np.random.default_rng(7).integers(10, 4000, 24)]
N_GEN = 16


def skewed_trace(info, n_tokens: int, seed: int = 3) -> RoutingTrace:
    """A trace with a trained router's flavour: per layer, two experts take most tokens; k distinct ids."""
    rng = np.random.default_rng(seed)
    L, X, k = info.n_layer, info.n_expert, info.n_expert_used
    ids = np.empty((n_tokens, L, k), dtype=np.int32)
    for layer in range(L):
        p = rng.dirichlet(np.full(X, 0.3))
        for t in range(n_tokens):
            ids[t, layer] = rng.choice(X, size=k, replace=False, p=p)
    w = rng.random((n_tokens, L, k)).astype(np.float32) + 0.1
    w /= w.sum(-1, keepdims=True)
    return RoutingTrace(ids, w, np.zeros(n_tokens, dtype=np.int32), {"n_expert": X})


def generate(model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    sampling = SamplingParams(
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        seed=1,
        logit_bias={t: -math.inf for t in model.tokenizer.stop_token_ids},
    )
    ids = [ev.token_id for ev in model.generate_tokens(prompt, max_tokens=n, sampling=sampling, stop=None)]
    return ids, model.logits(prompt + ids)


def test_override_replaces_the_routing_and_can_be_turned_off() -> None:
    with colibri_backend.load("colibri-moe", threads=2, context_length=256) as m:
        ref = m.logits(PROMPT)
        natural = m.routing()[0].copy()
        trace = skewed_trace(m.info, 10)  # shorter than the prompt: rows wrap around (p % T)
        impose_trace(m, trace)
        got = m.logits(PROMPT)
        ids, w = m.routing()
        rows = np.arange(len(PROMPT)) % trace.n_tokens
        np.testing.assert_array_equal(ids, trace.ids[rows])
        np.testing.assert_array_equal(w, trace.weights[rows])
        assert not np.array_equal(natural, ids)
        assert not np.array_equal(ref, got)  # the experts' outputs follow the imposed choice
        impose_trace(m, None)
        np.testing.assert_array_equal(m.logits(PROMPT), ref)
        np.testing.assert_array_equal(m.routing()[0], natural)


def test_bad_traces_are_refused_and_the_previous_override_kept() -> None:
    with colibri_backend.load("colibri-moe", threads=2, context_length=256) as m:
        info = m.info
        good = skewed_trace(info, 8)
        impose_trace(m, good)
        out_of_range = skewed_trace(info, 8)
        out_of_range.ids[5, 2, 1] = info.n_expert
        with pytest.raises(EngineError, match=f"token 5, layer 2 names expert {info.n_expert}"):
            impose_trace(m, out_of_range)
        twice = skewed_trace(info, 8)
        twice.ids[1, 0, 1] = twice.ids[1, 0, 0]
        with pytest.raises(EngineError, match="twice"):
            impose_trace(m, twice)
        nan = skewed_trace(info, 8)
        nan.weights[0, 0, 0] = np.nan
        with pytest.raises(EngineError, match="finite"):
            impose_trace(m, nan)
        wrong_k = RoutingTrace(good.ids[:, :, :1], good.weights[:, :, :1], good.tokens, {})
        with pytest.raises(ValueError, match="top-1"):
            impose_trace(m, wrong_k)
        m.logits(PROMPT[:8])
        np.testing.assert_array_equal(m.routing()[0], good.ids)  # the good override is still in place


@pytest.mark.parametrize(("prefetch", "overlap"), [("none", "1"), ("lookahead,temporal", "1"), ("none", "0")])
def test_streamed_decode_under_an_override_is_bit_identical(
    prefetch: str, overlap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLIBRI_DECODE_OVERLAP", overlap)  # 0: wait for every expert, one pool run
    with colibri_backend.load("colibri-moe", threads=2, context_length=256, memory_budget=0) as m:
        trace = skewed_trace(m.info, len(PROMPT) + N_GEN)
        impose_trace(m, trace)
        ref_ids, ref_logits = generate(m, PROMPT, N_GEN)
    with colibri_backend.load(
        "colibri-moe", threads=2, context_length=256, expert_slots="30%", prefetch=prefetch
    ) as m:
        impose_trace(m, trace)
        m.reset_stats()
        ids, logits = generate(m, PROMPT, N_GEN)
        s = m.stats()
    assert ids == ref_ids
    np.testing.assert_array_equal(logits, ref_logits)
    assert s["expert_slots"] < m.info.n_layer * m.info.n_expert
    assert s["expert_misses"] > 0 and s["expert_hits"] > 0  # both paths of the decode loop ran
    assert s["major_faults_decode"] >= 0 and "prefetch_dropped" in s


def test_colibri_memory_budget_is_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """COLIBRI_MEMORY_BUDGET (what benchmarks/capped_sweep.py sets to cap - overhead) is a budget given: the
    context gets exactly it, not it plus the resident copy the measured default gives back (which made the
    capped sweep's children outgrow their cgroup). The prefix cache's share comes out of it: engine and
    cache together get exactly the budget."""
    with colibri_backend.load("colibri-moe", memory_budget=0) as m:
        full = m.memory_plan()["total_bytes"]
    budget = full * 3 // 4
    monkeypatch.setenv("COLIBRI_MEMORY_BUDGET", str(budget))
    with colibri_backend.load("colibri-moe", threads=2) as m:
        cache = m.prefix_cache.max_bytes
        assert m.stats()["memory_budget"] + cache == budget
        assert m.memory_plan()["total_bytes"] + cache <= budget
    with colibri_backend.load("colibri-moe", threads=2, prefix_cache_size=0) as m:
        assert m.stats()["memory_budget"] == budget


def test_bench_r_has_the_trace_models_counts(tmp_path: Path) -> None:
    """make_bench_models.py's routed spec: bench-A's expert size with a trace's layer and expert counts."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import make_bench_models as mbm
    finally:
        sys.path.pop(0)
    v1 = mbm.spec_like_trace(V1_TRACE)
    assert v1 == mbm.SPECS["bench-r"]
    assert (v1.n_layer, v1.n_expert, v1.n_expert_used) == (6, 8, 2)
    a = mbm.SPECS["bench-a"]
    assert (v1.hidden, v1.n_ff_exp, v1.arch) == (a.hidden, a.n_ff_exp, a.arch)
    ids = np.tile(np.arange(4, dtype=np.int32), (5, 12, 1))
    path = RoutingTrace(ids, np.full(ids.shape, 0.25, np.float32), np.zeros(5, np.int32), {"n_expert": 32})
    saved = tmp_path / "v2.npz"
    path.save(saved)
    v2 = mbm.spec_like_trace(saved)
    assert (v2.name, v2.n_layer, v2.n_expert, v2.n_expert_used) == ("bench-r-l12-e32-k4", 12, 32, 4)
    assert v2.stamp() != v1.stamp()


def test_a_trace_models_profile_restamped_for_a_bench_file(tmp_path: Path) -> None:
    """make_bench_models.py --profile-from: the trace model's routing profile, written beside a file of the
    same counts as that file's own (the engine checks size and fingerprint), its table unchanged; a file
    of other counts is refused."""
    import shutil

    from colibri_backend.models import resolve_model
    from colibri_backend.profile import profile_path, read_profile

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import make_bench_models as mbm
    finally:
        sys.path.pop(0)
    moe = resolve_model("colibri-moe").gguf
    other = tmp_path / "other.gguf"  # the same tensors, another file: another size and fingerprint
    shutil.copy(moe, other)
    with open(other, "ab") as f:
        f.write(bytes(4096))
    source = profile_path(moe)
    with pytest.raises(ValueError, match="made from another model file"):
        read_profile(source, other)
    written = mbm.restamp_profile(source, other)
    assert written == profile_path(other)
    mine, theirs = read_profile(written, other), read_profile(source, moe)
    np.testing.assert_array_equal(mine.cand, theirs.cand)
    np.testing.assert_array_equal(mine.share, theirs.share)
    options = {"prefetch": "hashed", "warmup_routing": True, "expert_slots": "25%", "threads": 2}
    with colibri_backend.load(other, **options) as m:
        m.next_logits(PROMPT[:4])
        m.next_logits(PROMPT[:5])  # one decode step: every layer's hashed guess
        assert m.stats()["hashed_predicted"] == m.info.n_layer * m.info.n_expert_used
    with pytest.raises(SystemExit, match="profiles 6 layers of 32 experts, top-4"):
        mbm.restamp_profile(source, resolve_model("smollm2").gguf)
