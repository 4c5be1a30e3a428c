"""One benchmark run in a fresh process: load a model, prefill a prompt, generate tokens, report JSON.

Started by benchmarks/bench.py once per run; not meant to be called by hand (but it can be, for debugging):

    python benchmarks/_worker.py --engine colibri --model M.gguf --prompt-ids 1,2,3 --max-tokens 128

Both engines are timed the same way, from this process, around a token generator that takes token ids:
  * TTFT        = from the call that starts generation to the first generated token (prompt eval + 1 sample);
  * prefill     = n_prompt / TTFT (tok/s);
  * decode      = (n_generated - 1) / (time of the last token - time of the first token) (tok/s):
                  each of those steps evaluates one token and samples the next;
  * peak RSS    = VmHWM of this process at the end (the parent also records ru_maxrss from wait4).
The engines' own counters (Colibri's Model.stats(), llama.cpp's perf context) are reported beside them.

End-of-sequence and end-of-turn tokens (--ban-ids, chosen by the parent from the GGUF metadata) are
banned through a logit bias in both engines, so every run generates exactly --max-tokens tokens and greedy
runs of the two engines can be compared token by token. Colibri also stops on its tokenizer's stop
tokens; any of those missing from --ban-ids are banned too (and reported), since a stop would end the run
early.

The result is the last line of stdout, prefixed with RESULT_PREFIX, so stray library output cannot corrupt it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Iterator

RESULT_PREFIX = "COLIBRI_BENCH_RESULT "


def read_status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (e.g. VmHWM, VmRSS) in bytes, or None where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int:
    hwm = read_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    # ru_maxrss is KiB on Linux, bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def major_faults() -> int:
    """Major page faults of this process so far (a page read from storage when it was touched)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_majflt)


FAULTS: list[int] = []  # major faults at the start of generation, then at each token's arrival


def time_generation(tokens: Iterator[int], max_tokens: int) -> tuple[list[int], list[float], float]:
    """Pull max_tokens tokens from a started generator; return ids, arrival times and the start time.
    The process's major page faults at the start and at each arrival go to FAULTS."""
    ids: list[int] = []
    times: list[float] = []
    FAULTS[:] = [major_faults()]
    t0 = time.perf_counter()
    for tok in tokens:
        times.append(time.perf_counter())
        FAULTS.append(major_faults())
        ids.append(int(tok))
        if len(ids) >= max_tokens:
            break
    return ids, times, t0


# ---------------------------------------------------------------------------------------------------------
# engines: each returns a dict with the generated ids, their arrival times, the start time, the load time,
# the RSS after loading, the engine's own counters and the banned token ids


def load_option(text: str) -> tuple[str, object]:
    """KEY=VALUE (--load-option): the value as JSON where it parses (0.8, true), else as text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--load-option {text!r}: expected KEY=VALUE")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def run_colibri(args: argparse.Namespace, prompt: list[int]) -> dict:
    import colibri_backend
    from colibri_backend import _native
    from colibri_backend.adapters.sampling import SamplingParams

    rss_before_load = read_status_bytes("VmRSS")
    faults_before_load = major_faults()
    t_load = time.perf_counter()
    options = {"prefetch": args.prefetch} if args.prefetch else {}
    options.update(load_option(text) for text in args.load_option)
    model = colibri_backend.load(
        args.model,
        threads=args.threads,
        context_length=args.ctx,
        batch_size=args.batch_size or args.ctx,
        **options,
    )
    load_s = time.perf_counter() - t_load
    load_faults = major_faults() - faults_before_load
    if args.routing_trace:  # benchmarks only: a trained model's routing on this (random-weight) file
        from colibri_backend.trace import impose_trace, load_trace

        impose_trace(model, load_trace(args.routing_trace))
    rss_loaded = read_status_bytes("VmRSS")

    banned = sorted(set(args.ban_ids) | set(model.tokenizer.stop_token_ids))
    sampling = SamplingParams(
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        seed=args.seed,
        logit_bias={t: -math.inf for t in banned},
    )
    events = model.generate_tokens(
        prompt, max_tokens=args.max_tokens, sampling=sampling, stop=None, logprobs=None
    )
    at_first: dict = {}  # the counters once the prompt is in: the decode steps' own are the difference

    def token_ids() -> Iterator[int]:
        for i, ev in enumerate(events):
            if i == 0:
                at_first.update(model.stats())
            yield ev.token_id

    ids, times, t0 = time_generation(token_ids(), args.max_tokens)
    events.close()  # releases the sampler; the clock has stopped
    stats = dict(model.stats())
    model.close()
    return {
        "ids": ids,
        "times": times,
        "t0": t0,
        "load_s": load_s,
        "rss_loaded": rss_loaded,
        "rss_before_load": rss_before_load,
        "engine_stats": jsonable(stats),
        "engine_stats_at_first_token": jsonable(
            {k: v for k, v in at_first.items() if isinstance(v, (int, float))}
        ),
        "banned": banned,
        "backend": _native.cpu_backend(),
        "load_major_faults": load_faults,
    }


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "amx_int8" in line.split() for line in f)
    except OSError:
        return False


def built_with_amx(system_info: str) -> bool:
    """Whether llama.cpp's system info line ("AVX512 = 1 | ... | REPACK = 1 |") lists an AMX feature."""
    features = (field.partition("=") for field in system_info.split("|"))
    return any(name.strip().startswith("AMX") and value.strip() == "1" for name, _, value in features)


