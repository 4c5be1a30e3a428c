"""The tiny Q8_0 files' faithfulness bar, measured at 256 and at 1024 positions, for one kernel set.

    cd conformance_tests
    COLIBRI_LIB=.../libcolibri.so python reference/tiny_q8_bar.py --tag lane --out /tmp/q8bar
    COLIBRI_CPU_BACKEND=scalar COLIBRI_LIB=.../libcolibri.so \
        python reference/tiny_q8_bar.py --tag scalar --out /tmp/q8bar

For every llama.cpp-compatible tiny spec: its Q8_0 file's logits over test_vs_llama_cpp.py's four 256-token
windows from Colibri (the library and kernel set of this process), from llama.cpp (cached in OUT, so the
kernel sets are compared with the same llama.cpp run) and from the file's exact math (dequantized to F32);
then test_vs_llama_cpp.py's bar (Colibri's top-1 agreement with exact at most 2 points below llama.cpp's, KL
at most 1.5x llama.cpp's + 1e-3) on the first window alone (256 positions) and on all four (1024). Writes
OUT/tiny_q8_TAG.json and prints a line per file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import test_vs_llama_cpp as tl  # noqa: E402
import tiny_models as tm  # noqa: E402

import colibri_backend as colibri  # noqa: E402
from conftest import TinyZoo  # noqa: E402


def bar(exact: np.ndarray, ours: np.ndarray, theirs: np.ndarray, n: int) -> dict[str, float | bool]:
    a, b = tm.compare(exact[:n], ours[:n]), tm.compare(exact[:n], theirs[:n])
    floor = b.top1_agreement - tl.FAITHFUL_TOP1_SLACK
    ceiling = tl.FAITHFUL_KL_FACTOR * b.kl_mean + tl.FAITHFUL_KL_SLACK
    return {
        "ours_top1": a.top1_agreement,
        "ours_kl": a.kl_mean,
        "llama_top1": b.top1_agreement,
        "llama_kl": b.kl_mean,
        "top1_floor": floor,
        "kl_ceiling": ceiling,
        "ok": bool(a.top1_agreement >= floor and a.kl_mean <= ceiling),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", required=True, help="names the kernel set in the output file")
    ap.add_argument(
        "--out", type=Path, required=True, help="folder for the zoo, llama.cpp's cache and the JSON"
    )
    ap.add_argument(
        "--specs", default="", help="comma list of tiny specs (default: every llama.cpp-compatible one)"
    )
    args = ap.parse_args(argv)
    zoo_dir, cache = args.out / "zoo", args.out / "llama_cache"
    zoo_dir.mkdir(parents=True, exist_ok=True)
    cache.mkdir(exist_ok=True)
    zoo = TinyZoo(zoo_dir)
    names = (
        args.specs.split(",")
        if args.specs
        else [n for n in tm.ENGINE_SPECS if tm.SPEC_BY_NAME[n].llama_cpp_compatible]
    )
    results = {}
    for name in names:
        ckpt, gguf = zoo.checkpoint(name), zoo.gguf(name, "q8_0")
        windows = tl.tiny_windows(ckpt)
        cached = cache / f"{name}.npy"
        if cached.exists():
            theirs = np.load(cached)
        else:
            theirs = tl.llama_cpp_windows(gguf, windows)
            np.save(cached, theirs)
        ours = tl.colibri_logits(colibri, gguf, windows)
        with tempfile.TemporaryDirectory() as tmp:
            exact = tl.exact_windows(colibri, gguf, windows, Path(tmp))
        results[name] = {str(n): bar(exact, ours, theirs, n) for n in (256, 1024)}
        print(name, json.dumps(results[name]), flush=True)
    (args.out / f"tiny_q8_{args.tag}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
