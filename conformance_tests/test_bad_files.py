"""Bad files: mutated GGUFs are refused with an error code, never a crash.

A tiny llama-architecture model (two layers, every computable tensor type, a gpt2 tokenizer
section) is written here with the gguf package's GGUFWriter; the engine must load it and run it.
From it about 2300 mutants are derived: truncations at many offsets, bit flips in the header,
metadata and tensor table, and header/metadata/tensor-table fields rewritten (huge counts and
lengths, unknown types, offsets past the end or misaligned, zero or huge dimensions, duplicate
and missing tensor names, hyperparameters that contradict the tensor shapes). Each goes through
the full model-open path (colibri_model_open), so model validation is covered as well as the
GGUF reader.

Mutants are classified when they are made:
  * must_fail — provably invalid (a truncated tensor, an impossible count, ...): the engine must
    return an error status with a message;
  * may_pass  — could still be a valid file (a flipped bit in a string, a count off by one that
    happens to parse, ...): if the engine accepts it, the file is checked to be valid by an
    independent parser (the gguf package's GGUFReader plus the structural checks below), and
    the engine must run one eval on it (logits may be non-finite when the mutation
    reinterpreted weight bytes, e.g. an F32 tensor retyped as BF16: that is garbage in, not a bug).
Nothing may crash, hang, or return COLIBRI_E_INTERNAL. The mutants run in batches inside
subprocesses (this module is also the worker: `python test_bad_files.py --worker JOB`); when a
worker dies, the mutant it was on is reported by name, and the rest of its batch is rerun.

Set COLIBRI_BAD_FILES_DIR=/some/dir to also write every mutant there (for an AddressSanitizer
run of native/tools/gguf_check.c over the corpus).
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = 0x46554747
OK = 0
E_UNSUPPORTED = 4
E_INTERNAL = 8

# The tiny model's dimensions (llama, GQA 2:1, head_dim 16).
N_VOCAB = 96
N_EMBD = 64
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = N_EMBD // N_HEAD
N_FF = 96
N_LAYER = 2

# Value types of the GGUF spec: fixed sizes (None: string / array).
VT_SIZES: dict[int, int | None] = {
    0: 1,
    1: 1,
    2: 2,
    3: 2,
    4: 4,
    5: 4,
    6: 4,
    7: 1,
    8: None,
    9: None,
    10: 8,
    11: 8,
    12: 8,
}
VT_STRING, VT_ARRAY = 8, 9
# ggml type id -> (block size, block bytes), every standard type (for the independent check)
GGML_SIZES = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
    16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
    23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
    34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18),
}  # fmt: skip


# ---- the valid model ---------------------------------------------------------------------------


def write_valid_model(path: Path) -> None:
    """A tiny llama GGUF the engine fully accepts, with every computable tensor type."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    rng = np.random.default_rng(1234)
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("colibri-bad-files-base")
    w.add_context_length(128)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(N_VOCAB)
    w.add_file_type(7)
    tokens = [chr(c) for c in range(33, 33 + N_VOCAB - 1)] + ["<|endoftext|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (N_VOCAB - 1) + [3])
    w.add_token_merges(["a b", "c d", "ab cd"])
    w.add_bos_token_id(N_VOCAB - 1)
    w.add_eos_token_id(N_VOCAB - 1)

    def add(name: str, rows: int, cols: int, qtype: T, scale: float = 0.05) -> None:
        if rows == 0:  # a vector
            x = (1.0 + scale * rng.standard_normal(cols)).astype(np.float32)
        else:
            x = (scale * rng.standard_normal((rows, cols))).astype(np.float32)
        if qtype == T.F32:
            w.add_tensor(name, x)
        elif qtype == T.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, quants.quantize(x, qtype), raw_dtype=qtype)

    add("token_embd.weight", N_VOCAB, N_EMBD, T.Q8_0, 1.0)
    for il in range(N_LAYER):
        p = f"blk.{il}."
        add(p + "attn_norm.weight", 0, N_EMBD, T.F32)
        add(p + "attn_q.weight", N_HEAD * HEAD_DIM, N_EMBD, T.F16)
        add(p + "attn_k.weight", N_HEAD_KV * HEAD_DIM, N_EMBD, T.Q4_0)
        add(p + "attn_v.weight", N_HEAD_KV * HEAD_DIM, N_EMBD, T.BF16)
        add(p + "attn_output.weight", N_EMBD, N_HEAD * HEAD_DIM, T.Q8_0)
        add(p + "ffn_norm.weight", 0, N_EMBD, T.F32)
        add(p + "ffn_gate.weight", N_FF, N_EMBD, T.Q4_1)
        add(p + "ffn_up.weight", N_FF, N_EMBD, T.F32)
        add(p + "ffn_down.weight", N_EMBD, N_FF, T.Q4_0)
    add("output_norm.weight", 0, N_EMBD, T.F32)
    add("output.weight", N_VOCAB, N_EMBD, T.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- an independent structural parser ----------------------------------------------------------


class LayoutError(Exception):
    pass


@dataclass
class Span:
    """One field of the file: where it is and what it is."""

    offset: int
    size: int
    kind: str  # "magic", "version", "n_tensors", "n_kv", "key_len", "vtype", "str_len", ...
    owner: str  # the key or tensor it belongs to ("" for the header)
    value: int = 0


@dataclass
class TensorInfo:
    name: str
    ne: list[int]
    ggml_type: int
    rel_offset: int
    entry: int  # offset of the table entry
    nbytes: int = 0


@dataclass
class Layout:
    spans: list[Span] = field(default_factory=list)
    kvs: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    alignment: int = 32
    data_offset: int = 0
    meta_end: int = 0  # end of the tensor table


def parse_layout(data: bytes) -> Layout:
    """Parses a GGUF, recording every field, and applies the spec's validity rules.
    Raises LayoutError for anything invalid. Written from the spec, independently of gguf.c."""
    lay = Layout()
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise LayoutError(f"read of {n} bytes at {pos} past the end ({len(data)})")
        b = data[pos : pos + n]
        pos += n
        return b

    def u32(kind: str, owner: str) -> int:
        at = pos
        v = struct.unpack("<I", take(4))[0]
        lay.spans.append(Span(at, 4, kind, owner, v))
        return v

    def u64(kind: str, owner: str) -> int:
        at = pos
        v = struct.unpack("<Q", take(8))[0]
        lay.spans.append(Span(at, 8, kind, owner, v))
        return v

    def string(kind: str, owner: str) -> bytes:
        n = u64(kind + "_len", owner)
        at = pos
        s = take(n)
        # a key or tensor name is its own owner
        lay.spans.append(Span(at, n, kind, owner or s.decode("utf-8", "replace")))
        return s

    if u32("magic", "") != GGUF_MAGIC:
        raise LayoutError("magic")
    version = u32("version", "")
    if version not in (2, 3):
        raise LayoutError(f"version {version}")
    n_tensors = u64("n_tensors", "")
    n_kv = u64("n_kv", "")
    if n_kv > len(data) or n_tensors > len(data):
        raise LayoutError("counts")
    for _ in range(n_kv):
        key_b = string("key", "")
        if not key_b:
            raise LayoutError("empty key")
        key = key_b.decode("utf-8", "replace")
        if key in lay.kvs:
            raise LayoutError(f"duplicate key {key}")
        vt = u32("vtype", key)
        if vt not in VT_SIZES:
            raise LayoutError(f"value type {vt}")
        if vt == VT_STRING:
            lay.kvs[key] = string("str", key)
        elif vt == VT_ARRAY:
            at = u32("arr_type", key)
            count = u64("arr_len", key)
            if at not in VT_SIZES or at == VT_ARRAY:
                raise LayoutError(f"array type {at}")
            if at == VT_STRING:
                if count > len(data):
                    raise LayoutError("array count")
                lay.kvs[key] = [string("arr_str", key) for _ in range(count)]
            else:
                size = VT_SIZES[at]
                assert size is not None
                start = pos
                raw = take(count * size)
                lay.spans.append(Span(start, len(raw), "arr_data", key))
                if at == 7 and any(b > 1 for b in raw):
                    raise LayoutError("bool")
                lay.kvs[key] = raw
        else:
            size = VT_SIZES[vt]
            assert size is not None
            at_ = pos
            raw = take(size)
            lay.spans.append(Span(at_, size, f"val{vt}", key, int.from_bytes(raw, "little")))
            if vt == 7 and raw[0] > 1:
                raise LayoutError("bool")
            lay.kvs[key] = (vt, raw)
    if "general.alignment" in lay.kvs:
        vt, raw = lay.kvs["general.alignment"]
        a = int.from_bytes(raw, "little")
        if vt != 4 or a == 0 or a & (a - 1):
            raise LayoutError("alignment")
        lay.alignment = a
    names: set[str] = set()
    for _ in range(n_tensors):
        entry = pos
        name_b = string("name", "")
        name = name_b.decode("utf-8", "replace")
        if not name_b or len(name_b) > 127 or b"\0" in name_b or name in names:
            raise LayoutError(f"tensor name {name!r}")
        names.add(name)
        n_dims = u32("n_dims", name)
        if not 1 <= n_dims <= 4:
            raise LayoutError(f"n_dims {n_dims}")
        ne = [u64(f"ne{d}", name) for d in range(n_dims)]
        gt = u32("ggml_type", name)
        off = u64("offset", name)
        if any(d < 1 or d >= 1 << 63 for d in ne) or gt not in GGML_SIZES:
            raise LayoutError(f"tensor {name}: shape {ne} type {gt}")
        bs, bb = GGML_SIZES[gt]
        if ne[0] % bs:
            raise LayoutError(f"tensor {name}: row {ne[0]} vs block {bs}")
        count = 1
        for d in ne:
            count *= d
        if count >= 1 << 63:
            raise LayoutError("element count")
        nbytes = count // bs * bb
        lay.tensors.append(TensorInfo(name, ne, gt, off, entry, nbytes))
    lay.meta_end = pos
    lay.data_offset = (pos + lay.alignment - 1) // lay.alignment * lay.alignment
    if lay.tensors and lay.data_offset > len(data):
        raise LayoutError("data section past the end")
    ranges = []
    for t in lay.tensors:
        if t.rel_offset % lay.alignment or lay.data_offset + t.rel_offset + t.nbytes > len(data):
            raise LayoutError(f"tensor {t.name}: data placement")
        ranges.append((t.rel_offset, t.rel_offset + t.nbytes))
    ranges.sort()
    for (_, a_end), (b_start, _) in zip(ranges, ranges[1:], strict=False):
        if a_end > b_start:
            raise LayoutError("overlapping tensors")
    return lay


def independently_valid(data: bytes, path: Path) -> str | None:
    """None if both independent parsers accept the file, else why not."""
    try:
        parse_layout(data)
    except (LayoutError, struct.error, UnicodeError) as exc:
        return f"structural parser: {exc}"
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        for t in reader.tensors:
            _ = t.data.shape
    except Exception as exc:  # noqa: BLE001 - any failure of the reference reader means "invalid"
        return f"gguf.GGUFReader: {type(exc).__name__}: {exc}"
    return None


# ---- mutations ------------------------------------------------------------------------------------


@dataclass
class Mutation:
    name: str
    must_fail: bool
    truncate: int | None = None  # keep only the first N bytes
    patches: list[tuple[int, bytes]] = field(default_factory=list)
    expect: int | None = None  # the exact status required, where it is known

    def apply(self, base: bytes) -> bytes:
        b = bytearray(base if self.truncate is None else base[: self.truncate])
        for off, data in self.patches:
            b[off : off + len(data)] = data
        return bytes(b)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "truncate": self.truncate,
            "patches": [[o, d.hex()] for o, d in self.patches],
        }


