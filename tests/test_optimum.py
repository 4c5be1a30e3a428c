"""Belady's offline optimum (colibri_backend.optimum): checked against an exhaustive search over every
eviction choice on small traces, and as a lower bound on the misses of the real store's replays."""

from __future__ import annotations

import sys
from functools import cache
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
from engine_reference import make_tiny_model

import colibri_backend
from colibri_backend.optimum import access_sequence, belady, foresight_min


def _exhaustive(keys: tuple[int, ...], n_slots: int, preload: bool) -> int:
    """Fewest misses over every demand-paging schedule (and, with preload, every initial content)."""

    @cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(keys):
            return 0
        key = keys[i]
        if key in cache:
            return best(i + 1, cache)
        if len(cache) < n_slots:
            return 1 + best(i + 1, cache | {key})
        return 1 + min(best(i + 1, (cache - {victim}) | {key}) for victim in cache)

    if not preload:
        return best(0, frozenset())
    universe = sorted(set(keys))

    size = min(n_slots, len(universe))
    return min(best(0, frozenset(c)) for c in combinations(universe, size))


@pytest.mark.parametrize("seed", range(12))
def test_belady_equals_the_exhaustive_optimum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_layer, n_expert, k = 2, 3, 1 + seed % 2
    tokens = 6 if k == 1 else 4
    ids = np.stack([[rng.choice(n_expert, k, replace=False) for _ in range(n_layer)] for _ in range(tokens)])
    keys = tuple(access_sequence(ids, n_expert).tolist())
    for n_slots in (k, k + 1, k + 2):
        got = belady(ids, n_expert, n_slots)
        assert got.calls == len(keys)
        assert got.misses == _exhaustive(keys, n_slots, preload=False), (keys, n_slots)
        assert got.misses_preloaded == _exhaustive(keys, n_slots, preload=True), (keys, n_slots)


def test_access_order_is_layer_major_with_ids_sorted() -> None:
    ids = np.array([[[2, 0], [1, 3]], [[3, 2], [0, 1]]])
    assert access_sequence(ids, 4).tolist() == [0, 2, 5, 7, 2, 3, 4, 5]


def test_a_cache_holding_everything_misses_only_on_first_touch() -> None:
    ids = np.array([[[0, 1]], [[1, 2]], [[0, 2]], [[3, 0]]])
    got = belady(ids, 4, 4)
    assert (got.misses, got.misses_preloaded) == (4, 0)
    assert got.hit_rate == pytest.approx(1 - 4 / 8)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        belady(np.zeros((1, 1, 1), dtype=np.int32), 2, 0)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        belady(np.full((1, 1, 1), 5), 2, 1)
    with pytest.raises(ValueError, match="tokens, layers, k"):
        belady(np.zeros((3, 2)), 2, 1)


def test_no_replayed_policy_beats_the_optimum(tmp_path: Path) -> None:
    """The real store's replays (LFU, LRU and reuse, several slot counts) never miss less than Belady, and the
    optimum is what `colibri replay` reports beside each hit rate."""
    path = tmp_path / "mixtral.gguf"
    make_tiny_model(
        path,
        "mixtral",
        seed=5,
        wtype="Q8_0",
        n_expert=8,
        n_expert_used=2,
        n_embd=64,
        n_layer=3,
        n_ff_exp=512,
        head_dim=32,
    )
    rng = np.random.default_rng(3)
    # skewed routing, so that the policy matters and the cache is neither useless nor perfect
    p = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.07, 0.05, 0.03])
    ids = np.stack([[np.sort(rng.choice(8, 2, replace=False, p=p)) for _ in range(3)] for _ in range(200)])
    tokens = rng.integers(0, 100, size=200)
    optimal = []
    for slots in (3, 6, 12):
        best = belady(ids, 8, slots)
        optimal.append(best.misses)
        for policy in ("lfu", "lru", "reuse"):
            s = colibri_backend.replay_routing(path, tokens, ids, expert_slots=slots, expert_policy=policy)
            assert s["expert_slots"] == slots
            assert s["optimal_misses"] == best.misses
            assert s["expert_misses"] >= best.misses
            assert s["expert_hit_rate"] <= s["optimal_hit_rate"] + 1e-12
        assert best.misses_preloaded <= best.misses
    # MIN is a stack algorithm: more slots never cost misses
    assert optimal == sorted(optimal, reverse=True) and optimal[0] > optimal[-1]


