"""llama_bench_compare.py with two colibri-run builds: llama-bench, a base and a new colibri-run, alternating.

    python benchmarks/llama_bench_ab.py --base BASE/colibri-run --new build/dev/colibri-run \
        --model ~/.cache/colibri/bench/bench-a-q4_k_m.gguf --runs 3 --json ab.json

Warm only (the file read into the page cache once per model). Per model, runs go llama-bench, base, new,
llama-bench, base, new, ... each a fresh process, with the protocol of llama_bench_compare.py (llama-bench
pp64 / tg128 at 2 threads; colibri-run with its 64-token prompt, 128 sampled tokens). The load average at the
start of each run is recorded beside it. Prints, per model and engine, the medians and ranges of decode and
prefill tok/s and the ratios new / llama-bench, base / llama-bench and new / base.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench import environment, prewarm_page_cache, resolve_model  # noqa: E402
from llama_bench_compare import (  # noqa: E402
    cell,
    default_llama_bench,
    engine_summary,
    fmt,
    run_colibri,
    run_llama_bench,
    write_prompt_files,
)
from make_bench_models import DEFAULT_CACHE_DIR  # noqa: E402

ENGINES = ("llama_bench", "colibri_base", "colibri_new")


def measure(
    models: list[tuple[str, Path]], n_runs: int, engines: dict[str, Callable[[str, Path, int], dict]]
) -> list[dict]:
    """Every engine on every model, warm, alternating engines run by run."""
    runs: list[dict] = []
    for label, path in models:
        prewarm_page_cache(path)
        for i in range(n_runs):
            for engine, run in engines.items():
                load = os.getloadavg()[0]
                r = run(label, path, i)
                r.update(model=label, path=str(path), engine=engine, run=i, load_start=load)
                runs.append(r)
                status = (
                    f"decode {r['decode_tps']:.1f} tok/s, prefill {r['prefill_tps']:.1f} tok/s"
                    if r["ok"]
                    else f"FAILED: {r['error']}"
                )
                print(
                    f"{label} {engine} run {i + 1} (load {load:.1f}): {status}", file=sys.stderr, flush=True
                )
    return runs


def summarize(runs: list[dict]) -> list[dict]:
    """Medians and ranges per model and engine, and the three ratios of the medians."""
    rows = []
    for model in dict.fromkeys(r["model"] for r in runs):
        row: dict = {"model": model, "engines": {}}
        loads = [r["load_start"] for r in runs if r["model"] == model]
        row["load_range"] = [min(loads), max(loads)]
        for engine in ENGINES:
            ok = [r for r in runs if r["model"] == model and r["engine"] == engine and r["ok"]]
            row["engines"][engine] = engine_summary(ok, ("decode_tps", "prefill_tps"))
        ll, b, n = (row["engines"][e] for e in ENGINES)

        def ratio(x: dict, y: dict, k: str) -> float | None:
            return x[k] / y[k] if x[k] and y[k] else None

        row["ratio"] = {
            k: {"new/llama": ratio(n, ll, k), "base/llama": ratio(b, ll, k), "new/base": ratio(n, b, k)}
            for k in ("decode_tps", "prefill_tps")
        }
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """A markdown table: one line per model and measure (decode, prefill)."""
    lines = [
        "| model | | llama-bench | colibri base | colibri new | new / llama | base / llama | new / base "
        "| load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for k, name in (("decode_tps", "decode"), ("prefill_tps", "prefill")):
            q = r["ratio"][k]
            eng = r["engines"]
            lines.append(
                f"| {r['model']} | {name} | {cell(eng['llama_bench'], k)} | {cell(eng['colibri_base'], k)} "
                f"| {cell(eng['colibri_new'], k)} | {fmt(q['new/llama'], 2)}× | {fmt(q['base/llama'], 2)}× "
                f"| {fmt(q['new/base'], 2)}× | {fmt(r['load_range'][0])}–{fmt(r['load_range'][1])} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, help="a bench model name or a GGUF")
    ap.add_argument("--bench-type", default="q8_0", help="type of the bench model files (default q8_0)")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    ap.add_argument("--runs", type=int, default=3, help="runs per engine and model (default 3)")
    ap.add_argument(
        "--llama-bench", type=Path, default=None, help="llama-bench (default: build_llama_bench.sh's)"
    )
    ap.add_argument("--base", type=Path, required=True, help="the base colibri-run")
    ap.add_argument("--new", type=Path, required=True, help="the new colibri-run")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--json", type=Path, default=None, help="write every run and the summary here")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    lb = args.llama_bench or default_llama_bench()
    for exe in (lb, args.base, args.new):
        if not exe.is_file():
            ap.error(f"{exe} does not exist")
    models = [resolve_model(m, args.cache_dir, args.bench_type) for m in args.model]
    missing = [str(path) for _, path in models if not path.is_file()]
    if missing:
        ap.error(f"model file not found: {missing[0]}")
    with tempfile.TemporaryDirectory() as tmp:
        prompts = write_prompt_files(models, Path(tmp))

        def colibri(exe: Path) -> Callable[[str, Path, int], dict]:
            return lambda label, path, i: run_colibri(exe, path, prompts[label], i + 1, args.timeout)

        engines: dict[str, Callable[[str, Path, int], dict]] = {
            "llama_bench": lambda label, path, i: run_llama_bench(lb, path, args.timeout),
            "colibri_base": colibri(args.base),
            "colibri_new": colibri(args.new),
        }
        runs = measure(models, args.runs, engines)
    rows = summarize(runs)
    print(table(rows))
    if args.json is not None:
        args.json.write_text(
            json.dumps({"environment": environment(), "summary": rows, "runs": runs}, indent=2),
            encoding="utf-8",
        )
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
