"""Batched-step replay (colibri_replay_routing with n_seq > 1) against a simulator of the expert store's
eviction written here, and against Belady's optimum on the same unions.

The simulator restates, in plain Python and without I/O, the eviction rules of experts.c (docs/memory.md,
"The reuse policy" and "Batched steps"): slots taken free-first in index order; per wave the chosen experts
pinned; the per-layer floor on the first pass; LRU stamps by expert id per wave; LFU's decayed counts; the
reuse policy's gap histograms, follow table and use rates; and in a step of several tokens the scan guard
(experts read in this step go first, the latest read first). A decode step (one token) holds every chosen
expert before it acquires them (ffn.c's decode_experts), a step of several tokens acquires the union in waves
(chunk_experts). No prefetch, no profile: what the replay then counts is deterministic, so the test asks for
equal counts (hits and misses are integers: compared exactly). The simulator's victim choices compare LFU
and reuse scores as doubles computed in the same order as the C code; experts.c is built with
-ffp-contract=off (native/CMakeLists.txt), so no CPU fuses a*b+c into an FMA there and both sides round
alike. The decay factors 0.5^(g / 32) come from native/src/decay_table.h on both sides (its generator's
values here, scaled by powers of two, as experts.c's store_decay does), not from a libm pow() that may round
differently per CPU.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from engine_reference import make_tiny_model
from repo_tools import load_tool
from test_replay_native import SPEC, Model

from colibri_backend import _native as N
from colibri_backend.errors import EngineError
from colibri_backend.optimum import access_sequence, belady
from colibri_backend.replay import interleave

LIB = N.load_library()
L, X, K = SPEC["n_layer"], SPEC["n_expert"], SPEC["n_expert_used"]

# experts.h
LFU_HALF_LIFE = 32
REUSE_GAPS = 32
REUSE_HORIZON = 2
REUSE_PRIOR = 8.0
# decay_table.h's entries, 0.5^(k / LFU_HALF_LIFE) for k = 0 .. LFU_HALF_LIFE - 1, from the generator that
# writes the header (tests/test_decay_table.py holds the header to its output byte for byte)
DECAY_TABLE = load_tool("gen_decay_table").table(LFU_HALF_LIFE)


def decay(g: int) -> float:
    """experts.c's store_decay: 0.5^(g / LFU_HALF_LIFE), a table entry times a power of two (exact)."""
    halves = g // LFU_HALF_LIFE
    return 0.0 if halves > 1021 else math.ldexp(DECAY_TABLE[g % LFU_HALF_LIFE], -halves)


@dataclass
class Slot:
    layer: int = -1  # -1: free
    expert: int = -1
    loaded: int = 0  # the step that read it
    freq: float = 0.0
    last_tick: int = 0
    last_use: int = 0
    pinned_wave: int = 0
    demand: bool = False  # read by a decode step's hold, not yet acquired