def u32b(v: int) -> bytes:
    return struct.pack("<I", v & 0xFFFFFFFF)


def u64b(v: int) -> bytes:
    return struct.pack("<Q", v & 0xFFFFFFFFFFFFFFFF)


def make_mutations(base: bytes, lay: Layout, seed: int = 20261129) -> list[Mutation]:
    rng = random.Random(seed)
    muts: list[Mutation] = []
    data_end = max(lay.data_offset + t.rel_offset + t.nbytes for t in lay.tensors)
    assert data_end <= len(base)

    # 1. truncations: every offset of the metadata region (sampled evenly), some inside the data
    stride = max(1, lay.data_offset // 450)
    cuts = set(range(0, lay.data_offset + 1, stride)) | {lay.meta_end - 1, lay.meta_end, lay.data_offset}
    cuts |= {rng.randrange(lay.data_offset, data_end) for _ in range(60)}
    cuts |= {data_end - 1}
    for n in sorted(cuts):
        if n < data_end:
            muts.append(Mutation(f"truncate to {n} bytes (data ends at {data_end})", True, truncate=n))
        else:  # only padding cut: still a valid file
            muts.append(Mutation(f"truncate to {n} bytes (padding only)", False, truncate=n))

    # 2. bit flips anywhere before the tensor data
    for _ in range(420):
        off = rng.randrange(0, lay.data_offset)
        bit = rng.randrange(8)
        span = next((s for s in lay.spans if s.offset <= off < s.offset + max(s.size, 1)), None)
        where = f"{span.kind} of '{span.owner}'" if span else "padding"
        muts.append(
            Mutation(
                f"flip bit {bit} at {off} ({where})", False, patches=[(off, bytes([base[off] ^ (1 << bit)]))]
            )
        )

    def spans(kind: str) -> list[Span]:
        return [s for s in lay.spans if s.kind == kind]

    def rewrite(span: Span, value: int, must_fail: bool, why: str) -> None:
        enc = u32b(value) if span.size == 4 else u64b(value)
        owner = f" of '{span.owner}'" if span.owner else ""
        muts.append(
            Mutation(
                f"{span.kind}{owner} {span.value} -> {value} ({why})", must_fail, patches=[(span.offset, enc)]
            )
        )

    huge64 = [1 << 63, (1 << 64) - 1, 1 << 40, 1 << 32, len(base)]
    # 3. header fields
    (magic,) = spans("magic")
    for v in (0, 0x47475546, GGUF_MAGIC ^ 0x20):
        rewrite(magic, v, True, "bad magic")
    (version,) = spans("version")
    for v in (0, 1, 4, 0x03000000, 0xFFFFFFFF):
        rewrite(version, v, True, "unsupported version")
    rewrite(version, 2, False, "v2 has the v3 layout")
    for kind in ("n_tensors", "n_kv"):
        (s,) = spans(kind)
        for v in huge64:
            rewrite(s, v, True, "huge count")
        for v in (s.value + 1, s.value - 1, 0):
            rewrite(s, v, False, "count off")

    # 4. metadata fields
    for s in spans("key_len"):
        for v in (0, *huge64):
            rewrite(s, v, True, "key length")
        rewrite(s, s.value + 1, False, "key length off by one")
    for s in spans("vtype"):
        for v in (13, 99, 0xFFFFFFFF):
            rewrite(s, v, True, "unknown value type")
        other = rng.choice([t for t in VT_SIZES if t != s.value])
        rewrite(s, other, False, "other value type")
    for s in spans("str_len") + spans("arr_str_len")[:40]:
        for v in huge64[:4]:
            rewrite(s, v, True, "string length")
        rewrite(s, s.value + 3, False, "string length off")
    for s in spans("arr_type"):
        for v in (13, 0xFFFFFFFF):
            rewrite(s, v, True, "unknown array type")
        rewrite(s, VT_ARRAY, True, "nested array")
        rewrite(
            s, rng.choice([t for t in VT_SIZES if t not in (s.value, VT_ARRAY)]), False, "other array type"
        )
    for s in spans("arr_len"):
        for v in huge64:
            rewrite(s, v, True, "array length")
        rewrite(s, s.value + 1, False, "array length off")

    # 5. tensor table
    by_name = {t.name: t for t in lay.tensors}
    for t in lay.tensors:
        tsp = {s.kind: s for s in lay.spans if s.owner == t.name}
        name_len = next(s for s in lay.spans if s.kind == "name_len" and s.offset == t.entry)
        for v in (0, 128, 200, *huge64):
            rewrite(name_len, v, True, "name length")
        for v in (0, 5, 0xFFFFFFFF):
            rewrite(tsp["n_dims"], v, True, "dimension count")
        for d in range(len(t.ne)):
            s = tsp[f"ne{d}"]
            for v in (0, 1 << 63, (1 << 64) - 1, 1 << 40):
                rewrite(s, v, True, "dimension")
            # a changed shape no longer matches the hyperparameters (or the data)
            bs = GGML_SIZES[t.ggml_type][0]
            rewrite(s, t.ne[d] + (bs if d == 0 else 1), True, "shape vs hyperparameters")
        gt = tsp["ggml_type"]
        for v in (4, 5, 31, 36, 99, 0xFFFFFFFF):
            rewrite(gt, v, True, "unknown ggml type")
        rewrite(gt, 12, True, "Q4_K: row not a multiple of 256")
        # known ggml types without kernels: a valid GGUF, which the model loader must refuse as unsupported
        rows = 1
        for d in t.ne[1:]:
            rows *= d
        # Q8_1 (40 bytes per 32) is the larger of the two: the data still fits
        nb_q8_1 = t.ne[0] // 32 * 40 * rows
        if t.ggml_type in (0, 1, 30) and t.ne[0] % 32 == 0 and nb_q8_1 <= t.nbytes:
            kinds = [(9, "Q8_1")] + ([(41, "Q1_0")] if t.ne[0] % 128 == 0 else [])
            for v, label in kinds:
                rewrite(gt, v, True, f"{label}: known type without kernels")
                muts[-1].expect = E_UNSUPPORTED
        rewrite(gt, rng.choice([0, 1, 2, 3, 8, 30]), False, "other computable type")
        off = tsp["offset"]
        for v in (t.rel_offset + 1, t.rel_offset + 16, len(base), 1 << 63, (1 << 64) - 32):
            rewrite(off, v, True, "misaligned or out-of-range offset")
        other = rng.choice([x for x in lay.tensors if x is not t])
        rewrite(off, other.rel_offset, True, f"same data as '{other.name}' (overlap)")
    # duplicate and missing names (same-length rewrites keep the table parseable)
    for il in range(N_LAYER):
        for part in ("attn_q", "attn_k", "ffn_up", "ffn_norm"):
            t = by_name[f"blk.{il}.{part}.weight"]
            s = next(x for x in lay.spans if x.kind == "name" and x.offset == t.entry + 8)
            other = f"blk.{1 - il}.{part}.weight".encode()
            muts.append(
                Mutation(
                    f"tensor '{t.name}' renamed to '{other.decode()}' (duplicate)",
                    True,
                    patches=[(s.offset, other)],
                )
            )
            missing = t.name.replace(part, part[:-1] + "X").encode()
            muts.append(
                Mutation(
                    f"tensor '{t.name}' renamed to '{missing.decode()}' (missing tensor)",
                    True,
                    patches=[(s.offset, missing)],
                )
            )
    for name in ("token_embd.weight", "output_norm.weight"):
        t = by_name[name]
        s = next(x for x in lay.spans if x.kind == "name" and x.offset == t.entry + 8)
        muts.append(
            Mutation(f"tensor '{name}' renamed (missing)", True, patches=[(s.offset, name.upper().encode())])
        )

    # 6. hyperparameters that contradict the tensors
    def kv_value_span(key: str) -> Span:
        return next(s for s in lay.spans if s.owner == key and s.kind.startswith("val"))

    bad_values = {
        "llama.embedding_length": [0, 1, 32, 65, 128, 1 << 31, 0xFFFFFFFF],
        "llama.block_count": [0, 3, 1000, 0xFFFFFFFF],
        "llama.feed_forward_length": [0, 64, 97, 0xFFFFFFFF],
        "llama.attention.head_count": [0, 3, 5, 64, 0xFFFFFFFF],
        "llama.attention.head_count_kv": [0, 3, 8, 0xFFFFFFFF],
    }
    for key, values in bad_values.items():
        s = kv_value_span(key)
        for v in values:
            rewrite(s, v, True, "contradicts the tensor shapes")
    for key, values in {
        "llama.context_length": [0, 1, 0xFFFFFFFF],
        "llama.rope.dimension_count": [0, 2, 17, 1000],
        "llama.block_count": [1],
        "llama.attention.head_count": [2, 8],
    }.items():
        s = kv_value_span(key)
        for v in values:
            rewrite(s, v, False, "unusual hyperparameter")
    for key in ("llama.attention.layer_norm_rms_epsilon", "llama.rope.freq_base"):
        s = kv_value_span(key)
        for f in (0.0, -1.0, float("nan"), float("inf")):
            muts.append(Mutation(f"{key} -> {f}", False, patches=[(s.offset, struct.pack("<f", f))]))
    arch = next(s for s in lay.spans if s.kind == "str" and s.owner == "general.architecture")
    for v in (b"llamb", b"LLAMA", b"\xff\xfe\x00\x01\x02"):
        muts.append(Mutation(f"general.architecture -> {v!r}", True, patches=[(arch.offset, v)]))
        muts[-1].expect = E_UNSUPPORTED if v.isalpha() else None

    for i, m in enumerate(muts):
        m.name = f"#{i} {m.name}"
    return muts


# ---- the worker (runs in a subprocess) ----------------------------------------------------------


def _eval_once(lib: Any, native: Any, model: Any) -> str:
    """Runs token 1 through a fresh context; returns "finite", or what went wrong."""
    import ctypes

    params = native.ContextParamsC()
    lib.colibri_context_default_params(ctypes.byref(params))
    params.n_threads = 1
    params.n_ctx = 16
    params.n_batch = 4
    ctx = ctypes.c_void_p()
    st = lib.colibri_context_new(model, ctypes.byref(params), ctypes.byref(ctx))
    if st != OK:
        return f"context_new status {st}: {lib.last_error()}"
    info = native.ModelInfoC()
    lib.colibri_model_get_info(model, ctypes.byref(info))
    logits = np.zeros(max(1, info.n_vocab), dtype=np.float32)
    tokens = np.array([1], dtype=np.int32)
    st = lib.colibri_eval(ctx, native.i32_ptr(tokens), 1, native.f32_ptr(logits), 0)
    lib.colibri_context_free(ctx)
    if st != OK:
        return f"eval status {st}: {lib.last_error()}"
    return "finite" if np.isfinite(logits).all() else "non-finite logits"


def worker_main(job_path: str) -> None:
    import ctypes

    from colibri_backend import _native

    job = json.loads(Path(job_path).read_text())
    base = Path(job["base"]).read_bytes()
    lib = _native.load_library()
    tmp = Path(job["tmp"])
    for m in job["mutations"]:
        data = Mutation(
            m["name"], False, m["truncate"], [(o, bytes.fromhex(d)) for o, d in m["patches"]]
        ).apply(base)
        tmp.write_bytes(data)
        model = ctypes.c_void_p()
        st = lib.colibri_model_open(str(tmp).encode(), ctypes.byref(model))
        msg = lib.last_error()
        ev = None
        if st == OK:
            ev = _eval_once(lib, _native, model)
            lib.colibri_model_close(model)
        sys.stdout.write(json.dumps({"name": m["name"], "status": st, "msg": msg, "eval": ev}) + "\n")
        sys.stdout.flush()


# ---- the test ---------------------------------------------------------------------------------------


def run_batch(
    base: Path, muts: list[Mutation], workdir: Path, tag: str, timeout: float
) -> tuple[list[dict], list[str]]:
    """Runs mutants in worker subprocesses; returns their results and the crashes (by mutant)."""
    results: list[dict] = []
    crashes: list[str] = []
    todo = list(muts)
    round_ = 0
    while todo:
        round_ += 1
        job = workdir / f"job-{tag}-{round_}.json"
        job.write_text(
            json.dumps(
                {
                    "base": str(base),
                    "tmp": str(workdir / f"mutant-{tag}.gguf"),
                    "mutations": [m.to_json() for m in todo],
                }
            )
        )
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", str(job)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=os.environ.copy(),
            )
            out, err, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err, rc = "timeout", -9
        done = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        results.extend(done)
        if rc == 0 and len(done) == len(todo):
            break
        culprit = todo[len(done)] if len(done) < len(todo) else None
        if culprit is None:
            crashes.append(f"worker exited {rc} after its last mutant: {err[-2000:]}")
            break
        crashes.append(f"{culprit.name}: worker died (exit {rc}): {err[-2000:]}")
        todo = todo[len(done) + 1 :]
    return results, crashes


