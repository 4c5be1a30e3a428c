"""test_vs_llama_cpp_quant.py's bars for every case of test_llama_cpp_quantized_file, on 1 window of
128 positions and on several, for one library and kernel set.

    cd conformance_tests
    COLIBRI_LIB=.../libcolibri.so python reference/quant_bar.py --tag new --out /tmp/qbar
    COLIBRI_CPU_BACKEND=scalar COLIBRI_LIB=.../libcolibri.so \
        python reference/quant_bar.py --tag scalar --out /tmp/qbar

For each (type, model) of the test: llama.cpp's quantized file (made once, cached in OUT with llama.cpp's
batched and token-by-token logits, so that every library and kernel set is judged on the same file and the
same llama.cpp run), then Colibri's logits (this process's library and kernel set) and the file's exact math
over the test's windows (consecutive 128-token slices of the same English text, each a fresh sequence; the
first is the 128 positions the test used alone). The four bars of the test are evaluated on the first
`n` windows for every n in --counts, with the test's thresholds; the tiny random model's flip trim is
FLIP_TRIM per window (the same rate of dropped router flips as on one window). Writes OUT/quant_bar_TAG.json
and prints one line per case and count.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import test_vs_llama_cpp as tl  # noqa: E402
import test_vs_llama_cpp_quant as tq  # noqa: E402

import colibri_backend as colibri  # noqa: E402
from conftest import TinyZoo  # noqa: E402

BAR_KEYS = ("faithful_top1_ok", "faithful_kl_ok", "vs_llama_kl_ok", "vs_llama_top1_ok")


def bars(
    exact: np.ndarray, ours: np.ndarray, batched: np.ndarray, serial: np.ndarray, trim: int
) -> dict[str, Any]:
    """The test's four bars on these rows (the same code path as test_llama_cpp_quantized_file)."""
    self_noise = tq.robust(batched, serial, trim)
    vs_llama = tq.robust(batched, ours, trim)
    ours_vs_exact = tq.robust(exact, ours, trim)
    theirs_vs_exact = tq.robust(exact, batched, trim)
    top1_floor = theirs_vs_exact.top1_agreement - tl.FAITHFUL_TOP1_SLACK
    kl_ceiling = tl.FAITHFUL_KL_FACTOR * theirs_vs_exact.kl_mean + tl.FAITHFUL_KL_SLACK
    noise_kl = max(self_noise.kl_mean, theirs_vs_exact.kl_mean)
    noise_miss = 1.0 - min(self_noise.top1_agreement, theirs_vs_exact.top1_agreement)
    vs_kl_ceiling = tq.KL_FACTOR * noise_kl
    vs_miss_ceiling = tq.KL_FACTOR * noise_miss + tq.TOP1_SLACK
    out = {
        "positions": int(exact.shape[0]),
        "trim": trim,
        "ours_exact_top1": ours_vs_exact.top1_agreement,
        "top1_floor": top1_floor,
        "ours_exact_kl": ours_vs_exact.kl_mean,
        "kl_ceiling": kl_ceiling,
        "vs_llama_kl": vs_llama.kl_mean,
        "vs_llama_kl_ceiling": vs_kl_ceiling,
        "vs_llama_miss": 1.0 - vs_llama.top1_agreement,
        "vs_llama_miss_ceiling": vs_miss_ceiling,
        "llama_exact_top1": theirs_vs_exact.top1_agreement,
        "llama_exact_kl": theirs_vs_exact.kl_mean,
    }
    out["faithful_top1_ok"] = bool(out["ours_exact_top1"] >= top1_floor)
    out["faithful_kl_ok"] = bool(out["ours_exact_kl"] <= kl_ceiling)
    out["vs_llama_kl_ok"] = bool(out["vs_llama_kl"] <= vs_kl_ceiling)
    out["vs_llama_top1_ok"] = bool(out["vs_llama_miss"] <= vs_miss_ceiling)
    out["ok"] = all(out[k] for k in BAR_KEYS)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", required=True, help="names the library / kernel set in the output file")
    ap.add_argument("--out", type=Path, required=True, help="folder for files, llama.cpp's cache, JSON")
    ap.add_argument("--windows", type=int, default=4, help="128-token windows evaluated (default 4)")
    ap.add_argument("--counts", default="1,4", help="window counts at which the bars are evaluated")
    ap.add_argument("--cases", default="", help="comma list of TYPE-MODEL ids (default: all)")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    assert max(counts) <= args.windows
    files, cache = args.out / "files", args.out / "llama_cache"
    files.mkdir(parents=True, exist_ok=True)
    cache.mkdir(exist_ok=True)
    sources = tq.Sources(args.out / "sources", TinyZoo(args.out / "zoo"))
    cases = [(p.values[0], p.values[1]) for p in tq._cases()]
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if f"{c[0]}-{c[1]}" in wanted]
    results: dict[str, Any] = {}
    for ftype, model in cases:
        cid = f"{ftype}-{model}"
        qfile = files / f"{model}.{ftype.lower()}.gguf"
        if not qfile.exists():
            tq.llama_quantize(sources.f32(model), qfile, ftype)
        windows = tq._windows(colibri, qfile, args.windows)
        cached = cache / f"{cid}.npz"
        if cached.exists():
            z = np.load(cached)
            batched, serial = z["batched"], z["serial"]
        else:
            batched = np.concatenate([tq.llama_cpp_logits(qfile, w, n_batch=len(w)) for w in windows])
            serial = np.concatenate([tq.llama_cpp_logits(qfile, w, n_batch=1) for w in windows])
            np.savez(cached, batched=batched, serial=serial)
        t0 = time.perf_counter()
        ours = tl.colibri_logits(colibri, qfile, windows)
        with tempfile.TemporaryDirectory() as tmp:
            exact = tl.exact_windows(colibri, qfile, windows, Path(tmp))
        seconds = time.perf_counter() - t0
        per_window = 0 if model == "trained_moe" else tq.FLIP_TRIM
        results[cid] = {"colibri_and_exact_s": seconds}
        for n in counts:
            rows = n * tq.N_TOKENS
            b = bars(exact[:rows], ours[:rows], batched[:rows], serial[:rows], per_window * n)
            results[cid][str(rows)] = b
            failed = [k[:-3] for k in BAR_KEYS if not b[k]]
            print(
                f"{cid:24s} {rows:5d} {'ok  ' if b['ok'] else 'FAIL'} top1 {b['ours_exact_top1']:.4f} >= "
                f"{b['top1_floor']:.4f}  kl {b['ours_exact_kl']:.3g} <= {b['kl_ceiling']:.3g}  "
                f"vsL kl {b['vs_llama_kl']:.3g} <= {b['vs_llama_kl_ceiling']:.3g}  "
                f"miss {b['vs_llama_miss']:.4f} <= {b['vs_llama_miss_ceiling']:.4f} {' '.join(failed)}",
                flush=True,
            )
    (args.out / f"quant_bar_{args.tag}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
