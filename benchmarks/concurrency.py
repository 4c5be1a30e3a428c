"""Aggregate decode throughput and time to first token of `colibri serve` with concurrent clients, with
continuous batching (--max-concurrency) against the same requests served one at a time.

    python benchmarks/concurrency.py --model ~/.cache/colibri/bench/bench-a-q8_0.gguf
    python benchmarks/concurrency.py --model smollm2 --clients 1,4,8,16 --max-tokens 64
    python benchmarks/concurrency.py --clients 1,8 --max-tokens 32,128,256   # several completion lengths
    sudo python benchmarks/concurrency.py --model ... --memory-cap 50%   # in a cgroup (bench.py's)

For each mode, one server on loopback: "batched" with --max-concurrency max(--clients), "one at a time"
with --max-concurrency 1 (the same clients queue behind each other; --max-queue is large enough for
all). For each client count N, N clients send at once N different prompts (streaming completions,
greedy), and the script reports

* aggregate tok/s: completion tokens of all N / wall time from the first send to the last end (the
  prompts' prefill included),
* aggregate decode tok/s: the tokens after each request's first / the time at least one request was
  decoding (the union of the intervals from a request's first token to its end; the other requests'
  prefill steps that ran meanwhile included, the time when nobody had a first token yet not),
* p50 / p99 time to first token over the N requests (queueing included),
* whether every batched output is identical to the same request served one at a time.

--memory-cap SIZE (or P% of the model file) runs each server in a fresh memory cgroup (root needed);
the engine's default budget then follows the cgroup limit. --json FILE writes the figures.
--max-tokens takes a comma list: each length is measured in turn on fresh servers, and the JSON then holds
one report per length under "runs" (a single length writes its report as before).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _serve import ServeProcess  # noqa: E402
from bench import MemoryCgroup, parse_size  # noqa: E402  (the cgroup and size parsing bench.py uses)

TOPICS = [
    "the history of the printing press",
    "how bees make honey",
    "why the sky is blue",
    "the rules of chess",
    "how a steam engine works",
    "the water cycle",
    "the life of a star",
    "how vaccines work",
    "the invention of the telephone",
    "how plants grow",
    "the causes of tides",
    "how computers store numbers",
    "the migration of birds",
    "how bread rises",
    "the structure of an atom",
    "how rivers shape valleys",
]


def prompt(i: int, words: int) -> str:
    # The request number comes first, so no two prompts share more than a token or two of prefix:
    # the one-at-a-time server's KV prefix reuse does not flatter it.
    base = f"Request {i}. Write a detailed explanation of {TOPICS[i % len(TOPICS)]}. "
    filler = " ".join(TOPICS[(i + j) % len(TOPICS)] for j in range(words // 4))
    return base + "Background: " + filler + "\nExplanation:"


class Server:
    """`colibri serve` in a child process (optionally in a memory cgroup)."""

    def __init__(self, args: argparse.Namespace, concurrency: int, cap: int | None, tag: str) -> None:
        # --profile: the server's main thread (the event loop: HTTP, SSE, the response builders) under
        # cProfile, written when the server stops; the engine and request threads are not profiled.
        prof = ["-m", "cProfile", "-o", str(args.profile / f"{tag}.prof")] if args.profile else []
        cmd = [
            sys.executable,
            *prof,
            "-m",
            "colibri_backend",
            "serve",
            "--model",
            args.model,
            "--port",
            "0",
            "--context-length",
            str(args.context_length),
            "--max-concurrency",
            str(concurrency),
            "--max-queue",
            str(max(args.clients) + 1),
            "--log-level",
            "warning",
        ]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        self.cgroup = MemoryCgroup(cap, f"colibri-concurrency-{os.getpid()}") if cap else None
        if self.cgroup is not None:
            self.cgroup.__enter__()
        self.serve = ServeProcess(cmd, self.cgroup.join if self.cgroup is not None else None)
        self.proc, self.base = self.serve.proc, self.serve.base
        self.alias = next(iter(self.serve.models))
        self.profiled = bool(prof)

    def stop(self) -> None:
        if self.profiled and self.proc.poll() is None:
            # uvicorn re-raises the signal it stopped on: SIGTERM's default ends the process before
            # cProfile writes its file, SIGINT's KeyboardInterrupt lets it write.
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        self.serve.stop()
        if self.cgroup is not None:
            self.cgroup.__exit__(None, None, None)


def one_request(http: httpx.Client, alias: str, text: str, max_tokens: int) -> dict:
    body = {
        "model": alias,
        "prompt": text,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    out: list[str] = []
    tokens = 0
    with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(obj["error"]["message"])
            for c in obj.get("choices", []):
                if c.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    out.append(c["text"])
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
    return {
        "ttft": ttft if ttft is not None else float("nan"),
        "first": t0 + ttft if ttft is not None else None,
        "text": "".join(out),
        "tokens": tokens,
        "end": time.perf_counter(),
    }


def decoding_seconds(results: list[dict]) -> float:
    """Length of the union of the requests' [first token, end] intervals."""
    spans = sorted((r["first"], r["end"]) for r in results if r["first"] is not None)
    total, cur_start, cur_end = 0.0, None, None
    for a, b in spans:
        if cur_end is None or a > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def batch_counters(base: str) -> dict[str, float]:
    """The server's colibri_batch_*_total counters (absent without a batch scheduler)."""
    out: dict[str, float] = {}
    for line in httpx.get(base + "/metrics", timeout=60).text.splitlines():
        if line.startswith("colibri_batch_") and "_total{" in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{", 1)[0].removeprefix("colibri_batch_").removesuffix("_total")] = float(value)
    return out


STORE_STATS = ("expert_calls", "expert_hits", "expert_misses", "expert_bytes_read", "expert_stall_seconds")


def store_counters(base: str) -> dict[str, float]:
    """The engine's expert store counters (colibri_engine_*, the stats the server took after the last
    request ended): both modes have them, the one-at-a-time server has no batch counters."""
    out: dict[str, float] = {}
    for line in httpx.get(base + "/metrics", timeout=60).text.splitlines():
        name = line.split("{", 1)[0].removeprefix("colibri_engine_")
        if line.startswith("colibri_engine_") and name in STORE_STATS:
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def store_figures(before: dict[str, float], after: dict[str, float], tokens: int) -> dict:
    """The expert store over one round: misses, MiB read and stall seconds, in all and per completion
    token (prompt tokens included in the reads; the round's whole work over what it produced)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in STORE_STATS}
    if not d["expert_calls"]:
        return {}
    per = max(1, tokens)
    return {
        "expert_calls": int(d["expert_calls"]),
        "expert_misses": int(d["expert_misses"]),
        "expert_hit_rate": d["expert_hits"] / d["expert_calls"],
        "expert_mib_read": d["expert_bytes_read"] / 2**20,
        "expert_stall_s": d["expert_stall_seconds"],
        "expert_mib_read_per_token": d["expert_bytes_read"] / 2**20 / per,
        "expert_stall_ms_per_token": 1e3 * d["expert_stall_seconds"] / per,
    }


def step_figures(before: dict[str, float], after: dict[str, float], wall: float) -> dict:
    """Per batched step of one round: tokens, engine ms, ms between steps, partial steps; the share
    of the round's wall time the engine was stepping; and, where the server counts them (not before
    session 5), the steps that carried prompt tokens against the decode-only steps."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    steps = d.get("steps", 0.0)
    if not steps:
        return {}
    out = {
        "steps": int(steps),
        "tokens_per_step": d["step_tokens"] / steps,
        "engine_ms_per_step": 1e3 * d["step_engine_seconds"] / steps,
        "between_ms_per_step": 1e3 * d["step_between_seconds"] / steps,
        "partial_steps": int(d["partial_steps"]),
        "engine_share_of_wall": d["step_engine_seconds"] / wall,
        "between_share_of_wall": d["step_between_seconds"] / wall,
    }
    if "prefill_steps" in d:
        pre, dec = d["prefill_steps"], steps - d["prefill_steps"]
        dec_s = d["step_engine_seconds"] - d["prefill_step_engine_seconds"]
        out["prefill_steps"] = int(pre)
        out["prompt_tokens"] = int(d["step_prompt_tokens"])
        out["prefill_step_engine_share_of_wall"] = d["prefill_step_engine_seconds"] / wall
        out["prefill_step_ms"] = 1e3 * d["prefill_step_engine_seconds"] / pre if pre else 0.0
        out["decode_step_ms"] = 1e3 * dec_s / dec if dec else 0.0
        out["decode_step_tokens"] = (d["step_tokens"] - d["step_prompt_tokens"]) / steps
        if "decode_only_step_tokens" in d:  # sequences per decode-only step (not before session 8)
            out["decode_only_steps"] = int(dec)
            out["decode_only_step_seqs"] = d["decode_only_step_tokens"] / dec if dec else 0.0
    if "prefill_step_expert_bytes_read" in d:  # the store during each kind of step (experts streamed)
        for kind, n in (
            ("prefill", d.get("prefill_steps", 0.0)),
            ("decode", steps - d.get("prefill_steps", 0.0)),
        ):
            out[f"{kind}_step_mib_read"] = d[f"{kind}_step_expert_bytes_read"] / 2**20 / n if n else 0.0
            out[f"{kind}_step_stall_ms"] = 1e3 * d[f"{kind}_step_expert_stall_seconds"] / n if n else 0.0
            out[f"{kind}_step_misses"] = d[f"{kind}_step_expert_misses"] / n if n else 0.0
    return out