def extra_bufts_default(llama_cpp) -> bool:
    """`--llama-extra-bufts auto`: llama.cpp's default buffer types (REPACK included) unless its AMX buffer
    type can be chosen, which needs both an AMX CPU and a build with AMX compiled in. The README's build
    (tools/llama_cpp_cmake_args.py) compiles AMX out, so REPACK stays on even on an AMX Xeon."""
    return not (
        cpu_has_amx() and built_with_amx(llama_cpp.llama_print_system_info().decode(errors="replace"))
    )


def llama_cpp_plain_buffers(llama_cpp) -> None:
    """Make llama-cpp-python load weights into plain CPU buffers (use_extra_bufts = false).

    On CPUs with AMX, a llama.cpp 0.3.36 (ggml 0.25.3) built with AMX places quantized weights in its AMX
    buffer type and segfaults in ggml_backend_amx_mul_mat on the first evaluation (seen on this machine's
    Xeon under Firecracker). The Llama class has no parameter for it, so the default model parameters are
    wrapped.
    This also turns off the REPACK buffers (interleaved Q4_0/Q8_0 layouts), so llama.cpp runs its
    standard AVX-512 dot-product kernels.
    """
    low = llama_cpp.llama_cpp
    if getattr(low.llama_model_default_params, "_colibri_plain", False):
        return
    original = low.llama_model_default_params

    def params():
        p = original()
        p.use_extra_bufts = False
        return p

    params._colibri_plain = True
    low.llama_model_default_params = params


def run_llama_cpp(args: argparse.Namespace, prompt: list[int]) -> dict:
    import llama_cpp
    import numpy as np

    if args.routing_trace or args.prefetch:
        raise ValueError("--routing-trace and --prefetch are Colibri options; llama.cpp has neither")
    extra_bufts = args.llama_extra_bufts == "on" or (
        args.llama_extra_bufts == "auto" and extra_bufts_default(llama_cpp)
    )
    if not extra_bufts:
        llama_cpp_plain_buffers(llama_cpp)
    faults_before_load = major_faults()
    t_load = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=args.model,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=args.ctx,
        n_batch=args.batch_size or args.ctx,
        seed=args.seed,
        verbose=False,
    )
    load_s = time.perf_counter() - t_load
    rss_loaded = read_status_bytes("VmRSS")

    banned = sorted(set(args.ban_ids))
    mask = np.zeros(llm.n_vocab(), dtype=np.float32)
    mask[banned] = -np.inf

    def ban_eos(_input_ids, scores):
        return scores + mask

    # top_k <= 0, top_p = 1 and min_p = 0 switch those samplers off: plain temperature sampling (or greedy).
    gen = llm.generate(
        prompt,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        typical_p=1.0,
        temp=args.temperature,
        repeat_penalty=1.0,
        reset=True,
        logits_processor=llama_cpp.LogitsProcessorList([ban_eos]),
    )
    ids, times, t0 = time_generation(gen, args.max_tokens)
    gen.close()
    counters = {}
    try:
        perf = llama_cpp.llama_perf_context(llm.ctx)
        counters = {
            "t_p_eval_ms": perf.t_p_eval_ms,
            "n_p_eval": perf.n_p_eval,
            "t_eval_ms": perf.t_eval_ms,
            "n_eval": perf.n_eval,
            "t_load_ms": perf.t_load_ms,
        }
    except (AttributeError, TypeError):  # older/newer bindings without the perf API
        pass
    llm.close()
    return {
        "ids": ids,
        "times": times,
        "t0": t0,
        "load_s": load_s,
        "rss_loaded": rss_loaded,
        "engine_stats": {**counters, "extra_bufts": extra_bufts},
        "banned": banned,
        "backend": llama_cpp.__version__,
        "load_major_faults": major_faults() - faults_before_load,
    }


