"""Routing-trace replay (colibri_replay_routing, one decode step per token; batched steps in
test_replay_batched.py), the hashed token-table predictor and the lookahead depth, through the C API
(ctypes) on tiny MoE GGUF files.

Replay runs a recorded routing through a real expert store (real reads from the model file), so
its hit and miss counts are what a live run with that routing would see; with prefetching off they
are deterministic, which is what lets these tests state exact numbers.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from engine_reference import make_tiny_model

from colibri_backend import _native as N
from colibri_backend.errors import EngineError
from colibri_backend.optimum import belady

LIB = N.load_library()
N_CTX, N_BATCH, THREADS = 64, 16, 2
SPEC = dict(wtype="Q8_0", n_expert=8, n_expert_used=2, n_embd=64, n_layer=4, n_ff_exp=1024, head_dim=32)


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("replay") / "mixtral.gguf"
    make_tiny_model(path, "mixtral", seed=11, **SPEC)
    return path


class Model:
    """An open model for replays and plans."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle = ctypes.c_void_p()
        LIB.check(LIB.colibri_model_open(os.fsencode(path), ctypes.byref(self.handle)))
        info = N.ModelInfoC()
        LIB.check(LIB.colibri_model_get_info(self.handle, ctypes.byref(info)))
        self.info = info

    def close(self) -> None:
        LIB.colibri_model_close(self.handle)

    def params(
        self, slots: int, policy: int = N.POLICY_LFU, prefetch: int = 0, **kw: object
    ) -> N.ContextParamsC:
        """Context params whose plan has exactly `slots` expert slots (found from the memory budget)."""
        p = N.ContextParamsC(THREADS, N_CTX, N_BATCH, 0, policy, prefetch)
        for name, value in kw.items():
            setattr(p, name, value)
        lo, hi = 1, 1 << 34  # the smallest budget whose plan has >= slots slots
        while lo < hi:
            mid = (lo + hi) // 2
            p.memory_budget = mid
            if self.plan(p).n_expert_slots >= slots:
                hi = mid
            else:
                lo = mid + 1
        p.memory_budget = lo
        plan = self.plan(p)
        assert plan.n_expert_slots == slots and plan.fits == 1 and plan.all_resident == 0
        return p

    def plan(self, p: N.ContextParamsC) -> N.MemoryPlanC:
        out = N.MemoryPlanC()
        LIB.check(LIB.colibri_plan_model(self.handle, ctypes.byref(p), ctypes.byref(out)))
        return out

    def replay(
        self, p: N.ContextParamsC, ids: np.ndarray, tokens: np.ndarray | None = None, n_seq: int = 1
    ) -> N.StatsC:
        """colibri_replay_routing of ids [n_tokens, L, k] (step-major: n_tokens / n_seq steps of n_seq)."""
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        assert ids.shape[1:] == (self.info.n_layer, self.info.n_expert_used)
        tok_ptr = None
        if tokens is not None:
            tokens = np.ascontiguousarray(tokens, dtype=np.int32)
            tok_ptr = tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        out = N.StatsC()
        ids_ptr = ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        LIB.check(
            LIB.colibri_replay_routing(
                self.handle, ctypes.byref(p), tok_ptr, ids_ptr, len(ids), n_seq, ctypes.byref(out)
            )
        )
        return out


@pytest.fixture()
def model(moe: Path) -> Iterator[Model]:
    m = Model(moe)
    yield m
    m.close()


# ---- routing profiles (native/src/profile.h) ----------------------------------------------


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def bucket(token: int, n_buckets: int) -> int:
    if n_buckets == 1:
        return 0
    return ((token * 0x9E3779B1) & 0xFFFFFFFF) >> (32 - (n_buckets.bit_length() - 1))


