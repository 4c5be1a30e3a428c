"""Importance matrices (`colibri imatrix`): mean square activations per weight column, in llama.cpp's format.

The engine observes the input rows of every matrix product of the layers (colibri_imatrix_start,
native/src/imatrix.c) while a corpus runs through it teacher-forced, in llama-imatrix's chunks
(quality.make_chunks: n_ctx tokens, BOS first where the model uses one). For each weight tensor it
keeps, per matrix (per expert for stacked expert tensors) and per input column, the sum of x^2 and
the number of rows; a quantizer divides one by the other.

File format: llama.cpp's GGUF imatrix (tools/imatrix in llama.cpp, read by llama-quantize --imatrix
and by `colibri quantize --imatrix`):

    general.type = "imatrix"; imatrix.datasets = [corpus file names]; imatrix.chunk_count (u32);
    imatrix.chunk_size (u32, tokens per chunk)
    for each weight tensor NAME (sorted by name), two F32 tensors:
      NAME.in_sum2  ne = [n_cols, n_mat]   sum of x^2 per matrix and column
      NAME.counts   ne = [1, n_mat]        activation rows per matrix

As llama.cpp does, only tensors named blk.* are collected (not the output head), tensors that saw no
rows are left out, and experts no token routed to keep count 0 (a quantizer then weighs them evenly).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

IMATRIX_TYPE = "imatrix"
KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
SUM_SUFFIX = ".in_sum2"
COUNT_SUFFIX = ".counts"


@dataclass
class ImatrixEntry:
    """Statistics of one weight tensor."""

    sums: np.ndarray  # float64 [n_mat, n_cols]: sum of x^2 per matrix and column
    counts: np.ndarray  # int64 [n_mat]: activation rows per matrix

    def mean(self) -> np.ndarray:
        """sums / counts per matrix; matrices without rows are all ones (llama-quantize's choice)."""
        out = np.ones_like(self.sums)
        seen = self.counts > 0
        out[seen] = self.sums[seen] / self.counts[seen, None]
        return out


@dataclass
class Imatrix:
    entries: dict[str, ImatrixEntry]
    datasets: list[str]
    chunk_count: int
    chunk_size: int


def _read_engine(model: Any) -> dict[str, ImatrixEntry]:
    from colibri_backend import _native

    lib, ctx = model._lib, model._ctx
    out: dict[str, ImatrixEntry] = {}
    info = _native.ImatrixInfoC()
    for i in range(int(lib.colibri_imatrix_count(ctx))):
        lib.check(lib.colibri_imatrix_get(ctx, i, ctypes.byref(info), None, None), "imatrix entry")
        sums = np.zeros((info.n_mat, info.n_cols), dtype=np.float64)
        counts = np.zeros(info.n_mat, dtype=np.uint64)
        lib.check(
            lib.colibri_imatrix_get(
                ctx,
                i,
                ctypes.byref(info),
                sums.ctypes.data_as(ctypes.POINTER(ctypes.c_double)),
                counts.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)),
            ),
            "imatrix entry",
        )
        if counts.any():
            out[info.name.decode("utf-8")] = ImatrixEntry(sums, counts.astype(np.int64))
    return out


def collect(
    model: Any,
    chunks: np.ndarray,
    *,
    datasets: Sequence[str] = (),
    progress: Callable[[int], None] | None = None,
    on_logits: Callable[[np.ndarray, np.ndarray], None] | None = None,
) -> Imatrix:
    """Run `chunks` ([n_chunks, n_ctx] token ids) through a loaded model (colibri_backend.load, every
    expert resident) and return the statistics. on_logits(chunk, logits) sees each chunk's logits."""
    lib, ctx = model._lib, model._ctx
    with model._lock:
        model._check_open()
        lib.check(lib.colibri_imatrix_start(ctx), "cannot collect activation statistics")
        try:
            for i, chunk in enumerate(chunks):
                logits = model.logits(chunk)
                if on_logits is not None:
                    on_logits(chunk, logits)
                if progress is not None:
                    progress(i + 1)
            entries = _read_engine(model)
        finally:
            lib.colibri_imatrix_stop(ctx)
    return Imatrix(entries, list(datasets), int(chunks.shape[0]), int(chunks.shape[1]))


def write_imatrix(path: str | os.PathLike[str], im: Imatrix) -> Path:
    """Write `im` as llama.cpp's GGUF imatrix (to PATH.part, renamed when complete)."""
    import gguf

    out = Path(path)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"the output directory {out.parent} does not exist")
    if not im.entries:
        raise ValueError("no activation statistics were collected (an empty corpus?)")
    tmp = out.with_name(out.name + ".part")
    w = gguf.GGUFWriter(tmp, IMATRIX_TYPE)
    w.kv_data[0].pop("general.architecture", None)  # llama.cpp's imatrix files carry none
    try:
        w.add_type(IMATRIX_TYPE)
        w.add_array(KEY_DATASETS, list(im.datasets) or ["(unnamed)"])
        w.add_uint32(KEY_CHUNK_COUNT, im.chunk_count)
        w.add_uint32(KEY_CHUNK_SIZE, im.chunk_size)
        for name in sorted(im.entries):
            e = im.entries[name]
            w.add_tensor(name + SUM_SUFFIX, e.sums.astype(np.float32))
            w.add_tensor(name + COUNT_SUFFIX, e.counts.astype(np.float32).reshape(-1, 1))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


def read_imatrix(path: str | os.PathLike[str]) -> Imatrix:
    """Read a GGUF imatrix (llama.cpp's or ours); a file that is not one is a ValueError."""
    import gguf

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"imatrix file not found: {p}")
    try:
        r = gguf.GGUFReader(p)
    except Exception as exc:
        raise ValueError(f"{p}: not a GGUF imatrix file ({exc})") from None

    def field(key: str) -> Any:
        f = r.fields.get(key)
        return None if f is None else f.contents()

    if field("general.type") != IMATRIX_TYPE:
        raise ValueError(f"{p}: not an imatrix file (general.type is {field('general.type')!r})")
    tensors = {t.name: t for t in r.tensors}
    entries: dict[str, ImatrixEntry] = {}
    for tname, t in tensors.items():
        if not tname.endswith(SUM_SUFFIX):
            continue
        name = tname[: -len(SUM_SUFFIX)]
        c = tensors.get(name + COUNT_SUFFIX)
        if c is None:
            raise ValueError(f"{p}: {tname} has no {name + COUNT_SUFFIX}")
        n_cols, n_mat = int(t.shape[0]), int(t.shape[1]) if len(t.shape) > 1 else 1
        counts = np.asarray(c.data, dtype=np.float64).reshape(-1)
        if counts.size != n_mat:
            raise ValueError(f"{p}: {name} has {n_mat} matrices but {counts.size} counts")
        sums = np.asarray(t.data, dtype=np.float64).reshape(n_mat, n_cols)
        entries[name] = ImatrixEntry(sums, np.rint(counts).astype(np.int64))
    return Imatrix(
        entries,
        [str(x) for x in (field(KEY_DATASETS) or [])],
        int(field(KEY_CHUNK_COUNT) or 0),
        int(field(KEY_CHUNK_SIZE) or 0),
    )


__all__ = ["Imatrix", "ImatrixEntry", "collect", "read_imatrix", "write_imatrix"]
