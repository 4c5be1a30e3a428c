"""benchmarks/llama_bench_compare.py: the summary of alternating runs (medians, ranges, ratios) and the
parsing of colibri-run's report line. The runs themselves are benchmarks (the lead runs them), not tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import llama_bench_compare as lbc  # noqa: E402


def _run(engine: str, mode: str, decode: float, prefill: float, ok: bool = True, first: float = 0.0) -> dict:
    r = {
        "model": "m",
        "mode": mode,
        "engine": engine,
        "ok": ok,
        "decode_tps": decode,
        "prefill_tps": prefill,
    }
    if first:
        r["first_prefill_tps"] = first  # colibri-run's untimed warmup prefill
    return r


def test_summary_medians_ranges_and_ratios() -> None:
    runs = [
        _run("llama_bench", "warm", 30.0, 300.0),
        _run("colibri_run", "warm", 33.0, 420.0, first=350.0),
        _run("llama_bench", "warm", 31.0, 310.0),
        _run("colibri_run", "warm", 36.0, 400.0, first=330.0),
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
    # the first (warmup) prefill is summarised on its own, against the same llama-bench pp64
    assert c["first_prefill_tps"] == 340.0 and c["first_prefill_tps_range"] == [330.0, 350.0]
    assert warm["ratio"]["first_prefill_tps"] == 340.0 / 300.0 and cold["ratio"]["first_prefill_tps"] is None
    table = lbc.table([warm, cold])
    assert "| m | warm | 30.0 (29.0–31.0) | 34.5 (33.0–36.0) | 1.15× |" in table
    assert "| 410.0 (400.0–420.0) | 1.37× | 340.0 (330.0–350.0) | 1.13× |" in table


def test_colibri_run_report_is_parsed() -> None:
    stderr = (
        "colibri-run: warmup prompt: 64 tokens in 0.140 s (457.1 tok/s), not counted below\n"
        "colibri-run: llama, 2 threads, kernels avx512\n"
        "  prompt: 64 tokens in 0.123 s (520.3 tok/s)\n"
        "  generated: 128 tokens, time to first token 0.130 s, decode 41.7 tok/s\n"
    )
    m = lbc._COLIBRI_RE.search(stderr)
    assert m is not None
    # the timed run's figures, not the warmup's (whose line also says "prompt: ...")
    assert (int(m.group(1)), float(m.group(2)), int(m.group(3)), float(m.group(5))) == (64, 520.3, 128, 41.7)
    warm = lbc._WARMUP_RE.search(stderr)
    assert warm is not None and float(warm.group(1)) == 457.1


def test_cold_runs_start_with_the_model_evicted_and_warm_runs_with_it_cached(tmp_path: Path) -> None:
    """--cold-start evict (the default) takes the model file out of the page cache before every cold run
    of either engine and leaves other files cached; a warm mode reads the file in once before its runs."""
    import mmap

    import numpy as np
    import pytest
    from test_bench_scripts import _cached_pages, _fs_type

    if _fs_type(tmp_path.resolve()) in ("tmpfs", "ramfs"):
        pytest.skip("tmpfs pages cannot be evicted")
    model, other = tmp_path / "m.gguf", tmp_path / "other.bin"
    for f in (model, other):
        f.write_bytes(np.random.default_rng(0).bytes(1 << 20))
    pages = (1 << 20) // mmap.PAGESIZE
    seen: list[tuple[str, int, int]] = []

    def engine(name: str):
        def run(label: str, path: Path, i: int) -> dict:
            seen.append((name, _cached_pages(path), _cached_pages(other)))
            path.read_bytes()  # an engine reads the whole file, as a load does
            return {"ok": True, "decode_tps": 1.0, "prefill_tps": 1.0, "wall_s": 0.1}

        return run

    other.read_bytes()
    engines = {"llama_bench": engine("llama_bench"), "colibri_run": engine("colibri_run")}
    runs = lbc.measure([("m", model)], ["cold", "warm"], 2, "evict", engines)
    assert [(r["mode"], r["engine"], r["run"]) for r in runs[:4]] == [
        ("cold", "llama_bench", 0),
        ("cold", "colibri_run", 0),
        ("cold", "llama_bench", 1),
        ("cold", "colibri_run", 1),
    ]
    assert seen[:4] == [(n, 0, pages) for n in ("llama_bench", "colibri_run") * 2]
    assert [s[1] for s in seen[4:]] == [pages] * 4  # warm: cached from the first run on


def _nice_of(pid: int) -> int:
    # /proc/PID/stat: "pid (comm) state ..." with nice the 19th field, counted from after the comm's ")"
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16])


def test_background_load_runs_niced_processes_and_ends_them() -> None:
    with lbc.background_load(2, 7) as pids:
        assert len(pids) == 2
        assert all(_nice_of(pid) == min(19, os.nice(0) + 7) for pid in pids)  # os.nice adds to ours
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)  # killed and reaped
    with lbc.background_load(0, 10) as none:
        assert none == []


def test_each_run_records_its_engines_cpu_seconds_and_the_hosts_steal(tmp_path: Path) -> None:
    """measure() charges a run with the CPU seconds of the process its engine waited for (a busy child
    here, nothing in the other engine) and the host's stolen seconds meanwhile, which the summary keeps
    beside the speeds: what tells a slow run on a busy host from one that waited."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 4096)
    # user-space work between clock reads (reading the process clock is a system call)
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: sum(range(20000))"

    def spawns(label: str, path: Path, i: int) -> dict:
        subprocess.run([sys.executable, "-c", busy], check=True)
        return {"ok": True, "decode_tps": 1.0, "prefill_tps": 1.0, "wall_s": 0.3}

    def idle(label: str, path: Path, i: int) -> dict:
        return {"ok": True, "decode_tps": 1.0, "prefill_tps": 1.0, "wall_s": 0.0}

    runs = lbc.measure([("m", model)], ["warm"], 2, "evict", {"llama_bench": spawns, "colibri_run": idle})
    busy_runs = [r for r in runs if r["engine"] == "llama_bench"]
    idle_runs = [r for r in runs if r["engine"] == "colibri_run"]
    # the child burns 0.3 s of its own clock; getrusage may account it a clock tick apart
    assert all(r["cpu_user_s"] + r["cpu_sys_s"] >= 0.25 for r in busy_runs)
    assert all(r["cpu_user_s"] == 0.0 and r["cpu_sys_s"] == 0.0 for r in idle_runs)
    steal = lbc.host_steal_s()
    assert steal is None or steal >= 0.0
    assert all(r["steal_s"] is None if steal is None else r["steal_s"] >= 0.0 for r in runs)
    (row,) = lbc.summarize(runs)
    assert row["engines"]["llama_bench"]["cpu_user_s"] >= 0.2
    assert row["engines"]["colibri_run"]["cpu_user_s"] == 0.0