def write_profile(
    path: Path, model_path: Path, cand: np.ndarray, k: int, share: np.ndarray | None = None
) -> None:
    """A profile with candidates cand[n_buckets][n_layer][n_cand] and shares[n_layer][n_expert]
    (default: uniform, k / n_expert)."""
    n_buckets, n_layer, n_cand = cand.shape
    n_expert = SPEC["n_expert"]
    model_bytes = os.path.getsize(model_path)
    with open(model_path, "rb") as f:
        fingerprint = fnv1a64(f.read(1 << 20))
    head = b"CLBRPRF1" + struct.pack(
        "<6I3Q", 1, n_layer, n_expert, k, n_buckets, n_cand, model_bytes, fingerprint, 1000
    )
    if share is None:
        share = np.full((n_layer, n_expert), k / n_expert)
    share = np.ascontiguousarray(share, dtype="<f4")
    body = head + share.tobytes() + np.ascontiguousarray(cand, dtype="<u2").tobytes()
    path.write_bytes(body + struct.pack("<Q", fnv1a64(body)))


# ---- replay -------------------------------------------------------------------------------


def test_hashed_predictor_with_the_true_routing_is_exact(model: Model, tmp_path: Path) -> None:
    L, X, k = model.info.n_layer, model.info.n_expert, model.info.n_expert_used
    rng = np.random.default_rng(1)
    n_buckets, n_cand = 64, 4
    cand = np.stack([np.stack([rng.permutation(X)[:n_cand] for _ in range(L)]) for _ in range(n_buckets)])
    prof = tmp_path / "true.routing"
    write_profile(prof, model.path, cand, k)
    tokens = rng.integers(0, model.info.n_vocab, 40).astype(np.int32)
    # every token routes to its bucket's first k candidates: the profile knows the routing
    ids = np.stack([cand[bucket(int(t), n_buckets), :, :k] for t in tokens])
    p = model.params(3 * k, prefetch=N.PREFETCH_HASHED, routing_profile=os.fsencode(prof))
    s = model.replay(p, ids, tokens)
    n = len(tokens) * L * k
    assert s.hashed_predicted == s.hashed_correct == s.hashed_actual == n  # precision = recall = 1
    assert s.temporal_predicted == 0 and s.lookahead_predicted == 0
    assert s.expert_calls == n and s.expert_hits == n and s.expert_misses == 0  # every read was a prefetch
    assert s.prefetch_wasted == 0
    assert s.prefetch_issued > 0 and s.prefetch_used + s.prefetch_wasted <= s.prefetch_issued
    assert s.n_decode_tokens == len(tokens)

    # a profile that knows nothing (every bucket names other experts) is scored as such
    wrong = (cand + 1) % X
    for b in range(n_buckets):  # keep the candidates distinct and away from the true top-k
        for layer in range(L):
            true = set(cand[b, layer, :k].tolist())
            wrong[b, layer] = [e for e in range(X) if e not in true][:n_cand]
    write_profile(prof, model.path, wrong, k)
    s = model.replay(p, ids, tokens)
    assert s.hashed_predicted == n and s.hashed_correct == 0 and s.expert_misses > 0


def test_store_holding_every_used_expert_misses_only_on_first_touch(model: Model) -> None:
    L, k = model.info.n_layer, model.info.n_expert_used
    rng = np.random.default_rng(2)
    # 40 tokens routed among experts 0..3 of every layer: 4 * L distinct experts
    ids = np.stack([np.stack([rng.permutation(4)[:k] for _ in range(L)]) for _ in range(40)])
    distinct = {(layer, int(e)) for t in ids for layer in range(L) for e in t[layer]}
    assert len(distinct) == 4 * L
    for policy in (N.POLICY_LFU, N.POLICY_LRU, N.POLICY_REUSE):
        s = model.replay(model.params(4 * L, policy), ids)
        assert s.expert_calls == 40 * L * k
        assert s.expert_misses == len(distinct)
        assert s.expert_hits == s.expert_calls - len(distinct)
        assert s.prefetch_issued == 0 and s.expert_slots == 4 * L
        assert s.expert_bytes_read > 0


