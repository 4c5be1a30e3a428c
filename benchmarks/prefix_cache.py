"""Time to first token of requests sharing a long prefix with an earlier one: cold, warm, after a restart.

    python benchmarks/prefix_cache.py [--model colibri-moe --model PATH ...] [--prefix 1500] [--repeat 3]
                                      [--max-concurrency N]

For each model, a real `colibri serve --kv-cache-dir DIR` process on loopback (a fresh DIR), and for each
repeat a different 1,500-token prefix (consecutive slices of this repository's docs, as tokens of the
model's tokenizer) followed by a short question; streamed /v1/completions, temperature 0, 4 tokens,
TTFT = request sent to the first streamed text chunk:
  cold         the first request with this prefix;
  warm-live    the next one with the same prefix (the context still holds it);
  warm-stored  the same after an unrelated request replaced the context (restored from the cache);
then the server is stopped, started again on the same DIR, and
  restart      one more request per prefix (the entry read from DIR).
Every request also reports usage.prompt_tokens_details.cached_tokens, printed beside its median.
--max-concurrency N (N > 1) serves on the batched path (server/scheduler.py: every request on a sequence
of its own, restored from the stored prefixes only, so warm-live is one more stored case there).
Prints one table per model: median and worst TTFT of each case, the cold/case ratio. (docs/server.md)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _serve import ServeProcess  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CASES = ("cold", "warm-live", "warm-stored", "restart")


class Server:
    def __init__(self, model: str, cache_dir: Path, args: argparse.Namespace) -> None:
        cmd = [sys.executable, "-m", "colibri_backend", "serve", "--model", model, "--port", "0"]
        cmd += ["--threads", str(args.threads), "--context-length", str(args.context)]
        cmd += ["--kv-cache-dir", str(cache_dir), "--max-concurrency", str(args.concurrency)]
        self.serve = ServeProcess([*cmd, "--log-level", "warning"])
        self.http = httpx.Client(base_url=self.serve.base, timeout=600)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]

    def ttft(self, prompt: str) -> tuple[float, int]:
        """(seconds to the first streamed text, cached_tokens of the request)."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        first, cached = None, -1
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if first is None and obj.get("choices") and obj["choices"][0].get("text"):
                    first = time.perf_counter() - t0
                if obj.get("usage"):
                    cached = obj["usage"]["prompt_tokens_details"]["cached_tokens"]
        if first is None:  # every token held back (a stop string, an incomplete character)
            first = time.perf_counter() - t0
        return first, cached

    def stop(self) -> None:
        self.serve.stop()


def prefixes(model: str, n_tokens: int, count: int) -> list[str]:
    """`count` different texts of n_tokens tokens of the model's tokenizer, from the docs."""
    import colibri_backend
    from colibri_backend.adapters.gguf_metadata import read_metadata
    from colibri_backend.adapters.tokenizer import Tokenizer

    path = colibri_backend.resolve_model(model).gguf
    tok = Tokenizer.from_gguf(path, read_metadata(path))
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) < n_tokens * count:
        raise SystemExit(f"the docs hold {len(ids)} tokens, fewer than {count} prefixes of {n_tokens}")
    return [tok.decode(ids[i * n_tokens : (i + 1) * n_tokens]) for i in range(count)]


def bench(model: str, args: argparse.Namespace) -> dict[str, list[tuple[float, int]]]:
    texts = prefixes(model, args.prefix, args.repeat)
    out: dict[str, list[tuple[float, int]]] = {c: [] for c in CASES}
    with tempfile.TemporaryDirectory(prefix="colibri-kv-") as cache_dir:
        s = Server(model, Path(cache_dir), args)
        try:
            s.ttft("Hello.")  # loads the kernels' first pages, so cold measures the prompt only
            for i, text in enumerate(texts):
                out["cold"].append(s.ttft(f"{text}\nQuestion {i}a: what is this about?"))
                out["warm-live"].append(s.ttft(f"{text}\nQuestion {i}b: who wrote it?"))
                s.ttft(f"Something else entirely, number {i}.")
                out["warm-stored"].append(s.ttft(f"{text}\nQuestion {i}c: why?"))
        finally:
            s.stop()
        s = Server(model, Path(cache_dir), args)
        try:
            s.ttft("Hello.")
            for i, text in enumerate(texts):
                out["restart"].append(s.ttft(f"{text}\nQuestion {i}d: and then?"))
        finally:
            s.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="a model name or GGUF path (repeatable)")
    ap.add_argument("--prefix", type=int, default=1500, help="tokens of the shared prefix")
    ap.add_argument("--repeat", type=int, default=3, help="prefixes per model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context-length", dest="context", type=int, default=2048)
    ap.add_argument("--max-concurrency", dest="concurrency", type=int, default=1, help=">1: batched path")
    args = ap.parse_args()
    for model in args.model or ["colibri-moe"]:
        res = bench(model, args)
        cold = statistics.median(t for t, _ in res["cold"])
        print(
            f"\n{model}: {args.prefix}-token prefix, {args.repeat} prefixes, {args.threads} threads, "
            f"max concurrency {args.concurrency}"
        )
        print(f"{'case':<12} {'median ms':>10} {'worst ms':>9} {'cold/case':>10} {'cached_tokens':>14}")
        for case in CASES:
            times = [t for t, _ in res[case]]
            cached = statistics.median(c for _, c in res[case])
            med, worst = 1000 * statistics.median(times), 1000 * max(times)
            print(f"{case:<12} {med:>10.1f} {worst:>9.1f} {1000 * cold / med:>9.1f}x {cached:>14.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