# Server threads by OS name (colibri_backend.server.thread_names); the main thread runs the event loop
# (HTTP, SSE, the response builders); what is left is the engine's worker threads (and the few helper
# threads the server starts: tokenizing off the loop, the model loader).
THREAD_CLASSES = {"colibri-batch": "step_thread", "colibri-req": "request_threads"}


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server's threads, summed per kind of thread."""
    tick = os.sysconf("SC_CLK_TCK")
    out = dict.fromkeys(("event_loop", "step_thread", "request_threads", "engine_workers"), 0.0)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        secs = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        kind = "event_loop" if int(task.name) == pid else THREAD_CLASSES.get(comm, "engine_workers")
        out[kind] += secs
    return out


def cpu_figures(before: dict[str, float], after: dict[str, float], wall: float, tokens: int) -> dict:
    """Per kind of server thread over one round: CPU seconds, share of the round's wall time (on 2
    CPUs the most is 2.0 in all), and ms per completion token."""
    out: dict = {}
    for kind in after:
        secs = after[kind] - before.get(kind, 0.0)
        out[kind] = {"cpu_s": secs, "per_wall": secs / wall, "ms_per_token": 1e3 * secs / max(1, tokens)}
    # All threads together: what a completion token costs the server in CPU time, which moves much less
    # with the machine's load than the wall time does (engine spin-waits included).
    out["all_ms_per_token"] = 1e3 * sum(after[k] - before.get(k, 0.0) for k in after) / max(1, tokens)
    return out


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def run_clients(server: Server, n: int, args: argparse.Namespace, first: int, max_tokens: int) -> dict:
    """n clients at once, sending prompts first .. first+n-1, each asking for max_tokens tokens."""
    texts = [prompt(first + i, args.prompt_words) for i in range(n)]
    # The clients and their threads exist before the clock starts: an httpx.Client takes tens of
    # milliseconds to make (its SSL context), which is the client's cost, not the server's.
    https = [httpx.Client(base_url=server.base, timeout=3600) for _ in range(n)]
    counters = batch_counters(server.base)
    store = store_counters(server.base)
    cpu = thread_cpu(server.proc.pid)
    start = threading.Barrier(n + 1)

    def client(i: int) -> dict:
        start.wait()
        return one_request(https[i], server.alias, texts[i], max_tokens)

    try:
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(client, i) for i in range(n)]
            start.wait()
            t0 = time.perf_counter()
            results = [f.result() for f in futures]
        cpu_after = thread_cpu(server.proc.pid)
    finally:
        for http in https:
            http.close()
    wall = max(r["end"] for r in results) - t0
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    decoding = decoding_seconds(results)
    decode_tokens = sum(max(0, r["tokens"] - 1) for r in results)
    return {
        "clients": n,
        "wall_s": wall,
        "completion_tokens": tokens,
        "aggregate_tok_s": tokens / wall if wall > 0 else float("nan"),
        "decoding_s": decoding,
        "decode_tok_s": decode_tokens / decoding if decoding > 0 else float("nan"),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": percentile(ttfts, 99),
        "texts": [r["text"] for r in results],
        "steps": step_figures(counters, batch_counters(server.base), wall),
        "store": store_figures(store, store_counters(server.base), tokens),
        "cpu": cpu_figures(cpu, cpu_after, wall, tokens),
    }


