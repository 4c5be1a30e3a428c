"""What the two lossy, opt-in routing options cost: the hashed routing pre-filter and drop-cold.

On held-out text (files of the CPython standard library that Colibri's trained MoE never saw), the
teacher-forced logits of the exact engine are compared with those of the engine run with

* route_prefilter_margin = M: router logits only for the routing profile's candidates of the token,
  kept when the gap between the k-th and (k+1)-th candidate is at least M logits;
* drop_cold_share = S: experts whose profile share is below S are never routed to.

Reported per setting: mean and 99th-percentile KL(exact || option) over positions, same top-1 token
rate, the rows the pre-filter decided alone (prefilter_accepted / prefilter_rows), the experts dropped,
and for the pre-filter the candidate recall (share of the exact top-k experts found among the token's
candidates), which bounds how often it can be right.

    python benchmarks/lossy_routing.py --tokens 2048 --json benchmarks/results/lossy_routing.json
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np

import colibri_backend
from colibri_backend.models import default_model_path
from colibri_backend.profile import bucket_of, profile_path, read_profile

HELD_OUT = ("statistics.py", "pprint.py", "warnings.py", "fnmatch.py", "operator.py", "struct.py")


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(ref: np.ndarray, other: np.ndarray) -> dict[str, float]:
    a, b = log_softmax(ref), log_softmax(other)
    kl = (np.exp(a) * (a - b)).sum(-1)
    return {
        "kl_mean": float(kl.mean()),
        "kl_p99": float(np.percentile(kl, 99)),
        "kl_max": float(kl.max()),
        "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
    }


def windows(ids: list[int], n: int) -> list[list[int]]:
    return [ids[i : i + n] for i in range(0, len(ids), n)]


def run(
    model_path: str, chunks: list[list[int]], **opts: Any
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    model = colibri_backend.load(model_path, context_length=len(chunks[0]), memory_budget=0, **opts)
    logits, routes = [], []
    for c in chunks:
        logits.append(model.logits(c))
        routes.append(model.routing()[0])
    stats = model.stats()
    model.close()
    return np.concatenate(logits), np.concatenate(routes), stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--margins", default="0.25,0.5,1,2,4")
    ap.add_argument("--shares", default="0.005,0.01,0.02,0.05,0.1")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    probe = colibri_backend.load(args.model, context_length=args.window, memory_budget=0)
    ids: list[int] = []
    for name in HELD_OUT:
        ids += probe.tokenize((stdlib / name).read_text(encoding="utf-8"), add_special_tokens=False)
    probe.close()
    ids = ids[: args.tokens]
    chunks = windows(ids, args.window)
    if len(chunks[-1]) < args.window:
        chunks = chunks[:-1]
    toks = np.concatenate([np.asarray(c) for c in chunks])
    profile = read_profile(profile_path(args.model))

    ref_logits, ref_routes, _ = run(args.model, chunks)
    cand = profile.cand[bucket_of(toks, profile.n_buckets)]  # [T, L, n_cand]
    in_cand = (ref_routes[..., :, None] == cand[..., None, :]).any(-1)  # [T, L, k]
    recall = float(in_cand.mean())
    print(f"{len(toks)} held-out tokens; profile candidate recall ({profile.n_cand} per layer): {recall:.3f}")

    rows: list[dict[str, Any]] = []
    for m in (float(x) for x in args.margins.split(",")):
        lg, rt, st = run(args.model, chunks, warmup_routing=True, route_prefilter_margin=m)
        r = {"option": f"pre-filter, margin {m:g}", **compare(ref_logits, lg)}
        r["decided_by_candidates"] = st["prefilter_accepted"] / max(st["prefilter_rows"], 1)
        r["routing_same"] = float((np.sort(rt, -1) == np.sort(ref_routes, -1)).all(-1).mean())
        rows.append(r)
    for s in (float(x) for x in args.shares.split(",")):
        lg, rt, st = run(args.model, chunks, warmup_routing=True, drop_cold_share=s)
        r = {"option": f"drop cold, share < {s:g}", **compare(ref_logits, lg)}
        r["experts_dropped"] = st["experts_dropped"]
        r["routing_same"] = float((np.sort(rt, -1) == np.sort(ref_routes, -1)).all(-1).mean())
        rows.append(r)

    head = ["option", "KL mean", "KL p99", "KL max", "same top-1", "(token, layer) routed as exact"]
    head += ["decided by candidates", "experts dropped"]
    print("\n| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["option"], f"{r['kl_mean']:.2e}", f"{r['kl_p99']:.2e}", f"{r['kl_max']:.2e}"]
        cells += [f"{100 * r['top1_agreement']:.1f}%", f"{100 * r['routing_same']:.1f}%"]
        cells.append(f"{100 * r['decided_by_candidates']:.1f}%" if "decided_by_candidates" in r else "-")
        cells.append(str(r.get("experts_dropped", "-")))
        print("| " + " | ".join(cells) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"tokens": int(len(toks)), "candidate_recall": recall, "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
