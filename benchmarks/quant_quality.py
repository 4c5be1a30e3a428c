"""Quantization quality: `colibri quantize` against llama.cpp's quantizer on the trained MoE.

For the bundled trained MoE (tools/train_moe/release, a Mixtral-architecture checkpoint) this script
  1. converts the checkpoint to an F32 GGUF (`colibri convert --type f32`), and rewrites it once with
     `colibri quantize --type f32` so its data is 32-byte aligned (a file llama.cpp's quantizer can
     re-align; see issue 9 item 4) — this one file is the source of every quantization below;
  2. computes an importance matrix on the *training* split (mean squared input activation of every
     weight matrix, per expert, collected with forward hooks on the transformers model) and writes it
     in llama.cpp's GGUF imatrix format (NAME.in_sum2 / NAME.counts);
  3. quantizes the source to each type with `colibri quantize` (the CLI) and with llama.cpp's
     `llama_model_quantize` (llama-cpp-python), each with and without the importance matrix;
  4. evaluates every file teacher-forced on windows of the *held-out* split and compares its token
     distributions with the F32 source's: mean and 99th-percentile KL divergence, perplexity, top-1
     agreement (llama-perplexity --kl-divergence conventions: KL(P_f32 || P_quant) per token).

Evaluation engine: `--engine llama_cpp` (default: llama.cpp computes every type in the table) or
`--engine colibri` (the engine's `Model.logits`). Both quantizers' files are always evaluated by the same
engine. The math lives in `kl_stats()` only.

`--engine tools` measures as a user would, with each project's command-line tools instead of the steps
above: `colibri imatrix` on the training split, `colibri quantize` against llama.cpp's `llama-quantize`,
every file scored by `colibri perplexity --kl-divergence` against the F32 source's base file, and
llama.cpp's files also by `llama-perplexity` (benchmarks/build_llama_bench.sh builds both llama.cpp tools):

    python benchmarks/quant_quality.py --out /tmp/qqv2 --engine tools --windows 32 --ctx 512 \
        --json benchmarks/results/session18/quant_quality_v2_tools.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RELEASE = ROOT / "tools" / "train_moe" / "release"
TYPES = ("q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_k_s", "q3_k_m", "q2_k", "iq4_xs", "q4_0", "mxfp4")
LLAMA_FTYPE = {
    "q8_0": 7,
    "q6_k": 18,
    "q5_k_m": 17,
    "q4_k_m": 15,
    "q4_k_s": 14,
    "q3_k_m": 12,
    "q2_k": 10,
    "iq4_xs": 30,
    "q4_0": 2,
    "mxfp4": 38,
}


# ---- the statistics (one place) ---------------------------------------------------------------


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def kl_stats(base_logp: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """KL(P_base || P_q) per token (mean, p99), perplexity of `logits` on `targets`, top-1 agreement."""
    lq = log_softmax(logits)
    kl = (np.exp(base_logp) * (base_logp - lq)).sum(axis=-1)
    nll = -lq[np.arange(len(targets)), targets]
    return {
        "kld_mean": float(kl.mean()),
        "kld_p99": float(np.percentile(kl, 99)),
        "ppl": float(np.exp(nll.mean())),
        "top1": float((base_logp.argmax(-1) == lq.argmax(-1)).mean()),
    }


# ---- evaluation engines ------------------------------------------------------------------------


def logits_llama_cpp(path: Path, windows: list[np.ndarray], threads: int) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=len(windows[0]), logits_all=True, n_threads=threads, verbose=False
    )
    out = []
    for w in windows:
        llm.reset()
        llm.eval(w.tolist())
        out.append(np.array(llm.scores[: len(w)], dtype=np.float32))
    llm.close()
    return np.concatenate(out)


def logits_colibri(path: Path, windows: list[np.ndarray], threads: int) -> np.ndarray:
    import colibri_backend

    model = colibri_backend.load(str(path), threads=threads, context_length=len(windows[0]))
    try:
        return np.concatenate([model.logits(w.tolist()) for w in windows])
    finally:
        model.close()


ENGINES = {"llama_cpp": logits_llama_cpp, "colibri": logits_colibri}


# ---- data, importance matrix -------------------------------------------------------------------


def corpus(n_windows: int, ctx: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """(training tokens, held-out windows of ctx tokens), split exactly as the model was trained."""
    sys.path.insert(0, str(ROOT / "tools" / "train_moe"))
    from analyze import corpus_split_tokens
    from prepare import DEFAULT_STDLIB
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(RELEASE / "tokenizer.json"))
    train, held = corpus_split_tokens(tok, Path(DEFAULT_STDLIB), 5)
    step = max(ctx, (len(held) - ctx) // n_windows)
    windows = [held[i * step : i * step + ctx] for i in range(n_windows)]
    return train, [w for w in windows if len(w) == ctx]


def compute_imatrix(train: np.ndarray, n_chunks: int, ctx: int) -> tuple[dict, dict, dict]:
    """Mean squared input activation per column of every weight matrix (per expert for the experts)."""
    import torch
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(str(RELEASE), dtype=torch.float32).eval()
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}

    def acc(name: str, x: torch.Tensor, n_mat: int = 1, mat: int = 0) -> None:
        x = x.reshape(-1, x.shape[-1]).double()
        if name not in sums:
            sums[name] = torch.zeros(n_mat, x.shape[-1], dtype=torch.float64)
            counts[name] = torch.zeros(n_mat, dtype=torch.float64)
        sums[name][mat] += (x * x).sum(0)
        counts[name][mat] += x.shape[0]

    hooks = []
    for i, layer in enumerate(model.model.layers):
        att = layer.self_attn
        for proj, gname in (
            ("q_proj", "attn_q"),
            ("k_proj", "attn_k"),
            ("v_proj", "attn_v"),
            ("o_proj", "attn_output"),
        ):
            hooks.append(
                getattr(att, proj).register_forward_pre_hook(
                    lambda m, a, n=f"blk.{i}.{gname}.weight": acc(n, a[0])
                )
            )
        experts = layer.mlp.experts

        def exp_hook(m, args, i=i):  # noqa: ANN001, ANN202
            h, idx, _w = args
            for e in range(m.num_experts):
                rows = (idx == e).any(-1).nonzero().flatten()
                if rows.numel() == 0:
                    continue
                x = h[rows]
                gate, up = torch.nn.functional.linear(x, m.gate_up_proj[e]).chunk(2, dim=-1)
                acc(f"blk.{i}.ffn_gate_exps.weight", x, m.num_experts, e)
                acc(f"blk.{i}.ffn_up_exps.weight", x, m.num_experts, e)
                acc(f"blk.{i}.ffn_down_exps.weight", m.act_fn(gate) * up, m.num_experts, e)

        hooks.append(experts.register_forward_pre_hook(exp_hook))
    hooks.append(model.lm_head.register_forward_pre_hook(lambda m, a: acc("output.weight", a[0])))
    with torch.no_grad():
        for c in range(n_chunks):
            ids = torch.tensor(train[c * ctx : (c + 1) * ctx], dtype=torch.long)[None]
            model(ids)
    for h in hooks:
        h.remove()
    imat = {}
    for name, s in sums.items():
        c = counts[name].clamp(min=1)[:, None]
        imat[name] = (s / c).float().numpy().reshape(-1)
    return imat, sums, counts


def write_gguf_imatrix(path: Path, sums: dict, counts: dict, n_chunks: int, ctx: int) -> None:
    """llama.cpp's GGUF imatrix layout: NAME.in_sum2 [n_mat, ne0] and NAME.counts [n_mat, 1], F32."""
    import gguf

    w = gguf.GGUFWriter(path, arch="imatrix")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["cpython-stdlib-train"])
    w.add_uint32("imatrix.chunk_count", n_chunks)
    w.add_uint32("imatrix.chunk_size", ctx)
    for name in sorted(sums):
        w.add_tensor(f"{name}.in_sum2", sums[name].float().numpy())
        w.add_tensor(f"{name}.counts", counts[name].float().numpy().reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- quantizers --------------------------------------------------------------------------------


def quantize_colibri(src: Path, dst: Path, qtype: str, imatrix: Path | None, threads: int) -> None:
    cmd = [sys.executable, "-m", "colibri_backend.cli", "quantize", str(src), str(dst), "--type", qtype]
    cmd += ["--threads", str(threads), "--no-progress"]
    if imatrix is not None:
        cmd += ["--imatrix", str(imatrix)]
    subprocess.run(cmd, check=True, capture_output=True)


def quantize_llama_cpp(
    src: Path, dst: Path, qtype: str, imat: dict[str, np.ndarray] | None, threads: int
) -> None:
    quantize_llama_cpp_ftype(src, dst, LLAMA_FTYPE[qtype], imat, threads)


def quantize_llama_cpp_ftype(
    src: Path, dst: Path, ftype: int, imat: dict[str, np.ndarray] | None, threads: int, pure: bool = False
) -> None:
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.pure = pure
    p.nthread = threads
    keep = []
    if imat:
        arr = (llama_cpp.llama_model_imatrix_data * (len(imat) + 1))()
        for i, (k, v) in enumerate(imat.items()):
            a = np.ascontiguousarray(v, dtype=np.float32)
            keep.append(a)
            arr[i].name = k.encode()
            arr[i].data = a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = a.size
        arr[len(imat)].name = None
        p.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        keep.append(arr)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize(ftype {ftype}) failed: {rc}")


def weight_error(path: Path, src: dict[str, np.ndarray], imat: dict[str, np.ndarray]) -> float:
    """The systematic part of the loss: sum over matrices of imp_j * (w_ij - q_ij)^2, relative to
    sum imp_j * w_ij^2 (the first-order output error for inputs with mean squares imp), over every
    tensor the importance matrix covers. KL divergence on a small model also carries the chance of
    how one realisation of rounding errors combines; this does not."""
    import gguf

    num = den = 0.0
    for t in gguf.GGUFReader(path).tensors:
        if t.name not in imat:
            continue
        x = src[t.name]
        y = gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(x.shape)
        im = imat[t.name].reshape(x.shape[0] if x.ndim == 3 else 1, 1, -1)
        xs, ys = x.reshape(im.shape[0], -1, x.shape[-1]), y.reshape(im.shape[0], -1, x.shape[-1])
        num += float((((ys - xs) ** 2) * im).sum())
        den += float(((xs**2) * im).sum())
    return num / den


PURE_FTYPE = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7, "Q2_K": 10, "Q3_K": 12, "Q4_K": 15}
PURE_FTYPE |= {"Q5_K": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "MXFP4": 38}


