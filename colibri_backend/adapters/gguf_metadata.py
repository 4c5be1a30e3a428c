"""Fast reader of a GGUF file's metadata (header and key/value section only).

gguf.GGUFReader parses every tensor record and builds a numpy view per array element, which
takes seconds on a 49k-token vocabulary; loading a model should not. This reader walks the
key/value section once with struct, checks every length against the file, and returns plain
Python values (strings, numbers, lists; numeric arrays as numpy arrays).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from colibri_backend.errors import ModelFormatError

GGUF_MAGIC = b"GGUF"

# GGUF value type ids -> (struct format, numpy dtype) for the fixed-size ones.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),  # UINT8
    1: ("<b", "<i1"),  # INT8
    2: ("<H", "<u2"),  # UINT16
    3: ("<h", "<i2"),  # INT16
    4: ("<I", "<u4"),  # UINT32
    5: ("<i", "<i4"),  # INT32
    6: ("<f", "<f4"),  # FLOAT32
    7: ("<?", "<u1"),  # BOOL
    10: ("<Q", "<u8"),  # UINT64
    11: ("<q", "<i8"),  # INT64
    12: ("<d", "<f8"),  # FLOAT64
}
_STRING = 8
_ARRAY = 9

# Upper bounds that no real file reaches; they stop a corrupt count from allocating the machine.
_MAX_KV = 1 << 20
_MAX_ARRAY = 1 << 28


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def fail(self, what: str) -> ModelFormatError:
        return ModelFormatError("COLIBRI_E_FORMAT", f"{self.path}: {what} (at byte {self.pos})")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"truncated: needs {n} more bytes")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # Some vocabularies hold byte tokens that are not valid UTF-8 on their own.
            return raw.decode("utf-8", "surrogateescape")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            v = self.unpack(_SCALARS[vtype][0])
            return bool(v) if vtype == 7 else v
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.unpack("<I")
            count = self.unpack("<Q")
            if count > _MAX_ARRAY:
                raise self.fail(f"array of {count} elements is implausibly large")
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1])
                raw = self.take(count * dtype.itemsize)
                arr = np.frombuffer(raw, dtype=dtype).copy()
                return arr.astype(bool) if etype == 7 else arr
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            raise self.fail(f"unknown array element type {etype}")
        raise self.fail(f"unknown value type {vtype}")


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Key/value metadata of a GGUF file, plus "GGUF.version" and "GGUF.tensor_count"."""
    p = Path(path)
    with open(p, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ModelFormatError("COLIBRI_E_FORMAT", f"{p}: not a GGUF file ({size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            cur = _Cursor(mm, str(p))
            if cur.take(4) != GGUF_MAGIC:
                raise ModelFormatError("COLIBRI_E_FORMAT", f"{p}: not a GGUF file (bad magic)")
            version = cur.unpack("<I")
            if version not in (2, 3):
                raise ModelFormatError("COLIBRI_E_FORMAT", f"{p}: unsupported GGUF version {version}")
            n_tensors = cur.unpack("<Q")
            n_kv = cur.unpack("<Q")
            if n_kv > _MAX_KV:
                raise cur.fail(f"{n_kv} metadata entries is implausibly many")
            meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors}
            for _ in range(n_kv):
                key = cur.string()
                vtype = cur.unpack("<I")
                meta[key] = cur.value(vtype)
            return meta