MODES = ("one_at_a_time", "batched")


def compare(report: dict, clients: list[int]) -> None:
    """Adds to each batched row what it is against the one-at-a-time row of the same client count."""
    for i in range(len(clients)):
        base, bat = report["modes"]["one_at_a_time"][i], report["modes"]["batched"][i]
        bat["identical_to_one_at_a_time"] = bat["texts"] == base["texts"]
        bat["speedup"] = bat["aggregate_tok_s"] / base["aggregate_tok_s"]
        bat["decode_speedup"] = bat["decode_tok_s"] / base["decode_tok_s"]
        one, c = base["cpu"]["all_ms_per_token"], bat["cpu"]["all_ms_per_token"]
        bat["cpu_speedup"] = one / c if c else float("nan")


def print_rows(
    report: dict,
    clients: list[int],
    line: Callable[[int, str, dict], str | None],
    modes: tuple[str, ...] = MODES,
) -> None:
    """One table: per client count, each mode's row as line(clients, mode, row) puts it (None: no line)."""
    for i, n in enumerate(clients):
        for mode in modes:
            text = line(n, mode, report["modes"][mode][i])
            if text is not None:
                print(text)


def throughput_line(n: int, mode: str, r: dict) -> str:
    extra = (
        f"{r['speedup']:7.2f}x {r['decode_speedup']:6.2f}x {r['identical_to_one_at_a_time']}"
        if mode == "batched"
        else ""
    )
    return (
        f"{n:>7} {mode.replace('_', ' '):>14} {r['aggregate_tok_s']:10.2f} {r['decode_tok_s']:12.2f} "
        f"{r['ttft_p50_s']:8.2f}s {r['ttft_p99_s']:8.2f}s {extra}"
    )


