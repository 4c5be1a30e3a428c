"""Routing profiles: which experts a model's tokens route to, learned offline from a corpus.

`colibri profile MODEL CORPUS...` runs the corpus teacher-forced through the engine, counts for
every token bucket and layer which experts the router chose, and writes MODEL.routing next to the
model. The engine reads it (native/src/profile.h) to warm and pin the expert cache, as the hashed
token-table predictor, for the routing pre-filter and to drop cold experts.

    from colibri_backend.profile import build_profile, write_profile, read_profile, profile_path
    prof = build_profile(model, ["Lib/"], max_tokens=300_000)   # model = colibri_backend.load(...)
    write_profile(profile_path(model.path), prof)
    prof = read_profile(profile_path(model.path), model_path=model.path)

File layout (little-endian, no padding; native/src/profile.h is the reference):

    magic "CLBRPRF1" | u32 version=1 | u32 n_layer, n_expert, n_expert_used | u32 n_buckets, n_cand
    | u64 model_bytes | u64 model_fingerprint | u64 n_tokens
    | f32 share[n_layer][n_expert] | u16 cand[n_buckets][n_layer][n_cand] | u64 checksum

bucket(token) = ((token * 0x9E3779B1) mod 2^32) >> (32 - log2 n_buckets) (0 when n_buckets == 1).
The fingerprint is FNV-1a 64 of the GGUF's first min(size, 1 MiB) bytes; the checksum FNV-1a 64
of every byte before it.
"""

from __future__ import annotations

import math
import os
import struct
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"CLBRPRF1"
VERSION = 1
HEADER = struct.Struct("<8sIIIIIIQQQ")  # 56 bytes, see the module doc
MAX_BUCKETS = 1 << 24
DEFAULT_MAX_BUCKETS = 1 << 20
MAX_CAND = 64
FINGERPRINT_BYTES = 1 << 20
SUFFIX = ".routing"
# What a directory given as corpus contributes: text files with these extensions, recursively.
TEXT_EXTENSIONS = (
    ".py", ".pyi", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java",
    ".js", ".ts", ".json", ".toml", ".yaml", ".yml", ".html", ".css", ".sh", ".sql", ".tex",
)  # fmt: skip
_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", "node_modules", ".venv", ".tox"}

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


def fnv1a64(data: bytes | bytearray | memoryview, h: int = _FNV_OFFSET) -> int:
    """FNV-1a 64 of `data`, continuing from `h`. Byte-serial by definition, so a plain loop
    (about 10 MB/s in CPython; a profile of a large model takes a while to checksum)."""
    prime, mask = _FNV_PRIME, _MASK64
    for b in bytes(data):
        h = ((h ^ b) * prime) & mask
    return h


def model_fingerprint(model_path: str | os.PathLike[str]) -> tuple[int, int]:
    """(FNV-1a 64 of the first min(size, 1 MiB) bytes, size in bytes) of a model file."""
    with open(model_path, "rb") as f:
        head = f.read(FINGERPRINT_BYTES)
        size = os.fstat(f.fileno()).st_size
    return fnv1a64(head), size


def profile_path(model_path: str | os.PathLike[str]) -> Path:
    """The sidecar a model's routing profile lives in: MODEL.gguf -> MODEL.gguf.routing."""
    p = Path(model_path)
    return p.with_name(p.name + SUFFIX)


def default_buckets(n_vocab: int) -> int:
    """The next power of two >= n_vocab, at most 2^20 (one bucket per token id when that fits)."""
    n = 1
    while n < n_vocab and n < DEFAULT_MAX_BUCKETS:
        n <<= 1
    return n


def bucket_of(tokens: np.ndarray | Sequence[int], n_buckets: int) -> np.ndarray:
    """Bucket of each token id (int64 array), the engine's hash (profile.h profile_bucket)."""
    t = np.asarray(tokens, dtype=np.int64)
    if n_buckets == 1:
        return np.zeros(t.shape, dtype=np.int64)
    shift = 32 - (n_buckets.bit_length() - 1)
    h = (t.astype(np.uint64) * np.uint64(0x9E3779B1)) & np.uint64(0xFFFFFFFF)
    return (h >> np.uint64(shift)).astype(np.int64)


