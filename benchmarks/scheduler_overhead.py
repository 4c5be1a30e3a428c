"""What the batch scheduler's hand-offs cost per step, without an engine or a generation loop.

    python benchmarks/scheduler_overhead.py --seqs 8 --steps 300 --step-ms 5

N threads each hold a sequence of one ``BatchScheduler`` and decode ``--steps`` tokens through it; the
model is a stand-in whose ``eval_batch`` sleeps ``--step-ms`` (the engine's step, with the GIL released)
and returns zero logits. Reported per step: wall ms, the scheduler's own between-steps ms (the engine
idle while the sequences hand their next token over), process CPU ms, partial steps, and how often the
step thread woke from its condition (each wake is a thread switch and a GIL hand-off). What it measures
is the scheduler's floor; the generation loop (sampling, detokenizing, SSE) comes on top.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np

from colibri_backend.server.scheduler import BatchScheduler


class StandIn:
    """The parts of a colibri Model the scheduler calls; every step takes ``step_s``."""

    batch_size = 64
    context_length = 1 << 20

    def __init__(self, n_seq: int, step_s: float) -> None:
        self.max_concurrency = n_seq
        self.step_s = step_s

    def eval_batch(self, seq_ids: np.ndarray, tokens: np.ndarray, want: np.ndarray) -> np.ndarray:
        time.sleep(self.step_s)
        return np.zeros((int(np.count_nonzero(want)), 8), dtype=np.float32)

    def seq_truncate(self, seq: int, n_past: int = 0) -> None:
        pass

    def seq_n_past(self, seq: int) -> int:
        return 0

    def seq_restore_prefix(self, seq: int, prompt: list[int]) -> int:
        return 0

    def prefix_save_point(self, n: int) -> int:
        return n

    def seq_remember(self, seq: int, prompt: list[int]) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300, help="decode tokens per sequence")
    ap.add_argument("--step-ms", type=float, default=5.0, help="the stand-in engine's step")
    args = ap.parse_args(argv)
    if args.seqs < 1 or args.steps < 1 or args.step_ms < 0:
        ap.error("--seqs and --steps must be at least 1, --step-ms at least 0")
    sched = BatchScheduler(StandIn(args.seqs, args.step_ms / 1e3))
    wakes = [0]
    wait = sched._cond.wait

    def counted(timeout: float | None = None) -> bool:
        if threading.current_thread() is sched._thread:
            wakes[0] += 1
        return wait(timeout)

    sched._cond.wait = counted  # type: ignore[method-assign]

    def generate() -> None:
        with sched.sequence() as seq:
            seq.prefill([1, 2, 3])
            for _ in range(args.steps):
                seq.decode(1)

    threads = [threading.Thread(target=generate) for _ in range(args.seqs)]
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    sched.close()
    n = sched.steps
    print(
        f"seqs {args.seqs}  steps {n}  wall {1e3 * wall / n:.3f} ms/step"
        f"  between {1e3 * sched.between_seconds / n:.3f} ms/step  cpu {1e3 * cpu / n:.3f} ms/step"
        f"  partial {sched.partial_steps}  step-thread wakes {wakes[0] / n:.2f}/step"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
