"""What bounds a capped decode in exact mode: the bytes the best possible cache would read, against the disk.

For every Colibri cell of capped sweeps (capped_sweep.py capped --out-dir DIR: capped_*.json, capped_none.json
for the uncapped reference, llama.cpp runs in the same or another DIR), the routing each run decoded with is
recorded again on the unbudgeted model (teacher-forced on its prompt + generated ids: the budget changes no
value, so this is the routing the capped run used), and Belady's optimum (colibri_backend.optimum) gives the
fewest misses any replacement policy could have on the decode steps with that run's expert slots, starting
from the best possible cache content. Those misses times an expert's bytes are the fewest bytes an exact
decode token can read; divided by the disk's rate (--disk-gbs, bench-io's figure) that is the least I/O time
per token. With the compute time per token (the uncapped runs' decode time per token, the same work without
the store, or --uncapped-tps), the best exact-mode speed is

    perfect prediction (every read overlapped with compute):  1 / max(compute, io)
    reads issued when the router has chosen (no overlap):      1 / (compute + io)

printed next to the measured cell, the run's own bytes and the issue's targets (85% of the uncapped speed;
8x llama.cpp under the same cap).

    python benchmarks/cap_bounds.py OUT/q8_0 OUT/llama-q8_0 --disk-gbs 1.57
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import median

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from capped_sweep import parse_label  # noqa: E402


def expert_bytes(path: str) -> list[int]:
    """Bytes of one expert of each MoE layer: its gate, up and down rows (the *_exps tensors / n_expert), the
    bytes the store reads for it."""
    import gguf

    reader = gguf.GGUFReader(path)
    per: dict[int, int] = {}
    for t in reader.tensors:
        name = t.name
        if not name.startswith("blk.") or "_exps" not in name:
            continue
        layer = int(name.split(".")[1])
        n_expert = int(t.shape[-1])
        per[layer] = per.get(layer, 0) + int(t.n_bytes) // n_expert
    return [per[k] for k in sorted(per)]


def decode_routing(path: str, prompt: list[int], generated: list[int]):
    """The routing ids [decode steps, layers, k] of a run: the rows of its decode steps' inputs (the generated
    ids but the last, each fed once), recorded on the unbudgeted model."""
    import colibri_backend
    from colibri_backend.trace import record_trace

    model = colibri_backend.load(path, threads=2, context_length=max(512, len(prompt) + len(generated)))
    try:
        trace = record_trace(model, token_ids=prompt + generated)
        n_expert = model.info.n_expert
    finally:
        model.close()
    return trace.ids[len(prompt) : len(prompt) + len(generated) - 1], n_expert


def load_runs(dirs: list[Path]) -> tuple[dict[tuple[str, str], list[dict]], dict[str, dict]]:
    """Runs by (cap label, engine) and each file's protocol by cap label; the prefetch set is kept per run."""
    runs: dict[tuple[str, str], list[dict]] = {}
    protocols: dict[str, dict] = {}
    for d in dirs:
        for f in sorted(d.glob("capped_*.json")):
            frac, basis, pf = parse_label(f.stem)
            label = frac + (f" of {basis}" if basis else "")
            doc = json.loads(f.read_text())
            protocols.setdefault(label, doc.get("protocol", {}))
            for r in doc["runs"]:
                if r.get("ok"):
                    runs.setdefault((label, r["engine"]), []).append(
                        {**r, "_pf": pf, "_protocol": doc["protocol"]}
                    )
    return runs, protocols