@dataclass
class RoutingProfile:
    """A routing profile in memory (the arrays of the file, see the module doc).

    share: float32 [n_layer, n_expert]  fraction of profiled tokens whose top-k included the expert
    cand:  uint16 [n_buckets, n_layer, n_cand]  candidate experts per (bucket, layer), likeliest first
    """

    n_expert_used: int
    n_tokens: int
    model_bytes: int
    model_fingerprint: int
    share: np.ndarray
    cand: np.ndarray

    @property
    def n_layer(self) -> int:
        return int(self.share.shape[0])

    @property
    def n_expert(self) -> int:
        return int(self.share.shape[1])

    @property
    def n_buckets(self) -> int:
        return int(self.cand.shape[0])

    @property
    def n_cand(self) -> int:
        return int(self.cand.shape[2])

    def candidates(self, token: int, layer: int) -> np.ndarray:
        """The n_cand candidate experts of `token` at `layer`, likeliest first."""
        return self.cand[int(bucket_of([token], self.n_buckets)[0]), layer]

    def hottest(self, layer: int) -> np.ndarray:
        """Experts of `layer` by share, hottest first (ties: lower id first)."""
        return _global_order(self.share[layer])

    def recall(self, tokens: np.ndarray, ids: np.ndarray, top: int | None = None) -> np.ndarray:
        """Per layer, the fraction of the actual routing `ids` [T, n_layer, k] of `tokens` [T] that
        is among the table's first `top` candidates (default: k, i.e. recall@k of the table)."""
        return table_recall(self, tokens, ids, top)


def _global_order(share_row: np.ndarray) -> np.ndarray:
    """Expert ids by decreasing share, ties by increasing id."""
    e = np.arange(share_row.size)
    return np.lexsort((e, -share_row.astype(np.float64)))


def profile_from_routing(
    tokens: np.ndarray,
    ids: np.ndarray,
    n_expert: int,
    *,
    n_buckets: int,
    n_cand: int,
    model_bytes: int = 0,
    model_fingerprint: int = 0,
) -> RoutingProfile:
    """The profile of a routing: tokens int [T], ids int [T, n_layer, k] (distinct per row).

    Candidates of a (bucket, layer): experts by how often that bucket's tokens chose them, ties
    broken by the layer's global share, then by id; experts its tokens never chose come after, in
    the same global order, so a bucket no token fell in holds the layer's hottest experts."""
    tokens = np.asarray(tokens, dtype=np.int64)
    ids = np.asarray(ids)
    if ids.ndim != 3 or tokens.shape != (ids.shape[0],):
        raise ValueError(
            f"routing ids {ids.shape} and tokens {tokens.shape} do not match ([T, L, k] and [T])"
        )
    n_tok, n_layer, k = ids.shape
    _check_dims(n_layer, n_expert, k, n_buckets, n_cand)
    if n_tok == 0:
        raise ValueError("no tokens to profile: the corpus is empty")
    # a layer without experts (DeepSeek's leading dense layers) records -1 for every choice (the largest
    # value in route_chunks' unsigned ids)
    none = -1 if np.issubdtype(ids.dtype, np.signedinteger) else np.iinfo(ids.dtype).max
    dense = np.all(ids == none, axis=(0, 2))
    routed = ids[:, ~dense, :]
    if routed.size and (routed.min() < 0 or routed.max() >= n_expert):
        raise ValueError(f"routing has expert ids outside [0, {n_expert})")
    srt = np.sort(routed, axis=2)
    if k > 1 and np.any(srt[:, :, 1:] == srt[:, :, :-1]):
        # Shares count tokens per expert; a repeated id would count one token twice.
        raise ValueError("routing lists an expert twice for one token and layer")
    buckets = bucket_of(tokens, n_buckets)
    seen, inv = np.unique(buckets, return_inverse=True)
    inv = inv.reshape(-1)
    share = np.zeros((n_layer, n_expert), dtype=np.float32)
    cand = np.empty((n_buckets, n_layer, n_cand), dtype=np.uint16)
    for layer in range(n_layer):
        if dense[layer]:  # never routed: share 0, candidates in id order (never asked for)
            cand[:, layer, :] = np.arange(n_cand)
            continue
        e = ids[:, layer, :].astype(np.int64)
        total = np.bincount(e.ravel(), minlength=n_expert)
        share[layer] = (total / n_tok).astype(np.float32)
        order = _global_order(total.astype(np.float64))  # by count = by share, exactly
        rank = np.empty(n_expert, dtype=np.int64)
        rank[order] = np.arange(n_expert)
        cand[:, layer, :] = order[:n_cand]
        counts = np.bincount((inv[:, None] * n_expert + e).ravel(), minlength=seen.size * n_expert)
        # One key per (bucket, expert): the count first, then the global rank; unique within a row.
        key = counts.reshape(seen.size, n_expert) * n_expert + (n_expert - 1 - rank)[None, :]
        top = np.argsort(-key, axis=1, kind="stable")[:, :n_cand]
        cand[seen, layer, :] = top
    return RoutingProfile(k, n_tok, int(model_bytes), int(model_fingerprint), share, cand)


