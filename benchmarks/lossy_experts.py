"""What the two lossy, opt-in expert options cost and save: fewer active experts (expert_mass) and
low-bit copies of the experts read on a miss (lowbit_experts, MODEL.lowbit).

On colibri-moe v2's held-out text (tools/train_moe's heldout.u16: 35 CPython-stdlib files the model
never saw), cut into chunks the way `colibri perplexity` cuts them (colibri_backend.quality: n_ctx
tokens, the second half scored), every setting evaluates the chunks teacher-forced one token per step
(batch_size 1, so every token is a decode step, as in generation) with the expert
store holding --slots of the routed experts. Against the exact run at the same slots it reports:

* KL(exact || option) over the scored tokens: mean and 99th percentile; same top-token rate;
  perplexity of both (quality.compare_rows / kld_summary, the `colibri perplexity --kl-divergence`
  statistics);
* per token: routed experts computed, experts read in full precision (store misses), low-bit copies
  used, and bytes read from disk (store reads + sidecar reads);
* decode speed: the median of --speed-runs greedy generations of --decode-tokens tokens per setting
  at the same slots (a quick figure: the page cache is not dropped, so the store's reads come from
  memory; benchmarks/bench.py --colibri-option runs a setting under a real cgroup cap).

    python benchmarks/lossy_experts.py --json benchmarks/results/lossy_experts.json

The sidecars are written once into --workdir (beside a link to the model, where lowbit_experts
looks for MODEL.lowbit), one directory per low-bit type.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import colibri_backend
from colibri_backend.quality import compare_rows, kld_summary, make_chunks, scored_logprobs
from colibri_backend.quantize import LOWBIT_TYPES, write_lowbit_sidecar

V2 = Path.home() / ".cache/colibri/train-v2"


def linked_model(model: Path, workdir: Path, qtype: str | None) -> Path:
    """model hard-linked (or copied) into workdir/TYPE, one directory per sidecar type, with its
    sidecar written there (load() resolves symbolic links, so a symlink would look beside the original)."""
    d = workdir / (qtype or "exact")
    d.mkdir(parents=True, exist_ok=True)
    dst = d / model.name
    if not dst.is_file() or not os.path.samefile(dst, model) and dst.stat().st_size != model.stat().st_size:
        dst.unlink(missing_ok=True)
        try:
            os.link(model, dst)
        except OSError:
            shutil.copyfile(model, dst)
    if qtype is not None:
        side = Path(f"{dst}.lowbit")
        if not side.is_file() or side.stat().st_mtime < dst.stat().st_mtime:
            t0 = time.perf_counter()
            write_lowbit_sidecar(dst, qtype, threads=os.cpu_count() or 1)
            print(f"wrote {side} ({side.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f} s")
    return dst


def evaluate(path: Path, chunks: np.ndarray, args: argparse.Namespace, **opts: Any) -> dict[str, Any]:
    """Scored log-probabilities of every chunk in decode steps, the engine's counters, decode speed."""
    common = dict(context_length=chunks.shape[1], threads=args.threads, expert_slots=args.slots)
    model = colibri_backend.load(path, batch_size=1, **common, **opts)
    rows, targets = [], []
    try:
        for c in chunks:
            r, t = scored_logprobs(model.logits(c.tolist()), c)
            rows.append(r.astype(np.float32))
            targets.append(t)
        stats = model.stats()
    finally:
        model.close()
    # decode speed: a fresh model per run, greedy from the first chunk's first half; the median run
    speeds = []
    prompt = chunks[0, : chunks.shape[1] // 2].tolist()
    for _ in range(args.speed_runs):
        model = colibri_backend.load(path, **common, **opts)
        try:
            times = [
                time.perf_counter() for _ in model.generate_tokens(prompt, max_tokens=args.decode_tokens)
            ]
        finally:
            model.close()
        speeds.append((len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0)
    speed = float(np.median(speeds))
    n = int(chunks.size)
    return {
        "rows": rows,
        "targets": targets,
        "tokens": n,
        "experts_per_token": stats["experts_computed"] / n,
        "full_reads_per_token": stats["expert_misses"] / n,
        "lowbit_per_token": stats["lowbit_computed"] / n,
        "bytes_per_token": (stats["expert_bytes_read"] + stats["lowbit_bytes_read"]) / n,
        "lowbit_bytes_per_token": stats["lowbit_bytes_read"] / n,
        "expert_hit_rate": stats["expert_hit_rate"],
        "decode_tok_s": speed,
        "decode_tok_s_runs": speeds,
    }


def compare(exact: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """colibri perplexity's KL statistics of `other` against `exact` over every scored token."""
    parts: dict[str, list[np.ndarray]] = {"nll": [], "kld": [], "dp": [], "same_top": [], "rest": []}
    base_nll = []
    for base, rows, t in zip(exact["rows"], other["rows"], exact["targets"], strict=True):
        base64 = base.astype(np.float64)
        b_nll = -base64[np.arange(t.size), t]
        ids = np.broadcast_to(np.arange(base.shape[1], dtype=np.int32), base.shape)
        r = compare_rows(rows.astype(np.float64), t, b_nll, ids, base64)
        for k in parts:
            parts[k].append(r[k])
        base_nll.append(b_nll)
    cat = {k: np.concatenate(v) for k, v in parts.items()}
    s = kld_summary(cat["nll"], np.concatenate(base_nll), cat["kld"], cat["dp"], cat["same_top"], cat["rest"])
    return {
        "kl_mean": s["kld_mean"],
        "kl_p99": s["kld_percentiles"]["99"],
        "kl_max": s["kld_max"],
        "same_top": s["same_top"],
        "ppl": s["ppl"],
        "ppl_exact": s["ppl_base"],
        "scored_tokens": s["n_tokens"],
    }


def decode_speed(path: Path, args: argparse.Namespace, **opts: Any) -> dict[str, Any]:
    """Greedy decode on a large file at --speed-budget of its size (or with --speed-slots expert slots):
    tok/s and what the decode steps (after the first token, which carries the prefill) read, per token."""
    budget = int(path.stat().st_size * args.speed_budget)
    store = {"expert_slots": args.speed_slots} if args.speed_slots else {"memory_budget": budget}
    model = colibri_backend.load(path, **store, context_length=128, threads=args.threads, **opts)
    try:
        prompt = list(range(100, 100 + args.speed_prompt))
        times: list[float] = []
        first: dict[str, Any] = {}
        for _ in model.generate_tokens(prompt, max_tokens=args.decode_tokens):
            times.append(time.perf_counter())
            if len(times) == 1:
                first = model.stats()
        last = model.stats()
    finally:
        model.close()
    n = max(len(times) - 1, 1)

    def per_token(key: str) -> float:
        return (last[key] - first[key]) / n

    return {
        "setting_options": opts,
        "budget": 0 if args.speed_slots else budget,
        "expert_slots": last["expert_slots"],
        "decode_tok_s": n / (times[-1] - times[0]) if len(times) > 1 else 0.0,
        "experts_per_token": per_token("experts_computed"),
        "full_MiB_per_token": per_token("expert_bytes_read") / 2**20,
        "lowbit_MiB_per_token": per_token("lowbit_bytes_read") / 2**20,
        "lowbit_per_token": per_token("lowbit_computed"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=V2 / "colibri-moe-v2-q8_0.gguf")
    ap.add_argument("--heldout", type=Path, default=V2 / "data/heldout.u16", help="uint16 token ids")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--slots", default="25%", help="expert slots: a share of the routed experts or a number")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--masses", default="0.9,0.8,0.6")
    ap.add_argument("--weights", default="0.1,0.2,0.3", help="lowbit_experts thresholds (with q2_k)")
    ap.add_argument("--lowbit-types", default="q2_k,iq4_xs", help="each runs at the middle threshold")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--speed-runs", type=int, default=3, help="greedy generations per setting (median)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/colibri-lossy-experts"))
    ap.add_argument(
        "--speed-model",
        type=Path,
        default=None,
        help="also time greedy decode on this file (e.g. bench-A Q8_0) under a memory budget of "
        "--speed-budget of its size, exact and with --speed-masses / --speed-weights",
    )
    ap.add_argument("--speed-budget", type=float, default=0.25)
    ap.add_argument(
        "--speed-slots", type=int, default=0, help="instead of --speed-budget: this many expert slots"
    )
    ap.add_argument(
        "--speed-prompt",
        type=int,
        default=32,
        help="prompt tokens before the timed decode (1: no prefill chunk, every step a decode step)",
    )
    ap.add_argument("--speed-masses", default="0.5")
    ap.add_argument("--speed-weights", default="0.5")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not args.model.is_file():
        ap.error(f"--model: no file {args.model}")
    if not args.heldout.is_file():
        ap.error(f"--heldout: no file {args.heldout} (tools/train_moe/prepare.py writes it)")
    types = [t.strip() for t in args.lowbit_types.split(",") if t.strip()]
    for t in types:
        if t not in LOWBIT_TYPES:
            ap.error(f"--lowbit-types: {t!r} is not one of {', '.join(LOWBIT_TYPES)}")
    weights = [float(x) for x in args.weights.split(",")]

    exact_path = linked_model(args.model, args.workdir, None)
    info = colibri_backend.load(exact_path, context_length=args.ctx, memory_budget=0)
    bos = info.info.bos_token_id
    info.close()
    tokens = np.fromfile(args.heldout, dtype=np.uint16).astype(np.int32)
    chunks = make_chunks(tokens, args.ctx, args.chunks, bos if bos >= 0 else None)
    print(f"{chunks.shape[0]} chunks of {args.ctx} held-out tokens, experts slots {args.slots}, decode steps")

    settings: list[tuple[str, Path, dict[str, Any]]] = [("exact", exact_path, {})]
    settings += [
        (f"expert_mass {p:g}", exact_path, {"expert_mass": p}) for p in map(float, args.masses.split(","))
    ]
    sides = {t: linked_model(args.model, args.workdir, t) for t in types}
    if "q2_k" in sides:
        settings += [(f"lowbit q2_k, W {w:g}", sides["q2_k"], {"lowbit_experts": w}) for w in weights]
    mid = weights[len(weights) // 2]
    settings += [
        (f"lowbit {t}, W {mid:g}", p, {"lowbit_experts": mid}) for t, p in sides.items() if t != "q2_k"
    ]

    results: list[dict[str, Any]] = []
    exact: dict[str, Any] | None = None
    for label, path, opts in settings:
        t0 = time.perf_counter()
        r = evaluate(path, chunks, args, **opts)
        exact = exact or r
        row = {"setting": label, "options": opts, **compare(exact, r)}
        row.update({k: v for k, v in r.items() if k not in ("rows", "targets")})
        results.append(row)
        print(f"  {label}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    head = ["setting", "KL mean", "KL p99", "same top", "PPL", "experts/token", "full reads/token"]
    head += ["low-bit/token", "MiB read/token", "decode tok/s"]
    print("\n| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in results:
        cells = [r["setting"], f"{r['kl_mean']:.4f}", f"{r['kl_p99']:.4f}", f"{100 * r['same_top']:.1f}%"]
        cells += [f"{r['ppl']:.2f}", f"{r['experts_per_token']:.2f}", f"{r['full_reads_per_token']:.2f}"]
        cells += [
            f"{r['lowbit_per_token']:.2f}",
            f"{r['bytes_per_token'] / 2**20:.3f}",
            f"{r['decode_tok_s']:.0f}",
        ]
        print("| " + " | ".join(cells) + " |")
    speed: list[dict[str, Any]] = []
    if args.speed_model:
        big = linked_model(args.speed_model, args.workdir, "q2_k")
        masses = [float(x) for x in args.speed_masses.split(",")]
        lows = [float(x) for x in args.speed_weights.split(",")]
        runs = [("exact", {})] + [(f"expert_mass {p:g}", {"expert_mass": p}) for p in masses]
        runs += [(f"lowbit q2_k, W {w:g}", {"lowbit_experts": w}) for w in lows]
        print(
            f"\n{args.speed_model.name} at {args.speed_budget:.0%} of the file, greedy, "
            f"{args.decode_tokens} tokens"
        )
        print("\n| setting | decode tok/s | experts / token | full MiB / token | low-bit MiB / token |")
        print("|---|---|---|---|---|")
        for label, opts in runs:
            r = {"setting": label, **decode_speed(big, args, **opts)}
            speed.append(r)
            print(
                f"| {label} | {r['decode_tok_s']:.2f} | {r['experts_per_token']:.1f} | "
                f"{r['full_MiB_per_token']:.1f} | {r['lowbit_MiB_per_token']:.1f} |"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"model": str(args.model), "heldout": str(args.heldout), "ctx": args.ctx}
        meta |= {"chunks": int(chunks.shape[0]), "slots": args.slots, "threads": args.threads}
        meta |= {
            "speed_model": str(args.speed_model) if args.speed_model else None,
            "speed_budget": args.speed_budget,
        }
        doc = {"meta": meta, "results": results, "speed": speed}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