def jsonable(value):
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


ENGINES = {"colibri": run_colibri, "llama_cpp": run_llama_cpp}


def summarize(engine: str, args: argparse.Namespace, prompt: list[int], raw: dict) -> dict:
    ids, times, t0 = raw["ids"], raw["times"], raw["t0"]
    if not ids:
        raise RuntimeError("the engine generated no tokens")
    ttft = times[0] - t0
    decode_s = times[-1] - times[0]
    # FAULTS[0] at the start, FAULTS[i + 1] when token i arrived: prefill = up to the first token, the
    # first decoded tokens (a cold start faulting weights in) apart from the rest
    faults = FAULTS if len(FAULTS) == len(ids) + 1 else None
    n_early = min(8, len(ids) - 1)
    return {
        "ok": True,
        "engine": engine,
        "model": args.model,
        "threads": args.threads,
        "temperature": args.temperature,
        "seed": args.seed,
        "n_prompt": len(prompt),
        "n_generated": len(ids),
        "load_s": raw["load_s"],
        "ttft_s": ttft,
        "prefill_tps": len(prompt) / ttft if ttft > 0 else None,
        "decode_s": decode_s,
        "decode_tps": (len(ids) - 1) / decode_s if len(ids) > 1 and decode_s > 0 else None,
        "rss_after_load_bytes": raw["rss_loaded"],
        "rss_before_load_bytes": raw.get("rss_before_load"),
        "peak_rss_bytes": peak_rss_bytes(),
        "banned_tokens": raw["banned"],
        "generated_ids": ids,
        "engine_backend": raw["backend"],
        "major_faults_load": raw.get("load_major_faults"),
        "major_faults_prefill": faults[1] - faults[0] if faults else None,
        "major_faults_per_decode_token": (faults[-1] - faults[1]) / (len(ids) - 1)
        if faults and len(ids) > 1
        else None,
        "major_faults_first_decode_tokens": faults[1 + n_early] - faults[1] if faults else None,
        "routing_trace": args.routing_trace,
        "prefetch": args.prefetch,
        "engine_stats": raw["engine_stats"],
        "engine_stats_at_first_token": raw.get("engine_stats_at_first_token"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one benchmark run (started by benchmarks/bench.py)")
    ap.add_argument("--engine", required=True, choices=sorted(ENGINES))
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=0, help="prompt tokens per evaluation (0: the context)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--ban-ids", default="", help="comma-separated token ids never to generate")
    ap.add_argument(
        "--routing-trace", default=None, help="Colibri: follow this routing trace (benchmark-only override)"
    )
    ap.add_argument("--prefetch", default=None, help="Colibri: expert predictors (load option prefetch)")
    ap.add_argument(
        "--load-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Colibri: a further load option",
    )
    ap.add_argument(
        "--llama-extra-bufts",
        choices=["auto", "on", "off"],
        default="auto",
        help="llama.cpp extra (AMX/REPACK) weight buffers; auto: off on AMX CPUs (crash)",
    )
    args = ap.parse_args(argv)
    args.ban_ids = [int(t) for t in args.ban_ids.split(",") if t.strip()]

    prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    try:
        raw = ENGINES[args.engine](args, prompt)
        result = summarize(args.engine, args, prompt, raw)
    except Exception as exc:  # reported to the parent as a failed run rather than a bare traceback
        traceback.print_exc(file=sys.stderr)
        result = {
            "ok": False,
            "engine": args.engine,
            "model": args.model,
            "error": f"{type(exc).__name__}: {exc}",
            "peak_rss_bytes": peak_rss_bytes(),
        }
    sys.stdout.flush()
    sys.stdout.write("\n" + RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 1)  # skip interpreter teardown: nothing after this is measured


if __name__ == "__main__":
    sys.exit(main())