def table_recall(
    prof: RoutingProfile, tokens: np.ndarray, ids: np.ndarray, top: int | None = None
) -> np.ndarray:
    """Per layer, the share of actual (token, layer, expert) choices among the first `top` (default
    k) candidates of the token's bucket. float64 [n_layer]."""
    tokens = np.asarray(tokens, dtype=np.int64)
    ids = np.asarray(ids)
    if ids.ndim != 3 or ids.shape[1:] != (prof.n_layer, prof.n_expert_used) or tokens.shape != ids.shape[:1]:
        raise ValueError(
            f"routing of shape {ids.shape} does not match the profile "
            f"(n_layer {prof.n_layer}, top-{prof.n_expert_used}) or its {tokens.size} tokens"
        )
    top = prof.n_expert_used if top is None else int(top)
    if not 1 <= top <= prof.n_cand:
        raise ValueError(f"top must be between 1 and n_cand {prof.n_cand}, got {top}")
    if tokens.size == 0:
        return np.zeros(prof.n_layer)
    hits = np.zeros(prof.n_layer, dtype=np.int64)
    block = 1 << 14  # bounded memory: [block, L, top, k] booleans at a time
    for s in range(0, tokens.size, block):
        pred = prof.cand[bucket_of(tokens[s : s + block], prof.n_buckets), :, :top].astype(np.int64)
        actual = ids[s : s + block].astype(np.int64)
        found = (pred[:, :, :, None] == actual[:, :, None, :]).any(axis=2)  # [b, L, k]
        hits += found.sum(axis=(0, 2))
    return hits / (tokens.size * prof.n_expert_used)


def static_recall(prof: RoutingProfile, ids: np.ndarray) -> np.ndarray:
    """Per layer, the recall of the layer's k globally hottest experts (no token table): the
    baseline the hashed table has to beat."""
    ids = np.asarray(ids, dtype=np.int64)
    k = prof.n_expert_used
    out = np.zeros(prof.n_layer)
    if ids.shape[0] == 0:
        return out
    for layer in range(prof.n_layer):
        hot = prof.hottest(layer)[:k]
        out[layer] = np.isin(ids[:, layer, :], hot).mean()
    return out


def _check_dims(n_layer: int, n_expert: int, k: int, n_buckets: int, n_cand: int) -> None:
    if n_layer < 1 or n_expert < 1 or k < 1 or k > n_expert:
        raise ValueError(f"not a mixture-of-experts routing: {n_layer} layers, {n_expert} experts, top-{k}")
    if n_expert > 65535:
        raise ValueError(f"{n_expert} experts do not fit the profile's 16-bit expert ids")
    if not 1 <= n_buckets <= MAX_BUCKETS or n_buckets & (n_buckets - 1):
        raise ValueError(f"n_buckets must be a power of two between 1 and 2^24, got {n_buckets}")
    hi = min(n_expert, MAX_CAND)
    if not k <= n_cand <= hi:
        raise ValueError(f"n_cand must be between top-k ({k}) and {hi}, got {n_cand}")


