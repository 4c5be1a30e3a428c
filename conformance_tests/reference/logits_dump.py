"""Logits of every tiny spec, to show an engine refactor changes no bit.

    COLIBRI_LIB=/old/libcolibri.so python conformance_tests/reference/logits_dump.py dump old.npz [SPEC ...]
    COLIBRI_LIB=/new/libcolibri.so python conformance_tests/reference/logits_dump.py dump new.npz [SPEC ...]
    python conformance_tests/reference/logits_dump.py compare old.npz new.npz

`dump` builds each tiny checkpoint (tiny_models.SPECS, or the named ones) under --root, converts it with
Colibri's converter to F32 and Q8_0 and stores the teacher-forced logits of 80 positions from the engine
that COLIBRI_LIB names; `compare` lists the arrays that differ in any bit (exit status 1 if one does).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import tiny_models as tm  # noqa: E402

N_POS = 80


def dump(out: Path, names: list[str], root: Path) -> None:
    import colibri_backend
    from colibri_backend.convert import convert

    root.mkdir(parents=True, exist_ok=True)
    logits: dict[str, np.ndarray] = {}
    for name in names:
        spec = tm.SPEC_BY_NAME[name]
        ckpt = root / name
        if not (ckpt / "config.json").exists():
            gemma = spec.extra.get("tokenizer") == "gemma4"
            tok_dir = root / ("gemma4_tokenizer" if gemma else "tokenizer")
            if not tok_dir.exists():
                (tm.build_gemma4_tokenizer if gemma else tm.build_tokenizer)(tok_dir)
            tm.build_checkpoint(spec, ckpt, tok_dir)
        ids = tm.token_ids(ckpt, N_POS)
        for out_type in ("f32", "q8_0"):
            gguf = root / f"{name}.{out_type}.gguf"
            if not gguf.exists():
                convert(ckpt, gguf, out_type=out_type, progress=False)
            with colibri_backend.load(gguf, threads=tm.ENGINE_THREADS, context_length=256) as model:
                logits[f"{name}.{out_type}"] = model.logits(ids)
    np.savez(out, **logits)
    print(f"{out}: {len(logits)} arrays")


def compare(a_path: Path, b_path: Path) -> int:
    a, b = np.load(a_path), np.load(b_path)
    both = set(a.files) & set(b.files)
    differ = sorted((set(a.files) ^ set(b.files)) | {k for k in both if not np.array_equal(a[k], b[k])})
    print(f"{len(both)} arrays in both; differing in any bit (or in one file only): {differ or 'none'}")
    return 1 if differ else 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out", type=Path)
    d.add_argument("specs", nargs="*")
    d.add_argument("--root", type=Path, default=Path("/tmp/colibri-logits-dump"))
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        return compare(args.a, args.b)
    unknown = [n for n in args.specs if n not in tm.SPEC_BY_NAME]
    if unknown:
        ap.error(f"unknown specs {unknown}; known: {', '.join(tm.SPEC_BY_NAME)}")
    dump(args.out, args.specs or [s.name for s in tm.SPECS], args.root)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