class StoreSim:
    """The expert store's hits and misses without I/O (policy: "lru", "lfu" or "reuse"; guard: the reuse
    policy's scan guard, on as in experts.c, off to show what it changes)."""

    def __init__(self, n_slots: int, policy: str, guard: bool = True) -> None:
        self.policy, self.reuse, self.guard = policy, policy == "reuse", guard
        self.slots = [Slot() for _ in range(n_slots)]
        self.where: dict[tuple[int, int], int] = {}
        self.layer_count = [0] * L
        self.floor = min(n_slots // L, K)
        self.decay = decay(1)
        self.tick = self.step = self.wave = self.use_base = self.use_clock = 0
        self.decode_step = False
        self.hits = self.misses = 0
        # the reuse policy's statistics
        self.seen = [0] * (L * X)
        self.rate = [0.0] * (L * X)
        self.follow = [0.0] * ((L - 1) * X * X)
        self.follow_n = [0.0] * (L * X)
        q, left = K / X, 1.0
        self.gap = []
        for _ in range(L):
            g = []
            left = 1.0
            for _ in range(REUSE_GAPS):
                g.append(REUSE_PRIOR * left * q)
                left *= 1.0 - q
            g.append(REUSE_PRIOR * left)
            self.gap.append(g)
        self.surv: list[list[float]] = []
        self.refresh()

    # ---- the reuse policy's statistics
    def refresh(self) -> None:
        self.surv = []
        for g in self.gap:
            sv, acc = [0.0] * (REUSE_GAPS + 2), 0.0
            for j in range(REUSE_GAPS, -1, -1):
                acc += g[j]
                sv[j] = acc
            self.surv.append(sv)

    def observe(self, layer: int, e: int) -> None:
        if not self.reuse:
            return
        i, now = layer * X + e, self.step + 1
        if self.seen[i] == now:
            return
        if self.seen[i]:
            g = now - self.seen[i]
            self.gap[layer][REUSE_GAPS if g > REUSE_GAPS else g - 1] += 1.0
            self.rate[i] = self.rate[i] * decay(g) + 1.0
        else:
            self.rate[i] = 1.0
        self.seen[i] = now
        if not self.decode_step:
            return
        if layer + 1 < L:
            self.follow_n[i] += 1.0
        if layer > 0:
            for c in range(X):
                if self.seen[(layer - 1) * X + c] == now:
                    self.follow[(layer - 1) * X * X + c * X + e] += 1.0

    def window(self, layer: int, g0: int, h: int) -> float:
        sv = self.surv[layer]
        if h <= 0:
            return 0.0
        g0 = min(g0, REUSE_GAPS)
        end = min(g0 + h, REUSE_GAPS + 1)
        return (sv[g0 - 1] - sv[end - 1]) / sv[g0 - 1] if sv[g0 - 1] > 0.0 else 0.0

    def reuse_score(self, sl: Slot, for_layer: int) -> float:
        i, now = sl.layer * X + sl.expert, self.step + 1
        seen = self.seen[i]
        age = now - seen if seen else REUSE_GAPS + 1
        ahead = sl.layer > for_layer and age > 0
        g0 = age if ahead else age + 1
        p = self.window(sl.layer, g0, REUSE_HORIZON)
        if ahead and sl.layer == for_layer + 1 and self.decode_step:
            best = -1.0
            for c in range(X):
                fn = self.follow_n[for_layer * X + c]
                if self.seen[for_layer * X + c] == now and fn > 0.0:
                    best = max(best, self.follow[for_layer * X * X + c * X + sl.expert] / fn)
            if best >= 0.0:
                p = best + (1.0 - best) * self.window(sl.layer, g0 + 1, REUSE_HORIZON - 1)
        avg = K / X / (1.0 - self.decay)
        r = self.rate[i] * decay(now - seen) if seen else 0.0
        w = (r + avg) / (2.0 * avg)
        return p * w * w

    # ---- slots
    def lfu_score(self, sl: Slot) -> float:
        return sl.freq * decay(self.tick - sl.last_tick)

    def pick_victim(self, for_layer: int) -> int:
        guard = self.reuse and self.guard and not self.decode_step
        for first_pass in (True, False):
            best, best_key = -1, (3, 0.0)
            for i, sl in enumerate(self.slots):
                if sl.layer < 0:
                    return i
                if sl.pinned_wave == self.wave:
                    continue
                cls = 1 if guard and sl.loaded == self.step else 2
                if first_pass and sl.layer != for_layer and self.layer_count[sl.layer] <= self.floor:
                    continue
                if cls == 1:
                    score = -float(sl.last_use)  # the latest read first
                elif self.policy == "lru":
                    score = float(sl.last_use)
                elif self.reuse:
                    score = self.reuse_score(sl, for_layer)
                else:
                    score = self.lfu_score(sl)
                if best < 0 or (cls, score) < best_key:
                    best, best_key = i, (cls, score)
            if best >= 0:
                return best
        return -1

    def claim(self, i: int, layer: int, e: int) -> Slot:
        sl = self.slots[i]
        if sl.layer >= 0:
            del self.where[(sl.layer, sl.expert)]
            self.layer_count[sl.layer] -= 1
        self.slots[i] = sl = Slot(layer, e, self.step, 0.0, self.tick)
        self.where[(layer, e)] = i
        self.layer_count[layer] += 1
        return sl

    def touch(self, sl: Slot) -> None:
        self.observe(sl.layer, sl.expert)
        sl.freq = self.lfu_score(sl) + 1.0
        sl.last_tick = self.tick
        sl.last_use = self.use_base + sl.expert + 1

    def wave_begin(self) -> None:
        self.wave += 1
        self.use_base = self.use_clock
        self.use_clock += X

    def hold(self, layer: int, e: int) -> None:
        self.observe(layer, e)
        i = self.where.get((layer, e))
        if i is not None:
            self.slots[i].pinned_wave = self.wave
            return
        v = self.pick_victim(layer)
        if v >= 0:
            sl = self.claim(v, layer, e)
            sl.demand, sl.pinned_wave = True, self.wave

    def acquire(self, layer: int, e: int) -> bool:
        i = self.where.get((layer, e))
        if i is not None:
            sl = self.slots[i]
            if sl.demand:
                self.misses += 1
                sl.demand = False
            else:
                self.hits += 1
        else:
            v = self.pick_victim(layer)
            if v < 0:
                return False
            sl = self.claim(v, layer, e)
            self.misses += 1
        sl.pinned_wave = self.wave
        self.touch(sl)
        return True

    # ---- steps
    def run(self, steps: np.ndarray) -> tuple[int, int]:
        """steps [n_steps, n_seq, L, k]: (hits, misses)."""
        for step in steps:
            n_seq = step.shape[0]
            self.tick += n_seq
            self.step += 1
            self.decode_step = n_seq == 1
            if self.reuse:
                self.refresh()
            for layer in range(L):
                union = sorted({int(e) for e in step[:, layer].reshape(-1)})
                if n_seq == 1:  # hold all, then acquire: one wave (k slots are guaranteed)
                    self.wave_begin()
                    for e in union:
                        self.hold(layer, e)
                    for e in union:
                        assert self.acquire(layer, e)
                    continue
                pending = union
                while pending:  # waves of what the unpinned slots take
                    self.wave_begin()
                    n = 0
                    while n < len(pending) and self.acquire(layer, pending[n]):
                        n += 1
                    assert n > 0
                    pending = pending[n:]
        return self.hits, self.misses


POLICIES = {"lru": N.POLICY_LRU, "lfu": N.POLICY_LFU, "reuse": N.POLICY_REUSE}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    path = tmp_path_factory.mktemp("batched") / "mixtral.gguf"
    make_tiny_model(path, "mixtral", seed=11, **SPEC)
    m = Model(path)
    yield m
    m.close()


def replay(model: Model, steps: np.ndarray, slots: int, policy: str) -> N.StatsC:
    """The C replay of steps [n_steps, n_seq, L, k] as colibri_replay_routing takes them."""
    n_seq = steps.shape[1]
    return model.replay(model.params(slots, POLICIES[policy]), steps.reshape(-1, L, K), n_seq=n_seq)


def scan_trace(n_steps: int) -> np.ndarray:
    """Two sequences whose union is experts 0..3 at every layer: 16 experts a step, in the same order every
    step, a loop longer than the cache (the scan the guard is for)."""
    step = np.array([[[0, 1]] * L, [[2, 3]] * L], dtype=np.int32)
    return np.stack([step] * n_steps)


def test_scan_guard_changes_the_victim_and_the_replay_counts_as_the_simulator(model: Model) -> None:
    steps, slots = scan_trace(12), 10
    want = {policy: StoreSim(slots, policy).run(steps) for policy in POLICIES}
    unguarded = StoreSim(slots, "reuse", guard=False).run(steps)
    # 16 experts looped through 10 slots: LRU evicts each just before its turn and never hits; Belady
    # misses 84 of the 192 uses
    optimum = belady(steps, X, slots)
    assert optimum.misses == 84
    assert want["lru"] == (0, 192) and want["lfu"] == (84, 108)
    # the guard evicts this step's latest reads and keeps the experts from before the step: 6 more hits
    assert unguarded == (82, 110) and want["reuse"] == (88, 104)
    for policy, (hits, misses) in want.items():
        s = replay(model, steps, slots, policy)
        assert (s.expert_hits, s.expert_misses) == (hits, misses), policy
        assert s.expert_calls == 16 * 12 and s.expert_hits <= optimum.calls - optimum.misses
    # the same tokens as decode steps (one per step): the union is the token's pair, no scan guard
    single = steps.reshape(-1, 1, L, K)
    for policy in POLICIES:
        hits, misses = StoreSim(slots, policy).run(single)
        s = replay(model, single, slots, policy)
        assert (s.expert_hits, s.expert_misses) == (hits, misses), policy
    assert StoreSim(slots, "reuse").run(single) == StoreSim(slots, "reuse", guard=False).run(single)


def test_simulator_factor_is_the_table_scaled_exactly() -> None:
    """decay() scales the table by whole half-lives, bit for bit (test_experts.c asks the same of
    store_decay), and stays within an ulp or so of the true 0.5^(g / 32)."""
    assert decay(0) == 1.0 and decay(32) == 0.5 and decay(16) == math.sqrt(0.5)
    for g in range(1, 3000):
        assert decay(g + 32) == decay(g) / 2  # exact: a power of two
        assert math.isclose(decay(g), 0.5 ** (g / 32), rel_tol=3e-16, abs_tol=0.0)
    last = 1022 * 32 - 1
    assert decay(last) >= 2.0**-1022 and decay(last + 1) == 0.0 and decay(2**64 - 1) == 0.0


def skewed_steps(seed: int, n_tokens: int, n_seq: int) -> np.ndarray:
    """A random routing with hot experts (each layer favours a few), cut into n_seq streams."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(X, 0.6), size=L)
    ids = np.empty((n_tokens, L, K), dtype=np.int32)
    for t in range(n_tokens):
        for layer in range(L):
            ids[t, layer] = np.sort(rng.choice(X, size=K, replace=False, p=weights[layer]))
    return interleave(ids, n_seq)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("n_seq", [1, 2, 4])
@pytest.mark.parametrize("slots", [8, 13])
def test_replay_counts_as_the_simulator_and_never_beats_belady(
    model: Model, seed: int, n_seq: int, slots: int
) -> None:
    steps = skewed_steps(seed, 48, n_seq)
    calls = access_sequence(steps, X).shape[0]
    optimum = belady(steps, X, slots)
    for policy in POLICIES:
        s = replay(model, steps, slots, policy)
        assert (s.expert_hits, s.expert_misses) == StoreSim(slots, policy).run(steps), policy
        assert s.expert_calls == calls == optimum.calls
        assert s.expert_hits <= optimum.calls - optimum.misses, policy


def test_n_seq_1_is_the_single_stream_replay(model: Model) -> None:
    """n_seq 1 is one decode step per token, and the Python API's streams=1 passes the token ids through
    (the hashed predictor needs them) where streams > 1 cuts the trace into interleaved streams."""
    import colibri_backend

    ids = skewed_steps(3, 40, 1).reshape(-1, L, K)
    p = model.params(9, N.POLICY_REUSE)
    s = model.replay(p, ids)
    got = colibri_backend.replay_routing(
        model.path, np.zeros(40, dtype=np.int32), ids, expert_slots=9, expert_policy="reuse", prefetch="none"
    )
    assert (got["expert_hits"], got["expert_misses"]) == (s.expert_hits, s.expert_misses)
    assert got["streams"] == 1 and got["n_tokens"] == 40
    four = colibri_backend.replay_routing(
        model.path,
        np.zeros(40, dtype=np.int32),
        ids,
        expert_slots=9,
        expert_policy="reuse",
        prefetch="none",
        streams=4,
    )
    s4 = model.replay(p, interleave(ids, 4).reshape(-1, L, K), n_seq=4)
    assert (four["expert_hits"], four["expert_misses"]) == (s4.expert_hits, s4.expert_misses)
    assert four["optimal_misses"] == belady(interleave(ids, 4), X, 9).misses


def test_bad_step_arguments_are_refused(model: Model) -> None:
    p = model.params(2 * K)
    ids = np.ascontiguousarray(np.tile(np.arange(K, dtype=np.int32), (6, L, 1)))
    ptr = ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    for n_tokens, n_seq, what in (
        (6, 0, "n_seq must be >= 1"),
        (6, -2, "n_seq must be >= 1"),
        (6, 4, "not a whole"),
    ):
        out = N.StatsC()
        status = LIB.colibri_replay_routing(
            model.handle, ctypes.byref(p), None, ptr, n_tokens, n_seq, ctypes.byref(out)
        )
        assert status == N.E_INVALID_ARG
        assert what in LIB.last_error(), (n_seq, LIB.last_error())
    pf = model.params(2 * K, prefetch=N.PREFETCH_TEMPORAL)
    with pytest.raises(EngineError) as err:
        model.replay(pf, ids, n_seq=2)
    assert err.value.status == "COLIBRI_E_INVALID_ARG" and "does not prefetch" in err.value.message
    model.replay(pf, ids, n_seq=1)  # a decode step does prefetch
    model.replay(p, ids, n_seq=3)  # 6 tokens: 2 steps of 3


def test_interleave_keeps_each_stream_in_order() -> None:
    ids = np.arange(7 * L * K, dtype=np.int32).reshape(7, L, K)
    steps = interleave(ids, 3)  # 2 steps of 3 streams; the 7th token is left out
    assert steps.shape == (2, 3, L, K)
    assert np.array_equal(steps[:, 0], ids[0:2]) and np.array_equal(steps[:, 2], ids[4:6])
    with pytest.raises(ValueError):
        interleave(ids, 0)
    with pytest.raises(ValueError):
        interleave(ids, 8)


def live_batched(model: Model, p: N.ContextParamsC, tokens: np.ndarray) -> tuple[np.ndarray, N.StatsC]:
    """Batched decode steps live (colibri_eval_batch, tokens [n_steps, n_seq]: token j of each step to
    sequence j, every sequence from an empty cache, no logits): the routing each step made
    [n_steps, n_seq, L, k] and the context's counters."""
    ctx = ctypes.c_void_p()
    LIB.check(LIB.colibri_context_new(model.handle, ctypes.byref(p), ctypes.byref(ctx)))
    try:
        n_seq = tokens.shape[1]
        seqs = np.arange(n_seq, dtype=np.int32)
        want = np.zeros(n_seq, dtype=np.uint8)
        routes = []
        for step in tokens:
            toks = np.ascontiguousarray(step, dtype=np.int32)
            LIB.check(
                LIB.colibri_eval_batch(
                    ctx, N.i32_ptr(seqs), N.i32_ptr(toks), n_seq, want.ctypes.data_as(ctypes.c_void_p), None
                )
            )
            ids = np.zeros((n_seq, L, K), dtype=np.int32)
            w = np.zeros((n_seq, L, K), dtype=np.float32)
            n = ctypes.c_int32()
            LIB.check(LIB.colibri_get_routing(ctx, N.i32_ptr(ids), N.f32_ptr(w), n_seq, ctypes.byref(n)))
            assert n.value == n_seq
            routes.append(ids)
        s = N.StatsC()
        LIB.check(LIB.colibri_get_stats(ctx, ctypes.byref(s)))
        return np.stack(routes), s
    finally:
        LIB.colibri_context_free(ctx)


@pytest.mark.parametrize("n_seq", [1, 4])
def test_live_batched_decode_counts_as_its_replay(model: Model, n_seq: int) -> None:
    """The store under a live batched decode (the real forward pass) counts the hits and misses the replay
    of the routing it made counts, for every policy (and a one-sequence context, as a decode step)."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, model.info.n_vocab, (24, n_seq))
    for policy in POLICIES:
        p = model.params(9, POLICIES[policy], n_seq_max=n_seq)
        routes, live = live_batched(model, p, tokens)
        assert live.expert_calls == access_sequence(routes, X).shape[0]
        s = model.replay(p, routes.reshape(-1, L, K), n_seq=n_seq)
        assert (live.expert_hits, live.expert_misses) == (s.expert_hits, s.expert_misses), policy
        assert (s.expert_hits, s.expert_misses) == StoreSim(9, policy).run(routes), policy


def test_colibri_replay_streams(model: Model, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`colibri replay --streams N` is replay_routing(streams=N): the counts of the batched replay and
    Belady's optimum on the unions; 0 streams is refused."""
    import json

    import colibri_backend
    from colibri_backend.cli import main
    from colibri_backend.trace import RoutingTrace, write_trace

    ids = skewed_steps(4, 40, 1).reshape(-1, L, K)
    trace = RoutingTrace(ids, np.full(ids.shape, 0.5, dtype=np.float32), np.zeros(40, dtype=np.int32), {})
    path = write_trace(tmp_path / "skewed.npz", trace)
    args = ["replay", str(model.path), str(path), "--expert-slots", "9", "--prefetch", "none", "--json"]
    assert main([*args, "--streams", "4"]) == 0
    got = json.loads(capsys.readouterr().out)
    s = model.replay(model.params(9, N.POLICY_REUSE), interleave(ids, 4).reshape(-1, L, K), n_seq=4)
    assert got["streams"] == 4 and got["tokens"] == 40
    assert (got["hits"], got["misses"]) == (s.expert_hits, s.expert_misses)
    assert got["optimal_misses"] == belady(interleave(ids, 4), X, 9).misses
    with pytest.raises(ValueError, match="streams must be at least 1"):
        colibri_backend.replay_routing(model.path, ids[:, 0, 0], ids, expert_slots=9, streams=0)
