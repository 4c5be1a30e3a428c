"""Soak run of `colibri serve`: many concurrent streaming clients for a long while, on loopback.

    python benchmarks/soak.py                                   # 50 clients, 10 minutes, the bundled model
    python benchmarks/soak.py --clients 50 --duration 600 --max-concurrency 8 --max-queue 16 \
        --json benchmarks/results/soak.json

Every client loops until the time is up, each request a streamed chat completion or a streamed completion
(alternating) of one of a few prompts, greedy. Before the load starts, every (endpoint, prompt) pair is
served once alone: that text is the reference, and since a greedy request's output does not depend on what
it is batched with, any other text under load is counted as corrupted. A request turned away with 429
must carry `Retry-After`; the client waits that long and sends it again. The server's RSS is sampled from
/proc every second: the figure is its growth from the end of the warm-up to the end of the run.

Reported: requests finished, failed (any error status but 429, a broken stream, no [DONE]), corrupted,
429s (and any without Retry-After), completion tokens per second, p50/p99 request latency, RSS at the
end of the warm-up, at the end, the largest after the warm-up, and the growth in percent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _serve import ServeProcess  # noqa: E402

PROMPTS = [
    "def fibonacci(n):",
    "The history of the printing press begins",
    "import numpy as np\n\ndef normalise(x):",
    "Write a short note about rivers and valleys.",
    "class Stack:\n    def __init__(self):",
    "Explain how bread rises.",
    "for i in range(10):",
    "The migration of birds is",
]
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


def request_body(alias: str, endpoint: str, prompt: str, max_tokens: int) -> dict:
    body: dict = {"model": alias, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


class Rejected(Exception):
    """429: the queue was full; `retry_after` is the header's value (None when it was missing)."""

    def __init__(self, retry_after: str | None) -> None:
        super().__init__(f"429, Retry-After {retry_after!r}")
        self.retry_after = retry_after


def stream_once(http: httpx.Client, endpoint: str, body: dict) -> str:
    """The streamed text of one request; Rejected on 429, RuntimeError on anything else that is wrong."""
    pieces: list[str] = []
    done = False
    with http.stream("POST", endpoint, json=body) as r:
        if r.status_code == 429:
            raise Rejected(r.headers.get("retry-after"))
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"error event: {obj['error']}")
            for choice in obj.get("choices", []):
                piece = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                if piece:
                    pieces.append(piece)
    if not done:
        raise RuntimeError("the stream ended without [DONE]")
    return "".join(pieces)


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: int = 0
    failed: int = 0
    corrupted: int = 0
    rejected: int = 0
    rejected_without_retry_after: int = 0
    chars: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def client_loop(
    base: str,
    alias: str,
    client: int,
    deadline: float,
    references: dict,
    args: argparse.Namespace,
    tally: Tally,
) -> None:
    with httpx.Client(base_url=base, timeout=args.request_timeout) as http:
        i = client
        while time.monotonic() < deadline:
            endpoint = ENDPOINTS[i % len(ENDPOINTS)]
            prompt = PROMPTS[(i // len(ENDPOINTS)) % len(PROMPTS)]
            i += 1
            body = request_body(alias, endpoint, prompt, args.max_tokens)
            t0 = time.monotonic()
            while True:
                try:
                    text = stream_once(http, endpoint, body)
                except Rejected as e:
                    with tally.lock:
                        tally.rejected += 1
                        if e.retry_after is None or not e.retry_after.isdigit():
                            tally.rejected_without_retry_after += 1
                    wait = float(e.retry_after) if e.retry_after and e.retry_after.isdigit() else 1.0
                    if time.monotonic() + wait >= deadline:
                        return
                    time.sleep(wait)
                    continue
                except (RuntimeError, httpx.HTTPError, json.JSONDecodeError) as e:
                    with tally.lock:
                        tally.failed += 1
                        tally.errors.append(f"{endpoint} {prompt!r}: {e}")
                    break
                with tally.lock:
                    tally.finished += 1
                    tally.chars += len(text)
                    tally.latencies.append(time.monotonic() - t0)
                    if text != references[endpoint, prompt]:
                        tally.corrupted += 1
                        tally.errors.append(f"corrupted {endpoint} {prompt!r}: {text[:80]!r}")
                break


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))] if s else float("nan")


def soak(args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable, "-m", "colibri_backend", "serve", "--model", args.model, "--port", "0",
        "--max-concurrency", str(args.max_concurrency), "--max-queue", str(args.max_queue),
        "--context-length", str(args.context_length), "--log-level", "warning",
    ]  # fmt: skip
    server = ServeProcess(cmd)
    try:
        alias = next(iter(server.models))
        with httpx.Client(base_url=server.base, timeout=args.request_timeout) as http:
            references = {
                (ep, p): stream_once(http, ep, request_body(alias, ep, p, args.max_tokens))
                for ep in ENDPOINTS
                for p in PROMPTS
            }
        tally = Tally()
        samples: list[tuple[float, int]] = []
        start = time.monotonic()
        deadline = start + args.duration
        stop_sampling = threading.Event()

        def sample_rss() -> None:
            while not stop_sampling.wait(1.0):
                samples.append((time.monotonic() - start, rss_bytes(server.proc.pid)))

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        with ThreadPoolExecutor(args.clients) as pool:
            futures = [
                pool.submit(client_loop, server.base, alias, c, deadline, references, args, tally)
                for c in range(args.clients)
            ]
            for f in futures:
                f.result()
        wall = time.monotonic() - start
        stop_sampling.set()
        sampler.join()
        if server.proc.poll() is not None:
            raise SystemExit(f"the server exited ({server.proc.returncode}):\n" + "".join(server.log))
        final_rss = rss_bytes(server.proc.pid)
    finally:
        server.stop()

    after = [rss for t, rss in samples if t >= args.warmup]
    warm_rss = after[0] if after else final_rss
    return {
        "model": args.model,
        "clients": args.clients,
        "duration_s": args.duration,
        "wall_s": round(wall, 1),
        "max_concurrency": args.max_concurrency,
        "max_queue": args.max_queue,
        "max_tokens": args.max_tokens,
        "requests_finished": tally.finished,
        "failed": tally.failed,
        "corrupted": tally.corrupted,
        "rejected_429": tally.rejected,
        "rejected_429_without_retry_after": tally.rejected_without_retry_after,
        "chars_per_s": round(tally.chars / wall, 1),
        "latency_p50_s": round(statistics.median(tally.latencies), 3) if tally.latencies else None,
        "latency_p99_s": round(percentile(tally.latencies, 99), 3),
        "warmup_s": args.warmup,
        "rss_after_warmup_mib": round(warm_rss / 2**20, 1),
        "rss_final_mib": round(final_rss / 2**20, 1),
        "rss_max_after_warmup_mib": round(max(after, default=final_rss) / 2**20, 1),
        "rss_growth_pct": round(100 * (final_rss - warm_rss) / warm_rss, 2),
        "errors": tally.errors[:20],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="colibri-moe", help="what `colibri serve --model` takes")
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds before the RSS baseline is taken")
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--context-length", type=int, default=512)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    args = ap.parse_args()
    if args.clients < 1 or args.duration <= 0 or args.warmup < 0 or args.warmup >= args.duration:
        ap.error("need --clients >= 1, --duration > 0 and 0 <= --warmup < --duration")
    report = soak(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    bad = report["failed"] or report["corrupted"] or report["rejected_429_without_retry_after"]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