def lfu_vs_lru_trace(L: int, n_cycles: int) -> np.ndarray:
    """Layer 0: a hot pair used 10 times, then cycles of two cold pairs and the hot pair again;
    every other layer always uses experts {0, 1}. With 4 slots left to layer 0, LFU keeps the hot
    pair (its frequency is high) while LRU evicts it behind the cold pairs every cycle."""
    layer0 = [[0, 1]] * 10 + [[2, 3], [4, 5], [0, 1]] * n_cycles
    return np.array([[pair] + [[0, 1]] * (L - 1) for pair in layer0], dtype=np.int32)


def test_lfu_and_lru_differ_where_the_policy_matters(model: Model) -> None:
    L, k = model.info.n_layer, model.info.n_expert_used
    n_cycles = 5
    ids = lfu_vs_lru_trace(L, n_cycles)
    slots = 4 + (L - 1) * k  # the other layers keep their pair (the per-layer floor), layer 0 gets 4
    lfu = model.replay(model.params(slots, N.POLICY_LFU), ids)
    lru = model.replay(model.params(slots, N.POLICY_LRU), ids)
    first = k * L + 4  # first touches: every layer's pair, then layer 0's two cold pairs
    # LFU: the cold pairs take turns in two slots (2 misses per cycle after the first one)
    assert lfu.expert_misses == first + 2 * 2 * (n_cycles - 1)
    # LRU: layer 0 cycles through 6 experts in 4 slots, every access misses
    assert lru.expert_misses == k * L + 6 * n_cycles
    assert lfu.expert_misses < lru.expert_misses
    assert lfu.expert_calls == lru.expert_calls == len(ids) * L * k


def test_reuse_keeps_the_hot_pair_as_lfu_does(model: Model) -> None:
    """On LFU's trace above the reuse policy keeps the hot pair too (its use rate outranks the cold
    pairs'), so it misses no more than LFU where LRU misses every access of layer 0."""
    L, k = model.info.n_layer, model.info.n_expert_used
    ids = lfu_vs_lru_trace(L, 5)
    slots = 4 + (L - 1) * k
    lfu = model.replay(model.params(slots, N.POLICY_LFU), ids)
    reuse = model.replay(model.params(slots, N.POLICY_REUSE), ids)
    assert reuse.expert_misses <= lfu.expert_misses < k * L + 6 * 5


def periodic_trace(L: int, n_tokens: int) -> np.ndarray:
    """Layer 0: expert 0 and expert 1 + t % 4 (four experts taking turns, each back after 4 tokens);
    every other layer always experts {0, 1}."""
    return np.array([[[0, 1 + t % 4]] + [[0, 1]] * (L - 1) for t in range(n_tokens)], dtype=np.int32)


def test_reuse_policy_learns_a_period_lfu_and_lru_cannot_use(model: Model) -> None:
    """Three slots for layer 0 (expert 0 and two for the four that take turns): LRU and LFU keep the two
    used last and always need the third, 12 misses in 12 tokens; Belady drops the one due last and hits
    every third token, 8 misses; the reuse policy, once it has seen the period, knows which of the two is
    due within its next two chances and makes Belady's choice (counted by hand, as in test_experts.c).
    Replays of 40 and 52 tokens: their difference leaves the warm-up out."""
    L, k = model.info.n_layer, model.info.n_expert_used
    slots = 3 + (L - 1) * k
    last12 = {}
    for policy in (N.POLICY_LRU, N.POLICY_LFU, N.POLICY_REUSE):
        p = model.params(slots, policy)
        a, b = (model.replay(p, periodic_trace(L, n)).expert_misses for n in (40, 52))
        last12[policy] = b - a
    assert last12 == {N.POLICY_LRU: 12, N.POLICY_LFU: 12, N.POLICY_REUSE: 8}
    optimum = belady(periodic_trace(L, 52), model.info.n_expert, slots).misses
    optimum_40 = belady(periodic_trace(L, 40), model.info.n_expert, slots).misses
    assert optimum - optimum_40 == 8