def bound_of_run(run: dict, routing, n_expert: int, per_expert: list[int]) -> dict:
    """Belady's fewest decode misses for this run's slot count, as bytes per decoded token."""
    from colibri_backend.optimum import belady

    slots = run["engine_stats"]["expert_slots"]
    opt = belady(routing, n_expert, slots)
    mean_bytes = sum(per_expert) / len(per_expert)
    return {
        "slots": slots,
        "opt_hit": opt.hit_rate_preloaded,
        "opt_mib_per_token": opt.misses_preloaded * mean_bytes / 2**20 / max(routing.shape[0], 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", type=Path, nargs="+", help="capped sweep output folders (Colibri and llama.cpp)")
    ap.add_argument("--disk-gbs", type=float, required=True, help="the disk's read rate, GB/s (bench-io)")
    ap.add_argument(
        "--uncapped-tps",
        type=float,
        default=None,
        help="the uncapped decode speed to take the compute time from, instead of the capped_none.json runs' "
        "median (e.g. colibri-run's warm figure on a quiet machine)",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    runs, _ = load_runs(args.dirs)
    uncapped = [r["decode_tps"] for r in runs.get(("none", "colibri"), []) if r.get("decode_tps")]
    if not uncapped and not args.uncapped_tps:
        raise SystemExit("cap_bounds: no uncapped Colibri run (capped_none.json) and no --uncapped-tps")
    unc_tps = args.uncapped_tps or median(uncapped)
    compute_s = 1.0 / unc_tps
    routing_cache: dict[tuple[str, tuple[int, ...]], tuple] = {}
    sizes: dict[str, list[int]] = {}
    rows = []
    for (label, engine), cell in sorted(runs.items()):
        if engine != "colibri" or label == "none":
            continue
        llama = [r["decode_tps"] for r in runs.get((label, "llama_cpp"), []) if r.get("decode_tps")]
        for pf in sorted({r["_pf"] for r in cell}):
            group = [r for r in cell if r["_pf"] == pf]
            bounds = []
            for r in group:
                path = r["model"]
                prompt = r["_protocol"]["prompt_ids"][path]
                key = (path, tuple(prompt + r["generated_ids"]))
                if key not in routing_cache:
                    routing_cache[key] = decode_routing(path, prompt, r["generated_ids"])
                if path not in sizes:
                    sizes[path] = expert_bytes(path)
                routing, n_expert = routing_cache[key]
                bounds.append(bound_of_run(r, routing, n_expert, sizes[path]))
            opt_mib = median(b["opt_mib_per_token"] for b in bounds)
            io_s = opt_mib * 2**20 / (args.disk_gbs * 1e9)
            a = [r["engine_stats_at_first_token"] for r in group]
            b = [r["engine_stats"] for r in group]
            run_mib = median(
                (y["expert_bytes_read"] - x["expert_bytes_read"])
                / 2**20
                / max(y["n_decode_tokens"] - x["n_decode_tokens"], 1)
                for x, y in zip(a, b, strict=True)
            )
            row = {
                "cap": label,
                "prefetch": pf,
                "slots": bounds[0]["slots"],
                "measured_tps": median(r["decode_tps"] for r in group),
                "llama_tps": median(llama) if llama else None,
                "run_mib_per_token": run_mib,
                "opt_hit": median(x["opt_hit"] for x in bounds),
                "opt_mib_per_token": opt_mib,
                "io_ms": 1e3 * io_s,
                "compute_ms": 1e3 * compute_s,
                "best_overlap_tps": 1.0 / max(compute_s, io_s),
                "best_serial_tps": 1.0 / (compute_s + io_s),
            }
            rows.append(row)

    print(
        f"uncapped Colibri {unc_tps:.2f} tok/s ({1e3 * compute_s:.1f} ms a token), "
        f"disk {args.disk_gbs:.2f} GB/s"
    )
    print(
        "| cap | prefetch | slots | measured tok/s | MiB read / token (run) | Belady hit % "
        "| Belady MiB / token "
        "| I/O ms / token at the disk's rate | best tok/s, overlapped | best tok/s, not overlapped "
        "| best / uncapped | best / llama.cpp |"
    )
    print("|" + "---|" * 12)
    for r in rows:
        lt = r["llama_tps"]
        print(
            f"| {r['cap']} | {r['prefetch']} | {r['slots']} | {r['measured_tps']:.2f} | "
            f"{r['run_mib_per_token']:.1f} | {100 * r['opt_hit']:.1f} | {r['opt_mib_per_token']:.1f} | "
            f"{r['io_ms']:.1f} | {r['best_overlap_tps']:.2f} | {r['best_serial_tps']:.2f} | "
            f"{r['best_overlap_tps'] / unc_tps:.0%} / {r['best_serial_tps'] / unc_tps:.0%} | "
            + (f"{r['best_overlap_tps'] / lt:.1f}x / {r['best_serial_tps'] / lt:.1f}x |" if lt else "- |")
        )
    if args.json:
        args.json.write_text(
            json.dumps({"uncapped_tps": unc_tps, "disk_gbs": args.disk_gbs, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
