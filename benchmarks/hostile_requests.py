"""How fast `colibri serve` refuses hostile bodies, and whether /health and the RSS notice.

    python benchmarks/hostile_requests.py [--model colibri-moe] [--repeat 5]

Starts a server on loopback, then sends each case --repeat times: a 10 MB body, JSON nested 1,000 deep,
a 5,000-digit integer, a text/plain POST; after each, one GET /health. Prints the status, the median and
worst time to the answer, the worst /health time, and the server's RSS growth. (docs/server.md)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _serve import ServeProcess  # noqa: E402


def start(model: str) -> ServeProcess:
    cmd = [
        sys.executable,
        "-m",
        "colibri_backend",
        "serve",
        "--model",
        model,
        "--port",
        "0",
        "--threads",
        "1",
    ]
    return ServeProcess([*cmd, "--log-level", "warning"], timeout=180)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="colibri-moe")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    serve = start(args.model)
    proc, base = serve.proc, serve.base
    model = args.model.encode()
    json_ct = {"Content-Type": "application/json"}
    cases = {
        "10 MB body": (b'{"model": "' + model + b'", "prompt": "' + b"a" * (10 << 20) + b'"}', json_ct),
        "nested 1,000 deep": (
            b'{"model": "' + model + b'", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}",
            json_ct,
        ),
        "5,000-digit integer": (
            b'{"model": "' + model + b'", "prompt": "x", "seed": ' + b"9" * 5000 + b"}",
            json_ct,
        ),
        "text/plain POST": (b'{"model": "' + model + b'", "prompt": "x"}', {"Content-Type": "text/plain"}),
    }
    try:
        with httpx.Client(base_url=base, timeout=60) as c:
            c.post("/v1/completions", json={"model": args.model, "prompt": "x", "max_tokens": 1})  # warm up
            rss0 = rss_mib(proc.pid)
            print(f"{'case':<22} {'status':>6} {'median ms':>10} {'worst ms':>9} {'/health worst ms':>17}")
            for name, (body, headers) in cases.items():
                took, health, statuses = [], [], set()
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    statuses.add(c.post("/v1/completions", content=body, headers=headers).status_code)
                    took.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    c.get("/health")
                    health.append(time.perf_counter() - t0)
                status = ",".join(str(s) for s in sorted(statuses))
                med, worst, h = 1000 * statistics.median(took), 1000 * max(took), 1000 * max(health)
                print(f"{name:<22} {status:>6} {med:>10.1f} {worst:>9.1f} {h:>17.1f}")
            after = rss_mib(proc.pid)
            print(f"server RSS: {rss0:.1f} MiB after warm-up, {after:.1f} MiB after the hostile requests")
    finally:
        serve.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
