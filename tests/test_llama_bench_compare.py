"""benchmarks/llama_bench_compare.py: the summary of alternating runs (medians, ranges, ratios) and the
parsing of colibri-run's report line. The runs themselves are benchmarks (the lead runs them), not tests."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import llama_bench_compare as lbc  # noqa: E402


def _run(engine: str, mode: str, decode: float, prefill: float, ok: bool = True) -> dict:
    return {
        "model": "m",
        "mode": mode,
        "engine": engine,
        "ok": ok,
        "decode_tps": decode,
        "prefill_tps": prefill,
    }


def test_summary_medians_ranges_and_ratios() -> None:
    runs = [
        _run("llama_bench", "warm", 30.0, 300.0),
        _run("colibri_run", "warm", 33.0, 420.0),
        _run("llama_bench", "warm", 31.0, 310.0),
        _run("colibri_run", "warm", 36.0, 400.0),
        _run("llama_bench", "warm", 29.0, 290.0),
        _run("colibri_run", "warm", 0.0, 0.0, ok=False),
        _run("llama_bench", "cold", 20.0, 100.0),
        _run("colibri_run", "cold", 25.0, 150.0),
    ]
    warm, cold = lbc.summarize(runs)
    ll, c = warm["engines"]["llama_bench"], warm["engines"]["colibri_run"]
    assert ll["runs_ok"] == 3 and c["runs_ok"] == 2  # the failed run is left out
    assert ll["decode_tps"] == 30.0 and ll["decode_tps_range"] == [29.0, 31.0]
    assert c["decode_tps"] == 34.5 and c["prefill_tps_range"] == [400.0, 420.0]
    assert warm["ratio"]["decode_tps"] == 34.5 / 30.0 and cold["ratio"]["prefill_tps"] == 1.5
    table = lbc.table([warm, cold])
    assert "| m | warm | 30.0 (29.0–31.0) | 34.5 (33.0–36.0) | 1.15× |" in table


def test_colibri_run_report_is_parsed() -> None:
    stderr = (
        "colibri-run: llama, 2 threads, kernels avx512\n"
        "  prompt: 64 tokens in 0.123 s (520.3 tok/s)\n"
        "  generated: 128 tokens, time to first token 0.130 s, decode 41.7 tok/s\n"
    )
    m = lbc._COLIBRI_RE.search(stderr)
    assert m is not None
    assert (int(m.group(1)), float(m.group(2)), int(m.group(3)), float(m.group(5))) == (64, 520.3, 128, 41.7)
