"""Where a batched decode step's time goes, engine alone (no server, no HTTP): N sequences decoding
together through Model.eval_batch, against the same N sequences decoded one at a time.

    python benchmarks/batch_steps.py --model ~/.cache/colibri/bench/bench-a-q8_0.gguf --seqs 1,2,4,8,16

For each N, N different prompts are prefilled into sequences 0..N-1 of one context, then --steps
greedy decode steps run with one token of every sequence per step (one eval_batch call), and, for
comparison, the same N sequences each decoded alone for the same number of steps (one eval_batch
call of one token per step). Reported per N: engine milliseconds per step (the eval_batch call),
engine CPU milliseconds per step (all the process's threads during the call: with --threads 1 the
step's compute, robust to a loaded machine), Python milliseconds per step (the greedy pick over the
rows and building the next step's input),
aggregate decode tok/s of both, their ratio, the experts computed per step and whether every
batched token equals the one-at-a-time token (batch invariance). --json FILE writes the figures.

--chunks 1,8,64,... adds what one prompt chunk of T tokens costs per token (one eval_batch of T tokens
of one sequence, logits for the last only; --repeats times each, alternating the sizes), in wall and in
process CPU milliseconds per token: the CPU time moves less with the machine's load. It says what a
batched step's prompt chunk costs beside its decode tokens, and what prefill costs at all.

--joint N adds what N whole prompts cost per token prefilled together (sequences 0..N-1 from empty, in
steps of up to n_batch tokens spanning the prompts, as the server's idle-engine step takes them) against
the same N prompts in 64-token chunks (the server's chunk beside decodes; each a step of its own), --repeats
times alternating, in wall and process CPU ms per prompt token. A single sequence's chunk of T tokens
attends over its own T positions; N prompts in one step attend each over its own, so this is the figure
for requests that arrive together.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import colibri_backend

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrency import prompt  # noqa: E402  (the same prompts as the server benchmark)


def prefill(model: colibri_backend.Model, seq: int, ids: list[int]) -> int:
    """Prompt ``ids`` into the empty sequence ``seq`` in n_batch chunks; returns its greedy next token."""
    model.seq_truncate(seq, 0)
    chunk = int(model.batch_size)
    row = None
    for i in range(0, len(ids), chunk):
        part = ids[i : i + chunk]
        want = np.zeros(len(part), dtype=np.uint8)
        want[-1] = 1
        row = model.eval_batch(np.full(len(part), seq), np.array(part), want)
    assert row is not None
    return int(row[0].argmax())


def decode_steps(model: colibri_backend.Model, seqs: list[int], first: list[int], steps: int) -> dict:
    """``steps`` decode steps of the sequences ``seqs`` together, starting from tokens ``first``."""
    seq_ids = np.array(seqs, dtype=np.int32)
    want = np.ones(len(seqs), dtype=np.uint8)
    tokens = np.array(first, dtype=np.int32)
    out = [[int(t)] for t in first]
    engine, cpu, python, distinct = [], [], [], []
    for _ in range(steps):
        c0, t0 = time.process_time(), time.perf_counter()
        rows = model.eval_batch(seq_ids, tokens, want)
        t1, c1 = time.perf_counter(), time.process_time()
        cpu.append(c1 - c0)
        tokens = rows.argmax(axis=1).astype(np.int32)
        for o, t in zip(out, tokens, strict=True):
            o.append(int(t))
        t2 = time.perf_counter()
        engine.append(t1 - t0)
        python.append(t2 - t1)
        route = model.routing()[0]  # [n_seq, n_layer, k]: experts each layer reads this step
        distinct.append(np.mean([len(np.unique(route[:, il])) for il in range(route.shape[1])]))
    experts = float(np.mean(distinct))
    return {"engine": engine, "cpu": cpu, "python": python, "tokens": out, "experts": experts}


def chunk_costs(model: colibri_backend.Model, ids: list[int], sizes: list[int], repeats: int) -> list[dict]:
    """Per-token wall and CPU milliseconds of one prompt chunk of each size (sequence 0, from empty)."""
    ids = (ids * (max(sizes) // len(ids) + 1))[: max(sizes)]
    wall: dict[int, list[float]] = {t: [] for t in sizes}
    cpu: dict[int, list[float]] = {t: [] for t in sizes}
    for _ in range(repeats):
        for t in sizes:
            model.seq_truncate(0, 0)
            want = np.zeros(t, dtype=np.uint8)
            want[-1] = 1
            w0, c0 = time.perf_counter(), time.process_time()
            model.eval_batch(np.zeros(t, dtype=np.int32), np.array(ids[:t]), want)
            wall[t].append(1e3 * (time.perf_counter() - w0) / t)
            cpu[t].append(1e3 * (time.process_time() - c0) / t)
    model.seq_truncate(0, 0)
    rows = []
    print(f"{'chunk':>5} {'wall ms/token':>14} {'(min-max)':>15} {'cpu ms/token':>13} {'(min-max)':>15}")
    for t in sizes:
        row = {
            "tokens": t,
            "wall_ms_per_token": statistics.median(wall[t]),
            "wall_range": [min(wall[t]), max(wall[t])],
            "cpu_ms_per_token": statistics.median(cpu[t]),
            "cpu_range": [min(cpu[t]), max(cpu[t])],
        }
        rows.append(row)
        print(
            f"{t:>5} {row['wall_ms_per_token']:14.2f} {min(wall[t]):7.2f}-{max(wall[t]):<7.2f} "
            f"{row['cpu_ms_per_token']:13.2f} {min(cpu[t]):7.2f}-{max(cpu[t]):<7.2f}"
        )
    return rows


def joint_costs(model: colibri_backend.Model, ids: list[list[int]], repeats: int, chunk: int = 64) -> dict:
    """Per prompt-token wall and CPU ms of the prompts ``ids`` prefilled together (steps of up to n_batch
    tokens across them) and one after another in ``chunk``-token steps."""
    n_batch = int(model.batch_size)
    plans = {
        "together": [
            [(q, t) for q in range(len(ids)) for t in ids[q]][i : i + n_batch]
            for i in range(0, sum(map(len, ids)), n_batch)
        ],
        f"chunks_of_{chunk}": [
            [(q, t) for t in ids[q][i : i + chunk]]
            for q in range(len(ids))
            for i in range(0, len(ids[q]), chunk)
        ],
    }
    total = sum(map(len, ids))
    wall: dict[str, list[float]] = {k: [] for k in plans}
    cpu: dict[str, list[float]] = {k: [] for k in plans}
    for _ in range(repeats):
        for name, steps in plans.items():
            for q in range(len(ids)):
                model.seq_truncate(q, 0)
            w0, c0 = time.perf_counter(), time.process_time()
            for step in steps:
                seqs = np.array([q for q, _ in step], dtype=np.int32)
                toks = np.array([t for _, t in step], dtype=np.int32)
                model.eval_batch(seqs, toks, np.zeros(len(step), dtype=np.uint8))
            wall[name].append(1e3 * (time.perf_counter() - w0) / total)
            cpu[name].append(1e3 * (time.process_time() - c0) / total)
    for q in range(len(ids)):
        model.seq_truncate(q, 0)
    out = {}
    print(f"{len(ids)} prompts, {total} tokens: wall / cpu ms per prompt token (median, min-max)")
    for name in plans:
        out[name] = {
            "steps": len(plans[name]),
            "wall_ms_per_token": statistics.median(wall[name]),
            "wall_range": [min(wall[name]), max(wall[name])],
            "cpu_ms_per_token": statistics.median(cpu[name]),
            "cpu_range": [min(cpu[name]), max(cpu[name])],
        }
        print(
            f"{name:>14} {len(plans[name]):>3} steps {out[name]['wall_ms_per_token']:7.2f} "
            f"({min(wall[name]):.2f}-{max(wall[name]):.2f}) {out[name]['cpu_ms_per_token']:7.2f} "
            f"({min(cpu[name]):.2f}-{max(cpu[name]):.2f})"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path.home() / ".cache/colibri/bench/bench-a-q8_0.gguf"))
    ap.add_argument("--seqs", default="1,2,4,8,16", help="comma list of sequence counts")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per sequence")
    ap.add_argument("--prompt-words", type=int, default=60)
    ap.add_argument("--context-length", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0, help="engine threads (default: all CPUs)")
    ap.add_argument("--chunks", default="", help="comma list of prompt chunk sizes to cost per token")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each chunk size (--chunks)")
    ap.add_argument("--joint", type=int, default=0, help="N prompts prefilled together against in chunks")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        counts = sorted({int(c) for c in args.seqs.split(",")})
    except ValueError:
        ap.error(f"--seqs: {args.seqs!r} is not a comma list of numbers")
    if not counts or min(counts) < 1 or args.steps < 1:
        ap.error("--seqs counts and --steps must be at least 1")
    try:
        chunks = [int(c) for c in args.chunks.split(",")] if args.chunks else []
    except ValueError:
        ap.error(f"--chunks: {args.chunks!r} is not a comma list of numbers")
    if chunks and (min(chunks) < 1 or max(chunks) > args.context_length or args.repeats < 1):
        ap.error("--chunks sizes must be within 1..--context-length, --repeats at least 1")
    if args.joint < 0:
        ap.error("--joint must be at least 0")
    kw = {"threads": args.threads} if args.threads else {}
    model = colibri_backend.load(
        args.model, context_length=args.context_length, max_concurrency=max(*counts, args.joint), **kw
    )
    ids = [model.tokenize(prompt(i, args.prompt_words)) for i in range(max(*counts, args.joint))]
    firsts = [prefill(model, q, ids[q]) for q in range(max(counts))]
    decode_steps(model, [0], [firsts[0]], 4)  # warm-up: page cache, expert slots

    report = []
    print(f"{args.model}  steps={args.steps}  threads={model.threads}")
    print(
        f"{'seqs':>4} {'engine ms/step':>15} {'cpu ms/step':>12} {'python ms/step':>15} "
        f"{'batched tok/s':>14} {'alone tok/s':>12} {'ratio':>6} {'experts/layer':>13} same"
    )
    for n in counts:
        alone_s, alone_tokens = 0.0, []
        for q in range(n):
            firsts[q] = prefill(model, q, ids[q])
            r = decode_steps(model, [q], [firsts[q]], args.steps)
            alone_s += sum(r["engine"]) + sum(r["python"])
            alone_tokens.append(r["tokens"][0])
        for q in range(n):
            prefill(model, q, ids[q])
        r = decode_steps(model, list(range(n)), firsts[:n], args.steps)
        total = sum(r["engine"]) + sum(r["python"])
        row = {
            "seqs": n,
            "engine_ms_per_step": 1e3 * statistics.median(r["engine"]),
            "engine_cpu_ms_per_step": 1e3 * statistics.median(r["cpu"]),
            "python_ms_per_step": 1e3 * statistics.median(r["python"]),
            "batched_tok_s": n * args.steps / total,
            "alone_tok_s": n * args.steps / alone_s,
            "experts_per_layer_step": r["experts"],
            "identical": r["tokens"] == alone_tokens,
        }
        row["ratio"] = row["batched_tok_s"] / row["alone_tok_s"]
        report.append(row)
        print(
            f"{n:>4} {row['engine_ms_per_step']:15.2f} {row['engine_cpu_ms_per_step']:12.2f} "
            f"{row['python_ms_per_step']:15.3f} "
            f"{row['batched_tok_s']:14.2f} {row['alone_tok_s']:12.2f} {row['ratio']:5.2f}x "
            f"{row['experts_per_layer_step']:13.2f} {row['identical']}"
        )
    chunk_rows = chunk_costs(model, ids[0], chunks, args.repeats) if chunks else []
    joint = joint_costs(model, ids[: args.joint], args.repeats) if args.joint else {}
    model.close()
    if args.json:
        out = {"model": args.model, "steps": args.steps, "rows": report, "chunks": chunk_rows, "joint": joint}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(r["identical"] for r in report) else 1


if __name__ == "__main__":
    sys.exit(main())
