"""Routing traces as several sequences decoding together (`colibri replay --streams N`).

A batched decode step runs one token of each of N sequences; each layer then takes the union of their
experts. A single trace stands for N sequences by cutting it into N consecutive streams of equal length:
step s is token s of every stream, so each stream keeps its own order and context, as N clients decoding
different parts of a text at the same pace would.
"""

from __future__ import annotations

import numpy as np


def interleave(ids: np.ndarray, n_streams: int) -> np.ndarray:
    """Routing ids [T, L, k] as n_streams sequences stepping together: [T // n_streams, n_streams, L, k],
    stream j being tokens j * S .. (j + 1) * S - 1 (S = T // n_streams; the last T % n_streams tokens are
    left out)."""
    ids = np.asarray(ids)
    if ids.ndim != 3:
        raise ValueError(f"routing ids must be [tokens, layers, k], got shape {ids.shape}")
    if n_streams < 1:
        raise ValueError(f"streams must be at least 1, got {n_streams}")
    steps = ids.shape[0] // n_streams
    if steps == 0:
        raise ValueError(f"{ids.shape[0]} tokens cannot make {n_streams} streams of one token or more")
    per_stream = ids[: steps * n_streams].reshape(n_streams, steps, *ids.shape[1:])
    return np.ascontiguousarray(per_stream.swapaxes(0, 1))
