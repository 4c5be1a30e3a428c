"""Who computes a row never changes its value: the logits of a prefill (rows in pool_split's fixed
parts) and of decode steps (rows dealt in chunks that threads claim as they go, jobs.c) are
bit-identical on 1, 2 and 3 threads, for an MoE model whose matrices are large enough to be dealt
in many chunks (K-quant experts and Q8_0 attention, as bench-A mixes them), and for one with a
shared expert (qwen2moe: a shared SwiGLU job beside the routed ones in the same run)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_reference import make_tiny_model
from native_engine import Engine

PROMPT = [1, 17, 42, 99, 5, 250, 31, 8, 64, 12, 200, 77, 3, 150, 9, 44, 180, 21, 60, 90]
DECODE = 12
TYPES = {"ffn_down_exps": "Q6_K", "attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0"}


@pytest.fixture(scope="module", params=["mixtral", "qwen2moe"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("split") / f"{request.param}.gguf"
    # 512-wide rows: a 1024-row expert matrix is ~8 dealt chunks of 64 KB; down projections Q6_K,
    # q/k/v Q8_0, the head Q4_K (301 rows, one chunk: a run of jobs with few chunks each too)
    make_tiny_model(
        path,
        request.param,
        n_embd=512,
        n_layer=2,
        n_head=8,
        n_head_kv=2,
        head_dim=64,
        n_expert=4,
        n_expert_used=2,
        n_ff_exp=1024,
        n_ff_shexp=512,
        wtype="Q4_K",
        tensor_types={f"blk.{il}.{name}.weight": qtype for il in range(2) for name, qtype in TYPES.items()},
    )
    return path


def _run(path: Path, threads: int) -> np.ndarray:
    """Prefill logits of every prompt token, then greedy decode steps, one token per eval."""
    with Engine(path, threads=threads, n_ctx=64, n_batch=32) as e:
        rows = [e.eval(PROMPT, all_logits=True)]
        tok = int(rows[0][-1].argmax())
        for _ in range(DECODE):
            rows.append(e.eval([tok], all_logits=False))
            tok = int(rows[-1][-1].argmax())
    return np.concatenate(rows)


def test_logits_bit_identical_across_thread_counts(model: Path) -> None:
    one = _run(model, 1)
    assert np.isfinite(one).all()
    assert len({int(r.argmax()) for r in one}) > 1, "a degenerate model would hide a split error"
    for threads in (2, 3):
        other = _run(model, threads)
        diff = np.flatnonzero((one.view(np.uint32) != other.view(np.uint32)).any(axis=1))
        assert diff.size == 0, f"{threads} threads: logits rows {diff.tolist()} differ from 1 thread"
