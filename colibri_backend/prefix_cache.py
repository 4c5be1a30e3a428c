"""The prefix cache: KV states of earlier prompts, reused by any later prompt that starts the same way.

An entry is the engine's state blob (``colibri_state_save``: the KV rows of every layer for the first
n tokens, self-checking) and the n tokens it holds. Lookup finds the entry sharing the longest prefix
with a new prompt: the prompt's tokens are cut into blocks of :data:`BLOCK` tokens, each block's hash
chained on the previous one, and every entry is indexed under the chain hashes of its whole blocks,
so the deepest hash the prompt shares with the index names the candidates; the shared length is then
counted token by token (a hash never decides alone). The context's own KV cache (the tokens it holds
now) is one more candidate, the one that costs nothing to restore: reusing the previous prompt is the
case of this cache where the best entry is the live one.

Entries of limited reach (``reach``: ``colibri_state_reach``, native/src/kv_io.c): a restored state can
be cut back by at most ``reach`` tokens, so an entry serves a prompt only when the prompt shares all its
tokens but at most ``reach``. A sliding-window ring keeps that many rows past its window (a prompt that
differs in its last ``reach`` tokens is served); a recurrent state exists only at the position it was
saved at (``reach`` 0: only a prompt that extends it, an agent's next turn), so the engine saves it
while prefilling, at the prompt's last whole block before its last token (:func:`save_point`).

Bounded in bytes, least recently used first out. An entry that is a prefix of a newer one is dropped
(unless the reach is limited): the newer covers every prompt it covers. ``directory`` (``--kv-cache-dir``):
each entry is also a file there, written atomically (a temporary file, then rename), so a restart keeps
the cache; files are indexed at start from their headers and read when a prompt hits them. A file that
fails a check (its header, its tokens' digest, or the engine's own checks of the blob) is ignored with a
warning and removed.

File layout (little-endian): ``CLBRPC01``, uint32 n_tokens, uint32 zero, uint64 blob bytes, 32-byte
BLAKE2b of the header's first 24 bytes and the tokens, int32 tokens[n_tokens], the blob.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BLOCK = 32  # tokens per hashed block; prompts shorter than one block are not stored
FILE_MAGIC = b"CLBRPC01"
_HEAD = struct.Struct("<8sIIQ")  # magic, n_tokens, zero, blob bytes
_DIGEST = 32
SUFFIX = ".kvc"


def save_point(n_prompt: int, reach: int | None) -> int:
    """Where a prompt of ``n_prompt`` tokens is stored: after all of it, or for entries that cannot be
    cut back (``reach`` 0: they serve only a prompt sharing all their tokens, and a prompt's last token
    is always evaluated again) its last whole block before the last token."""
    return (n_prompt - 1) // BLOCK * BLOCK if reach == 0 else n_prompt


def chain_hashes(tokens: np.ndarray, n_blocks: int) -> list[bytes]:
    """Hash of blocks [0, i] for each i < n_blocks, each chained on the one before."""
    out: list[bytes] = []
    h = b""
    for i in range(n_blocks):
        h = hashlib.blake2b(h + tokens[i * BLOCK : (i + 1) * BLOCK].tobytes(), digest_size=16).digest()
        out.append(h)
    return out


def common_length(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int32 arrays."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass(eq=False)
class Entry:
    """A cached state: the tokens it holds, its blob (None while only on disk) and its file."""

    key: str
    tokens: np.ndarray  # int32 [n]
    n_bytes: int  # the blob's size
    blob: bytes | None = None
    path: Path | None = None
    hashes: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class Reuse:
    """What to restore for a prompt: ``n`` tokens, from ``entry`` or (entry None) the live context."""

    n: int
    entry: Entry | None


class PrefixCache:
    """Token sequences -> state blobs (see the module). Thread-safe; the engine calls it under its lock,
    except for the file writes of the batched path (:meth:`persist`).

    ``max_bytes`` 0 keeps no entries: only the live context is reused. ``reach``: how many of its
    tokens an entry may lack to serve a prompt (None: any; see the module). ``namespace`` names the model and
    KV type the blobs are for (a digest of the engine's empty state); entries on disk live under
    ``directory/namespace``, so models sharing a directory never meet each other's files. Entries
    longer than ``max_tokens`` (a context of that length could not hold them: a directory written with a
    longer context) are kept but never offered.
    """

    def __init__(
        self,
        max_bytes: int,
        namespace: str = "",
        directory: str | os.PathLike[str] | None = None,
        max_tokens: int | None = None,
        reach: int | None = None,
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if reach is not None and reach < 0:
            raise ValueError(f"reach must be >= 0 or None, got {reach}")
        self.max_bytes = max_bytes
        self.reach = reach
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        self._index: dict[bytes, dict[str, None]] = {}  # chain hash -> keys of entries holding it
        self._lock = threading.RLock()
        self.bytes = 0
        self.hits = self.misses = self.tokens_reused = self.dropped_files = 0
        self.directory = Path(directory) / namespace if directory is not None and max_bytes > 0 else None
        if self.directory is not None:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._scan()
            except OSError as exc:
                raise ValueError(f"kv_cache_dir: cannot use {directory}: {exc.strerror or exc}") from None

    # ---- lookup ---------------------------------------------------------------------------------

    def best(self, prompt: np.ndarray, live: np.ndarray, limit: int) -> Reuse:
        """The longest reuse for ``prompt`` (at most ``limit`` tokens): the live context's tokens
        ``live``, or a cached entry when it shares more."""
        with self._lock:
            reuse = Reuse(common_length(live[:limit], prompt[:limit]), None)
            hashes = chain_hashes(prompt, min(limit, prompt.size) // BLOCK)
            for h in reversed(hashes):
                keys = self._index.get(h)
                if not keys:
                    continue
                found = False
                for key in reversed(keys):  # most recently stored first
                    e = self._entries[key]
                    if self.max_tokens is not None and e.tokens.size > self.max_tokens:
                        continue
                    n = common_length(e.tokens[:limit], prompt[:limit])
                    if self.reach is not None and e.tokens.size - n > self.reach:
                        continue  # it cannot be cut back that far
                    found = True
                    if n > reuse.n:
                        reuse = Reuse(n, e)
                # A shallower hash can only give shorter prefixes; entries of limited reach that do not
                # serve the prompt are held under shallower hashes too, so those go on until one serves.
                if found or self.reach is None:
                    break
            return reuse

    def blob(self, entry: Entry) -> bytes | None:
        """The entry's blob, read from its file if needed; None (and the entry dropped) if unreadable."""
        with self._lock:
            if entry.blob is not None:
                return entry.blob
            assert entry.path is not None
            try:
                data = entry.path.read_bytes()
                tokens, blob = _parse_file(data)
                if not np.array_equal(tokens, entry.tokens):
                    raise ValueError("its tokens changed since the cache was indexed")
            except (OSError, ValueError) as exc:
                self.discard(entry, str(exc))
                return None
            entry.blob = blob  # counted in self.bytes already, on disk or not
            return blob

    def used(self, entry: Entry | None, n: int) -> None:
        """Record a lookup's outcome: ``n`` tokens reused, from ``entry`` (None: the live context)."""
        with self._lock:
            if entry is not None:
                self.hits += 1
                self._entries.move_to_end(entry.key)
            elif n == 0:
                self.misses += 1
            self.tokens_reused += n

    # ---- insert and remove ------------------------------------------------------------------------

    def covers(self, tokens: np.ndarray) -> bool:
        """True if some entry already holds ``tokens`` as a prefix (storing them would add nothing)."""
        reuse = self.best(tokens, np.empty(0, np.int32), tokens.size)
        return reuse.entry is not None and reuse.n == tokens.size

    def put(self, tokens: np.ndarray, save: Callable[[], bytes], write: bool = True) -> Entry | None:
        """Store the state of ``tokens`` made by ``save`` (called only when it will be stored).

        With a directory the entry's file is written by :meth:`persist`: here, or with ``write`` False by
        the caller once it has let go of the lock it made the blob under (the engine's: a slow disk then
        delays only the request that stored the entry, not the other sequences' steps)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        if self.max_bytes == 0 or tokens.size < BLOCK or self.covers(tokens):
            return None
        blob = save()
        if len(blob) > self.max_bytes:
            return None
        hashes = chain_hashes(tokens, tokens.size // BLOCK)
        key = hashlib.blake2b(tokens.tobytes(), digest_size=16).hexdigest()
        entry = Entry(key, tokens, len(blob), blob, hashes=hashes)
        with self._lock:
            # Entries this one extends are redundant now (of limited reach, they still serve their own).
            if self.reach is None:
                for old in [e for e in self._entries.values() if e.tokens.size <= tokens.size]:
                    if common_length(old.tokens, tokens) == old.tokens.size:
                        self._remove(old)
            self._add(entry)
            self._evict()
        if write:
            self.persist(entry)
        return entry

    def persist(self, entry: Entry) -> None:
        """Write ``entry``'s file if the cache has a directory (atomically: a temporary name, then rename).
        No lock is held while it writes: lookups and other puts go on, and the entry serves from memory
        meanwhile. An entry dropped while its file was written has the file removed."""
        if self.directory is None or entry.blob is None or entry.path is not None:
            return
        try:
            path = self._write(entry)
        except OSError as exc:
            warnings.warn(f"prefix cache: cannot write to {self.directory}: {exc}", stacklevel=2)
            return
        with self._lock:
            if self._entries.get(entry.key) is entry:
                entry.path = path
            elif entry.key not in self._entries:  # (a newer entry of the same tokens owns the name)
                path.unlink(missing_ok=True)

    def discard(self, entry: Entry, reason: str) -> None:
        """Drop a broken entry (and its file), with a warning."""
        with self._lock:
            where = entry.path if entry.path is not None else f"entry {entry.key}"
            warnings.warn(f"prefix cache: ignoring {where}: {reason}; removed", stacklevel=2)
            self.dropped_files += 1
            self._remove(entry)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "prefix_cache_entries": len(self._entries),
                "prefix_cache_bytes": self.bytes,
                "prefix_cache_max_bytes": self.max_bytes,
                "prefix_cache_hits": self.hits,
                "prefix_cache_misses": self.misses,
                "prefix_cache_tokens_reused": self.tokens_reused,
                "prefix_cache_dropped_files": self.dropped_files,
            }

    def _add(self, entry: Entry) -> None:
        self._entries[entry.key] = entry
        self.bytes += entry.n_bytes
        for h in entry.hashes:
            self._index.setdefault(h, {})[entry.key] = None

    def _remove(self, entry: Entry) -> None:
        if self._entries.pop(entry.key, None) is None:
            return
        self.bytes -= entry.n_bytes
        for h in entry.hashes:
            keys = self._index.get(h)
            if keys is not None:
                keys.pop(entry.key, None)
                if not keys:
                    del self._index[h]
        if entry.path is not None:
            entry.path.unlink(missing_ok=True)

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._entries:
            self._remove(next(iter(self._entries.values())))

    # ---- files ------------------------------------------------------------------------------------

    def _write(self, entry: Entry) -> Path:
        assert self.directory is not None and entry.blob is not None
        head = _HEAD.pack(FILE_MAGIC, entry.tokens.size, 0, len(entry.blob))
        tok = entry.tokens.astype("<i4").tobytes()
        digest = hashlib.blake2b(head + tok, digest_size=_DIGEST).digest()
        path = self.directory / f"{entry.key}{SUFFIX}"
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head + digest + tok)
                f.write(entry.blob)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def _scan(self) -> None:
        """Index the directory's files, oldest first (so the newest are the most recently used)."""
        assert self.directory is not None
        for stale in self.directory.glob(f".tmp-*{SUFFIX}"):  # a write cut short by a crash
            stale.unlink(missing_ok=True)
        files = sorted(self.directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                tokens, n_bytes = _read_header(path)
                if path.stem != hashlib.blake2b(tokens.tobytes(), digest_size=16).hexdigest():
                    raise ValueError("its name is not its tokens' digest")
            except (OSError, ValueError) as exc:
                warnings.warn(f"prefix cache: ignoring {path}: {exc}; removed", stacklevel=2)
                self.dropped_files += 1
                path.unlink(missing_ok=True)
                continue
            if tokens.size < BLOCK:
                path.unlink(missing_ok=True)
                continue
            hashes = chain_hashes(tokens, tokens.size // BLOCK)
            self._add(Entry(path.stem, tokens, n_bytes, None, path, hashes))
        self._evict()


def _check_header(head: bytes, size: int) -> tuple[int, int]:
    """(n_tokens, blob bytes) of a file's header, checked against the file's size."""
    if len(head) < _HEAD.size + _DIGEST:
        raise ValueError("truncated header")
    magic, n, zero, n_bytes = _HEAD.unpack_from(head)
    if magic != FILE_MAGIC or zero != 0:
        raise ValueError("not a Colibri prefix-cache file")
    if size != _HEAD.size + _DIGEST + 4 * n + n_bytes:
        raise ValueError(f"{size} bytes, its header says {_HEAD.size + _DIGEST + 4 * n + n_bytes}")
    return n, n_bytes


def _tokens(head: bytes, tok: bytes) -> np.ndarray:
    if hashlib.blake2b(head[: _HEAD.size] + tok, digest_size=_DIGEST).digest() != head[_HEAD.size :]:
        raise ValueError("its header or tokens are corrupt (digest mismatch)")
    return np.frombuffer(tok, dtype="<i4").astype(np.int32)


def _read_header(path: Path) -> tuple[np.ndarray, int]:
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(_HEAD.size + _DIGEST)
        n, n_bytes = _check_header(head, size)
        tok = f.read(4 * n)
    return _tokens(head, tok), n_bytes


def _parse_file(data: bytes) -> tuple[np.ndarray, bytes]:
    """(tokens, blob) of a whole file; the blob's own checks are the engine's (colibri_state_load)."""
    n, _ = _check_header(data, len(data))
    start = _HEAD.size + _DIGEST
    return _tokens(data[:start], data[start : start + 4 * n]), data[start + 4 * n :]
