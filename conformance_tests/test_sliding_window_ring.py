"""The sliding-window KV ring (gpt-oss and Gemma 4's local layers), on the tiny checkpoints.

A sliding-window layer keeps window + min(n_batch, window) - 1 rows per KV head instead of one per position
(native/src/context.h, kv_layer). These tests check what that must not change and what it must:

* the logits of one teacher-forced pass do not depend on how large the ring is: batch sizes 1, 5 and the
  default (ring sizes window, window + 4, 2 * window - 1) give the same logits as a context whose ring is the
  whole context (context_length = 2 * window - 1, so the ring is as long as the context and never wraps);
* reusing a cached prefix after the ring wrapped: a rollback within the ring's reach keeps the cache, one
  beyond it clears the cache (the engine reports the kept n_past), and either way the greedy continuation
  equals a fresh context's;
* the plan's KV bytes are those of the rings (test_arch_memory compares them with transformers' cache).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tiny_models as tm

RING_SPECS = ["gpt_oss", "gemma4"]
N_POS, N_CTX = 72, 128


@pytest.mark.parametrize("name", RING_SPECS)
def test_logits_do_not_depend_on_the_ring_size(tiny_zoo: Any, colibri: Any, name: str) -> None:
    gguf = tiny_zoo.gguf(name, "f32")
    ids = tm.token_ids(tiny_zoo.checkpoint(name), N_POS)
    window = tm.config_of(tiny_zoo.checkpoint(name))["sliding_window"]
    runs = {}
    for batch in (None, 5, 1):
        with colibri.load(gguf, threads=tm.ENGINE_THREADS, context_length=N_CTX, batch_size=batch) as m:
            runs[batch] = m.logits(ids)
    # a context no longer than the default ring: every layer keeps every position it can hold
    short = 2 * window - 1
    with colibri.load(gguf, threads=tm.ENGINE_THREADS, context_length=short) as m:
        full_rows = m.logits(ids[:short])
    tm.report(
        f"{name}: ring of window {window}: logits at batch 5 / 1 equal to the default batch: "
        f"{np.array_equal(runs[None], runs[5])} / {np.array_equal(runs[None], runs[1])}"
    )
    assert np.array_equal(runs[None], runs[5])
    assert np.array_equal(runs[None], runs[1])
    assert np.array_equal(runs[None][:short], full_rows)


@pytest.mark.parametrize("name", RING_SPECS)
def test_prefix_reuse_after_the_ring_wrapped(tiny_zoo: Any, colibri: Any, name: str) -> None:
    from colibri_backend.adapters.sampling import SamplingParams

    gguf = tiny_zoo.gguf(name, "f32")
    ids = tm.token_ids(tiny_zoo.checkpoint(name), N_POS)
    window = tm.config_of(tiny_zoo.checkpoint(name))["sliding_window"]
    greedy = SamplingParams(temperature=0.0)

    def run(model: Any, prompt: list[int]) -> list[tuple[int, float]]:
        return [
            (e.token_id, e.logprob)
            for e in model.generate_tokens(prompt, max_tokens=6, sampling=greedy, logprobs=0)
        ]

    near = ids[: N_POS - 3] + [ids[5], ids[6]]  # shares all but the last 3 cached positions
    far = ids[: N_POS - 3 * window] + ids[10:20]  # shares a prefix 3 windows back: beyond the ring
    with colibri.load(gguf, threads=tm.ENGINE_THREADS, context_length=N_CTX) as fresh:
        want_near = run(fresh, near)
    with colibri.load(gguf, threads=tm.ENGINE_THREADS, context_length=N_CTX) as fresh:
        want_far = run(fresh, far)
    with colibri.load(gguf, threads=tm.ENGINE_THREADS, context_length=N_CTX) as m:
        run(m, ids)
        got_near = run(m, near)
        kept_near = m.stats()["n_past"]
        run(m, ids)
        got_far = run(m, far)
    tm.report(
        f"{name}: prefix reuse after the ring wrapped, as fresh: near {got_near == want_near}, "
        f"far {got_far == want_far}"
    )
    assert [t for t, _ in got_near] == [t for t, _ in want_near]
    assert [t for t, _ in got_far] == [t for t, _ in want_far]
    np.testing.assert_allclose([lp for _, lp in got_near], [lp for _, lp in want_near], atol=1e-5)
    np.testing.assert_allclose([lp for _, lp in got_far], [lp for _, lp in want_far], atol=1e-5)
    assert kept_near == len(near) + 6 - 1  # the prompt and the generated tokens but the last stayed cached
