"""Routing traces: which experts a mixture-of-experts model chose, token by token and layer by layer.

A trace records, for one text, every (token position, layer) -> (expert ids, routing weights) that the
engine computed, the token ids, and the identity of the model file (path, SHA-256), so that expert
caches and predictors can be replayed and analysed offline without running the model again.

    from colibri_backend.trace import record_trace, load_trace
    trace = record_trace(model, text="def fibonacci(n):")   # model = colibri_backend.load(...)
    trace.save("fib.npz")                                    # or "fib.jsonl"
    trace = load_trace("fib.npz")
    trace.ids.shape      # [T, L, k] int32 expert ids, in the engine's order (descending weight)
    trace.weights.shape  # [T, L, k] float32 weights applied to those experts' outputs
    trace.lookahead_ids  # [T, L, D, k] int32 the lookahead's guesses for layer l+d from layer l, or None

Two file formats, chosen by the suffix (docs/routing_traces.md has the field-by-field description):

* ``.npz``: a NumPy archive (no pickles) with the arrays ``ids`` int32 [T, L, k], ``weights``
  float32 [T, L, k], ``tokens`` int32 [T] and ``meta``, a 0-d string array holding the JSON metadata;
  with a lookahead record also ``lookahead_ids`` int32 and ``lookahead_probs`` float32 [T, L, D, k].
* ``.jsonl``: line 1 is the metadata object; then one object per token position,
  ``{"pos": t, "token": id, "piece": "...", "ids": [[e, ...] per layer], "weights": [[w, ...] per layer]}``.
  Weights are written with enough digits to read back the identical float32 values. With a lookahead
  record each line also has ``"lookahead_ids"`` and ``"lookahead_probs"`` ([L][D][k] lists).

The lookahead record (meta["lookahead_depth"] = D, optional: traces without it read as before) holds, for
token t, layer l and depth d = 1..D, the top k of layer l+d's router on layer l's FFN input: what the
lookahead predictor guesses, so its recall by depth can be measured offline (benchmarks/replay_policies.py).

Texts longer than the context window are traced in consecutive windows of ``window`` tokens, each one
evaluated from an empty cache (meta["window"]; position t belongs to window t // window).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from colibri_backend.budget import PREFETCHERS, parse_prefetch

FORMAT = "colibri-routing-trace"
VERSION = 1
SUFFIXES = (".npz", ".jsonl")


@dataclass
class RoutingTrace:
    """The routing decisions of one model on one token sequence.

    ids:     int32 [T, L, k]  expert chosen in slot j of layer l at position t
    weights: float32 [T, L, k]  the weight that expert's output was scaled by
    tokens:  int32 [T]  the token ids that were evaluated
    meta:    model identity and recording details (see docs/routing_traces.md)
    """

    ids: np.ndarray
    weights: np.ndarray
    tokens: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)
    lookahead_ids: np.ndarray | None = None
    lookahead_probs: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.ids = np.ascontiguousarray(self.ids, dtype=np.int32)
        self.weights = np.ascontiguousarray(self.weights, dtype=np.float32)
        self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int32)
        if self.ids.ndim != 3:
            raise ValueError(f"routing ids must be [tokens, layers, k], got shape {self.ids.shape}")
        if self.weights.shape != self.ids.shape:
            raise ValueError(f"weights shape {self.weights.shape} differs from ids shape {self.ids.shape}")
        if self.tokens.shape != (self.ids.shape[0],):
            raise ValueError(f"tokens shape {self.tokens.shape} does not match {self.ids.shape[0]} positions")
        if (self.lookahead_ids is None) != (self.lookahead_probs is None):
            raise ValueError("lookahead_ids and lookahead_probs come together")
        if self.lookahead_ids is not None and self.lookahead_probs is not None:
            self.lookahead_ids = np.ascontiguousarray(self.lookahead_ids, dtype=np.int32)
            self.lookahead_probs = np.ascontiguousarray(self.lookahead_probs, dtype=np.float32)
            la = self.lookahead_ids.shape
            if len(la) != 4 or la[:2] != self.ids.shape[:2] or la[3] != self.ids.shape[2] or la[2] < 1:
                raise ValueError(
                    f"lookahead_ids must be [tokens, layers, depth, k] for {self.ids.shape}, got {la}"
                )
            if self.lookahead_probs.shape != la:
                raise ValueError(f"lookahead_probs shape {self.lookahead_probs.shape} differs from {la}")

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    def recorded_guesses(self, prefetch: str | None) -> dict[str, np.ndarray]:
        """The replay_routing keywords that replay this trace's recorded lookahead guesses when the
        predictor set ``prefetch`` includes the lookahead and the trace holds them; else none."""
        if self.lookahead_ids is None or not parse_prefetch(prefetch or "none") & PREFETCHERS["lookahead"]:
            return {}
        return {"lookahead_ids": self.lookahead_ids, "lookahead_probs": self.lookahead_probs}

    @property
    def n_layer(self) -> int:
        return int(self.ids.shape[1])

    @property
    def k(self) -> int:
        return int(self.ids.shape[2])

    def save(self, path: str | os.PathLike[str], pieces: Sequence[str] | None = None) -> Path:
        """Write the trace; the format follows the suffix (.npz or .jsonl). `pieces` (one string per
        token, for people reading a .jsonl file) is optional and is not read back."""
        return write_trace(path, self, pieces=pieces)


def file_sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(
            f"{path}: a routing trace file must end in .npz or .jsonl, not {suffix or '(none)'!r}"
        )
    return suffix


def record_trace(
    model: Any,
    *,
    text: str | None = None,
    token_ids: Sequence[int] | None = None,
    add_special_tokens: bool = False,
    window: int | None = None,
    source: str | None = None,
    lookahead_depth: int = 0,
) -> RoutingTrace:
    """Evaluate `text` (or `token_ids`) with a loaded colibri_backend Model and return its routing.

    window: tokens per evaluation (default and maximum: the model's context length); longer inputs
    are cut into consecutive windows, each evaluated from an empty cache.
    lookahead_depth: also record the lookahead predictor's guesses this many layers ahead (1..8; 0: none).
    """
    if (text is None) == (token_ids is None):
        raise ValueError("give exactly one of text or token_ids")
    info = model.info
    if info.n_expert <= 0 or info.n_expert_used <= 0:
        raise ValueError(f"{model.path} is not a mixture-of-experts model (no experts): nothing to trace")
    ids = model.tokenize(text, add_special_tokens=add_special_tokens) if text is not None else list(token_ids)
    if not ids:
        raise ValueError("the text has no tokens")
    ctx = int(model.context_length)
    window = ctx if window is None else int(window)
    if not 1 <= window <= ctx:
        raise ValueError(f"window must be between 1 and the context length {ctx}, got {window}")
    n, n_layer, k = len(ids), info.n_layer, info.n_expert_used
    out_ids = np.empty((n, n_layer, k), dtype=np.int32)
    out_w = np.empty((n, n_layer, k), dtype=np.float32)
    la_ids = la_p = None
    if lookahead_depth:
        model.record_lookahead(lookahead_depth)
        la_ids = np.empty((n, n_layer, lookahead_depth, k), dtype=np.int32)
        la_p = np.empty((n, n_layer, lookahead_depth, k), dtype=np.float32)
    t0 = time.perf_counter()
    for start in range(0, n, window):
        chunk = ids[start : start + window]
        model.logits(chunk)  # a fresh sequence: the routing of exactly these tokens
        r_ids, r_w = model.routing()
        if r_ids.shape != (len(chunk), n_layer, k):
            raise RuntimeError(
                f"the engine reported routing of shape {r_ids.shape} for {len(chunk)} tokens "
                f"(expected {(len(chunk), n_layer, k)})"
            )
        out_ids[start : start + len(chunk)] = r_ids
        out_w[start : start + len(chunk)] = r_w
        if la_ids is not None and la_p is not None:
            g_ids, g_p = model.lookahead()
            la_ids[start : start + len(chunk)] = g_ids
            la_p[start : start + len(chunk)] = g_p
    if lookahead_depth:
        model.record_lookahead(0)
    from colibri_backend import __version__

    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "model_path": str(Path(model.path).resolve()),
        "model_sha256": file_sha256(model.path),
        "model_name": model.name,
        "arch": info.arch,
        "n_layer": n_layer,
        "n_expert": info.n_expert,
        "n_expert_used": k,
        "n_tokens": n,
        "window": window,
        "add_special_tokens": bool(add_special_tokens),
        "source": source or ("text" if text is not None else "token_ids"),
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest() if text is not None else None,
        "engine": f"colibri {__version__}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "eval_seconds": round(time.perf_counter() - t0, 4),
    }
    if lookahead_depth:
        meta["lookahead_depth"] = int(lookahead_depth)
    return RoutingTrace(out_ids, out_w, np.asarray(ids, dtype=np.int32), meta, la_ids, la_p)


def write_trace(
    path: str | os.PathLike[str], trace: RoutingTrace, pieces: Sequence[str] | None = None
) -> Path:
    """Write `trace` to `path` (.npz or .jsonl) atomically (a temporary file, then a rename)."""
    path = Path(path)
    suffix = _suffix(path)
    if pieces is not None and len(pieces) != trace.n_tokens:
        raise ValueError(f"{len(pieces)} pieces for {trace.n_tokens} tokens")
    meta = {**trace.meta, "format": FORMAT, "version": VERSION}
    meta.pop("lookahead_depth", None)
    if trace.lookahead_ids is not None:
        meta["lookahead_depth"] = int(trace.lookahead_ids.shape[2])
    part = path.with_name(f".{path.name}.part{os.getpid()}")
    try:
        if suffix == ".npz":
            with open(part, "wb") as f:
                extra = {}
                if trace.lookahead_ids is not None:
                    extra = {"lookahead_ids": trace.lookahead_ids, "lookahead_probs": trace.lookahead_probs}
                np.savez_compressed(
                    f,
                    ids=trace.ids,
                    weights=trace.weights,
                    tokens=trace.tokens,
                    meta=np.array(json.dumps(meta, sort_keys=True)),
                    **extra,
                )
        else:
            with open(part, "w", encoding="utf-8") as f:
                f.write(json.dumps(meta, sort_keys=True) + "\n")
                for t in range(trace.n_tokens):
                    row: dict[str, Any] = {"pos": t, "token": int(trace.tokens[t])}
                    if pieces is not None:
                        row["piece"] = pieces[t]
                    row["ids"] = trace.ids[t].tolist()
                    # float32 -> float64 is exact and json writes the shortest repr that reads back
                    # the same float64, hence the same float32.
                    row["weights"] = trace.weights[t].astype(np.float64).tolist()
                    if trace.lookahead_ids is not None and trace.lookahead_probs is not None:
                        row["lookahead_ids"] = trace.lookahead_ids[t].tolist()
                        row["lookahead_probs"] = trace.lookahead_probs[t].astype(np.float64).tolist()
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(part, path)
    finally:
        if part.exists():
            part.unlink()
    return path


def _check_meta(meta: Any, path: Path) -> dict[str, Any]:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not a Colibri routing trace (no format={FORMAT!r} header)")
    version = meta.get("version")
    if version != VERSION:
        raise ValueError(
            f"{path}: routing trace version {version!r} is not supported (this reader: {VERSION})"
        )
    return meta


def _load_npz(path: Path) -> RoutingTrace:
    try:
        with np.load(path, allow_pickle=False) as z:
            if not hasattr(z, "files"):
                raise ValueError("a single array, not an archive")
            names = ("ids", "weights", "tokens", "meta", "lookahead_ids", "lookahead_probs")
            arrays = {name: z[name] for name in names if name in z.files}
    except Exception as exc:
        # np.load and zipfile raise assorted errors on files that are not archives (it even tries
        # them as pickles), and a corrupt member fails only when read: zlib.error,
        # an unsupported-feature error for unknown zip flags, ... (found by tools/fuzz_python.py). Nothing
        # else runs in this block, so any of them means the archive is unreadable: one clear message.
        raise ValueError(f"{path}: not a readable routing trace archive ({exc})") from exc
    missing = {"ids", "weights", "tokens", "meta"} - set(arrays)
    if missing:
        raise ValueError(f"{path}: routing trace lacks the arrays {sorted(missing)}")
    # np.load gives a member that is not a .npy file as its raw bytes (found by tools/fuzz_python.py)
    not_arrays = sorted(name for name, a in arrays.items() if not isinstance(a, np.ndarray))
    if not_arrays:
        raise ValueError(f"{path}: the members {not_arrays} are not arrays")
    if arrays["meta"].ndim != 0:
        raise ValueError(f"{path}: the meta array is not a single string")
    try:
        meta = json.loads(str(arrays["meta"][()]))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: the meta array is not JSON ({exc})") from exc
    meta = _check_meta(meta, path)
    la_ids, la_p = arrays.get("lookahead_ids"), arrays.get("lookahead_probs")
    _check_lookahead_meta(meta, la_ids, path)
    try:
        return RoutingTrace(arrays["ids"], arrays["weights"], arrays["tokens"], meta, la_ids, la_p)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def _check_lookahead_meta(meta: dict[str, Any], la_ids: np.ndarray | None, path: Path) -> None:
    depth = meta.get("lookahead_depth")
    if la_ids is None:
        if depth:
            raise ValueError(
                f"{path}: the header says lookahead_depth={depth!r} but the trace holds no guesses"
            )
        return
    if la_ids.ndim != 4 or depth != la_ids.shape[2]:
        raise ValueError(
            f"{path}: lookahead guesses of shape {la_ids.shape} do not match lookahead_depth={depth!r}"
        )


def _load_jsonl(path: Path) -> RoutingTrace:
    with open(path, encoding="utf-8") as f:
        first = f.readline()
        try:
            meta = _check_meta(json.loads(first), path) if first.strip() else None
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"{path}: line 1 is not JSON ({exc})") from exc
        if meta is None:
            raise ValueError(f"{path}: empty file, not a routing trace")
        tokens: list[int] = []
        ids: list[list[list[int]]] = []
        weights: list[list[list[float]]] = []
        depth = meta.get("lookahead_depth")
        la_ids: list[Any] = []
        la_p: list[Any] = []
        for lineno, line in enumerate(f, start=2):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                pos, tok, row_ids, row_w = row["pos"], row["token"], row["ids"], row["weights"]
                if depth:
                    la_ids.append(row["lookahead_ids"])
                    la_p.append(row["lookahead_probs"])
            except (json.JSONDecodeError, RecursionError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a routing record ({exc})") from exc
            if pos != len(tokens):
                raise ValueError(f"{path}:{lineno}: position {pos} out of order (expected {len(tokens)})")
            tokens.append(tok)
            ids.append(row_ids)
            weights.append(row_w)
    n_layer, k = int(meta.get("n_layer", 0)), int(meta.get("n_expert_used", 0))
    try:
        ids_arr = np.asarray(ids, dtype=np.int32).reshape(len(tokens), n_layer, k)
        w_arr = np.asarray(weights, dtype=np.float32).reshape(len(tokens), n_layer, k)
        tok_arr = np.asarray(tokens, dtype=np.int32)
        la_arr = la_parr = None
        if depth:
            d = int(depth)
            la_arr = np.asarray(la_ids, dtype=np.int32).reshape(len(tokens), n_layer, d, k)
            la_parr = np.asarray(la_p, dtype=np.float32).reshape(len(tokens), n_layer, d, k)
    except (ValueError, TypeError, OverflowError) as exc:
        # ragged records, non-numbers, or ids/tokens outside int32 (OverflowError: found by
        # tools/fuzz_python.py, input in tests/fuzz_corpus/trace/)
        raise ValueError(
            f"{path}: records must hold {n_layer} layers x {k} int32 expert ids and float weights ({exc})"
        ) from exc
    try:
        return RoutingTrace(ids_arr, w_arr, tok_arr, meta, la_arr, la_parr)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def load_trace(path: str | os.PathLike[str]) -> RoutingTrace:
    """Read a routing trace written by `colibri trace` / RoutingTrace.save (.npz or .jsonl)."""
    path = Path(path)
    suffix = _suffix(path)
    if not path.is_file():
        raise FileNotFoundError(f"routing trace not found: {path}")
    trace = _load_npz(path) if suffix == ".npz" else _load_jsonl(path)
    n = trace.meta.get("n_tokens")
    if n is not None and n != trace.n_tokens:
        raise ValueError(f"{path}: header says {n} tokens but {trace.n_tokens} were read (truncated file?)")
    return trace


def impose_trace(model: Any, trace: RoutingTrace | None) -> None:
    """Benchmarks and tests only: make a loaded Model follow `trace`'s routing from its next evaluation on
    (position p takes row p % T of the trace, every layer), or stop with None.

    Meant for a random-weight model with the trace model's layer count, expert count and top-k (e.g.
    benchmarks/make_bench_models.py's bench-r), so the expert store reads real bytes and the kernels do
    real work under a trained router's choices. The router still runs; only its choice is replaced. When
    the trace holds the lookahead's recorded guesses, the lookahead prefetch takes them too (what the
    trained model's lookahead guessed, not this file's router on hidden states the routing did not come
    from), and the hashed predictor keys on the trace's tokens (its routing profile's table is the trace
    model's: benchmarks/make_bench_models.py --like-trace writes one beside bench-r)."""
    if trace is None:
        model._debug_route_override(None)
        return
    info = model.info
    want = (info.n_layer, info.n_expert_used)
    if (trace.n_layer, trace.k) != want or info.n_expert <= 0:
        raise ValueError(
            f"the trace routes {trace.n_layer} layers top-{trace.k}; {model.path} has {info.n_layer} layers "
            f"top-{info.n_expert_used} over {info.n_expert} experts"
        )
    n_expert = int(trace.meta.get("n_expert", info.n_expert))
    if n_expert != info.n_expert:
        raise ValueError(
            f"the trace's model has {n_expert} experts per layer; {model.path} has {info.n_expert}"
        )
    if trace.n_tokens == 0:
        raise ValueError("the trace has no tokens")
    guesses = None
    if trace.lookahead_ids is not None and trace.lookahead_probs is not None:
        guesses = (trace.lookahead_ids, trace.lookahead_probs)
    model._debug_route_override(trace.ids, trace.weights, guesses, tokens=trace.tokens)