@pytest.mark.parametrize("seed", range(6))
def test_foresight_past_the_end_is_belady_and_never_beats_it(seed: int) -> None:
    """Told every token ahead, foresight_min is MIN (the same misses); told fewer, it never misses less than
    MIN, and on a layered trace it misses more with no foresight than with the whole trace."""
    rng = np.random.default_rng(seed)
    n_expert, n_layer, k, tokens = 6, 3, 2, 60
    ids = np.stack(
        [[np.sort(rng.choice(n_expert, k, replace=False)) for _ in range(n_layer)] for _ in range(tokens)]
    )
    if seed % 2:
        ids[::7, 1] = -1  # a layer without a router at some tokens: no access there
    for n_slots in (2, 5, 9):
        best = belady(ids, n_expert, n_slots)
        told_all = foresight_min(ids, n_expert, n_slots, tokens)
        assert (told_all.calls, told_all.misses) == (best.calls, best.misses)
        for ahead in (0, 1, 3):
            assert foresight_min(ids, n_expert, n_slots, ahead).misses >= best.misses
    assert foresight_min(ids, n_expert, 5, 0).misses > belady(ids, n_expert, 5).misses


def test_foresight_of_one_token_keeps_the_expert_the_next_token_uses() -> None:
    """Experts A B C A B, one a token, two slots. At C, with no foresight the least recently used (A) goes and
    A's return then evicts B: 5 misses. Told the next token (A), B goes instead: 4, as MIN."""
    ids = np.array([0, 1, 2, 0, 1]).reshape(5, 1, 1)
    assert foresight_min(ids, 3, 2, 0).misses == 5
    assert foresight_min(ids, 3, 2, 1).misses == 4
    assert belady(ids, 3, 2).misses == 4
    assert foresight_min(ids, 3, 2, 1).hit_rate == pytest.approx(1 / 5)


def test_foresight_bad_arguments_are_refused() -> None:
    ids = np.zeros((2, 1, 1), dtype=np.int32)
    with pytest.raises(ValueError, match="at least one slot"):
        foresight_min(ids, 2, 0, 1)
    with pytest.raises(ValueError, match="tokens_ahead"):
        foresight_min(ids, 2, 1, -1)
    with pytest.raises(ValueError, match="single stream"):
        foresight_min(np.zeros((2, 2, 1, 1), dtype=np.int32), 2, 1, 1)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        foresight_min(np.full((1, 1, 1), 5), 2, 1, 0)


def test_replay_policies_prints_the_foresight_table(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/replay_policies.py --foresight: one row per size, Belady and each horizon's hit rate with
    its share of the optimum, and the same figures in the JSON results."""
    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    from replay_policies import foresight_table

    from colibri_backend.trace import RoutingTrace

    ids = np.array([0, 1, 2, 0, 1]).reshape(5, 1, 1)
    trace = RoutingTrace(ids=ids, weights=np.ones(ids.shape), tokens=np.arange(5), meta={"n_expert": 3})
    results: list[dict] = []
    foresight_table("abc", trace, {"67%": 2}, [0, 1], results)
    out = capsys.readouterr().out.splitlines()
    assert out[-3:] == [
        "| slots | Belady | W = 0 | W = 1 |",
        "|---|---|---|---|",
        "| 67% (2) | 20.0% | 0.0% (0.0%) | 20.0% (100.0%) |",
    ]
    assert [(r["foresight_tokens"], r["hit_rate"], r["optimal_hit_rate"]) for r in results] == [
        (0, 0.0, pytest.approx(0.2)),
        (1, pytest.approx(0.2), pytest.approx(0.2)),
    ]
    with pytest.raises(SystemExit, match="n_expert"):
        foresight_table(
            "abc", RoutingTrace(ids=ids, weights=np.ones(ids.shape), tokens=np.arange(5)), {"x": 2}, [0], []
        )
