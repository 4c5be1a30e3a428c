"""Colibri's C runner against llama.cpp's own C++ `llama-bench`: no Python in either engine's loop.

    benchmarks/build_llama_bench.sh                      # once: llama-bench from the llama-cpp-python sdist
    python benchmarks/llama_bench_compare.py --model bench-a --runs 3 --json out.json
    python benchmarks/llama_bench_compare.py --model /path/file.q4_k_m.gguf --modes warm
    # issue 10's architecture files (make_bench_models.py --models bench-gptoss,bench-qwen35,bench-deepseek2),
    # one command per file:
    python benchmarks/llama_bench_compare.py --model bench-gptoss --runs 3 --modes warm --json gptoss.json
    python benchmarks/llama_bench_compare.py --model bench-qwen35 --runs 3 --modes warm --json qwen35.json
    python benchmarks/llama_bench_compare.py --model bench-deepseek2 --runs 3 --modes warm --json ds2.json

Per model and mode (warm: the file in the page cache, read once before the first run; cold: the file
out of the page cache before every run), runs alternate llama.cpp, Colibri, llama.cpp, Colibri, ... each a
fresh process. A cold run starts with `--cold-start evict` (the default: posix_fadvise DONTNEED on the model
file and its sidecars only, as bench.py does, so other processes keep their cached files) or `--cold-start
drop-caches` (`echo 3 > /proc/sys/vm/drop_caches`, the whole page cache, which needs root and disturbs
everything else on the machine). Both engines time prefill and decode after their load, so a cold run's
tok/s differ from a warm one's only where the weights are still read from the file while it runs; each
run's process wall time (`wall_s`, load included) is recorded next to them.

`--background N --background-nice K` runs both engines beside N busy-looping processes at nice K (a
build or a batch job on a desktop): what each engine keeps of its speed when it does not have the CPUs to
itself. The processes start before the first run and are ended after the last. The engines:

* llama.cpp: `llama-bench -m FILE -t 2 -p 64 -n 128 -r 1 -o json` (prefill pp64 and decode tg128 in one
  process, its default buffer types, REPACK included; llama-bench first runs each test once untimed, its
  warmup);
* Colibri: `colibri-run FILE -f PROMPT -n 128 -t 2 --temp 0.8 --seed S --warmup` with the same 64-token
  prompt text as benchmarks/bench.py (sampled, so random-weight models do not stop at an end token);
  prefill and decode tok/s from its report line. `--warmup` is llama-bench's warmup: the prompt and one
  decode step once, untimed, then the timed run from an empty context. The untimed first prefill is kept
  as `first_prefill_tps` (the "first prefill" column), which is what a process's first request gets.

Every run also records what the CPUs did meanwhile: the engine process's user and system CPU seconds
(`cpu_user_s`, `cpu_sys_s`, from getrusage of the waited-for child) and the seconds the hypervisor stole from
this machine's CPUs (`steal_s`, /proc/stat; null where there is no such column). A run slower than its
neighbours with the same CPU seconds waited (I/O, a descheduled thread); one with more CPU seconds for the
same work ran on a slower core (a busy host); steal says the host took the CPUs outright.

Medians, ranges (min, max) and Colibri / llama.cpp ratios go to stdout and, with --json, to a file with
every run's raw figures. colibri-run is built (Release) into build/bench/ unless --colibri-run names one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from bench import (  # noqa: E402
    environment,
    make_cold,
    median,
    prewarm_page_cache,
    prompt_ids,
    resolve_model,
)
from make_bench_models import DEFAULT_CACHE_DIR  # noqa: E402

THREADS = 2
N_PROMPT = 64
N_GEN = 128
LLAMA_VERSION = "0.3.36"
ENGINES = ("llama_bench", "colibri_run")
_COLIBRI_RE = re.compile(
    r"^\s+prompt: (\d+) tokens in [0-9.]+ s \(([0-9.]+) tok/s\).*?"
    r"generated: (\d+) tokens, time to first token ([0-9.]+) s, decode ([0-9.]+) tok/s",
    re.S | re.M,
)
_WARMUP_RE = re.compile(r"warmup prompt: \d+ tokens in [0-9.]+ s \(([0-9.]+) tok/s\)")


def default_llama_bench() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "colibri"
    return cache / f"llama.cpp-{LLAMA_VERSION}" / "bin" / "llama-bench"


def build_colibri_run(build_dir: Path) -> Path:
    """colibri-run from this checkout, Release, in build_dir (configured once)."""
    if not (build_dir / "CMakeCache.txt").is_file():
        subprocess.run(
            ["cmake", "-S", str(REPO / "native"), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    subprocess.run(
        ["cmake", "--build", str(build_dir), "-j", "2", "--target", "colibri-run"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return build_dir / "colibri-run"


def run_llama_bench(exe: Path, model: Path, timeout: float) -> dict:
    cmd = [
        str(exe),
        "-m",
        str(model),
        "-t",
        str(THREADS),
        "-p",
        str(N_PROMPT),
        "-n",
        str(N_GEN),
        "-r",
        "1",
        "-o",
        "json",
    ]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        return {"ok": False, "error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]}
    out: dict = {"ok": True, "wall_s": wall}
    for test in json.loads(p.stdout):
        if test.get("n_prompt") == N_PROMPT and test.get("n_gen") == 0:
            out["prefill_tps"] = float(test["avg_ts"])
        elif test.get("n_gen") == N_GEN and test.get("n_prompt") == 0:
            out["decode_tps"] = float(test["avg_ts"])
    if "prefill_tps" not in out or "decode_tps" not in out:
        return {"ok": False, "error": "llama-bench printed no pp64/tg128 results"}
    return out


def run_colibri(exe: Path, model: Path, prompt_file: Path, seed: int, timeout: float) -> dict:
    cmd = [
        str(exe),
        str(model),
        "-f",
        str(prompt_file),
        "-n",
        str(N_GEN),
        "-t",
        str(THREADS),
        "--temp",
        "0.8",
        "--warmup",
    ]
    # the generated text of a random-weight model need not be valid UTF-8 where a run is cut off
    t0 = time.monotonic()
    p = subprocess.run(
        [*cmd, "--seed", str(seed)], capture_output=True, text=True, errors="replace", timeout=timeout
    )
    wall = time.monotonic() - t0
    m = _COLIBRI_RE.search(p.stderr)
    if p.returncode != 0 or m is None:
        return {"ok": False, "error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]}
    out = {
        "ok": True,
        "prompt_tokens": int(m.group(1)),
        "prefill_tps": float(m.group(2)),
        "generated": int(m.group(3)),
        "ttft_s": float(m.group(4)),
        "decode_tps": float(m.group(5)),
        "wall_s": wall,
    }
    warm = _WARMUP_RE.search(p.stderr)
    if warm:
        out["first_prefill_tps"] = float(warm.group(1))
    if out["generated"] < N_GEN:  # an end token came early: too few steps to time like tg128
        out.update(ok=False, error=f"generated {out['generated']} of {N_GEN} tokens")
    return out


def write_prompt_files(models: list[tuple[str, Path]], directory: Path) -> dict[str, Path]:
    """The benchmark prompt (its first N_PROMPT ids, decoded with each model's own tokenizer) written to a
    file per model for colibri-run's -f, keyed by the model's label."""
    from colibri_backend.adapters.tokenizer import Tokenizer

    prompts = {}
    for n, (label, path) in enumerate(models):
        prompts[label] = directory / f"prompt-{n}.txt"
        text = Tokenizer.from_gguf(path).decode(prompt_ids(path, N_PROMPT))
        prompts[label].write_text(text, encoding="utf-8")
    return prompts


def engine_summary(ok: list[dict], keys: tuple[str, ...]) -> dict:
    """One engine's successful runs: their count, and the median and (min, max) of each figure in ``keys``."""
    e: dict = {"runs_ok": len(ok)}
    for k in keys:
        vals = [r[k] for r in ok if k in r]
        e[k] = median(vals)
        e[f"{k}_range"] = [min(vals), max(vals)] if vals else None
    return e


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    keys = dict.fromkeys((r["model"], r["mode"]) for r in runs)
    for model, mode in keys:
        row: dict = {"model": model, "mode": mode, "engines": {}}
        for engine in ENGINES:
            ok = [
                r for r in runs if (r["model"], r["mode"], r["engine"]) == (model, mode, engine) and r["ok"]
            ]
            keys = ("decode_tps", "prefill_tps", "wall_s", "cpu_user_s")
            if engine == "colibri_run":
                keys += ("first_prefill_tps",)
            row["engines"][engine] = engine_summary(ok, keys)
        c, ll = row["engines"]["colibri_run"], row["engines"]["llama_bench"]
        row["ratio"] = {k: (c[k] / ll[k] if c[k] and ll[k] else None) for k in ("decode_tps", "prefill_tps")}
        first = c.get("first_prefill_tps")
        row["ratio"]["first_prefill_tps"] = first / ll["prefill_tps"] if first and ll["prefill_tps"] else None
        rows.append(row)
    return rows


def fmt(x: float | None, d: int = 1) -> str:
    return "–" if x is None else f"{x:.{d}f}"


def cell(e: dict, k: str) -> str:
    """An engine's median of figure ``k`` with its range, for a markdown table."""
    rng = e[f"{k}_range"]
    return f"{fmt(e[k])} ({fmt(rng[0])}–{fmt(rng[1])})" if rng else "–"


def table(rows: list[dict]) -> str:
    lines = [
        "| model | mode | llama-bench tg128 | colibri-run decode | ratio | llama-bench pp64 "
        "| colibri-run prefill | ratio | colibri-run first prefill (untimed warmup) | ratio "
        "| wall s llama-bench / colibri-run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ll, c = r["engines"]["llama_bench"], r["engines"]["colibri_run"]

        lines.append(
            f"| {r['model']} | {r['mode']} | {cell(ll, 'decode_tps')} | {cell(c, 'decode_tps')} | "
            f"{fmt(r['ratio']['decode_tps'], 2)}× | {cell(ll, 'prefill_tps')} | {cell(c, 'prefill_tps')} | "
            f"{fmt(r['ratio']['prefill_tps'], 2)}× | {cell(c, 'first_prefill_tps')} | "
            f"{fmt(r['ratio']['first_prefill_tps'], 2)}× | {fmt(ll['wall_s'])} / {fmt(c['wall_s'])} |"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def background_load(n: int, niceness: int) -> Iterator[list[int]]:
    """n busy-looping Python processes at nice `niceness` for the duration of the block; their pids."""
    code = f"import os\nos.nice({niceness})\nwhile True: pass"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]
    try:
        time.sleep(0.5 if procs else 0)  # let them reach the loop
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def host_steal_s() -> float | None:
    """CPU seconds the hypervisor has stolen from this machine since boot (all CPUs), or None."""
    try:
        # the first line: "cpu user nice system idle iowait irq softirq steal ...", in clock ticks
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


@contextlib.contextmanager
def cpu_accounting(into: dict) -> Iterator[None]:
    """Adds to `into` the CPU seconds of the child processes waited for inside the block (cpu_user_s,
    cpu_sys_s) and the host's stolen seconds meanwhile (steal_s, None where unknown)."""
    ru0, st0 = resource.getrusage(resource.RUSAGE_CHILDREN), host_steal_s()
    yield
    ru1, st1 = resource.getrusage(resource.RUSAGE_CHILDREN), host_steal_s()
    into.update(
        cpu_user_s=round(ru1.ru_utime - ru0.ru_utime, 3),
        cpu_sys_s=round(ru1.ru_stime - ru0.ru_stime, 3),
        steal_s=None if st0 is None or st1 is None else round(st1 - st0, 2),
    )


def measure(
    models: list[tuple[str, Path]],
    modes: list[str],
    n_runs: int,
    cold_start: str,
    engines: dict[str, Callable[[str, Path, int], dict]],
) -> list[dict]:
    """Every engine on every model and mode, alternating engines run by run; a cold run first takes the
    file out of the page cache (make_cold: `evict` or `drop-caches`), a warm mode reads it in once."""
    runs: list[dict] = []
    for label, path in models:
        for mode in modes:
            if mode == "warm":
                prewarm_page_cache(path)
            for i in range(n_runs):
                for engine, run in engines.items():
                    if mode == "cold":
                        make_cold(path, cold_start)
                    acct: dict = {}
                    with cpu_accounting(acct):
                        r = run(label, path, i)
                    r.update(acct, model=label, path=str(path), mode=mode, engine=engine, run=i)
                    runs.append(r)
                    steal = "–" if r["steal_s"] is None else f"{r['steal_s']:.2f}"
                    status = (
                        f"decode {r['decode_tps']:.1f} tok/s, prefill {r['prefill_tps']:.1f} tok/s, "
                        f"wall {r['wall_s']:.1f} s, cpu {r['cpu_user_s']:.2f} user + "
                        f"{r['cpu_sys_s']:.2f} sys s, steal {steal} s"
                        if r["ok"]
                        else f"FAILED: {r['error']}"
                    )
                    print(f"{label} {mode} {engine} run {i + 1}: {status}", file=sys.stderr, flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model",
        action="append",
        required=True,
        help="a bench model (bench-a, bench-gptoss, bench-qwen35, bench-deepseek2, ...), smollm2 or a GGUF",
    )
    ap.add_argument("--bench-type", default="q8_0", help="type of the bench model files (default q8_0)")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    ap.add_argument("--runs", type=int, default=3, help="runs per engine, mode and model (default 3)")
    ap.add_argument("--modes", default="warm,cold", help="warm, cold or warm,cold")
    ap.add_argument(
        "--cold-start",
        choices=["evict", "drop-caches"],
        default="evict",
        help="how a cold run starts: evict the model file and its sidecars from the page cache (default) "
        "or drop the whole page cache (root; disturbs every other process on the machine)",
    )
    ap.add_argument(
        "--llama-bench", type=Path, default=None, help="llama-bench (default: build_llama_bench.sh's)"
    )
    ap.add_argument(
        "--colibri-run", type=Path, default=None, help="colibri-run (default: built in build/bench)"
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument(
        "--background", type=int, default=0, help="busy-looping processes beside both engines (default 0)"
    )
    ap.add_argument("--background-nice", type=int, default=10, help="their nice value (default 10)")
    ap.add_argument("--json", type=Path, default=None, help="write every run and the summary here")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("warm", "cold") for m in modes):
        ap.error("--modes takes warm, cold or warm,cold")
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.background < 0 or not 0 <= args.background_nice <= 19:
        ap.error("--background takes a count >= 0 and --background-nice a value in 0..19")
    lb = args.llama_bench or default_llama_bench()
    if not lb.is_file():
        ap.error(f"{lb} does not exist: run benchmarks/build_llama_bench.sh first (or pass --llama-bench)")
    cr = args.colibri_run or build_colibri_run(REPO / "build" / "bench")
    models = [resolve_model(m, args.cache_dir, args.bench_type) for m in args.model]
    missing = [str(path) for _, path in models if not path.is_file()]
    if missing:
        ap.error(f"model file not found: {missing[0]}")

    with tempfile.TemporaryDirectory() as tmp:
        prompts = write_prompt_files(models, Path(tmp))
        engines: dict[str, Callable[[str, Path, int], dict]] = {
            "llama_bench": lambda label, path, i: run_llama_bench(lb, path, args.timeout),
            "colibri_run": lambda label, path, i: run_colibri(
                cr, path, prompts[label], seed=i + 1, timeout=args.timeout
            ),
        }
        with background_load(args.background, args.background_nice):
            runs = measure(models, modes, args.runs, args.cold_start, engines)
    rows = summarize(runs)
    print(table(rows))
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "environment": environment(),
                    "cold_start": args.cold_start,
                    "background": {"processes": args.background, "nice": args.background_nice},
                    "summary": rows,
                    "runs": runs,
                },
                indent=2,
            ),
            encoding="utf-8",
        )
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