def per_type_errors(src: Path, imat: dict[str, np.ndarray], out: Path, threads: int) -> list[dict]:
    """Every block type alone (llama.cpp's `pure` mode; ours through colibri_quantize_row) on one real
    matrix, the layer-2 experts' ffn_down (v1: 8 x 128 rows of 512; v2: 32 x 128 rows of 256): relative
    error, plain and weighted by the importance matrix, ours and llama.cpp's."""
    import gguf

    from colibri_backend import _native

    name = "blk.2.ffn_down_exps.weight"
    x = {t.name: np.array(t.data, dtype=np.float32) for t in gguf.GGUFReader(src).tensors}[name]
    n_exp, n_rows, n_cols = x.shape
    imp = imat[name].reshape(n_exp, 1, n_cols)
    one = out / "one-matrix.gguf"
    w = gguf.GGUFWriter(one, "llama")
    for k, v in (("block_count", 1), ("context_length", 64), ("embedding_length", n_rows)):
        w.add_uint32(f"llama.{k}", v)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_feed_forward_length(n_cols)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_rows // 4)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(2)
    w.add_tensor("blk.0.ffn_down_exps.weight", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    lib = _native.load_library()

    def rel(y: np.ndarray, wt: np.ndarray | float) -> float:
        return float((((y - x) ** 2) * wt).sum() / ((x**2) * wt).sum())

    rows = []
    for tname, ft in PURE_FTYPE.items():
        qt = gguf.GGMLQuantizationType[tname]
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        r: dict[str, object] = {"type": tname}
        for with_imat in (False, True):
            flat = {"blk.0.ffn_down_exps.weight": imp.reshape(-1)} if with_imat else None
            dst = out / "one-matrix-q.gguf"
            quantize_llama_cpp_ftype(one, dst, ft, flat, threads, pure=True)
            t = gguf.GGUFReader(dst).tensors[0]
            theirs = gguf.quants.dequantize(np.array(t.data), t.tensor_type).reshape(x.shape)
            ours = np.empty_like(x)
            for e in range(n_exp):
                buf = np.zeros(n_rows * n_cols // bs * ts, dtype=np.uint8)
                im = imp[e, 0] if with_imat else None
                st = lib.colibri_quantize_row(
                    int(qt),
                    _native.f32_ptr(np.ascontiguousarray(x[e])),
                    n_rows,
                    n_cols,
                    None if im is None else _native.f32_ptr(np.ascontiguousarray(im)),
                    buf.ctypes.data,
                    buf.nbytes,
                )
                lib.check(st, "quantize_row")
                ours[e] = gguf.quants.dequantize(buf.reshape(x.shape[1], -1), qt)
            wt = imp if with_imat else 1.0
            r["imatrix" if with_imat else "plain"] = {"ours": rel(ours, wt), "llama_cpp": rel(theirs, wt)}
        rows.append(r)
    return rows


def bits_per_weight(path: Path) -> tuple[int, float]:
    import gguf

    r = gguf.GGUFReader(path)
    nbytes = sum(int(t.n_bytes) for t in r.tensors)
    n = sum(int(t.n_elements) for t in r.tensors)
    return path.stat().st_size, 8.0 * nbytes / n


def markdown_table(result: dict) -> str:
    """The tables of docs/quantization.md from a --json result."""
    lines: list[str] = []
    if "per_type" in result:
        lines += [
            "| block type | error ours | error llama.cpp | ratio | imatrix-weighted ours | llama.cpp "
            "| ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in result["per_type"]:
            p, i = r["plain"], r["imatrix"]
            lines.append(
                f"| {r['type']} | {p['ours']:.3e} | {p['llama_cpp']:.3e} | "
                f"{p['ours'] / p['llama_cpp']:.3f} | "
                f"{i['ours']:.3e} | {i['llama_cpp']:.3e} | {i['ours'] / i['llama_cpp']:.3f} |"
            )
    if "rows" not in result:
        return "\n".join(lines)
    src = result["source"]
    own = any("llama_perplexity" in r["llama_cpp"] for r in result["rows"])
    scorer = "`colibri perplexity`" if result["engine"] == "tools" else result["engine"]
    lines += [
        f"F32 source: perplexity {src['ppl']:.3f} on {result['tokens']} held-out tokens "
        f"(scored by {scorer}).",
        "",
        "| type | imatrix | size MiB | bpw | KLD mean ours | KLD mean llama.cpp | ratio | KLD p99 ours | "
        "KLD p99 llama.cpp | PPL ours | PPL llama.cpp | weight error ours | weight error llama.cpp |"
        + (" llama-perplexity on llama.cpp's file: KLD mean, p99, PPL |" if own else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if own else ""),
    ]
    for r in result["rows"]:
        c, ll = r["colibri"], r["llama_cpp"]
        line = (
            f"| {r['type']} | {'yes' if r['imatrix'] else 'no'} | "
            f"{c['bytes'] / 2**20:.2f} | {c['bpw']:.3f} | "
            f"{c['kld_mean']:.5f} | {ll['kld_mean']:.5f} | {c['kld_mean'] / ll['kld_mean']:.2f} | "
            f"{c['kld_p99']:.4f} | {ll['kld_p99']:.4f} | {c['ppl']:.3f} | {ll['ppl']:.3f} | "
            f"{c['weight_error']:.2e} | {ll['weight_error']:.2e} |"
        )
        if own:
            lp = ll["llama_perplexity"]
            line += f" {lp['kld_mean']:.5f}, {lp['kld_p99']:.4f}, {lp['ppl']:.3f} |"
        lines.append(line)
    return "\n".join(lines)


# ---- the command-line tools: colibri's against llama.cpp's -------------------------------------
# `--engine tools` measures the way a user would: importance matrix from `colibri imatrix`, files from
# `colibri quantize` and from llama.cpp's `llama-quantize` (benchmarks/build_llama_bench.sh), every file
# scored by `colibri perplexity --kl-divergence` against the F32 source's base file, and llama.cpp's files
# also by `llama-perplexity --kl-divergence` (llama.cpp's numbers for its own files).

LLAMA_QUANT_NAME = {t: t.upper() for t in TYPES} | {"mxfp4": "MXFP4_MOE"}  # llama-quantize's names


def corpus_texts(out: Path) -> tuple[Path, Path]:
    """The training and held-out splits of the trained MoE's corpus as text files (split as trained)."""
    sys.path.insert(0, str(ROOT / "tools" / "train_moe"))
    from prepare import DEFAULT_STDLIB, is_heldout, list_corpus, read_text

    paths = (out / "train.txt", out / "heldout.txt")
    if all(p.exists() for p in paths):
        return paths
    stdlib = Path(DEFAULT_STDLIB)
    for held, path in zip((False, True), paths, strict=True):
        names = [f for f in list_corpus(stdlib) if is_heldout(f, 5) == held]
        path.write_text("\n".join(read_text(stdlib / f) for f in names), encoding="utf-8")
    return paths


def llama_bin(name: str) -> Path:
    import os

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "colibri" / "llama.cpp-0.3.36"
    path = cache / "bin" / name
    if not path.exists():
        raise SystemExit(f"{path} is missing: run benchmarks/build_llama_bench.sh first")
    return path


def colibri_perplexity(args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "colibri_backend.cli", "perplexity", *args, "--json", "--quiet"]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


LLAMA_PPL_LINES = {
    "ppl": r"Mean PPL\(Q\)\s*:\s*([0-9.eE+-]+)",
    "kld_mean": r"Mean\s+KLD:\s*([0-9.eE+-]+)",
    "kld_p99": r"99\.0%\s+KLD:\s*([0-9.eE+-]+)",
    "same_top": r"Same top p:\s*([0-9.eE+-]+)",
}


def llama_perplexity(model: Path, base: Path, threads: int, text: Path | None = None, ctx: int = 0,
                     chunks: int = 0) -> dict[str, float]:  # fmt: skip
    """llama-perplexity's --kl-divergence-base run (with text) or --kl-divergence run (without), parsed."""
    import re

    cmd = [
        str(llama_bin("llama-perplexity")),
        "-m",
        str(model),
        "-t",
        str(threads),
        "--kl-divergence-base",
        str(base),
    ]
    if text is not None:
        cmd += ["-f", str(text), "-c", str(ctx), "--chunks", str(chunks)]
    else:
        cmd += ["--kl-divergence"]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    if text is not None:
        return {}
    log = done.stdout + done.stderr
    stats = {}
    for key, pattern in LLAMA_PPL_LINES.items():
        found = re.search(pattern, log)
        if not found:
            raise RuntimeError(f"llama-perplexity printed no {key!r}:\n{log[-2000:]}")
        stats[key] = float(found.group(1))
    stats["same_top"] /= 100.0
    return stats


def tools_comparison(args: argparse.Namespace, src: Path, out: Path) -> dict:
    """Every type with and without the imatrix, both quantizers, scored by both perplexity tools."""
    from colibri_backend.quantize import read_imatrix

    cli = [sys.executable, "-m", "colibri_backend.cli"]
    train, held = corpus_texts(out)
    imat_path = out / "moe.imatrix.gguf"
    if not (args.reuse and imat_path.exists()):
        subprocess.run(
            cli + ["imatrix", str(src), str(train), "-o", str(imat_path), "--ctx", str(args.ctx),
                   "--chunks", str(args.imatrix_chunks), "--threads", str(args.threads), "--quiet"],
            check=True,
        )  # fmt: skip
    imat = read_imatrix(imat_path)
    import gguf

    src_w = {
        t.name: np.array(t.data, dtype=np.float32) for t in gguf.GGUFReader(src).tensors if t.name in imat
    }
    base, lbase = out / "f32.kld", out / "f32.llama.kld"
    window = ["--ctx", str(args.ctx), "--chunks", str(args.windows), "--threads", str(args.threads)]
    if not (args.reuse and base.exists()):
        colibri_perplexity([str(src), str(held), *window, "--kl-divergence-base", str(base)])
    if not (args.reuse and lbase.exists()):
        llama_perplexity(src, lbase, args.threads, held, args.ctx, args.windows)
    source = colibri_perplexity([str(src), "--kl-divergence", str(base), "--threads", str(args.threads)])
    rows = []
    for qtype in args.types.split(","):
        for with_imat in [m == "yes" for m in ("no", "yes") if m in args.imatrix_modes.split(",")]:
            row: dict[str, object] = {"type": qtype, "imatrix": with_imat}
            for who in ("colibri", "llama_cpp"):
                dst = out / f"moe-{qtype}-{who}{'-imat' if with_imat else ''}.gguf"
                secs = None
                if not (args.reuse and dst.exists()):
                    t0 = time.perf_counter()
                    if who == "colibri":
                        quantize_colibri(src, dst, qtype, imat_path if with_imat else None, args.threads)
                    else:
                        cmd = [str(llama_bin("llama-quantize"))]
                        cmd += ["--imatrix", str(imat_path)] if with_imat else []
                        cmd += [str(src), str(dst), LLAMA_QUANT_NAME[qtype], str(args.threads)]
                        subprocess.run(cmd, check=True, capture_output=True)
                    secs = time.perf_counter() - t0
                size, bpw = bits_per_weight(dst)
                kl = colibri_perplexity(
                    [str(dst), "--kl-divergence", str(base), "--threads", str(args.threads)]
                )
                k = kl["kl_divergence"]
                cell = {
                    "bytes": size,
                    "bpw": bpw,
                    "seconds": secs,
                    "weight_error": weight_error(dst, src_w, imat),
                    "kld_mean": k["kld_mean"],
                    "kld_p99": k["kld_percentiles"]["99"],
                    "ppl": k["ppl"],
                    "top1": k["same_top"],
                }
                if who == "llama_cpp":
                    cell["llama_perplexity"] = llama_perplexity(dst, lbase, args.threads)
                row[who] = cell
            rows.append(row)
            c, ll = row["colibri"], row["llama_cpp"]
            print(
                f"{qtype:7s} imat={int(with_imat)} KLD {c['kld_mean']:.5f} vs {ll['kld_mean']:.5f} "
                f"({c['kld_mean'] / ll['kld_mean']:.3f}x; "
                f"llama-perplexity {ll['llama_perplexity']['kld_mean']:.5f})"
                f"  p99 {c['kld_p99']:.4f} vs {ll['kld_p99']:.4f}  ppl {c['ppl']:.3f} vs {ll['ppl']:.3f}",
                flush=True,
            )
    k = source["kl_divergence"]
    return {
        "engine": "tools",
        "windows": args.windows,
        "ctx": args.ctx,
        "tokens": k["n_tokens"],
        "source": {"ppl": k["ppl_base"], "ppl_error": k["ppl_base_error"]},
        "rows": rows,
    }


# ---- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="work directory for the GGUF files")
    ap.add_argument(
        "--table",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="print the table of --json results (later rows win)",
    )
    ap.add_argument(
        "--imatrix-modes", default="no,yes", help="quantize without (no) and/or with (yes) the imatrix"
    )
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument(
        "--engine",
        choices=sorted(ENGINES) + ["tools"],
        default="llama_cpp",
        help="who scores the files: llama_cpp or colibri through their Python APIs, or tools: each "
        "project's command-line tools (imatrix, quantize, perplexity)",
    )
    ap.add_argument("--windows", type=int, default=16, help="held-out windows of --ctx tokens")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--imatrix-chunks", type=int, default=64, help="training windows for the imatrix")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--reuse", action="store_true", help="keep the files (and imatrix) already in --out")
    ap.add_argument("--per-type-only", action="store_true", help="only the one-matrix comparison per type")
    args = ap.parse_args(argv)
    if args.table:
        merged: dict = {}
        rows: dict[tuple[str, bool], dict] = {}
        for path in args.table:
            part = json.loads(path.read_text())
            rows |= {(r["type"], r["imatrix"]): r for r in part.pop("rows", [])}
            merged |= part
        if rows:
            merged["rows"] = list(rows.values())
        print(markdown_table(merged))
        return 0
    if args.out is None:
        ap.error("--out is required")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    raw, src = out / "moe-f32-conv.gguf", out / "moe-f32.gguf"
    cli = [sys.executable, "-m", "colibri_backend.cli"]
    if not src.exists():
        subprocess.run(
            cli + ["convert", str(RELEASE), "-o", str(raw), "--type", "f32", "--no-progress"], check=True
        )
        subprocess.run(cli + ["quantize", str(raw), str(src), "--type", "f32", "--no-progress"], check=True)
        raw.unlink()

    if args.engine == "tools":
        from colibri_backend.quantize import read_imatrix

        result = tools_comparison(args, src, out)
        result["per_type"] = per_type_errors(src, read_imatrix(out / "moe.imatrix.gguf"), out, args.threads)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(markdown_table(result))
        return 0
    evaluate = ENGINES[args.engine]
    train, windows = corpus(args.windows, args.ctx)
    targets = np.concatenate([np.append(w[1:], -1) for w in windows])
    keep_rows = targets >= 0
    imat_path = out / "moe.imatrix.gguf"
    if args.reuse and imat_path.exists():
        from colibri_backend.quantize import read_imatrix

        imat = read_imatrix(imat_path)
    else:
        imat, sums, counts = compute_imatrix(train, args.imatrix_chunks, args.ctx)
        write_gguf_imatrix(imat_path, sums, counts, args.imatrix_chunks, args.ctx)
    per_type = per_type_errors(src, imat, out, args.threads)
    for r in per_type:
        p, i = r["plain"], r["imatrix"]
        print(
            f"{r['type']:7s} one matrix: plain {p['ours']:.3e} vs {p['llama_cpp']:.3e} "
            f"({p['ours'] / p['llama_cpp']:.3f}x)  imatrix-weighted {i['ours']:.3e} vs {i['llama_cpp']:.3e} "
            f"({i['ours'] / i['llama_cpp']:.3f}x)",
            flush=True,
        )
    if args.per_type_only:
        if args.json:
            args.json.write_text(json.dumps({"per_type": per_type}, indent=1) + "\n")
        return 0

    import gguf

    src_tensors = gguf.GGUFReader(src).tensors
    src_w = {t.name: np.array(t.data, dtype=np.float32) for t in src_tensors if t.name in imat}
    base = evaluate(src, windows, args.threads)[keep_rows]
    base_logp = log_softmax(base)
    tg = targets[keep_rows]
    rows = []
    base_stats = kl_stats(base_logp, base, tg)
    print(f"f32 source: ppl {base_stats['ppl']:.4f}", flush=True)
    for qtype in args.types.split(","):
        modes = args.imatrix_modes.split(",")
        for with_imat in [m == "yes" for m in ("no", "yes") if m in modes]:
            row: dict[str, object] = {"type": qtype, "imatrix": with_imat}
            for who in ("colibri", "llama_cpp"):
                dst = out / f"moe-{qtype}-{who}{'-imat' if with_imat else ''}.gguf"
                t0 = time.perf_counter()
                secs = None
                if not (args.reuse and dst.exists()):
                    if who == "colibri":
                        quantize_colibri(src, dst, qtype, imat_path if with_imat else None, args.threads)
                    else:
                        quantize_llama_cpp(src, dst, qtype, imat if with_imat else None, args.threads)
                    secs = time.perf_counter() - t0
                size, bpw = bits_per_weight(dst)
                st = kl_stats(base_logp, evaluate(dst, windows, args.threads)[keep_rows], tg)
                werr = weight_error(dst, src_w, imat)
                row[who] = {"bytes": size, "bpw": bpw, "seconds": secs, "weight_error": werr, **st}
            rows.append(row)
            c, ll = row["colibri"], row["llama_cpp"]
            print(
                f"{qtype:7s} imat={int(with_imat)} bpw {c['bpw']:.3f}/{ll['bpw']:.3f}  "
                f"KLD {c['kld_mean']:.5f} vs {ll['kld_mean']:.5f} ({c['kld_mean'] / ll['kld_mean']:.3f}x)  "
                f"p99 {c['kld_p99']:.4f} vs {ll['kld_p99']:.4f}  ppl {c['ppl']:.3f} vs {ll['ppl']:.3f}  "
                f"weight error {c['weight_error']:.3e} vs {ll['weight_error']:.3e}",
                flush=True,
            )
    result = {
        "per_type": per_type,
        "engine": args.engine,
        "windows": len(windows),
        "ctx": args.ctx,
        "tokens": int(keep_rows.sum()),
        "source": base_stats,
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