def steps_line(n: int, mode: str, r: dict) -> str | None:
    st = r["steps"]
    if not st:
        return None
    line = (
        f"{n:>7} {st['steps']:>6} steps {st['tokens_per_step']:6.2f} tok "
        f"{st['engine_ms_per_step']:8.2f} ms {st['between_ms_per_step']:7.2f} ms "
        f"{st['partial_steps']:>5} {100 * st['engine_share_of_wall']:5.1f}% "
        f"{100 * st['between_share_of_wall']:4.1f}%"
    )
    if "prefill_steps" in st:
        line += (
            f" | {st['prefill_steps']:>4} {st['prefill_step_ms']:8.2f} ms "
            f"{100 * st['prefill_step_engine_share_of_wall']:5.1f}% | {st['decode_step_ms']:8.2f} ms"
        )
    return line


def cpu_line(n: int, mode: str, r: dict) -> str:
    c, st = r["cpu"], r["steps"]
    py = c["event_loop"]["ms_per_token"] + c["request_threads"]["ms_per_token"]
    line = (
        f"{n:>7} {mode.replace('_', ' '):>14} "
        + " ".join(
            f"{c[k]['per_wall']:5.2f}"
            for k in ("event_loop", "request_threads", "step_thread", "engine_workers")
        )
        + f"  python {py:6.2f} ms/token  all {c['all_ms_per_token']:7.2f} ms/token"
    )
    if mode == "batched":
        line += f" ({r['cpu_speedup']:.2f}x)"
    if "decode_only_steps" in st:
        line += f" | {st['decode_only_steps']:>5} {st['decode_only_step_seqs']:5.2f}"
    return line


def store_line(n: int, mode: str, r: dict) -> str | None:
    st, steps = r["store"], r["steps"]
    if not st:
        return None
    line = (
        f"{n:>7} {mode.replace('_', ' '):>14} {st['expert_hit_rate']:6.3f} "
        f"{st['expert_mib_read']:9.1f} {st['expert_stall_s']:7.2f} "
        f"{st['expert_mib_read_per_token']:7.2f} {st['expert_stall_ms_per_token']:7.1f}"
    )
    if "prefill_step_mib_read" in steps:
        line += (
            f" | {steps['prefill_step_mib_read']:7.1f} {steps['prefill_step_stall_ms']:8.1f}"
            f" | {steps['decode_step_mib_read']:7.1f} {steps['decode_step_stall_ms']:8.1f}"
        )
    return line


