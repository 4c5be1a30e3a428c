"""Expert cache and predictor figures on Colibri's trained MoE, live and replayed from a routing trace.

The model reads held-out text (files of the CPython standard library that the model never saw in
training, tools/train_moe's split) one token per step: every step is a decode step (one colibri_eval of
one token), teacher-forced, in windows of --window tokens that each start from an empty KV cache. The
same token stream runs once unbudgeted (the reference) and once per configuration with --slots of the
routed experts resident (expert_slots), for each cache policy and predictor combination. For every
run the script checks that the logits of every step are bit-identical to the reference and prints hit
rate, misses, prefetches issued / used / wasted (and wasted bytes), the share of decode time stalled
on expert reads, and each predictor's precision and recall (lookahead recall = next-layer recall).

It then writes the reference routing as a trace (colibri_backend.trace format) and replays it through
colibri_replay_routing with the same store settings: the cache and the temporal and hashed predictors
replay exactly; lookahead needs hidden states and is not part of a replay.

    python benchmarks/expert_cache.py --slots 40% --tokens 1024 --json benchmarks/results/expert_cache.json

Profiles ("hashed", warm start, pinning) use the routing profile next to the model
(colibri_backend/models/colibri-moe-q8_0.gguf.routing, learned from the training split).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import colibri_backend
from colibri_backend.models import default_model_path
from colibri_backend.trace import RoutingTrace, load_trace

# Held-out files of tools/train_moe's by-file split (manifest "heldout_files"): never trained on.
HELD_OUT = ("statistics.py", "pprint.py", "warnings.py", "fnmatch.py", "operator.py", "struct.py")

# (label, policy, prefetch, uses the profile, pinned experts)
LIVE_CONFIGS: tuple[tuple[str, str, str, bool, int], ...] = (
    ("LFU none", "lfu", "none", False, 0),
    ("LFU lookahead", "lfu", "lookahead", False, 0),
    ("LFU temporal", "lfu", "temporal", False, 0),
    ("LFU lookahead+temporal", "lfu", "lookahead,temporal", False, 0),
    ("LFU profile: warm start, no prefetch", "lfu", "none", True, 0),
    ("LFU profile: hashed", "lfu", "hashed", True, 0),
    ("LFU profile: all three", "lfu", "lookahead,temporal,hashed", True, 0),
    ("LFU profile: all three + pin", "lfu", "lookahead,temporal,hashed", True, -1),
    ("LRU none", "lru", "none", False, 0),
    ("LRU lookahead", "lru", "lookahead", False, 0),
    ("LRU temporal", "lru", "temporal", False, 0),
    ("LRU lookahead+temporal", "lru", "lookahead,temporal", False, 0),
    ("LRU profile: warm start, no prefetch", "lru", "none", True, 0),
    ("LRU profile: hashed", "lru", "hashed", True, 0),
    ("LRU profile: all three", "lru", "lookahead,temporal,hashed", True, 0),
    ("LRU profile: all three + pin", "lru", "lookahead,temporal,hashed", True, -1),
)


def held_out_ids(model: colibri_backend.Model, stdlib: Path, n_tokens: int) -> list[int]:
    ids: list[int] = []
    for name in HELD_OUT:
        ids += model.tokenize((stdlib / name).read_text(encoding="utf-8"), add_special_tokens=False)
        if len(ids) >= n_tokens:
            break
    if len(ids) < n_tokens:
        raise SystemExit(f"the held-out files give only {len(ids)} tokens, fewer than --tokens {n_tokens}")
    return ids[:n_tokens]


def decode_run(model: colibri_backend.Model, ids: list[int], window: int) -> tuple[str, np.ndarray, float]:
    """Teacher-forced decode, one token per step; returns the SHA-256 of every step's logits, the
    routing [T, L, k] and the wall time."""
    h = hashlib.sha256()
    routes = []
    t0 = time.perf_counter()
    for start in range(0, len(ids), window):
        win = ids[start : start + window]
        for i in range(len(win)):
            h.update(model.next_logits(win[: i + 1]).tobytes())
            routes.append(model.routing()[0][-1])
    return h.hexdigest(), np.stack(routes), time.perf_counter() - t0


def ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def summarize(s: dict[str, Any], slot_bytes: int) -> dict[str, Any]:
    out = {
        "hit_rate": ratio(s["expert_hits"], s["expert_calls"]),
        "calls": s["expert_calls"],
        "misses": s["expert_misses"],
        "prefetch_issued": s["prefetch_issued"],
        "prefetch_used": s["prefetch_used"],
        "prefetch_wasted": s["prefetch_wasted"],
        "prefetch_wasted_bytes": s.get("prefetch_wasted_bytes", 0),
        "bytes_read": s["expert_bytes_read"],
        "stall_decode_share": ratio(s.get("expert_stall_decode_seconds", 0.0), s["decode_seconds"]),
        "decode_tok_s": ratio(s["n_decode_tokens"], s["decode_seconds"]),
        "experts_pinned": s.get("experts_pinned", 0),
        "slot_bytes": slot_bytes,
    }
    for src in ("lookahead", "temporal", "hashed"):
        out[f"{src}_precision"] = ratio(s.get(f"{src}_correct", 0), s.get(f"{src}_predicted", 0))
        out[f"{src}_recall"] = ratio(s.get(f"{src}_correct", 0), s.get(f"{src}_actual", 0))
    return out


def pr(r: dict[str, Any], src: str) -> str:
    return f"{r[src + '_precision']:.2f} / {r[src + '_recall']:.2f}" if r[src + "_recall"] else "-"


def print_table(title: str, rows: list[tuple[str, dict[str, Any]]], live: bool) -> None:
    print(f"\n{title}\n")
    head = ["configuration", "identical", "hit %", "misses", "prefetch issued / used / wasted", "wasted MiB"]
    head += ["stall % of decode", "decode tok/s"] if live else ["stall s"]
    head += ["lookahead P / R"] if live else []
    head += ["temporal P / R", "hashed P / R"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, r in rows:
        cells = [
            name,
            r.get("identical", "n/a"),
            f"{100 * r['hit_rate']:.1f}",
            str(r["misses"]),
            f"{r['prefetch_issued']} / {r['prefetch_used']} / {r['prefetch_wasted']}",
            f"{r['prefetch_wasted_bytes'] / 2**20:.1f}",
        ]
        cells += (
            [f"{100 * r['stall_decode_share']:.1f}", f"{r['decode_tok_s']:.0f}"]
            if live
            else [f"{r['stall_seconds']:.3f}"]
        )
        cells += [pr(r, "lookahead")] if live else []
        cells += [pr(r, "temporal"), pr(r, "hashed")]
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--slots", default="40%", help="expert slots: a count or a share of the routed experts")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256, help="tokens per sequence (training context)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stdlib", type=Path, default=None, help="CPython Lib/ with the held-out files")
    ap.add_argument("--trace", type=Path, default=Path("/tmp/colibri-expert-cache-trace.npz"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    import sysconfig

    stdlib = args.stdlib or Path(sysconfig.get_paths()["stdlib"])
    common = dict(threads=args.threads, context_length=args.window, batch_size=64)

    ref_model = colibri_backend.load(args.model, memory_budget=0, **common)
    ids = held_out_ids(ref_model, stdlib, args.tokens)
    ref_sha, ref_routes, _ = decode_run(ref_model, ids, args.window)
    ref_model.close()
    RoutingTrace(
        ids=ref_routes,
        weights=np.zeros(ref_routes.shape, np.float32),
        tokens=np.asarray(ids, np.int32),
        meta={"model": str(args.model), "source": "benchmarks/expert_cache.py", "window": args.window},
    ).save(args.trace)
    print(f"{len(ids)} held-out tokens from {', '.join(HELD_OUT)}; reference routing -> {args.trace}")

    live_rows: list[tuple[str, dict[str, Any]]] = []
    for name, policy, prefetch, profile, pin in LIVE_CONFIGS:
        opts: dict[str, Any] = dict(expert_slots=args.slots, expert_policy=policy, prefetch=prefetch)
        if profile:
            opts["warmup_routing"] = True
        model = colibri_backend.load(args.model, **common, **opts, pin_experts=0)
        n_slots = int(model.stats()["expert_slots"])
        k = model.info.n_expert_used
        if pin < 0:  # pin half of what is left after the top-k working set
            model.close()
            opts["pin_experts"] = (n_slots - k) // 2
            model = colibri_backend.load(args.model, **common, **opts)
        model.reset_stats()
        sha, routes, _ = decode_run(model, ids, args.window)
        r = summarize(model.stats(), int(model.memory_plan()["expert_slot_bytes"]))
        r["identical"] = "yes" if sha == ref_sha and np.array_equal(routes, ref_routes) else "NO"
        r["n_slots"] = n_slots
        r["options"] = {k2: v for k2, v in opts.items()}
        live_rows.append((name, r))
        model.close()
        print(f"  {name}: hit {100 * r['hit_rate']:.1f}%  ({r['identical']})", file=sys.stderr, flush=True)
    print_table(
        f"Live, {len(ids)} decode steps, {live_rows[0][1]['n_slots']} slots ({args.slots} of the experts)",
        live_rows,
        live=True,
    )

    trace = load_trace(args.trace)
    replay_rows: list[tuple[str, dict[str, Any]]] = []
    for name, policy, prefetch, profile, pin in LIVE_CONFIGS:
        if "lookahead" in prefetch and prefetch != "lookahead,temporal,hashed":
            continue  # lookahead alone cannot be replayed
        opts = dict(
            expert_slots=args.slots, expert_policy=policy, prefetch=prefetch.replace("lookahead,", "")
        )
        if profile:
            opts["warmup_routing"] = True
        if pin < 0:
            opts["pin_experts"] = dict(live_rows)[name]["options"]["pin_experts"]
        s = colibri_backend.replay_routing(args.model, trace.tokens, trace.ids, **opts)
        r = summarize({**s, "decode_seconds": 0.0, "n_decode_tokens": 0}, 0)
        r["stall_seconds"] = s["expert_stall_seconds"]
        replay_rows.append((name.replace("all three", "temporal+hashed"), r))
    print_table("Replay of the recorded trace (colibri_replay_routing)", replay_rows, live=False)

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "slots": args.slots,
                    "tokens": len(ids),
                    "window": args.window,
                    "held_out": HELD_OUT,
                    "live": dict(live_rows),
                    "replay": dict(replay_rows),
                },
                indent=2,
            )
        )
    return 0 if all(r["identical"] == "yes" for _, r in live_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
