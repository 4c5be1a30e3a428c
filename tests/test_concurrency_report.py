"""benchmarks/concurrency.py's report: the tables measure() prints and the comparisons it adds to the JSON,
from rows made up here (no server: Server and run_clients are replaced), checked line for line.

The rows go through the script's own step_figures / store_figures / cpu_figures, so the step, store and
CPU tables see what a real run gives them: the batched server has batch counters (with the step split of
session 5 and the decode-only steps of session 8), the one-at-a-time server none; one round has no expert
store figures, and its line is left out of that table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import concurrency  # noqa: E402

CLIENTS = [1, 4]


class FakeServer:
    def __init__(self, args: argparse.Namespace, concurrency_: int, cap: int | None, tag: str) -> None:
        self.batched = concurrency_ > 1

    def stop(self) -> None:
        pass


def batch_counters(n: int) -> dict[str, float]:
    steps, pre = 10.0 * n, 2.0 * n
    return {
        "steps": steps,
        "step_tokens": 3.0 * steps,
        "step_engine_seconds": 0.02 * steps,
        "step_between_seconds": 0.001 * steps,
        "partial_steps": n,
        "prefill_steps": pre,
        "step_prompt_tokens": 16.0 * n,
        "prefill_step_engine_seconds": 0.05 * pre,
        "decode_only_step_tokens": n * (steps - pre),
        "prefill_step_expert_bytes_read": 3.0 * 2**20 * pre,
        "prefill_step_expert_stall_seconds": 0.004 * pre,
        "prefill_step_expert_misses": 5.0 * pre,
        "decode_step_expert_bytes_read": 2**20 * (steps - pre),
        "decode_step_expert_stall_seconds": 0.001 * (steps - pre),
        "decode_step_expert_misses": 2.0 * (steps - pre),
    }


def fake_run_clients(
    server: FakeServer, n: int, args: argparse.Namespace, first: int, max_tokens: int
) -> dict:
    k = 2.0 if server.batched else 1.0  # the batched server twice as fast, its CPU time per token halved
    tokens = n * max_tokens
    wall = n * 0.5 / k
    store = (
        {}
        if n == 1 and not server.batched
        else concurrency.store_figures(
            {},
            {
                "expert_calls": 100.0 * n,
                "expert_hits": 80.0 * n / k,
                "expert_misses": 100.0 * n - 80.0 * n / k,
                "expert_bytes_read": 2**20 * 10.0 * n,
                "expert_stall_seconds": 0.05 * n,
            },
            tokens,
        )
    )
    cpu = {
        "event_loop": 0.1 * n,
        "step_thread": 0.2 * n / k,
        "request_threads": 0.05 * n,
        "engine_workers": n / k,
    }
    return {
        "clients": n,
        "wall_s": wall,
        "completion_tokens": tokens,
        "aggregate_tok_s": tokens / wall,
        "decoding_s": wall * 0.8,
        "decode_tok_s": (tokens - n) / (wall * 0.8),
        "ttft_p50_s": 0.1 * n,
        "ttft_p99_s": 0.2 * n,
        # the batched text differs from the one-at-a-time text at 4 clients
        "texts": [f"text {i}" + ("!" if server.batched and n == 4 else "") for i in range(n)],
        "steps": concurrency.step_figures({}, batch_counters(n), wall) if server.batched else {},
        "store": store,
        "cpu": concurrency.cpu_figures({}, cpu, wall, tokens),
    }


WANT = (
    "\n".join(
        (
            "m.gguf  cap=none  max_tokens=8",
            "clients           mode  agg tok/s decode tok/s  ttft p50  ttft p99  speedup  decode same",
            "      1  one at a time      16.00        17.50     0.10s     0.20s ",
            "      1        batched      32.00        35.00     0.10s     0.20s    2.00x   2.00x True",
            "      4  one at a time      16.00        17.50     0.40s     0.80s ",
            "      4        batched      32.00        35.00     0.40s     0.80s    2.00x   2.00x False",
            "batched steps (through the server): tokens/step, engine ms/step, ms between steps, partial"
            " steps, % of wall in the engine / between steps; steps with prompt tokens: count, ms each, % of"
            " wall; decode-only steps: ms each",
            "      1     10 steps   3.00 tok    20.00 ms    1.00 ms     1  80.0%  4.0% |    2    50.00 ms "
            " 40.0% |    12.50 ms",
            "      4     40 steps   3.00 tok    20.00 ms    1.00 ms     4  80.0%  4.0% |    8    50.00 ms "
            " 40.0% |    12.50 ms",
            "server CPU per round (thread kind: CPU s / wall s; event loop, request threads, step thread,"
            " engine workers) and ms of event loop + request threads per completion token; all threads' CPU"
            " ms per completion token (batched: and one at a time's over it, the load-robust speed-up);"
            " batched decode-only steps: count, sequences each",
            "      1  one at a time  0.20  0.10  0.40  2.00  python  18.75 ms/token  all  168.75 ms/token",
            "      1        batched  0.40  0.20  0.40  2.00  python  18.75 ms/token  all   93.75 ms/token"
            " (1.80x) |     8  1.00",
            "      4  one at a time  0.20  0.10  0.40  2.00  python  18.75 ms/token  all  168.75 ms/token",
            "      4        batched  0.40  0.20  0.40  2.00  python  18.75 ms/token  all   93.75 ms/token"
            " (1.80x) |    32  4.00",
            "expert store per round: hit rate, MiB read, stall s, per completion token MiB / stall ms;"
            " batched steps with prompt tokens / decode-only: MiB read and stall ms per step",
            "      1        batched  0.400      10.0    0.05    1.25     6.2 |     3.0      4.0 |     1.0   "
            "   1.0",
            "      4  one at a time  0.800      40.0    0.20    1.25     6.2",
            "      4        batched  0.400      40.0    0.20    1.25     6.2 |     3.0      4.0 |     1.0   "
            "   1.0",
        )
    )
    + "\n"
)


def test_measure_prints_the_tables_and_adds_the_comparisons(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(concurrency, "Server", FakeServer)
    monkeypatch.setattr(concurrency, "run_clients", fake_run_clients)
    args = argparse.Namespace(model="m.gguf", clients=CLIENTS)
    report = concurrency.measure(args, None, 8)
    assert capsys.readouterr().out == WANT
    one, bat = report["modes"]["one_at_a_time"], report["modes"]["batched"]
    assert [r["clients"] for r in one] == [r["clients"] for r in bat] == CLIENTS
    assert [r["identical_to_one_at_a_time"] for r in bat] == [True, False]
    assert all(r["speedup"] == r["decode_speedup"] == 2.0 for r in bat)
    assert [round(r["cpu_speedup"], 6) for r in bat] == [1.8, 1.8]
    # the comparisons go to the batched rows only, in the order the JSON has always had them
    assert not any("speedup" in r for r in one)
    assert list(bat[0])[-4:] == ["identical_to_one_at_a_time", "speedup", "decode_speedup", "cpu_speedup"]
