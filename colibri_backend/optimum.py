"""Belady's offline optimum for an expert cache: the fewest misses any policy could have on a trace.

The access sequence is the one a decode step makes: token by token, layer by layer, the chosen experts of a
layer in increasing id (the order forward.c and the replay acquire them). A cache of `n_slots` experts, shared
by all layers, serves it. On a miss with the cache full, MIN evicts the resident expert whose next use lies
furthest ahead (never used again counts as infinitely far), which is optimal for demand paging (Belady 1966;
Mattson et al. 1970). Any real policy, with a per-layer floor, pinning or prefetch, has at least this many
demand misses on the same trace with the same slot count, so `hit_rate / optimal hit rate` is how close a
policy comes to the best possible.

Two starting states are reported: an empty cache (what a store without a routing profile starts from) and a
freely chosen initial content (a store warmed from a profile). The second is exactly the first less the
cold misses while the cache fills: an optimum from a preloaded set S can be turned into one from empty by
loading S lazily, at most min(n_slots, distinct experts) extra misses, and preloading the first experts MIN
would load reaches that bound.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

_NEVER = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Optimum:
    calls: int
    n_slots: int
    misses: int  # from an empty cache
    misses_preloaded: int  # from the best initial content

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.misses / self.calls if self.calls else 0.0

    @property
    def hit_rate_preloaded(self) -> float:
        return 1.0 - self.misses_preloaded / self.calls if self.calls else 0.0


def access_sequence(ids: np.ndarray, n_expert: int) -> np.ndarray:
    """Flatten routing ids [tokens, layers, k] into cache keys layer * n_expert + expert, in the order a
    decode step uses them (each layer's experts sorted by id). A (token, layer) of -1 throughout is a
    layer without a router (DeepSeek's leading dense ones, as the engine records them): no access.
    Batched steps, ids [steps, sequences, layers, k]: per step and layer the union of the sequences'
    experts, each once, by increasing id (what a step of several tokens acquires)."""
    ids = np.asarray(ids)
    if ids.ndim == 4:
        if ids.size and (ids.max() >= n_expert or ids.min() < -1):
            raise ValueError(f"routing ids must lie in [0, {n_expert}), got {ids.min()}..{ids.max()}")
        steps, _, n_layer, _ = ids.shape
        used = np.zeros((steps, n_layer, n_expert + 1), dtype=bool)  # the last column: -1, no router
        s, _, layer, _ = np.indices(ids.shape, sparse=True)
        used[s, layer, ids] = True
        step, layer, expert = np.nonzero(used[:, :, :n_expert])  # row-major: step, then layer, then id
        return layer.astype(np.int64) * n_expert + expert
    if ids.ndim != 3:
        raise ValueError(f"routing ids must be [tokens, layers, k], got shape {ids.shape}")
    dense = (ids == -1).all(axis=2)
    used = ids[~dense]
    if used.size and (used.min() < 0 or used.max() >= n_expert):
        raise ValueError(f"routing ids must lie in [0, {n_expert}), got {used.min()}..{used.max()}")
    layer = np.arange(ids.shape[1], dtype=np.int64)[None, :, None]
    keys = np.sort(ids.astype(np.int64), axis=2) + layer * n_expert
    return keys[~dense].reshape(-1)


def _next_use(keys: np.ndarray) -> np.ndarray:
    """nxt[i] = the next index j > i with keys[j] == keys[i], or _NEVER."""
    nxt = np.full(keys.shape[0], _NEVER, dtype=np.int64)
    order = np.lexsort((np.arange(keys.shape[0]), keys))  # by key, then position
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady(ids: np.ndarray, n_expert: int, n_slots: int) -> Optimum:
    """Belady's MIN on a routing trace for a cache of `n_slots` experts (ids: see access_sequence)."""
    if n_slots < 1:
        raise ValueError(f"the cache needs at least one slot, got {n_slots}")
    keys = access_sequence(ids, n_expert)
    nxt = _next_use(keys)
    resident: dict[int, int] = {}  # key -> its next use (the heap may hold stale entries)
    heap: list[tuple[int, int]] = []  # (-next use, key): furthest next use on top
    misses = 0
    for i, key in enumerate(keys.tolist()):
        if key not in resident:
            misses += 1
            if len(resident) == n_slots:
                while True:
                    neg, victim = heapq.heappop(heap)
                    if resident.get(victim) == -neg:
                        del resident[victim]
                        break
        resident[key] = int(nxt[i])
        heapq.heappush(heap, (-int(nxt[i]), key))
    distinct = int(np.unique(keys).shape[0])
    return Optimum(
        calls=int(keys.shape[0]),
        n_slots=n_slots,
        misses=misses,
        misses_preloaded=misses - min(n_slots, distinct),
    )


@dataclass(frozen=True)
class Foresight:
    """Misses of MIN told the routing of the current token and of the next `tokens_ahead` only."""

    calls: int
    n_slots: int
    tokens_ahead: int
    misses: int  # from an empty cache

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.misses / self.calls if self.calls else 0.0


def foresight_min(ids: np.ndarray, n_expert: int, n_slots: int, tokens_ahead: int) -> Foresight:
    """A policy between a real cache and Belady's optimum: on a miss with the cache full it knows every
    use of the current token and of the next `tokens_ahead` tokens, and nothing after them (a decode loop
    cannot know a token it has not produced, so no real predictor knows more). An expert with no use
    within that horizon goes first, the least recently used of them, but never one the current layer
    step has already used (the engine holds a layer's experts while it computes them); when every
    expert has a use within the horizon, the one used furthest ahead goes, as under MIN. With a horizon
    past the trace's end it is MIN exactly.

    What it answers: how much of the distance between a cache and Belady's optimum a perfect prediction
    of the next tokens' routing could close. ids: a single stream's routing, [tokens, layers, k]."""
    if n_slots < 1:
        raise ValueError(f"the cache needs at least one slot, got {n_slots}")
    if tokens_ahead < 0:
        raise ValueError(f"tokens_ahead must be >= 0, got {tokens_ahead}")
    ids = np.asarray(ids)
    if ids.ndim != 3:
        raise ValueError(
            f"foresight_min takes a single stream's routing, [tokens, layers, k]; got shape {ids.shape}"
        )
    keys = access_sequence(ids, n_expert)  # validates the ids
    n_tok, _, k = ids.shape
    routed = ~(ids == -1).all(axis=2)  # [tokens, layers]: a layer with a router
    token_of = np.repeat(np.nonzero(routed)[0], k)  # the token of every access
    layer_of = keys // n_expert
    token_start = np.searchsorted(token_of, np.arange(n_tok + 1))  # each token's first access, and the end
    new_step = np.ones(keys.shape[0], dtype=bool)  # the first access of a (token, layer) step
    new_step[1:] = (token_of[1:] != token_of[:-1]) | (layer_of[1:] != layer_of[:-1])
    step_start = np.maximum.accumulate(np.where(new_step, np.arange(keys.shape[0]), 0))
    nxt = _next_use(keys)

    # the cache as slot arrays: one numpy pass over the slots per eviction
    slot_key = np.full(n_slots, -1, dtype=np.int64)
    slot_next = np.zeros(n_slots, dtype=np.int64)
    slot_last = np.zeros(n_slots, dtype=np.int64)  # index of its last access
    slot_of: dict[int, int] = {}
    misses = 0
    for i, key in enumerate(keys.tolist()):
        s = slot_of.get(key)
        if s is None:
            misses += 1
            if len(slot_of) < n_slots:
                s = len(slot_of)
            else:
                horizon = token_start[min(int(token_of[i]) + tokens_ahead + 1, n_tok)]
                idle = np.nonzero((slot_next >= horizon) & (slot_last < step_start[i]))[0]
                s = int(idle[np.argmin(slot_last[idle])]) if idle.size else int(np.argmax(slot_next))
                del slot_of[int(slot_key[s])]
            slot_key[s] = key
            slot_of[key] = s
        slot_next[s] = nxt[i]
        slot_last[s] = i
    return Foresight(calls=int(keys.shape[0]), n_slots=n_slots, tokens_ahead=tokens_ahead, misses=misses)
