"""Quantize a GGUF with the engine's quantizer, and read llama.cpp importance matrices.

`quantize()` hands the work to `colibri_quantize` in the C engine (type mixes, threads, the temporary
file and its rename live there). `write_lowbit_sidecar()` writes MODEL.lowbit, low-bit copies of a
model's routed experts for the lossy `lowbit_experts` load option (native/src/expert_lowbit.h).
`read_imatrix()` reads both imatrix formats llama.cpp writes:

* GGUF (llama.cpp's current format): per weight tensor `NAME.in_sum2` (F32, ne0 x n_mat: sums of
  squared activations per input column, per expert) and `NAME.counts` (F32, n_mat: how many
  activations each sum holds); the importance is in_sum2 / counts (1 where a count is 0).
* the legacy binary `.dat`: int32 n_entries, then per entry int32 name length, the name, int32 ncall,
  int32 nval, nval float32 values; the importance is value / ncall. Optional trailer: int32 chunk count,
  int32 length and the dataset name.

Both come back as {tensor name: float32 importances (ne0 * n_expert)}, normalised the way llama.cpp's
quantizer normalises them.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np


class ImatrixError(ValueError):
    """The importance-matrix file is unreadable, truncated or inconsistent."""


def quantize_types() -> tuple[str, ...]:
    """The target names the engine's quantizer accepts (q8_0, q6_k, q5_k_m, q4_k_m, ...)."""
    from colibri_backend._native import load_library

    return tuple(load_library().colibri_quantize_types().decode().split(","))


