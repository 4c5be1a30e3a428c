"""Belady's offline optimum (colibri_backend.optimum): checked against an exhaustive search over every
eviction choice on small traces, and as a lower bound on the misses of the real store's replays."""

from __future__ import annotations

from functools import cache
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
from engine_reference import make_tiny_model

import colibri_backend
from colibri_backend.optimum import access_sequence, belady


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