def test_colibri_replay_accepts_the_reuse_policy(
    moe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from colibri_backend.cli import main
    from colibri_backend.trace import RoutingTrace, write_trace

    L = SPEC["n_layer"]
    ids = periodic_trace(L, 52)
    trace = RoutingTrace(ids, np.full(ids.shape, 0.5, dtype=np.float32), np.zeros(52, dtype=np.int32), {})
    path = write_trace(tmp_path / "periodic.npz", trace)
    slots = 3 + (L - 1) * SPEC["n_expert_used"]
    args = ["replay", str(moe), str(path), "--expert-slots", str(slots), "--prefetch", "none", "--json"]
    got = {}
    for policy in ("lru", "reuse"):
        assert main([*args, "--expert-policy", policy]) == 0
        got[policy] = json.loads(capsys.readouterr().out)
    # options lists what differs from the defaults, and reuse is the default
    assert got["lru"]["options"]["expert_policy"] == "lru" and "expert_policy" not in got["reuse"]["options"]
    assert got["reuse"]["misses"] < got["lru"]["misses"]
    assert got["reuse"]["optimal_misses"] == belady(ids, SPEC["n_expert"], slots).misses
    assert got["reuse"]["share_of_optimum"] > got["lru"]["share_of_optimum"]


def test_bad_traces_and_arguments_are_rejected(model: Model) -> None:
    L, X, k = model.info.n_layer, model.info.n_expert, model.info.n_expert_used
    p = model.params(2 * k)
    good = np.zeros((3, L, k), dtype=np.int32)
    good[:, :, 1] = 1
    model.replay(p, good)
    for bad_id, what in ((X, "outside"), (-1, "outside")):
        bad = good.copy()
        bad[1, 2, 0] = bad_id
        with pytest.raises(EngineError) as err:
            model.replay(p, bad)
        assert err.value.status == "COLIBRI_E_INVALID_ARG"
        assert "token 1, layer 2" in err.value.message and what in err.value.message
    dup = good.copy()
    dup[2, 1, 1] = 0  # expert 0 twice in one (token, layer)
    with pytest.raises(EngineError) as err:
        model.replay(p, dup)
    assert "token 2, layer 1" in err.value.message and "twice" in err.value.message

    unlimited = N.ContextParamsC(THREADS, N_CTX, N_BATCH, 0, 0, 0)  # every expert resident: nothing to stream
    with pytest.raises(EngineError) as err:
        model.replay(unlimited, good)
    assert err.value.status == "COLIBRI_E_INVALID_ARG" and "nothing would stream" in err.value.message

    out = N.StatsC()
    ids_ptr = good.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    assert (
        LIB.colibri_replay_routing(None, ctypes.byref(p), None, ids_ptr, 3, 1, ctypes.byref(out))
        == N.E_INVALID_ARG
    )
    assert LIB.colibri_replay_routing(
        model.handle, ctypes.byref(p), None, ids_ptr, -1, 1, ctypes.byref(out)
    ) == (N.E_INVALID_ARG)
    assert LIB.colibri_replay_routing(model.handle, ctypes.byref(p), None, None, 3, 1, ctypes.byref(out)) == (
        N.E_INVALID_ARG
    )
    for confidence in (1.0, -0.25, float("nan")):  # the engine checks it too, not only LoadOptions
        q = model.params(2 * k)
        q.lookahead_confidence = confidence
        with pytest.raises(EngineError, match=r"lookahead_confidence .* is not in \[0, 1\)"):
            model.replay(q, good)
    guesses = np.full((3, L, 1, k), -1, dtype=np.int32)
    assert LIB.colibri_replay_routing_lookahead(
        model.handle, ctypes.byref(p), None, ids_ptr, None, None, 1, 3, ctypes.byref(out)
    ) == (N.E_INVALID_ARG)
    probs = np.zeros(guesses.shape, dtype=np.float32)
    probs[0, 0, 0, 0] = 2.0  # a probability above 1
    pl = model.params(2 * k, prefetch=N.PREFETCH_LOOKAHEAD)
    assert LIB.colibri_replay_routing_lookahead(
        model.handle,
        ctypes.byref(pl),
        None,
        ids_ptr,
        guesses.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
        probs.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
        1,
        3,
        ctypes.byref(out),
    ) == (N.E_INVALID_ARG)


def test_temporal_replay_predicts_and_scores(model: Model) -> None:
    L, k = model.info.n_layer, model.info.n_expert_used
    ids = lfu_vs_lru_trace(L, 4)
    # LOOKAHEAD is asked for too: a trace has no hidden states, so replay ignores it
    p = model.params(4 + (L - 1) * k, prefetch=N.PREFETCH_TEMPORAL | N.PREFETCH_LOOKAHEAD)
    s = model.replay(p, ids)
    assert s.lookahead_predicted == 0
    # layers 1.. always use {0, 1}: after the first token temporal names them exactly
    assert s.temporal_actual == (len(ids) - 1) * L * k
    assert 0 < s.temporal_correct <= s.temporal_predicted
    assert s.temporal_correct >= (len(ids) - 1) * (L - 1) * k


# ---- live runs: lookahead depth, hashed predictor, no allocation per step ------------------


class Run:
    """A context with explicit params, evaluating a prompt then greedy decode steps."""

    def __init__(self, path: Path, p: N.ContextParamsC) -> None:
        self.model = Model(path)
        self.ctx = ctypes.c_void_p()
        status = LIB.colibri_context_new(self.model.handle, ctypes.byref(p), ctypes.byref(self.ctx))
        if status:
            self.model.close()
            LIB.check(status, "context")

    def close(self) -> None:
        LIB.colibri_context_free(self.ctx)
        self.model.close()

    def eval(self, tokens: list[int]) -> np.ndarray:
        toks = np.asarray(tokens, dtype=np.int32)
        out = np.zeros(self.model.info.n_vocab, dtype=np.float32)
        LIB.check(LIB.colibri_eval(self.ctx, N.i32_ptr(toks), len(toks), N.f32_ptr(out), 0))
        return out

    def greedy(
        self, prompt: list[int], n_new: int, check_allocs: bool = False
    ) -> tuple[list[int], np.ndarray]:
        last = self.eval(prompt)
        ids, steps = [], []
        for _ in range(n_new):
            ids.append(int(np.argmax(last)))
            last = self.eval([ids[-1]])
            steps.append(last)
            if check_allocs:
                assert self.stats().allocs_last_eval == 0
        return ids, np.stack(steps)

    def stats(self) -> N.StatsC:
        s = N.StatsC()
        LIB.check(LIB.colibri_get_stats(self.ctx, ctypes.byref(s)))
        return s

    def expert_stats(self) -> list[N.ExpertStatsC]:
        n_total = self.model.info.n_layer * self.model.info.n_expert
        arr = (N.ExpertStatsC * n_total)()
        n = ctypes.c_int32()
        LIB.check(LIB.colibri_get_expert_stats(self.ctx, arr, n_total, ctypes.byref(n)))
        return list(arr[: n.value])


PROMPT = np.random.default_rng(3).integers(0, 301, 20).tolist()
N_GEN = 10


def test_lookahead_depth_prefetches_more_and_changes_nothing(model: Model) -> None:
    L, k = model.info.n_layer, model.info.n_expert_used
    ref = Run(model.path, N.ContextParamsC(THREADS, N_CTX, N_BATCH))
    try:
        want = ref.greedy(PROMPT, N_GEN)
    finally:
        ref.close()
    got = {}
    for depth in (1, 2, 3):
        run = Run(model.path, model.params(L * k + 2, prefetch=N.PREFETCH_LOOKAHEAD, lookahead_depth=depth))
        try:
            ids, logits = run.greedy(PROMPT, N_GEN, check_allocs=True)
            got[depth] = run.stats()
        finally:
            run.close()
        assert ids == want[0] and np.array_equal(logits, want[1]), f"depth {depth} changed the output"
    for depth in (1, 2, 3):
        # only the next-layer guess is scored, whatever the depth
        assert got[depth].lookahead_predicted == N_GEN * (L - 1) * k
    assert got[2].prefetch_issued > got[1].prefetch_issued
    assert got[3].prefetch_issued > got[1].prefetch_issued


def test_hashed_and_deep_lookahead_decode_allocates_nothing(model: Model, tmp_path: Path) -> None:
    L, X, k = model.info.n_layer, model.info.n_expert, model.info.n_expert_used
    rng = np.random.default_rng(4)
    cand = np.stack([np.stack([rng.permutation(X)[:4] for _ in range(L)]) for _ in range(16)])
    prof = tmp_path / "m.routing"
    write_profile(prof, model.path, cand, k)
    ref = Run(model.path, N.ContextParamsC(THREADS, N_CTX, N_BATCH))
    try:
        want = ref.greedy(PROMPT, N_GEN)
    finally:
        ref.close()
    flags = N.PREFETCH_LOOKAHEAD | N.PREFETCH_TEMPORAL | N.PREFETCH_HASHED
    p = model.params(L * k, prefetch=flags, lookahead_depth=2, routing_profile=os.fsencode(prof))
    run = Run(model.path, p)
    try:
        ids, logits = run.greedy(PROMPT, N_GEN, check_allocs=True)
        s = run.stats()
    finally:
        run.close()
    assert ids == want[0] and np.array_equal(logits, want[1])
    # the hashed guess is made for every layer of every decode step, layer 0 at the step start
    assert s.hashed_predicted == s.hashed_actual == N_GEN * L * k
    assert s.hashed_correct <= s.hashed_predicted
    assert s.lookahead_predicted == N_GEN * (L - 1) * k
    assert s.temporal_actual == N_GEN * L * k


def test_unreadable_model_file_is_an_io_error(moe: Path, tmp_path: Path) -> None:
    copy = tmp_path / "gone.gguf"
    copy.write_bytes(moe.read_bytes())
    m = Model(copy)
    try:
        L, k = m.info.n_layer, m.info.n_expert_used
        p = m.params(2 * k)
        # the store reads experts from the inode the model loaded (a deleted or replaced path does not
        # matter, tests/test_file_changes.py); a file cut short under it fails the reads, as live
        os.truncate(copy, copy.stat().st_size // 8)
        ids = np.tile(np.arange(k, dtype=np.int32), (2, L, 1))
        with pytest.raises(EngineError) as err:
            m.replay(p, ids)
        assert err.value.status == "COLIBRI_E_IO" and "gone.gguf" in err.value.message
        assert "truncated" in err.value.message
    finally:
        m.close()


def test_predictors_never_name_a_dropped_expert(model: Model, tmp_path: Path) -> None:
    """With drop-cold the router never picks the cold experts, so neither may the lookahead (its
    router logits for them are excluded as moe_ffn excludes them) nor the hashed guess (it takes
    the first k candidates the router can still pick)."""
    L, X, k = model.info.n_layer, model.info.n_expert, model.info.n_expert_used
    share = np.zeros((L, X))
    share[:, :4] = k / 4  # experts 4..7 are cold in every layer
    cold = [4, 5]
    cand = np.tile(np.array(cold + [0, 1], dtype=np.int32), (16, L, 1))  # the cold ones listed first
    prof = tmp_path / "cold.routing"
    write_profile(prof, model.path, cand, k, share)
    flags = N.PREFETCH_LOOKAHEAD | N.PREFETCH_HASHED
    p = model.params(L * k, prefetch=flags, lookahead_depth=2, routing_profile=os.fsencode(prof))
    p.drop_cold_share = 0.1
    run = Run(model.path, p)
    try:
        run.greedy(PROMPT, N_GEN, check_allocs=True)
        s = run.stats()
        per = run.expert_stats()
    finally:
        run.close()
    assert s.experts_dropped == 4 * L
    assert s.hashed_predicted == N_GEN * L * k  # k non-cold candidates remain: a full guess
    assert s.prefetch_issued > 0
    for e in per:
        if e.expert >= 4:
            assert e.calls == 0 and e.prefetch_issued == 0, f"expert {e.expert} of layer {e.layer} was named"