def profile_bytes(prof: RoutingProfile) -> bytes:
    """The file's bytes (header, shares, candidates, checksum)."""
    _check_dims(prof.n_layer, prof.n_expert, prof.n_expert_used, prof.n_buckets, prof.n_cand)
    if prof.n_tokens < 1:
        raise ValueError("a routing profile needs at least one profiled token")
    head = HEADER.pack(
        MAGIC,
        VERSION,
        prof.n_layer,
        prof.n_expert,
        prof.n_expert_used,
        prof.n_buckets,
        prof.n_cand,
        prof.model_bytes,
        prof.model_fingerprint,
        prof.n_tokens,
    )
    body = head + prof.share.astype("<f4").tobytes() + prof.cand.astype("<u2").tobytes()
    return body + struct.pack("<Q", fnv1a64(body))


def write_profile(path: str | os.PathLike[str], prof: RoutingProfile) -> Path:
    """Write `prof` to `path` atomically (a temporary file next to it, then a rename)."""
    path = Path(path)
    data = profile_bytes(prof)
    part = path.with_name(f".{path.name}.part{os.getpid()}")
    try:
        with open(part, "wb") as f:
            f.write(data)
        os.replace(part, path)
    finally:
        if part.exists():
            part.unlink()
    return path


def read_profile(
    path: str | os.PathLike[str], model_path: str | os.PathLike[str] | None = None
) -> RoutingProfile:
    """Read and check a routing profile: magic, version, sizes, checksum, every value's range and,
    with `model_path`, that it was made from that model file (size and fingerprint). Every problem
    is a ValueError naming the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"routing profile not found: {path}")
    b = path.read_bytes()
    if len(b) < HEADER.size + 8:
        raise ValueError(f"routing profile {path} is truncated: {len(b)} bytes")
    magic, version, n_layer, n_expert, k, n_buckets, n_cand, model_bytes, fp, n_tokens = HEADER.unpack_from(b)
    if magic != MAGIC:
        raise ValueError(f"{path} is not a routing profile (bad magic)")
    if version != VERSION:
        raise ValueError(f"routing profile {path} has version {version}; this reader reads version {VERSION}")
    try:
        _check_dims(n_layer, n_expert, k, n_buckets, n_cand)
    except ValueError as exc:
        raise ValueError(f"routing profile {path}: {exc}") from None
    n_share, n_cands = n_layer * n_expert, n_buckets * n_layer * n_cand
    want = HEADER.size + 4 * n_share + 2 * n_cands + 8
    if len(b) != want:
        raise ValueError(f"routing profile {path} has {len(b)} bytes; its header says {want}")
    if fnv1a64(memoryview(b)[:-8]) != struct.unpack_from("<Q", b, len(b) - 8)[0]:
        raise ValueError(f"routing profile {path} is corrupt: checksum mismatch")
    if n_tokens == 0:
        raise ValueError(f"routing profile {path} was made from no tokens")
    share = np.frombuffer(b, dtype="<f4", count=n_share, offset=HEADER.size).reshape(n_layer, n_expert)
    cand = np.frombuffer(b, dtype="<u2", count=n_cands, offset=HEADER.size + 4 * n_share)
    cand = cand.reshape(n_buckets, n_layer, n_cand)
    if not np.all(np.isfinite(share)) or share.min() < 0 or share.max() > 1:
        raise ValueError(f"routing profile {path}: a share is outside [0, 1]")
    sums = share.astype(np.float64).sum(axis=1)
    if np.any(np.abs(sums - k) > 1e-3 * k):
        layer = int(np.argmax(np.abs(sums - k)))
        raise ValueError(
            f"routing profile {path}: the shares of layer {layer} sum to {sums[layer]:g}, not {k}"
        )
    if cand.max() >= n_expert:
        raise ValueError(f"routing profile {path}: a candidate id is >= n_expert {n_expert}")
    srt = np.sort(cand, axis=2)
    if n_cand > 1 and np.any(srt[:, :, 1:] == srt[:, :, :-1]):
        raise ValueError(f"routing profile {path}: an expert is listed twice among one row's candidates")
    prof = RoutingProfile(k, n_tokens, model_bytes, fp, share.astype(np.float32), cand.astype(np.uint16))
    if model_path is not None:
        check_model(prof, model_path, path)
    return prof


def check_model(prof: RoutingProfile, model_path: str | os.PathLike[str], where: Any = "the profile") -> None:
    """ValueError unless `prof` was made from the file `model_path` (size and fingerprint)."""
    fp, size = model_fingerprint(model_path)
    if size != prof.model_bytes or fp != prof.model_fingerprint:
        raise ValueError(
            f"routing profile {where} was made from another model file ({prof.model_bytes} bytes, "
            f"fingerprint {prof.model_fingerprint:016x}); {model_path} has {size} bytes, "
            f"fingerprint {fp:016x}"
        )


# ---- corpus and routing ---------------------------------------------------------------------------


def corpus_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The files of a corpus: files as given; directories searched recursively for TEXT_EXTENSIONS
    (skipping hidden directories and __pycache__), sorted. A missing path is a FileNotFoundError."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            found = [
                f
                for f in p.rglob("*")
                if f.is_file()
                and f.suffix.lower() in TEXT_EXTENSIONS
                and not any(
                    part in _SKIP_DIRS or part.startswith(".") for part in f.relative_to(p).parts[:-1]
                )
            ]
            out.extend(sorted(found))
        else:
            raise FileNotFoundError(f"corpus path not found: {p}")
    return out


def read_corpus_text(path: Path) -> str | None:
    """A file's text (UTF-8, undecodable bytes replaced), or None for a binary file (a NUL byte)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace")


