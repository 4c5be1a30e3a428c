"""Diagnose a Colibri / llama.cpp disagreement on a quantized GGUF: which engine is further from exact math?

    python conformance_tests/reference/quantization_error.py FILE.gguf [N_TOKENS]

"Exact" is the same file with every tensor dequantized to F32, run by llama.cpp with an F32 KV cache: the
quantized weights' own math, without the engines' activation quantization, F16 KV cache or accumulation
order. The script prints, for teacher-forced logits over N_TOKENS (default 256) tokens of English text
(this Python's LICENSE.txt): Colibri vs exact, llama.cpp vs exact, Colibri vs llama.cpp.
If the two engines are each close to exact but far from each other, they round differently (for example
activation quantization); if one is far from exact, that engine's quantized kernels lose precision.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import tiny_models as tm  # noqa: E402


def dequantized_copy(
    src: Path, dst: Path, overrides: dict[str, Any] | None = None, drop: frozenset[str] = frozenset()
) -> Path:
    """Write `src` with every tensor as F32 (metadata unchanged except general.file_type).

    overrides: metadata to change, key -> (value, gguf.GGUFValueType[, array element type]), or None to drop
    the key; drop: tensors to leave out (bad-input tests write inconsistent files this way)."""
    import gguf
    from gguf.quants import dequantize

    overrides = dict(overrides or {})
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for key, value in overrides.items():
        if value is not None and key not in reader.fields:
            writer.add_key_value(key, *value)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in overrides:
            if overrides[key] is not None:
                writer.add_key_value(key, *overrides[key])
            continue
        if key == "general.alignment":  # the writer must also lay the data out that way
            writer.add_custom_alignment(int(field.contents()))
            continue
        if key == "general.file_type":
            writer.add_uint32(key, int(gguf.LlamaFileType.ALL_F32))
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name in drop:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        values = dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        writer.add_tensor(t.name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def main(argv: list[str]) -> int:
    import colibri_backend

    path = Path(argv[0])
    n = int(argv[1]) if len(argv) > 1 else 256
    with colibri_backend.load(path, threads=tm.ENGINE_THREADS, context_length=max(n, 64)) as model:
        ids = model.tokenize(tm.english_text(), add_special_tokens=False)[:n]
        ours = model.logits(ids)
    with tempfile.TemporaryDirectory(prefix="colibri-exact-") as tmp:
        exact_file = dequantized_copy(path, Path(tmp) / "exact.gguf")
        exact = tm.llama_cpp_logits(exact_file, ids, f32_kv=True)
    theirs = tm.llama_cpp_logits(path, ids)
    print(tm.compare(exact, ours).line(f"Colibri   vs exact ({path.name})"))
    print(tm.compare(exact, theirs).line(f"llama.cpp vs exact ({path.name})"))
    print(tm.compare(theirs, ours).line(f"Colibri   vs llama.cpp ({path.name})"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
