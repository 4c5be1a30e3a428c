"""Colibri and llama.cpp on llama.cpp's own Gemma 4 files: F16, Q8_0 and Q4_K_M (the tiny `gemma4` spec).

    python conformance_tests/reference/gemma4_llama_cpp_kl.py [WORKDIR]

Builds the spec's checkpoint (tiny_models, the tokenizer of Gemma 4's kind), converts it with llama.cpp's
convert_hf_to_gguf.py to F32 and F16 and quantizes the F32 file with llama.cpp's quantizer to Q8_0; the same
for `gemma4_256`, the spec with rows of 256 (hidden, dense MLP and expert widths), quantized to Q4_K_M so that
its matrices are K-quants rather than llama.cpp's fallbacks for short rows. Over 256 positions it prints
Colibri against llama.cpp on the same file; llama.cpp's own batched pass against its token-by-token pass (the
disagreement the issue's KL bound is stated in); and each engine against the exact model (Colibri on the F32
file, which matches transformers to 1e-5). The bar of test_vs_llama_cpp_quant is checked and reported:
KL(llama.cpp || Colibri) at most twice llama.cpp's disagreement with itself, taken as the larger of batched
vs token-by-token and its distance from the exact model. A measurement for docs/conformance.md, not a test.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import tiny_models as tm  # noqa: E402

N_POS = 256
KL_FACTOR = 2.0
# gemma4 with every hidden-side row 256 long, so that Q4_K_M's K-quants cover the projections and experts;
# its soft-cap raised to 30 (at 8, the wider tied head saturates it: top-2 margins of 0.03 on average)
GEMMA4_256 = dataclasses.replace(
    tm.SPEC_BY_NAME["gemma4"],
    name="gemma4_256",
    config={
        **tm.SPEC_BY_NAME["gemma4"].config,
        "hidden_size": 256,
        "intermediate_size": 256,
        "moe_intermediate_size": 256,
        "final_logit_softcapping": 30.0,
    },
)


def _measure(colibri: Any, exact_file: Path, files: dict[str, Path], ids: list[int]) -> None:
    with colibri.load(exact_file, threads=tm.ENGINE_THREADS, context_length=N_POS) as m:
        exact = m.logits(ids)
    for kind, path in files.items():
        with colibri.load(path, threads=tm.ENGINE_THREADS, context_length=N_POS) as m:
            ours = m.logits(ids)
        batched = tm.llama_cpp_logits(path, ids)
        serial = tm.llama_cpp_logits(path, ids, n_batch=1)
        vs_llama = tm.compare(batched, ours)
        self_noise = tm.compare(batched, serial)
        theirs_vs_exact = tm.compare(exact, batched)
        print(vs_llama.line(f"{kind} Colibri   vs llama.cpp"))
        print(self_noise.line(f"{kind} llama.cpp batched vs token-by-token"))
        print(tm.compare(exact, ours).line(f"{kind} Colibri   vs exact"))
        print(theirs_vs_exact.line(f"{kind} llama.cpp vs exact"))
        noise = max(self_noise.kl_mean, theirs_vs_exact.kl_mean)
        print(
            f"{kind} bar: KL(llama.cpp || Colibri) {vs_llama.kl_mean:.3g} <= {KL_FACTOR} x max(self "
            f"{self_noise.kl_mean:.3g}, vs exact {theirs_vs_exact.kl_mean:.3g}) = {KL_FACTOR * noise:.3g}: "
            f"{'met' if vs_llama.kl_mean <= KL_FACTOR * noise else 'NOT met'}; against batched-vs-token-by-"
            f"token alone: {'met' if vs_llama.kl_mean <= KL_FACTOR * self_noise.kl_mean else 'NOT met'}"
        )


def main(argv: list[str]) -> int:
    import colibri_backend

    root = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="colibri-gemma4-"))
    tok = tm.build_gemma4_tokenizer(root / "tok")
    ck = tm.build_checkpoint(tm.SPEC_BY_NAME["gemma4"], root / "gemma4", tok)
    ck256 = tm.build_checkpoint(GEMMA4_256, root / "gemma4_256", tok)
    f32, f32_256 = root / "gemma4.f32.gguf", root / "gemma4_256.f32.gguf"
    files = {"f16": root / "gemma4.f16.gguf", "q8_0": root / "gemma4.q8_0.gguf"}
    tm.llama_cpp_convert([(ck, f32), (ck256, f32_256)], "f32")
    tm.llama_cpp_convert([(ck, files["f16"])], "f16")
    tm.llama_cpp_quantize(f32, files["q8_0"], "Q8_0")
    q4 = tm.llama_cpp_quantize(f32_256, root / "gemma4_256.q4_k_m.gguf", "Q4_K_M")
    _measure(colibri_backend, f32, files, tm.token_ids(ck, N_POS, seed=1))
    _measure(colibri_backend, f32_256, {"gemma4_256 q4_k_m": q4}, tm.token_ids(ck256, N_POS, seed=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