def test_valid_model_loads_and_runs(tmp_path: Path) -> None:
    from colibri_backend import _native

    path = tmp_path / "base.gguf"
    write_valid_model(path)
    data = path.read_bytes()
    lay = parse_layout(data)
    assert len(lay.tensors) == 3 + 9 * N_LAYER
    assert independently_valid(data, path) is None
    import ctypes

    lib = _native.load_library()
    model = ctypes.c_void_p()
    st = lib.colibri_model_open(str(path).encode(), ctypes.byref(model))
    assert st == OK, lib.last_error()
    try:
        info = _native.ModelInfoC()
        assert lib.colibri_model_get_info(model, ctypes.byref(info)) == OK
        assert info.arch.decode() == "llama"
        assert (info.n_vocab, info.n_embd, info.n_layer, info.n_head, info.n_head_kv, info.n_ff) == (
            N_VOCAB,
            N_EMBD,
            N_LAYER,
            N_HEAD,
            N_HEAD_KV,
            N_FF,
        )
        assert _eval_once(lib, _native, model) == "finite"
    finally:
        lib.colibri_model_close(model)


def test_bad_files(tmp_path: Path) -> None:
    base = tmp_path / "base.gguf"
    write_valid_model(base)
    data = base.read_bytes()
    lay = parse_layout(data)
    muts = make_mutations(data, lay)
    assert len(muts) >= 1000, len(muts)
    by_name = {m.name: m for m in muts}

    dump = os.environ.get("COLIBRI_BAD_FILES_DIR")
    if dump:
        out = Path(dump)
        out.mkdir(parents=True, exist_ok=True)
        (out / "base.gguf").write_bytes(data)
        for i, m in enumerate(muts):
            (out / f"mutant-{i:05d}.gguf").write_bytes(m.apply(data))
        (out / "index.json").write_text(json.dumps([m.name for m in muts], indent=0))

    n_workers = 2
    chunks = [muts[i::n_workers] for i in range(n_workers)]
    with ThreadPoolExecutor(n_workers) as pool:
        futs = [
            pool.submit(run_batch, base, chunk, tmp_path, str(i), 240.0) for i, chunk in enumerate(chunks)
        ]
        outcomes = [f.result() for f in futs]
    results = [r for res, _ in outcomes for r in res]
    crashes = [c for _, cr in outcomes for c in cr]

    problems: list[str] = [f"CRASH {c}" for c in crashes]
    accepted: list[str] = []
    status_counts: dict[int, int] = {}
    non_finite = 0
    for r in results:
        m = by_name[r["name"]]
        status_counts[r["status"]] = status_counts.get(r["status"], 0) + 1
        if r["status"] == E_INTERNAL:
            problems.append(f"{m.name}: COLIBRI_E_INTERNAL: {r['msg']}")
        elif r["status"] != OK:
            if not r["msg"]:
                problems.append(f"{m.name}: status {r['status']} without a message")
            if m.expect is not None and r["status"] != m.expect:
                problems.append(f"{m.name}: status {r['status']} ({r['msg']}), expected {m.expect}")
            continue
        elif m.must_fail:
            problems.append(f"{m.name}: accepted, but the file is invalid")
        else:
            accepted.append(m.name)
            mutant = tmp_path / "accepted.gguf"
            mutant.write_bytes(m.apply(data))
            why = independently_valid(mutant.read_bytes(), mutant)
            if why is not None:
                problems.append(f"{m.name}: accepted, but the independent parser refuses it: {why}")
            # garbage weights (a retyped tensor) may give non-finite logits; the eval must still run
            if r["eval"] not in ("finite", "non-finite logits"):
                problems.append(f"{m.name}: accepted, but one eval fails: {r['eval']}")
            non_finite += r["eval"] == "non-finite logits"
    assert len(results) + len(crashes) >= len(muts), "some mutants were never run"
    summary = (
        f"{len(muts)} mutants, statuses {dict(sorted(status_counts.items()))}, "
        f"{len(accepted)} accepted as still valid (one eval each; {non_finite} with non-finite logits), "
        f"{len(crashes)} crashes"
    )
    print(summary)
    if os.environ.get("COLIBRI_BAD_FILES_VERBOSE"):
        print("\n".join(accepted))
    assert not problems, summary + "\n" + "\n".join(problems[:60])


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    worker_main(sys.argv[2])