def tokenize_corpus(model: Any, files: Sequence[Path]) -> list[list[int]]:
    """Token ids of each non-empty, non-binary file, tokenized as `colibri run` tokenizes a prompt
    (with the model's special tokens such as BOS)."""
    texts = [t for t in (read_corpus_text(f) for f in files) if t and t.strip()]
    if not texts:
        return []
    return [ids for ids in model.tokenizer.encode_batch(texts, add_special_tokens=True) if ids]


def chunk_documents(
    docs: Iterable[Sequence[int]], context: int, max_tokens: int | None = None
) -> list[np.ndarray]:
    """Cut documents into consecutive chunks of at most `context` tokens. With max_tokens and a
    larger corpus, chunks are taken evenly spaced over the whole corpus (not its first files) and
    the last one is cut so that exactly max_tokens remain."""
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    chunks: list[np.ndarray] = []
    for doc in docs:
        arr = np.asarray(doc, dtype=np.int32)
        chunks.extend(arr[s : s + context] for s in range(0, arr.size, context))
    total = sum(c.size for c in chunks)
    if max_tokens is None or total <= max_tokens:
        return chunks
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    want = min(len(chunks), math.ceil(len(chunks) * max_tokens / total))
    picked = [chunks[i] for i in np.unique(np.linspace(0, len(chunks) - 1, want).round().astype(np.int64))]
    out: list[np.ndarray] = []
    n = 0
    for c in picked:  # evenly spaced chunks may run short of max_tokens (short last chunks): top up
        if n >= max_tokens:
            break
        out.append(c[: max_tokens - n])
        n += out[-1].size
    if n < max_tokens:
        taken = {id(c) for c in picked}
        for c in chunks:
            if n >= max_tokens:
                break
            if id(c) not in taken:
                out.append(c[: max_tokens - n])
                n += out[-1].size
    return out


