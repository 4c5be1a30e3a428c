"""Colibri against llama.cpp on the same GGUF files: decode and prefill speed, time to first token, peak RSS.

Protocol (docs/benchmarks.md, DESIGN.md): the same GGUF in both engines, the same 64-token prompt of fixed
English text (token ids computed once and passed to both engines), 128 generated tokens, 2 threads, a fresh
process per run (benchmarks/_worker.py), runs alternating A B A B, at least 3 each, medians and the
Colibri / llama.cpp ratio. Decoding is measured greedy and with sampling (temperature 0.8, fixed seed): random
weights repeat themselves under greedy decoding, which would flatter any cache.

Capped mode (--memory-cap SIZE) runs each child inside a fresh cgroup with a memory limit (cgroup v2
memory.max, or v1 memory.limit_in_bytes where only v1 has the memory controller, as on this machine), after
making the model cold, and removes the cgroup afterwards. It needs root. Cold means the model file and its
sidecars (.lowbit, .digests) are evicted from the page cache (posix_fadvise DONTNEED on those files only,
so other processes on the machine keep theirs); `--cold-start drop-caches` drops the whole page cache
instead (`echo 3 > /proc/sys/vm/drop_caches`), for a quiet machine.

    python benchmarks/bench.py --model smollm2 --model bench-a --model bench-b --runs 3 \
        --json out.json --markdown
    python benchmarks/bench.py --model bench-a --engines colibri --sampling sampled --memory-cap 1034M
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from _worker import RESULT_PREFIX  # noqa: E402
from make_bench_models import DEFAULT_CACHE_DIR, SMOLLM2_GGUF_FALLBACK, SPECS, gguf_path  # noqa: E402

# Fixed prompt text: plain English prose, long enough for more than 64 tokens in any 49k BPE vocabulary.
PROMPT_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a small brass lamp "
    "and a notebook in which he recorded the weather, the ships that passed and the birds that rested on the "
    "rail. Over forty years he had filled more than two hundred notebooks, and the village library kept them "
    "on a long shelf by the window, where children would read about storms that their grandparents still "
    "remembered. One winter night, when the wind was strong enough to rattle the heavy glass, he noticed "
    "a light"
)
ENGINE_LABELS = {"colibri": "Colibri", "llama_cpp": "llama.cpp"}
SAMPLING_MODES = {"greedy": 0.0, "sampled": 0.8}


# ---------------------------------------------------------------------------------------------------------
# models and prompt


def resolve_model(spec: str, cache_dir: Path, bench_type: str) -> tuple[str, Path]:
    """(label, path) for a --model value: smollm2, default (Colibri's default model), a bench model's name
    (make_bench_models.SPECS: bench-a, bench-b, bench-gptoss, bench-qwen35, bench-deepseek2, ...) or a GGUF
    path."""
    key = spec.lower()
    if key == "smollm2":
        path = None
        try:
            import colibri_backend

            path = Path(colibri_backend.resolve_model("smollm2").gguf)
        except Exception:  # the resolver may be unavailable; the development copy is used then
            path = None
        if path is None or not path.is_file():
            path = SMOLLM2_GGUF_FALLBACK
        label = "SmolLM2-135M Q4_1" if "q4_1" in path.name.lower() else f"SmolLM2-135M ({path.name})"
        return label, path
    if key == "default":
        import colibri_backend

        path = Path(colibri_backend.default_model_path())
        return f"default: {path.name}", path
    if key in SPECS:
        path = gguf_path(cache_dir, key, bench_type)
        if not path.is_file():
            raise SystemExit(
                f"{path} does not exist; run: nice python benchmarks/make_bench_models.py "
                f"--models {key} --out-type {bench_type} --cache-dir {cache_dir}"
            )
        suffix = key.removeprefix("bench-")  # bench-A, bench-B, bench-R; bench-gptoss, bench-qwen35, ...
        return f"bench-{suffix.upper() if len(suffix) == 1 else suffix} {bench_type.upper()}", path
    path = Path(spec).expanduser()
    if not path.is_file():
        raise SystemExit(f"model {spec!r} is neither smollm2, bench-a, bench-b nor an existing file")
    return path.name, path


# Control tokens that end a turn in common chat formats; generation would stop on them.
END_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "</s>")


def banned_ids(model_path: Path) -> list[int]:
    """Ids that would end generation early: EOS/EOT/EOM from the metadata and end-of-turn control tokens."""
    from gguf import GGUFReader

    fields = GGUFReader(str(model_path)).fields
    ids: set[int] = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in fields:
            ids.add(int(fields[key].contents()))
    if "tokenizer.ggml.tokens" in fields:
        tokens = fields["tokenizer.ggml.tokens"].contents()
        types = (
            fields["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in fields else []
        )
        for i, text in enumerate(tokens):
            if text in END_TEXTS and (not types or types[i] == 3):
                ids.add(i)
    return sorted(ids)


def prompt_ids(model_path: Path, n_tokens: int) -> list[int]:
    """The first n_tokens ids of PROMPT_TEXT under the model's own tokenizer (read from the GGUF metadata):
    Colibri's tokenizer adapter where the package is importable, else a byte-level BPE rebuilt here."""
    try:
        from colibri_backend.adapters.tokenizer import Tokenizer as ColibriTokenizer

        ids = ColibriTokenizer.from_gguf(model_path).encode(PROMPT_TEXT, add_special_tokens=False)
    except ImportError:
        from make_bench_models import tokenizer_from_gguf, tokenizer_json
        from tokenizers import Tokenizer

        tok = Tokenizer.from_str(json.dumps(tokenizer_json(tokenizer_from_gguf(model_path))))
        ids = tok.encode(PROMPT_TEXT, add_special_tokens=False).ids
    if len(ids) < n_tokens:
        raise SystemExit(
            f"the fixed prompt has only {len(ids)} tokens under this tokenizer, {n_tokens} requested"
        )
    return ids[:n_tokens]


def prewarm_page_cache(path: Path) -> None:
    """Read the file once so the first run does not pay for the disk while later runs do not."""
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass


# ---------------------------------------------------------------------------------------------------------
# memory cap: a cgroup per run


_SIZE_UNITS = {
    "": 1,
    "K": 1 << 10,
    "M": 1 << 20,
    "G": 1 << 30,
    "KB": 1000,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
}


def parse_size(text: str) -> int:
    """Bytes from "1034M" / "1.5G" / "512MiB" (binary) or "250MB" / "1GB" (decimal) or a plain number."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _SIZE_UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"cannot parse size {text!r} (examples: 1034M, 1.5G, 250MB)")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def evict_model(path: Path) -> None:
    """Drop the model file and its sidecars from the page cache, and nothing else (--cold-start evict).
    Clean pages of a file nobody maps go at once; the kernel keeps pages another process maps or locks."""
    for f in (path, path.with_name(path.name + ".lowbit"), path.with_name(path.name + ".digests")):
        try:
            fd = os.open(f, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_cold(path: Path, method: str) -> None:
    if method == "drop-caches":
        drop_page_cache()
    else:
        evict_model(path)


class MemoryCgroup:
    """A cgroup with a memory limit that one child process joins; removed on exit.

    v2 (unified hierarchy with the memory controller): <root>/NAME/memory.max, peak in memory.peak.
    v1 (memory controller mounted on its own): /sys/fs/cgroup/memory/NAME/memory.limit_in_bytes (and
    memory.memsw.limit_in_bytes where swap accounting exists), peak in memory.max_usage_in_bytes.
    """

    V2_ROOT = Path("/sys/fs/cgroup")
    V1_ROOT = Path("/sys/fs/cgroup/memory")

    def __init__(self, limit_bytes: int, name: str, version: str = "auto") -> None:
        self.limit = limit_bytes
        self.version = self._detect() if version == "auto" else version
        root = self.V2_ROOT if self.version == "v2" else self.V1_ROOT
        self.path = root / name
        self.peak_bytes: int | None = None
        self.oom_events: int | None = None

    @classmethod
    def _detect(cls) -> str:
        controllers = cls.V2_ROOT / "cgroup.controllers"
        if controllers.is_file() and "memory" in controllers.read_text().split():
            return "v2"
        if (cls.V1_ROOT / "memory.limit_in_bytes").is_file():
            return "v1"
        raise SystemExit("no cgroup memory controller found (need cgroup v2 memory or v1 memory mounted)")

    def __enter__(self) -> MemoryCgroup:
        if self.version == "v2":
            sub = self.V2_ROOT / "cgroup.subtree_control"
            if "memory" not in (self.V2_ROOT / "cgroup.subtree_control").read_text().split():
                sub.write_text("+memory")
            self.path.mkdir()
            (self.path / "memory.max").write_text(str(self.limit))
            swap = self.path / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
        else:
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
            memsw = self.path / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                with contextlib.suppress(OSError):  # absent without swap accounting
                    memsw.write_text(str(self.limit))
        return self

    def join(self) -> None:
        """Move the calling process into the cgroup (used as the child's preexec_fn, before exec)."""
        with open(self.path / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def _read_int(self, name: str) -> int | None:
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def __exit__(self, *exc: object) -> None:
        if self.version == "v2":
            self.peak_bytes = self._read_int("memory.peak")
            try:
                for line in (self.path / "memory.events").read_text().splitlines():
                    key, value = line.split()
                    if key == "oom_kill":
                        self.oom_events = int(value)
            except (OSError, ValueError):
                pass
        else:
            self.peak_bytes = self._read_int("memory.max_usage_in_bytes")
            self.oom_events = self._read_int("memory.failcnt")
        # The child has been reaped, but the kernel may take a moment to empty the group.
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        print(f"warning: could not remove cgroup {self.path}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------------
# one run


@dataclass
class RunRequest:
    model_label: str
    model_path: Path
    engine: str
    sampling: str
    round: int


def run_worker(
    req: RunRequest, args: argparse.Namespace, prompt: list[int], ban: list[int], cap_index: int
) -> dict:
    cmd = [
        sys.executable,
        str(HERE / "_worker.py"),
        "--engine",
        req.engine,
        "--model",
        str(req.model_path),
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--max-tokens",
        str(args.max_tokens),
        "--threads",
        str(args.threads),
        "--ctx",
        str(args.ctx),
        "--batch-size",
        str(args.batch_size),
        "--temperature",
        str(SAMPLING_MODES[req.sampling]),
        "--seed",
        str(args.seed),
        "--ban-ids",
        ",".join(map(str, ban)),
        "--llama-extra-bufts",
        args.llama_extra_bufts,
    ]
    if req.engine == "colibri" and args.routing_trace:
        cmd += ["--routing-trace", str(args.routing_trace)]
    if req.engine == "colibri" and args.prefetch:
        cmd += ["--prefetch", args.prefetch]
    if req.engine == "colibri":
        for option in args.colibri_option:
            cmd += ["--load-option", option]
    env = dict(os.environ)
    if args.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    if args.nice:
        cmd = ["nice", "-n", str(args.nice)] + cmd
    cgroup_ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
    cgroup = None
    if args.memory_cap:
        make_cold(req.model_path, args.cold_start)
        name = f"colibri-bench-{os.getpid()}-{cap_index}"
        cgroup = MemoryCgroup(args.memory_cap, name, args.cgroup_version)
        cgroup_ctx = cgroup
    load_before = load_average()
    with cgroup_ctx, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=err,
            cwd=REPO,
            env=env,
            preexec_fn=cgroup.join if cgroup is not None else None,
        )
        timer = threading.Timer(args.timeout, lambda: _kill(proc.pid))
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - t0
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode("utf-8", "replace")
        stderr = err.read().decode("utf-8", "replace")
    result: dict | None = None
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
            break
    if result is None:
        result = {
            "ok": False,
            "error": f"worker exited with {proc.returncode} and no result: "
            f"{stderr.strip().splitlines()[-1:] or ''}",
        }
    result.update(
        {
            "model_label": req.model_label,
            "sampling": req.sampling,
            "round": req.round,
            "engine": req.engine,
            "exit_code": proc.returncode,
            "wall_s": wall,
            "load_average_before": load_before,
            # ru_maxrss of the reaped child, KiB on Linux.
            "ru_maxrss_bytes": usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024),
        }
    )
    if cgroup is not None:
        result.update(
            {
                "memory_cap_bytes": args.memory_cap,
                "cgroup_version": cgroup.version,
                "cgroup_peak_bytes": cgroup.peak_bytes,
                "cgroup_limit_hits": cgroup.oom_events,
            }
        )
    if not result.get("ok"):
        result["stderr_tail"] = stderr[-2000:]
    return result


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def schedule(
    models: list[tuple[str, Path]], engines: list[str], samplings: list[str], runs: int
) -> Iterator[RunRequest]:
    """Per model and sampling mode: rounds of one run per engine, A B A B ..."""
    for label, path in models:
        for sampling in samplings:
            for r in range(runs):
                for engine in engines:
                    yield RunRequest(label, path, engine, sampling, r)


# ---------------------------------------------------------------------------------------------------------
# summary


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(results: list[dict], engines: list[str]) -> list[dict]:
    """One row per model: medians per engine and the Colibri / llama.cpp ratios."""
    rows = []
    for label in dict.fromkeys(r["model_label"] for r in results):
        row: dict = {"model": label, "engines": {}}
        for engine in engines:
            mine = [r for r in results if r["model_label"] == label and r["engine"] == engine]
            ok = [r for r in mine if r.get("ok")]
            failed = [r for r in mine if not r.get("ok")]
            e = {
                "runs_ok": len(ok),
                "runs_failed": len(failed),
                "errors": sorted({r.get("error", "") for r in failed}),
                "prefill_tps": median([r["prefill_tps"] for r in ok]),
                "ttft_ms": median([r["ttft_s"] * 1000 for r in ok]),
                "peak_rss_mib": median([r["peak_rss_bytes"] / 2**20 for r in ok]),
                "load_s": median([r["load_s"] for r in ok]),
            }
            for mode in SAMPLING_MODES:
                vals = [r["decode_tps"] for r in ok if r["sampling"] == mode]
                e[f"decode_tps_{mode}"] = median(vals)
                e[f"decode_tps_{mode}_range"] = [min(vals), max(vals)] if vals else None
            e["prefill_tps_range"] = (
                [min(r["prefill_tps"] for r in ok), max(r["prefill_tps"] for r in ok)] if ok else None
            )
            caps = [r["cgroup_peak_bytes"] / 2**20 for r in ok if r.get("cgroup_peak_bytes")]
            if caps:
                e["cgroup_peak_mib"] = median(caps)
            row["engines"][engine] = e
        if "colibri" in row["engines"] and "llama_cpp" in row["engines"]:
            c, ll = row["engines"]["colibri"], row["engines"]["llama_cpp"]
            row["ratio"] = {
                k: (c[k] / ll[k] if c.get(k) and ll.get(k) else None)
                for k in ("decode_tps_greedy", "decode_tps_sampled", "prefill_tps", "ttft_ms", "peak_rss_mib")
            }
            row["greedy_agreement"] = greedy_agreement(results, label)
        rows.append(row)
    return rows


def greedy_agreement(results: list[dict], label: str) -> dict | None:
    """How many leading greedy tokens the two engines share (first runs of each)."""

    def first(engine: str) -> list[int] | None:
        for r in results:
            same = r["model_label"] == label and r["engine"] == engine
            if same and r["sampling"] == "greedy" and r.get("ok"):
                return r["generated_ids"]
        return None

    a, b = first("colibri"), first("llama_cpp")
    if a is None or b is None:
        return None
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return {"common_prefix": n, "length": min(len(a), len(b))}


def fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(rows: list[dict], engines: list[str]) -> str:
    both = "colibri" in engines and "llama_cpp" in engines
    lines = []
    if both:
        lines += [
            "| model | decode greedy tok/s (C / L) | ratio | decode sampled tok/s (C / L) | ratio "
            "| prefill tok/s (C / L) | ratio | TTFT ms (C / L) | peak RSS MiB (C / L) "
            "| greedy tokens shared |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in rows:
            c, ll, q = row["engines"]["colibri"], row["engines"]["llama_cpp"], row["ratio"]
            agree = row.get("greedy_agreement")
            lines.append(
                f"| {row['model']} "
                f"| {fmt(c['decode_tps_greedy'])} / {fmt(ll['decode_tps_greedy'])} "
                f"| {fmt(q['decode_tps_greedy'], 2)} "
                f"| {fmt(c['decode_tps_sampled'])} / {fmt(ll['decode_tps_sampled'])} "
                f"| {fmt(q['decode_tps_sampled'], 2)} "
                f"| {fmt(c['prefill_tps'])} / {fmt(ll['prefill_tps'])} | {fmt(q['prefill_tps'], 2)} "
                f"| {fmt(c['ttft_ms'])} / {fmt(ll['ttft_ms'])} "
                f"| {fmt(c['peak_rss_mib'], 0)} / {fmt(ll['peak_rss_mib'], 0)} "
                f"| {agree['common_prefix'] if agree else '–'}/{agree['length'] if agree else '–'} |"
            )
        lines.append("")
    lines += [
        "| model | engine | runs ok | decode greedy tok/s (min–max) | decode sampled tok/s (min–max) "
        "| prefill tok/s (min–max) | TTFT ms | peak RSS MiB | load s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for engine in engines:
            e = row["engines"][engine]

            def rng(key: str, e=e) -> str:
                r = e.get(key)
                return f" ({r[0]:.1f}–{r[1]:.1f})" if r else ""

            lines.append(
                f"| {row['model']} | {ENGINE_LABELS[engine]} | {e['runs_ok']}"
                f"{' (' + str(e['runs_failed']) + ' failed)' if e['runs_failed'] else ''} "
                f"| {fmt(e['decode_tps_greedy'])}{rng('decode_tps_greedy_range')} "
                f"| {fmt(e['decode_tps_sampled'])}{rng('decode_tps_sampled_range')} "
                f"| {fmt(e['prefill_tps'])}{rng('prefill_tps_range')} | {fmt(e['ttft_ms'])} "
                f"| {fmt(e['peak_rss_mib'], 0)} | {fmt(e['load_s'], 2)} |"
            )
    return "\n".join(lines) + "\n"


def load_average() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def environment() -> dict:
    env: dict = {
        "load_average_end": load_average(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus_online": os.cpu_count(),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                env["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        env["mem_total_gib"] = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        env["colibri_commit"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        env["llama_cpp_python"] = version("llama_cpp_python")
    with contextlib.suppress(Exception):
        from colibri_backend import _native

        env["colibri_cpu_backend"] = _native.cpu_backend()
    return env


# ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument(
        "--model",
        action="append",
        default=None,
        help="smollm2, default, bench-a, bench-b or a GGUF path (repeatable; "
        "default: smollm2, bench-a, bench-b)",
    )
    ap.add_argument("--engines", default="colibri,llama_cpp", help="comma-separated: colibri, llama_cpp")
    ap.add_argument("--runs", type=int, default=3, help="runs per engine, model and sampling mode")
    ap.add_argument("--sampling", choices=["greedy", "sampled", "both"], default="both")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument(
        "--batch-size", type=int, default=0, help="prompt tokens per evaluation, both engines (0: ctx)"
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--cache-dir",
        type=Path,
        default=DEFAULT_CACHE_DIR,
        help="where make_bench_models.py wrote the bench models",
    )
    ap.add_argument("--bench-type", default="q8_0", help="tensor type of the bench-A/B files (default q8_0)")
    ap.add_argument(
        "--memory-cap",
        type=parse_size,
        default=None,
        help="run each child in a cgroup with this memory limit, the model made cold first (root)",
    )
    ap.add_argument(
        "--cold-start",
        choices=["evict", "drop-caches"],
        default="evict",
        help="how a capped run starts cold: evict the model file and its sidecars from the page cache "
        "(default; leaves other processes' pages alone) or drop the whole page cache (quiet machine only)",
    )
    ap.add_argument("--cgroup-version", choices=["auto", "v1", "v2"], default="auto")
    ap.add_argument("--no-prewarm", action="store_true", help="do not read each model once before its runs")
    ap.add_argument("--nice", type=int, default=0, help="run children under nice -n N")
    ap.add_argument(
        "--llama-extra-bufts",
        choices=["auto", "on", "off"],
        default="auto",
        help="llama.cpp's AMX/REPACK weight buffers (auto: on, unless llama.cpp has AMX compiled in and "
        "the CPU has AMX, where its AMX buffers crash)",
    )
    ap.add_argument(
        "--omp-wait-policy",
        choices=["active", "passive"],
        default=None,
        help="OMP_WAIT_POLICY for the children (llama.cpp uses OpenMP); default: unset",
    )
    ap.add_argument(
        "--routing-trace",
        type=Path,
        default=None,
        help="Colibri only: impose this routing trace (colibri_backend.trace) on the model, e.g. bench-r, "
        "which has the trace model's layer and expert counts; llama.cpp cannot follow one",
    )
    ap.add_argument("--prefetch", default=None, help="Colibri's expert predictors (default: the engine's)")
    ap.add_argument(
        "--colibri-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Colibri: a further load option (LoadOptions field), e.g. expert_mass=0.8 or lowbit_experts=0.2 "
        "(the lossy options, docs/memory.md); repeatable",
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before a run is killed")
    ap.add_argument("--json", type=Path, default=None, help="write every run and the summary here")
    ap.add_argument("--markdown", action="store_true", help="print the summary as Markdown tables")
    args = ap.parse_args(argv)

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINE_LABELS:
            ap.error(f"unknown engine {e!r}; choose from {', '.join(ENGINE_LABELS)}")
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if args.routing_trace and "llama_cpp" in engines:
        ap.error("--routing-trace: llama.cpp cannot follow a routing trace; use --engines colibri")
    if args.routing_trace and not args.routing_trace.is_file():
        ap.error(f"--routing-trace: no file {args.routing_trace}")
    samplings = list(SAMPLING_MODES) if args.sampling == "both" else [args.sampling]
    models = [
        resolve_model(m, args.cache_dir, args.bench_type)
        for m in (args.model or ["smollm2", "bench-a", "bench-b"])
    ]
    prompts = {str(path): prompt_ids(path, args.prompt_tokens) for _, path in models}
    bans = {str(path): banned_ids(path) for _, path in models}

    load_start = load_average()
    results: list[dict] = []
    warmed: set[Path] = set()
    requests = list(schedule(models, engines, samplings, args.runs))
    for i, req in enumerate(requests):
        if not args.memory_cap and not args.no_prewarm and req.model_path not in warmed:
            prewarm_page_cache(req.model_path)
            warmed.add(req.model_path)
        r = run_worker(req, args, prompts[str(req.model_path)], bans[str(req.model_path)], i)
        results.append(r)
        if r.get("ok"):
            print(
                f"[{i + 1}/{len(requests)}] {req.model_label} {req.engine:9s} {req.sampling:7s} "
                f"decode {r['decode_tps']:.1f} tok/s, prefill {r['prefill_tps']:.1f} tok/s, "
                f"TTFT {r['ttft_s'] * 1000:.0f} ms, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB",
                file=sys.stderr,
            )
        else:
            print(
                f"[{i + 1}/{len(requests)}] {req.model_label} {req.engine} {req.sampling}: FAILED: "
                f"{r.get('error')}",
                file=sys.stderr,
            )

    rows = summarize(results, engines)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "environment": {**environment(), "load_average_start": load_start},
                    "protocol": {
                        "prompt_tokens": args.prompt_tokens,
                        "max_tokens": args.max_tokens,
                        "threads": args.threads,
                        "ctx": args.ctx,
                        "batch_size": args.batch_size or args.ctx,
                        "runs": args.runs,
                        "samplings": samplings,
                        "sampled_temperature": SAMPLING_MODES["sampled"],
                        "seed": args.seed,
                        "memory_cap_bytes": args.memory_cap,
                        "cold_start": args.cold_start if args.memory_cap else None,
                        "prompt_text": PROMPT_TEXT,
                        "llama_extra_bufts": args.llama_extra_bufts,
                        "omp_wait_policy": args.omp_wait_policy,
                        "prompt_ids": prompts,
                        "banned_ids": bans,
                        "argv": sys.argv,
                    },
                    "summary": rows,
                    "runs": results,
                },
                indent=1,
            )
            + "\n"
        )
    if args.markdown:
        print(markdown(rows, engines))
    else:
        print(json.dumps(rows, indent=1))
    failed = sum(1 for r in results if not r.get("ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