def measure(args: argparse.Namespace, cap: int | None, max_tokens: int) -> dict:
    """Both modes at every client count for completions of max_tokens tokens; prints the tables."""
    report: dict = {"model": args.model, "memory_cap": cap, "max_tokens": max_tokens, "modes": {}}
    for mode, concurrency in zip(MODES, (1, max(args.clients)), strict=True):
        server = Server(args, concurrency, cap, mode)
        try:
            run_clients(server, 1, args, 10_000, max_tokens)  # warm-up (page cache, expert slots)
            starts = [sum(args.clients[:k]) for k in range(len(args.clients))]
            report["modes"][mode] = [
                run_clients(server, n, args, s, max_tokens) for n, s in zip(args.clients, starts, strict=True)
            ]
        finally:
            server.stop()
    compare(report, args.clients)
    print(f"{args.model}  cap={cap or 'none'}  max_tokens={max_tokens}")
    print(
        f"{'clients':>7} {'mode':>14} {'agg tok/s':>10} {'decode tok/s':>12} {'ttft p50':>9} {'ttft p99':>9} "
        f"{'speedup':>8} {'decode':>7} same"
    )
    print_rows(report, args.clients, throughput_line)
    print(
        "batched steps (through the server): tokens/step, engine ms/step, ms between steps, partial steps,"
        " % of wall in the engine / between steps; steps with prompt tokens: count, ms each, % of wall;"
        " decode-only steps: ms each"
    )
    print_rows(report, args.clients, steps_line, modes=("batched",))
    print(
        "server CPU per round (thread kind: CPU s / wall s; event loop, request threads, step thread,"
        " engine workers) and ms of event loop + request threads per completion token; all threads' CPU"
        " ms per completion token (batched: and one at a time's over it, the load-robust speed-up);"
        " batched decode-only steps: count, sequences each"
    )
    print_rows(report, args.clients, cpu_line)
    if any(r["store"] for rows in report["modes"].values() for r in rows):
        print(
            "expert store per round: hit rate, MiB read, stall s, per completion token MiB / stall ms;"
            " batched steps with prompt tokens / decode-only: MiB read and stall ms per step"
        )
        print_rows(report, args.clients, store_line)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path.home() / ".cache/colibri/bench/bench-a-q8_0.gguf"))
    ap.add_argument("--clients", default="1,4,8,16", help="comma list of concurrent client counts")
    ap.add_argument("--max-tokens", default="64", help="tokens per request (a comma list: each in turn)")
    ap.add_argument("--prompt-words", type=int, default=60, help="about this many words per prompt")
    ap.add_argument("--context-length", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0, help="engine threads (default: all CPUs)")
    ap.add_argument(
        "--memory-cap", default=None, metavar="SIZE|P%", help="run each server in a memory cgroup"
    )
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="run each server's event loop under cProfile, writing DIR/<mode>.prof",
    )
    args = ap.parse_args()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    try:
        args.clients = sorted({int(c) for c in args.clients.split(",")})
    except ValueError:
        ap.error(f"--clients: {args.clients!r} is not a comma list of numbers")
    if not args.clients or min(args.clients) < 1:
        ap.error("--clients: counts must be at least 1")
    try:
        lengths = [int(c) for c in args.max_tokens.split(",")]
    except ValueError:
        ap.error(f"--max-tokens: {args.max_tokens!r} is not a comma list of numbers")
    if min(lengths) < 1:
        ap.error("--max-tokens: lengths must be at least 1")
    cap = None
    if args.memory_cap:
        if args.memory_cap.endswith("%"):
            model = Path(args.model).expanduser()
            if not model.is_file():
                ap.error("--memory-cap P% needs --model to be a file")
            cap = int(model.stat().st_size * float(args.memory_cap[:-1]) / 100)
        else:
            cap = parse_size(args.memory_cap)

    reports = [measure(args, cap, n) for n in lengths]
    if args.json:
        out = reports[0] if len(reports) == 1 else {"model": args.model, "memory_cap": cap, "runs": reports}
        args.json.write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    same = all(r["identical_to_one_at_a_time"] for rep in reports for r in rep["modes"]["batched"])
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