def _read_gguf_imatrix(path: Path) -> dict[str, np.ndarray]:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the gguf package raises plain ValueError/IndexError on a damaged file
        raise ImatrixError(f"{path}: not a readable GGUF imatrix: {exc}") from exc
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        for suffix, table in ((".in_sum2", sums), (".counts", counts)):
            if t.name.endswith(suffix):
                if t.tensor_type != gguf.GGMLQuantizationType.F32:
                    raise ImatrixError(f"{path}: {t.name} must be F32, is {t.tensor_type.name}")
                table[t.name[: -len(suffix)]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if not sums:
        raise ImatrixError(f"{path}: a GGUF without imatrix tensors (NAME.in_sum2 / NAME.counts)")
    out: dict[str, np.ndarray] = {}
    for name, s in sums.items():
        c = counts.get(name)
        if c is None:
            raise ImatrixError(f"{path}: {name}.in_sum2 has no matching {name}.counts")
        if c.size == 0 or s.size % c.size != 0:
            raise ImatrixError(f"{path}: {name}: {s.size} sums do not split into {c.size} matrices")
        per = s.reshape(c.size, -1)
        cnt = c.reshape(-1, 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            out[name] = np.where(cnt > 0, per / np.where(cnt > 0, cnt, 1), 1.0).astype(np.float32).reshape(-1)
    missing = sorted(set(counts) - set(sums))
    if missing:
        raise ImatrixError(f"{path}: {missing[0]}.counts has no matching {missing[0]}.in_sum2")
    return out


def _read_legacy_imatrix(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise ImatrixError(f"{path}: truncated imatrix (reading {what} at byte {pos} of {len(data)})")
        chunk = data[pos : pos + n]
        pos += n
        return chunk

    (n_entries,) = struct.unpack("<i", take(4, "the entry count"))
    if n_entries < 1:
        raise ImatrixError(f"{path}: not an imatrix (entry count {n_entries})")
    out: dict[str, np.ndarray] = {}
    for i in range(n_entries):
        (name_len,) = struct.unpack("<i", take(4, f"entry {i}'s name length"))
        if not 0 < name_len <= 4096:
            raise ImatrixError(f"{path}: entry {i}: name length {name_len} is not plausible")
        try:
            name = take(name_len, f"entry {i}'s name").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ImatrixError(f"{path}: entry {i}: name is not UTF-8") from exc
        ncall, nval = struct.unpack("<ii", take(8, f"entry {name}'s counts"))
        if nval < 1:
            raise ImatrixError(f"{path}: entry {name}: {nval} values")
        vals = np.frombuffer(take(4 * nval, f"entry {name}'s {nval} values"), dtype="<f4").astype(np.float32)
        out[name] = vals / np.float32(ncall) if ncall > 0 else vals.copy()
    return out


def read_imatrix(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Read a llama.cpp importance matrix (GGUF or legacy .dat) as {tensor name: importances}."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"imatrix file {p} does not exist")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _read_gguf_imatrix(p)
    return _read_legacy_imatrix(p)


def quantize(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    qtype: str,
    imatrix: str | os.PathLike[str] | dict[str, np.ndarray] | None = None,
    threads: int | None = None,
    allow_requantize: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
    expert_outliers: float = 0.0,
    outlier_corpus: str | None = None,
) -> Path:
    """Quantize the GGUF `src` to `dst` with the type mix `qtype` (see quantize_types()); returns dst.

    `imatrix` is a llama.cpp imatrix file or an already-read {name: importances} dict. `progress` is
    called with (source bytes done, total, tensor name). Nothing is left at `dst` on failure.
    `expert_outliers` > 0 (at most 0.25) keeps that fraction of every routed expert's input columns
    exact to F16 as Colibri-only correction tensors (lossy, opt-in; docs/memory.md); `outlier_corpus`
    describes the calibration text, recorded as colibri.outliers.corpus (default: the imatrix file's name).
    """
    from colibri_backend._native import QuantizeParamsC, QuantizeProgressC, load_library

    lib = load_library()
    src_p, dst_p = Path(src), Path(dst)
    if not src_p.is_file():
        raise FileNotFoundError(f"input model {src_p} does not exist")
    table = read_imatrix(imatrix) if isinstance(imatrix, (str, os.PathLike)) else (imatrix or {})

    params = QuantizeParamsC()
    lib.colibri_quantize_default_params(ctypes.byref(params))
    params.type = qtype.encode()
    params.n_threads = int(threads) if threads else (os.cpu_count() or 1)
    params.allow_requantize = 1 if allow_requantize else 0
    params.expert_outliers = float(expert_outliers)
    if outlier_corpus is None and isinstance(imatrix, (str, os.PathLike)):
        outlier_corpus = f"imatrix {Path(imatrix).name}"
    corpus = (outlier_corpus or "none").encode()
    params.outlier_corpus = corpus

    arrays = [np.ascontiguousarray(v, dtype=np.float32) for v in table.values()]
    n = len(arrays)
    names = (ctypes.c_char_p * max(n, 1))(*[k.encode() for k in table])
    values = (ctypes.POINTER(ctypes.c_float) * max(n, 1))(
        *[a.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) for a in arrays]
    )
    sizes = (ctypes.c_int64 * max(n, 1))(*[a.size for a in arrays])
    params.n_imatrix = n
    params.imatrix_names = names
    params.imatrix_values = values
    params.imatrix_sizes = sizes

    errors: list[BaseException] = []

    def _cb(_user: object, done: int, total: int, tensor: bytes) -> int:
        try:
            if progress is not None:
                progress(int(done), int(total), tensor.decode(errors="replace"))
            return 0
        except BaseException as exc:  # KeyboardInterrupt included: cancel cleanly, re-raise below
            errors.append(exc)
            return 1

    keep = QuantizeProgressC(_cb)  # referenced until the call returns
    params.progress = keep
    status = lib.colibri_quantize(str(src_p).encode(), str(dst_p).encode(), ctypes.byref(params))
    if errors:
        raise errors[0]
    lib.check(status, f"quantize {src_p} -> {dst_p}")
    from colibri_backend.digests import write_digests

    write_digests(dst_p)  # MODEL.digests, as `colibri convert` writes them (docs/robustness.md)
    return dst_p


LOWBIT_TYPES = ("q2_k", "iq4_xs")  # colibri_lowbit_write


def write_lowbit_sidecar(
    model: str | os.PathLike[str], qtype: str = "q2_k", threads: int | None = None
) -> Path:
    """Write ``MODEL.lowbit``: every routed expert of the GGUF `model` requantized to `qtype` (q2_k or
    iq4_xs; rows that 256 does not divide take Q4_0 / IQ4_NL), with a header naming the model's size
    and digests so that it is refused beside any other file. Returns its path; nothing is left there
    on failure."""
    from colibri_backend._native import load_library

    src = Path(model)
    if not src.is_file():
        raise FileNotFoundError(f"model {src} does not exist")
    if qtype.lower() not in LOWBIT_TYPES:
        raise ValueError(f"low-bit sidecar type {qtype!r}: choose one of {', '.join(LOWBIT_TYPES)}")
    out = Path(f"{src}.lowbit")
    lib = load_library()
    n = int(threads) if threads else (os.cpu_count() or 1)
    status = lib.colibri_lowbit_write(os.fsencode(src), qtype.lower().encode(), os.fsencode(out), n)
    lib.check(status, f"low-bit sidecar of {src}")
    return out


__all__ = [
    "LOWBIT_TYPES",
    "ImatrixError",
    "quantize",
    "quantize_types",
    "read_imatrix",
    "write_lowbit_sidecar",
]
