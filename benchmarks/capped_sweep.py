"""Memory-budget sweeps of Colibri's expert streaming.

Two modes:

  budget   (no root needed) For each budget (fractions of the GGUF size), a fresh process loads the model
           with memory_budget=fraction * size, generates greedily from a fixed prompt, then computes the
           teacher-forced logits of prompt + generation. The parent checks greedy ids and logits are
           bit-identical to the unbudgeted run and prints decode tok/s, expert hit rate, bytes read per
           token, stall share, prefetch figures, predictor precision/recall and peak RSS against the
           ledger's plan (RSS growth from just before the load, so the interpreter is not counted).

      python benchmarks/capped_sweep.py budget --model ~/.cache/colibri/bench/bench-a-q8_0.gguf \\
          --fractions 1,0.5,0.25 --max-tokens 32

  capped   (root) The issue's capped sweep: for each fraction, benchmarks/bench.py runs Colibri and llama.cpp
           in a fresh cgroup whose memory limit is fraction * size (the model file evicted from the page cache
           first, cgroup removed afterwards, both done by bench.py; --cold-start drop-caches drops the whole
           page cache instead, for a quiet machine). Colibri gets its budget through COLIBRI_MEMORY_BUDGET =
           cap - --overhead (the Python process itself lives in the same cgroup).

      python benchmarks/capped_sweep.py capped --model bench-a --fractions 1,0.6,0.4,0.25 --runs 1

  --cap-of FILE (both modes) takes the fractions of FILE's size instead of the model's, so two
  quantizations of one model run under the same caps: bench-A Q4_K_M under 25% and 50% of bench-A Q8_0's
  size, next to Q8_0 itself (the result files are then named capped_0.25_of-STEM*.json).

      python benchmarks/capped_sweep.py capped --model ~/.cache/colibri/bench/bench-a-q4_k_m.gguf \\
          --cap-of ~/.cache/colibri/bench/bench-a-q8_0.gguf --fractions 0.5,0.25 --runs 3

  Realistic routing: --routing-trace TRACE (both modes) makes Colibri follow a trained model's recorded
  routing on a random-weight file with the same layer and expert counts (bench-r, made by
  make_bench_models.py; the override is for benchmarks only, colibri_backend.trace.impose_trace).
  llama.cpp cannot follow a trace, so the capped mode then runs Colibri alone. --prefetch-modes
  none/temporal runs every cell once per predictor set ("/" between sets), so prefetch on and off are
  measured side by side; each cell reports major page faults per decoded token.

      python benchmarks/capped_sweep.py capped --model bench-r --routing-trace \
          benchmarks/traces/colibri-moe-v1-heldout.npz --fractions 0.6,0.25 --prefetch-modes none/temporal

Results go to stdout as a table and, with --json, to a file. `report DIR [DIR ...]` turns capped runs'
JSON files into one markdown table; given the out-dirs of several rounds of the same cells (run one after
another, so the cells alternate), each row has the median over the rounds and every run's decode tok/s,
with each predictor's precision / recall and the MiB of prefetches wasted.

      for r in 1 2 3; do python benchmarks/capped_sweep.py capped ... --out-dir OUT/r$r; done
      python benchmarks/capped_sweep.py report OUT/r1 OUT/r2 OUT/r3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULT = "CAPPED_SWEEP_RESULT "


def vm_field(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def child(args: argparse.Namespace) -> int:
    """One point: load with a budget, greedy-generate, teacher-force, report JSON on the last line."""
    import numpy as np

    import colibri_backend

    rss_before = vm_field("VmRSS")
    model = colibri_backend.load(
        args.model,
        threads=args.threads,
        context_length=args.ctx,
        batch_size=args.batch,
        memory_budget=args.budget,
        expert_policy=args.policy,
        prefetch=args.prefetch,
    )
    if args.routing_trace:
        from colibri_backend.trace import impose_trace, load_trace

        impose_trace(model, load_trace(args.routing_trace))
    rng = np.random.default_rng(args.seed)
    prompt = [int(t) for t in rng.integers(100, model.info.n_vocab - 100, args.prompt_tokens)]
    model.reset_stats()
    from colibri_backend.adapters.sampling import SamplingParams

    sampling = SamplingParams(
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        seed=args.seed,
        logit_bias={t: float("-inf") for t in model.tokenizer.stop_token_ids},
    )
    ids: list[int] = []
    times: list[float] = []
    for ev in model.generate_tokens(
        prompt, max_tokens=args.max_tokens, sampling=sampling, stop=None, logprobs=None
    ):
        times.append(time.perf_counter())
        ids.append(int(ev.token_id))
    stats = model.stats()
    decode_s = times[-1] - times[0] if len(times) > 1 else 0.0
    logits = model.logits(prompt + ids) if args.teacher_force else None
    out = {
        "budget": args.budget,
        "ids": ids,
        "logits_sha256": hashlib.sha256(logits.tobytes()).hexdigest() if logits is not None else None,
        "decode_tok_s": (len(ids) - 1) / decode_s if decode_s > 0 else 0.0,
        "n_decode": len(ids) - 1,
        "stats": {k: v for k, v in stats.items() if k not in ("expert_layers", "last")},
        "rss_before": rss_before,
        "vm_hwm": vm_field("VmHWM"),
    }
    model.close()
    print(RESULT + json.dumps(out))
    return 0


def run_point(args: argparse.Namespace, budget: int, teacher_force: bool) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "child",
        "--model",
        str(args.model),
        "--budget",
        str(budget),
        "--threads",
        str(args.threads),
        "--ctx",
        str(args.ctx),
        "--batch",
        str(args.batch),
        "--max-tokens",
        str(args.max_tokens),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--seed",
        str(args.seed),
        "--policy",
        args.policy,
        "--prefetch",
        args.prefetch,
    ]
    if args.routing_trace:
        cmd += ["--routing-trace", str(args.routing_trace)]
    if teacher_force:
        cmd.append("--teacher-force")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    raise RuntimeError(f"budget {budget}: child failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")


def ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def cap_basis(model: Path, cap_of: Path | None) -> tuple[int, str]:
    """The size the fractions are taken of, and the label's suffix naming it: the model's own size (no
    suffix), or that of another file (--cap-of; e.g. Q4_K_M under a share of Q8_0's size)."""
    if cap_of is None:
        return model.stat().st_size, ""
    return cap_of.expanduser().stat().st_size, f"_of-{cap_of.name.removesuffix('.gguf')}"


def parse_label(stem: str) -> tuple[str, str, str]:
    """(fraction, basis, prefetch set) of a result file's stem, capped_0.25[_of-STEM][_pf-MODE]; the basis
    is "" for the model's own size and the fraction is "none" for the uncapped run."""
    label, _, pf = stem.removeprefix("capped_").partition("_pf-")
    frac, _, basis = label.partition("_of-")
    return frac, basis, pf or "default"


def budget_sweep(args: argparse.Namespace) -> int:
    size, basis = cap_basis(Path(args.model), args.cap_of)
    of = f" of {basis.removeprefix('_of-')}" if basis else ""
    fractions = [float(f) for f in args.fractions.split(",")]
    ref = run_point(args, 0, True)
    rows = [("unbudgeted", ref)]
    for f in fractions:
        rows.append((f"{f:.0%}{of}", run_point(args, int(size * f), True)))
    print(
        f"model {args.model} ({os.path.getsize(args.model) / 2**20:.1f} MiB), budgets of {size / 2**20:.1f} "
        f"MiB{of}, {args.max_tokens} greedy tokens, "
        f"policy {args.policy}, prefetch {args.prefetch}, threads {args.threads}"
        + (f", routing of {args.routing_trace}" if args.routing_trace else "")
    )
    head = (
        "budget",
        "identical",
        "decode tok/s",
        "hit %",
        "MiB read/tok",
        "stall %",
        "pf issued/used/wasted/dropped",
        "major faults/tok",
        "lookahead P/R",
        "temporal P/R",
        "plan MiB",
        "RSS growth MiB",
        "RSS/plan",
    )
    print(" | ".join(head))
    for name, r in rows:
        s = r["stats"]
        same = r["ids"] == ref["ids"] and r["logits_sha256"] == ref["logits_sha256"]
        n_tok = max(r["n_decode"] + 1, 1)
        plan_total = s["memory_plan"]["total_bytes"]
        growth = r["vm_hwm"] - r["rss_before"]
        cells = (
            name,
            "yes" if same else "NO",
            f"{r['decode_tok_s']:.2f}",
            f"{100 * ratio(s['expert_hits'], s['expert_calls']):.1f}" if s["expert_calls"] else "-",
            f"{s['expert_bytes_read'] / 2**20 / n_tok:.1f}",
            f"{100 * ratio(s['expert_stall_seconds'], s['decode_seconds'] + s['prefill_seconds']):.1f}",
            f"{s['prefetch_issued']}/{s['prefetch_used']}/{s['prefetch_wasted']}/{s['prefetch_dropped']}",
            f"{ratio(s['major_faults_decode'], s['n_decode_tokens']):.2f}",
            f"{ratio(s['lookahead_correct'], s['lookahead_predicted']):.2f}/"
            f"{ratio(s['lookahead_correct'], s['lookahead_actual']):.2f}",
            f"{ratio(s['temporal_correct'], s['temporal_predicted']):.2f}/"
            f"{ratio(s['temporal_correct'], s['temporal_actual']):.2f}",
            f"{plan_total / 2**20:.1f}",
            f"{growth / 2**20:.1f}",
            f"{ratio(growth, plan_total):.2f}",
        )
        print(" | ".join(cells))
    if args.json:
        args.json.write_text(json.dumps([{"name": n, **r} for n, r in rows], indent=2))
    same = all(r["ids"] == ref["ids"] and r["logits_sha256"] == ref["logits_sha256"] for _, r in rows)
    return 0 if same else 1


def capped_sweep(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(HERE))
    from make_bench_models import gguf_path  # noqa: E402  (the bench model's file, to size the caps)

    path = Path(args.model) if Path(args.model).is_file() else gguf_path(args.cache_dir, args.model, "q8_0")
    size, basis = cap_basis(path, args.cap_of)
    overhead = int(args.overhead_mib * 2**20)
    results = []
    modes = [m.strip() for m in args.prefetch_modes.split("/")] if args.prefetch_modes else [None]
    engines = "colibri" if args.routing_trace else args.engines
    cells = [(float(x), m) for x in args.fractions.split(",") for m in modes]
    for f, mode in cells:
        cap = int(size * f)
        env = dict(os.environ, COLIBRI_MEMORY_BUDGET=str(max(cap - overhead, 1)))
        tag = f"_pf-{mode.replace(',', '+')}" if mode else ""
        out = Path(args.out_dir) / f"capped_{f:.2f}{basis}{tag}.json"
        cmd = [
            sys.executable,
            str(HERE / "bench.py"),
            "--model",
            args.model,
            "--engines",
            engines,
            "--sampling",
            args.sampling,
            "--runs",
            str(args.runs),
            "--max-tokens",
            str(args.max_tokens),
            "--threads",
            str(args.threads),
            "--ctx",
            str(args.ctx),
            "--batch-size",
            str(args.batch),
            "--memory-cap",
            str(cap),
            "--cold-start",
            args.cold_start,
            "--json",
            str(out),
            "--markdown",
        ]
        if mode:
            cmd += ["--prefetch", mode]
        if args.routing_trace:
            cmd += ["--routing-trace", str(args.routing_trace)]
        for option in args.colibri_option:
            cmd += ["--colibri-option", option]
        print(
            f"== cap {f:.0%} of {size / 2**20:.0f} MiB{' (' + basis[4:] + ')' if basis else ''} = "
            f"{cap / 2**20:.0f} MiB, Colibri budget "
            f"{(cap - overhead) / 2**20:.0f} MiB" + (f", prefetch {mode}" if mode else ""),
            flush=True,
        )
        proc = subprocess.run(cmd, env=env, text=True, timeout=args.timeout)
        of = basis.removeprefix("_of-") or None
        results.append(
            {"fraction": f, "of": of, "prefetch": mode, "cap": cap, "rc": proc.returncode, "json": str(out)}
        )
    print(json.dumps(results, indent=2))
    return 0 if all(r["rc"] == 0 for r in results) else 1


def decode_figures(run: dict) -> dict | None:
    """The decode steps' own store figures of one bench.py run: the counters at the end less those at the
    first token (the prompt's chunked reads are another pattern, and dividing all bytes by prompt + decoded
    tokens hides what a decoded token costs). None for a run without the first token's counters."""
    a, b = run.get("engine_stats_at_first_token"), run["engine_stats"]
    if not a:
        return None
    n = b["n_decode_tokens"] - a["n_decode_tokens"]
    calls = b["expert_calls"] - a["expert_calls"]
    read = b["expert_bytes_read"] - a["expert_bytes_read"]
    secs = b["decode_seconds"] - a["decode_seconds"]
    stall = b["expert_stall_decode_seconds"] - a["expert_stall_decode_seconds"]
    if n <= 0 or secs <= 0:
        return None
    return {
        "hit": 100 * ratio(b["expert_hits"] - a["expert_hits"], calls),
        "mib_per_token": read / 2**20 / n,
        "read_mb_s": read / secs / 1e6,
        "stall": 100 * stall / secs,
    }


def predictor_cell(runs: list[dict]) -> str:
    """Each predictor that guessed in these runs: its letter (L lookahead, T temporal, H hashed) and the
    median precision / recall of its scored guesses."""
    from statistics import median

    out = []
    for name in ("lookahead", "temporal", "hashed"):
        stats = [r["engine_stats"] for r in runs if r["engine_stats"].get(f"{name}_predicted")]
        if stats:
            p = median(s[f"{name}_correct"] / s[f"{name}_predicted"] for s in stats)
            rc = median(s[f"{name}_correct"] / max(s[f"{name}_actual"], 1) for s in stats)
            out.append(f"{name[0].upper()} {p:.0%} / {rc:.0%}")
    return "; ".join(out) or "-"


def capped_report(args: argparse.Namespace) -> int:
    """Markdown tables from a capped sweep's JSON files (capped_*.json, plus capped_none.json: the same
    protocol without a cap, from `bench.py ... --json DIR/capped_none.json`; a `_pf-MODE` suffix names the
    predictor set of a --prefetch-modes cell)."""
    from statistics import median

    rows: dict[tuple[str, str, str], dict[str, list[dict]]] = {}
    caps: dict[str, int] = {}
    for f in sorted(f for d in args.dir for f in Path(d).glob("capped_*.json")):
        frac, basis, pf = parse_label(f.stem)
        label = frac + (f"_of-{basis}" if basis else "")
        doc = json.loads(f.read_text())
        caps[label] = doc.get("protocol", {}).get("memory_cap_bytes") or 0
        for r in doc["runs"]:
            if r.get("ok"):
                rows.setdefault((label, pf, r["sampling"]), {}).setdefault(r["engine"], []).append(r)

    def cap_cell(label: str) -> str:
        frac, _, basis = label.partition("_of-")
        if frac == "none":
            return "none"
        mib = f" ({caps[label] / 2**20:.0f} MiB)" if caps.get(label) else ""
        return f"{float(frac):.0%}" + (f" of {basis}" if basis else "") + mib

    def med(runs: list[dict], key: str) -> float | None:
        vals = [r[key] for r in runs if r.get(key) is not None]
        return median(vals) if vals else None

    uncapped = {
        (pf, s): med(e["colibri"], "decode_tps")
        for (lab, pf, s), e in rows.items()
        if lab == "none" and "colibri" in e
    }
    print(
        "| cap | prefetch | sampling | Colibri decode tok/s | llama.cpp decode tok/s | ratio "
        "| Colibri / own uncapped | decode hit % | MiB read / decoded token | read MB/s while decoding "
        "| decode stall % | MiB read / token, prompt included | major faults / token (C / L) "
        "| faults, first 8 tokens (C / L) | plan MiB | RSS growth MiB (/ plan) | cgroup peak MiB (C / L) "
        "| Colibri decode tok/s, each run | predictor precision / recall | MiB of prefetches wasted |"
    )
    print("|" + "---|" * 20)

    def order_key(k: tuple[str, str, str]) -> tuple:
        frac, _, basis = k[0].partition("_of-")
        return (frac != "none", basis, -float(frac) if frac != "none" else 0, k[1], k[2])

    order = sorted(rows, key=order_key)
    for label, pf, sampling in order:
        e = rows[(label, pf, sampling)]
        c, ll = e.get("colibri", []), e.get("llama_cpp", [])
        ctps = med(c, "decode_tps") if c else None
        ltps = med(ll, "decode_tps") if ll else None
        cells = [cap_cell(label), pf, sampling]
        cells += [f"{ctps:.2f}" if ctps else "-", f"{ltps:.2f}" if ltps else "-"]
        cells.append(f"{ctps / ltps:.1f}x" if ctps and ltps else "-")
        own = uncapped.get((pf, sampling)) or uncapped.get(("default", sampling))
        cells.append(f"{ctps / own:.0%}" if ctps and own and label != "none" else "-")
        faults = [med(x, "major_faults_per_decode_token") if x else None for x in (c, ll)]
        early = [med(x, "major_faults_first_decode_tokens") if x else None for x in (c, ll)]
        if c:
            st = c[0]["engine_stats"]
            n_tok = st["n_prompt_tokens"] + st["n_decode_tokens"]
            streaming = st.get("expert_calls", 0) > 0
            dec = [decode_figures(r) for r in c]
            dec = [d for d in dec if d]
            if streaming and dec:
                cells += [
                    f"{median(d['hit'] for d in dec):.1f}",
                    f"{median(d['mib_per_token'] for d in dec):.1f}",
                    f"{median(d['read_mb_s'] for d in dec):.0f}",
                    f"{median(d['stall'] for d in dec):.0f}",
                ]
            else:
                cells += ["all resident" if not streaming else "-", "-", "-", "-"]
            cells.append(f"{st['expert_bytes_read'] / 2**20 / max(n_tok, 1):.1f}")
        else:
            cells += ["-"] * 5
        cells.append(" / ".join("-" if v is None else f"{v:.1f}" for v in faults))
        cells.append(" / ".join("-" if v is None else f"{v:.0f}" for v in early))
        if c:
            plan = st["memory_plan"]["total_bytes"]
            growth = c[0]["peak_rss_bytes"] - (c[0].get("rss_before_load_bytes") or 0)
            cells += [
                f"{plan / 2**20:.0f}",
                f"{growth / 2**20:.0f} ({ratio(growth, plan):.2f})"
                if c[0].get("rss_before_load_bytes")
                else f"{c[0]['peak_rss_bytes'] / 2**20:.0f} (process)",
            ]
        else:
            cells += ["-"] * 2
        cg = [
            f"{x[0]['cgroup_peak_bytes'] / 2**20:.0f}" if x and x[0].get("cgroup_peak_bytes") else "-"
            for x in (c, ll)
        ]
        cells.append(" / ".join(cg))
        cells.append(", ".join(f"{r['decode_tps']:.1f}" for r in c) if c else "-")
        cells.append(predictor_cell(c) if c else "-")
        wasted = med([r["engine_stats"] for r in c], "prefetch_wasted_bytes") if c else None
        cells.append(f"{wasted / 2**20:.0f}" if wasted is not None else "-")
        print("| " + " | ".join(cells) + " |")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    report = sub.add_parser("report", help="Markdown tables from a capped sweep's --out-dir")
    report.add_argument(
        "dir", type=Path, nargs="+", help="an --out-dir; several (rounds of the same cells) go in one table"
    )
    for name in ("budget", "child", "capped"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument(
            "--routing-trace",
            type=Path,
            default=None,
            help="Colibri follows this recorded routing (benchmark-only override; the model needs the trace "
            "model's layer and expert counts, e.g. bench-r)",
        )
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--ctx", type=int, default=512)
        p.add_argument("--max-tokens", type=int, default=32)
        p.add_argument("--timeout", type=float, default=1800.0)
        p.add_argument("--batch", type=int, default=64)
        if name != "child":
            p.add_argument(
                "--cap-of",
                type=Path,
                default=None,
                metavar="FILE",
                help="take the fractions of FILE's size instead of the model's (e.g. Q4_K_M under shares "
                "of Q8_0's size)",
            )
        if name != "capped":
            p.add_argument("--prompt-tokens", type=int, default=32)
            p.add_argument("--seed", type=int, default=1234)
            p.add_argument("--policy", default="reuse")
            p.add_argument("--prefetch", default="lookahead,temporal")
        if name == "budget":
            p.add_argument("--fractions", default="1,0.5,0.25")
            p.add_argument("--json", type=Path, default=None)
        if name == "child":
            p.add_argument("--budget", type=int, required=True)
            p.add_argument("--teacher-force", action="store_true")
        if name == "capped":
            p.add_argument("--fractions", default="1,0.6,0.4,0.25")
            p.add_argument("--engines", default="colibri,llama_cpp")
            p.add_argument("--sampling", default="both")
            p.add_argument("--runs", type=int, default=1)
            p.add_argument(
                "--prefetch-modes",
                default=None,
                help="Colibri predictor sets separated by '/', each cell run once per set "
                "(e.g. none/temporal/lookahead,temporal); default: the engine's default",
            )
            p.add_argument(
                "--overhead-mib",
                type=float,
                default=80.0,
                help="memory left to the Python process inside the cgroup (MiB)",
            )
            p.add_argument(
                "--cold-start",
                choices=["evict", "drop-caches"],
                default="evict",
                help="bench.py --cold-start: evict the model file only (default) or drop the page cache",
            )
            p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "colibri" / "bench")
            p.add_argument("--out-dir", default=".")
            p.add_argument(
                "--colibri-option",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="a further Colibri load option for every cell (bench.py --colibri-option), e.g. "
                "the lossy expert_mass=0.8 or lowbit_experts=0.45",
            )
    args = ap.parse_args(argv)
    if args.mode == "child":
        return child(args)
    if args.mode == "budget":
        return budget_sweep(args)
    if args.mode == "report":
        return capped_report(args)
    return capped_sweep(args)


if __name__ == "__main__":
    sys.exit(main())
