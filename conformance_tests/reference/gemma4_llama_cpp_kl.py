"""Colibri and llama.cpp on llama.cpp's own Gemma 4 files at F16 and Q8_0 (the tiny `gemma4` spec).

    python conformance_tests/reference/gemma4_llama_cpp_kl.py [WORKDIR]

Builds the spec's checkpoint (tiny_models, the tokenizer of Gemma 4's kind), converts it with llama.cpp's
convert_hf_to_gguf.py to F32 and F16, quantizes the F32 file to Q8_0 with llama.cpp's quantizer, and prints,
over 256 positions: Colibri against llama.cpp on the same file, and each against the exact model (Colibri on
the F32 file, which matches transformers to 1e-5). A measurement for docs/conformance.md, not a test.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import tiny_models as tm  # noqa: E402


def main(argv: list[str]) -> int:
    import colibri_backend

    root = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="colibri-gemma4-"))
    ck = tm.build_checkpoint(
        tm.SPEC_BY_NAME["gemma4"], root / "gemma4", tm.build_gemma4_tokenizer(root / "tok")
    )
    files = {
        "f32": root / "gemma4.f32.gguf",
        "f16": root / "gemma4.f16.gguf",
        "q8_0": root / "gemma4.q8_0.gguf",
    }
    tm.llama_cpp_convert([(ck, files["f32"])], "f32")
    tm.llama_cpp_convert([(ck, files["f16"])], "f16")
    tm.llama_cpp_quantize(files["f32"], files["q8_0"], "Q8_0")
    ids = tm.token_ids(ck, 256, seed=1)
    with colibri_backend.load(files["f32"], threads=tm.ENGINE_THREADS, context_length=256) as m:
        exact = m.logits(ids)
    for kind in ("f16", "q8_0"):
        with colibri_backend.load(files[kind], threads=tm.ENGINE_THREADS, context_length=256) as m:
            ours = m.logits(ids)
        theirs = tm.llama_cpp_logits(files[kind], ids)
        print(tm.compare(theirs, ours).line(f"{kind} Colibri   vs llama.cpp"))
        print(tm.compare(exact, ours).line(f"{kind} Colibri   vs exact"))
        print(tm.compare(exact, theirs).line(f"{kind} llama.cpp vs exact"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