def route_chunks(
    model: Any, chunks: Sequence[np.ndarray], progress: Callable[[int, int], None] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Evaluate each chunk teacher-forced from an empty cache and collect its routing:
    (tokens int32 [T], ids uint16 [T, n_layer, k])."""
    info = model.info
    if info.n_expert <= 0 or info.n_expert_used <= 0:
        raise ValueError(f"{model.path} is a dense model (no experts): there is no routing to profile")
    total = int(sum(c.size for c in chunks))
    tokens = np.empty(total, dtype=np.int32)
    ids = np.empty((total, info.n_layer, info.n_expert_used), dtype=np.uint16)  # a dense layer's -1: 0xFFFF
    pos = 0
    for c in chunks:
        if c.size > model.context_length:
            raise ValueError(f"a chunk of {c.size} tokens exceeds the context of {model.context_length}")
        r = model.route(c)
        tokens[pos : pos + c.size] = c
        ids[pos : pos + c.size] = r
        pos += c.size
        if progress is not None:
            progress(pos, total)
    return tokens, ids


def build_profile(
    model: Any,
    corpus: Iterable[Sequence[int]] | Iterable[str | os.PathLike[str]],
    *,
    n_buckets: int | None = None,
    n_cand: int | None = None,
    context: int | None = None,
    max_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> RoutingProfile:
    """The routing profile of `corpus` on a loaded model (colibri_backend.load).

    corpus: paths (text files or directories, see corpus_files) or token id sequences, one per
    document. Documents are evaluated in chunks of `context` tokens (default: min(the model's
    context, 512)), each from an empty cache. Defaults: n_buckets = default_buckets(n_vocab),
    n_cand = min(n_expert, 2 * k)."""
    tokens, ids = route_corpus(model, corpus, context=context, max_tokens=max_tokens, progress=progress)
    return profile_for_model(model, tokens, ids, n_buckets=n_buckets, n_cand=n_cand)


def route_corpus(
    model: Any,
    corpus: Iterable[Sequence[int]] | Iterable[str | os.PathLike[str]],
    *,
    context: int | None = None,
    max_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, routing ids) of a corpus on `model`, as build_profile evaluates it."""
    items = list(corpus)
    if items and all(isinstance(x, (str, os.PathLike)) for x in items):
        docs: list[Sequence[int]] = tokenize_corpus(model, corpus_files(items))  # type: ignore[arg-type]
    else:
        docs = items  # type: ignore[assignment]
    ctx = min(int(model.context_length), 512) if context is None else int(context)
    if not 1 <= ctx <= model.context_length:
        raise ValueError(
            f"context must be between 1 and the model's context {model.context_length}, got {ctx}"
        )
    chunks = chunk_documents(docs, ctx, max_tokens)
    if not chunks:
        raise ValueError("the corpus is empty: no tokens to profile")
    return route_chunks(model, chunks, progress)


def profile_for_model(
    model: Any,
    tokens: np.ndarray,
    ids: np.ndarray,
    *,
    n_buckets: int | None = None,
    n_cand: int | None = None,
) -> RoutingProfile:
    """profile_from_routing with the model's dimensions, defaults and file fingerprint."""
    info = model.info
    if info.n_expert <= 0:
        raise ValueError(f"{model.path} is a dense model (no experts): there is no routing to profile")
    k = info.n_expert_used
    nb = default_buckets(info.n_vocab) if n_buckets is None else int(n_buckets)
    nc = min(info.n_expert, 2 * k, MAX_CAND) if n_cand is None else int(n_cand)
    fp, size = model_fingerprint(model.path)
    return profile_from_routing(
        tokens, ids, info.n_expert, n_buckets=nb, n_cand=nc, model_bytes=size, model_fingerprint=fp
    )


class Progress:
    """`label: done/total tokens, rate` on stderr: one line rewritten in place on a terminal, a new
    line per tenth of the work otherwise (logs stay readable)."""

    def __init__(self, label: str, stream: Any = None) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.next_tenth = 1

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        finished = done >= total
        if self.tty:
            if not finished and now - self.last < 0.5:
                return
        elif not finished and done * 10 < self.next_tenth * total:
            return
        self.last = now
        while self.next_tenth * total <= done * 10:
            self.next_tenth += 1
        rate = done / (now - self.t0) if now > self.t0 else 0.0
        line = f"{self.label}: {done}/{total} tokens, {rate:.0f} tok/s"
        if self.tty:
            print("\r" + line, end="\n" if finished else "", file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)
