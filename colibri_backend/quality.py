"""Perplexity and KL divergence in llama.cpp's `llama-perplexity` conventions (`colibri perplexity`).

Chunking: the text is tokenized once (with BOS where the model's tokenizer adds one), cut into
n_chunks consecutive chunks of n_ctx tokens (the rest is dropped), the first token of every chunk is
replaced by BOS when the model uses one, and each chunk is evaluated teacher-forced from an empty
cache. Only the second half is scored: the logits at positions first .. n_ctx-2 (first = n_ctx // 2)
predict tokens first+1 .. n_ctx-1, so every scored token has at least n_ctx/2 tokens of context.

Perplexity = exp(mean NLL) and its error ppl * sqrt(var(NLL) / (N - 1)), as llama-perplexity prints it.

KL divergence against a base model. A base run (`--kl-divergence-base FILE`) stores, for every scored
token, the base model's log-probability of the true next token and its top-K log-probabilities with
their token ids. A later run (`--kl-divergence FILE`) computes, per token,

    KLD = sum_{i in top-K} p_i (log p_i - log q_i) + p_rest (log p_rest - log q_rest)

where p is the base distribution, q the tested one and "rest" everything outside the base's top K.
By default K = n_vocab: the whole distribution is stored (as float16 log-probabilities, renormalised
when read), the rest is empty and the KL is the full one, as llama-perplexity computes it. With
--kl-top-k K < n_vocab only the top K are stored (float32, with their ids): a far smaller file and a
lower bound of the full KL (data-processing inequality), short of it by at most the terms of the
base's mass outside its top K, which the report prints. Δp = q(true token) - p(true token); "same top"
compares the two argmaxes.

Base file layout (little-endian, no padding):

    magic "CLBRKLD1" | u32 version=1 | u32 n_vocab | u32 n_ctx | u32 n_chunks | u32 top_k
    | u8[32] vocabulary fingerprint (SHA-256 of the token strings in id order)
    | i32 tokens[n_chunks][n_ctx]        (the chunks as evaluated, BOS substituted)
    | f32 nll[n_chunks][n_scored]        (n_scored = n_ctx - 1 - n_ctx // 2)
    then, when top_k == n_vocab (the default; 2 * n_vocab bytes per scored token):
    | f16 logp[n_chunks][n_scored][n_vocab]
    else (8 * top_k bytes per scored token):
    | i32 top_ids[n_chunks][n_scored][top_k]   (descending probability)
    | f32 top_logp[n_chunks][n_scored][top_k]
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

KLD_MAGIC = b"CLBRKLD1"
KLD_VERSION = 1
KLD_HEADER = struct.Struct("<8sIIIII32s")  # 60 bytes
KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)
DP_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 50.0, 25.0, 10.0, 5.0, 1.0, 0.1)


def vocab_fingerprint(tokenizer: Any) -> bytes:
    """SHA-256 of the tokenizer's token strings in id order: two models share a base file only
    when their vocabularies are the same tokens under the same ids."""
    vocab = tokenizer.hf.get_vocab(with_added_tokens=True)
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    h = hashlib.sha256()
    for text, tid in by_id:
        h.update(struct.pack("<I", tid))
        h.update(text.encode("utf-8", errors="surrogatepass"))
        h.update(b"\0")
    return h.digest()


def n_scored(n_ctx: int) -> int:
    """Tokens scored per chunk of n_ctx: the second half minus the last position."""
    return n_ctx - 1 - n_ctx // 2


def make_chunks(tokens: Sequence[int], n_ctx: int, n_chunks: int | None, bos_id: int | None) -> np.ndarray:
    """[n_chunks, n_ctx] int32 chunks of `tokens` (llama-perplexity's split), BOS as the first token
    of each chunk when bos_id is not None."""
    if n_ctx < 8:
        raise ValueError(f"--ctx must be at least 8 tokens, got {n_ctx}")
    arr = np.asarray(tokens, dtype=np.int32)
    available = arr.size // n_ctx
    if available < 1:
        raise ValueError(
            f"the text has {arr.size} tokens: at least one chunk of --ctx {n_ctx} tokens is needed "
            f"(use a longer text or a smaller --ctx)"
        )
    if n_chunks is not None:
        if n_chunks < 1:
            raise ValueError(f"--chunks must be at least 1, got {n_chunks}")
        available = min(available, n_chunks)
    chunks = arr[: available * n_ctx].reshape(available, n_ctx).copy()
    if bos_id is not None:
        chunks[:, 0] = bos_id
    return chunks


def log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax of each row."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def scored_logprobs(logits: np.ndarray, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log-softmax of the scored rows [n_scored, V] float64, the true next tokens [n_scored])."""
    n_ctx = chunk.size
    first = n_ctx // 2
    rows = log_softmax_rows(logits[first : n_ctx - 1])
    return rows, chunk[first + 1 :].astype(np.int64)


def mean_and_error(values: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error sqrt(var / (N - 1)) (0 for fewer than 11 values, as llama.cpp)."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return 0.0, 0.0
    mean = float(v.mean())
    var = float((v * v).mean() - mean * mean)
    err = math.sqrt(var / (v.size - 1)) if var > 0 and v.size > 10 else 0.0
    return mean, err


def percentile(values: np.ndarray, pct: float) -> float:
    """Linear interpolation between the order statistics (llama.cpp's percentile)."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), pct, method="linear"))


def ppl_summary(nll: np.ndarray) -> dict[str, float]:
    mean, err = mean_and_error(nll)
    ppl = math.exp(mean)
    return {
        "ppl": ppl,
        "ppl_error": ppl * err,
        "mean_nll": mean,
        "mean_nll_error": err,
        "n_tokens": int(nll.size),
    }


@dataclass
class KldBase:
    """A base file read back (see the module doc); chunk(i) gives one chunk's records."""

    n_vocab: int
    n_ctx: int
    n_chunks: int
    top_k: int
    fingerprint: bytes
    tokens: np.ndarray  # int32 [n_chunks, n_ctx]
    nll: np.ndarray  # float32 [n_chunks, n_scored]
    _payload: np.ndarray  # [n_chunks] records: raw top ids/log-probs, or float16 log-probs

    @property
    def full(self) -> bool:
        return self.top_k >= self.n_vocab

    def chunk(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids [n_scored, K] int64, log-probs [n_scored, K] float64) of chunk i."""
        rec = self._payload[i]
        if self.full:
            lp = rec["logp"].astype(np.float64)
            m = lp.max(axis=1, keepdims=True)  # renormalise away the float16 rounding of the sum
            lp = lp - m - np.log(np.exp(lp - m).sum(axis=1, keepdims=True))
            ids = np.broadcast_to(np.arange(self.n_vocab, dtype=np.int64), lp.shape)
            return ids, lp
        return rec["ids"].astype(np.int64), rec["logp"].astype(np.float64)


def _record_dtype(n_ctx: int, top_k: int, n_vocab: int) -> np.dtype:
    ns = n_scored(n_ctx)
    if top_k >= n_vocab:
        return np.dtype([("nll", "<f4", (ns,)), ("logp", "<f2", (ns, n_vocab))])
    return np.dtype([("nll", "<f4", (ns,)), ("ids", "<i4", (ns, top_k)), ("logp", "<f4", (ns, top_k))])


def file_bytes(n_chunks: int, n_ctx: int, top_k: int, n_vocab: int) -> int:
    """Size of a base file."""
    return KLD_HEADER.size + 4 * n_chunks * n_ctx + n_chunks * _record_dtype(n_ctx, top_k, n_vocab).itemsize


class BaseWriter:
    """Writes a base file chunk by chunk (to PATH.part, renamed by close(); abort() removes it)."""

    def __init__(self, path: str | os.PathLike[str], n_vocab: int, fingerprint: bytes, chunks: np.ndarray,
                 top_k: int) -> None:  # fmt: skip
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise FileNotFoundError(f"the output directory {self.path.parent} does not exist")
        self.n_vocab, self.top_k = n_vocab, min(top_k, n_vocab)
        self.n_chunks, self.n_ctx = int(chunks.shape[0]), int(chunks.shape[1])
        self.dtype = _record_dtype(self.n_ctx, self.top_k, n_vocab)
        self.written = 0
        self.tmp = self.path.with_name(self.path.name + ".part")
        self.f = open(self.tmp, "wb")
        self.f.write(
            KLD_HEADER.pack(
                KLD_MAGIC, KLD_VERSION, n_vocab, self.n_ctx, self.n_chunks, self.top_k, fingerprint
            )
        )
        self.f.write(np.ascontiguousarray(chunks, dtype="<i4").tobytes())

    def add(self, rows: np.ndarray, targets: np.ndarray) -> None:
        """One chunk: its scored log-softmax rows [n_scored, V] and true next tokens."""
        rec = np.zeros(1, dtype=self.dtype)
        rec["nll"][0] = -rows[np.arange(rows.shape[0]), targets]
        if self.top_k >= self.n_vocab:
            rec["logp"][0] = rows
        else:
            k = self.top_k
            part = np.argpartition(-rows, k - 1, axis=1)[:, :k]
            order = np.argsort(-np.take_along_axis(rows, part, axis=1), axis=1, kind="stable")
            ids = np.take_along_axis(part, order, axis=1)
            rec["ids"][0] = ids
            rec["logp"][0] = np.take_along_axis(rows, ids, axis=1)
        self.f.write(rec.tobytes())
        self.written += 1

    def close(self) -> Path:
        self.f.close()
        if self.written != self.n_chunks:
            self.abort()
            raise ValueError(f"internal error: {self.written} of {self.n_chunks} chunks written")
        os.replace(self.tmp, self.path)
        return self.path

    def abort(self) -> None:
        if not self.f.closed:
            self.f.close()
        self.tmp.unlink(missing_ok=True)


def read_base(path: str | os.PathLike[str]) -> KldBase:
    """Read and check a base file; a wrong magic, version, size or value is a ValueError."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"KL-divergence base file not found: {p}")
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(KLD_HEADER.size)
    if len(head) < KLD_HEADER.size:
        raise ValueError(f"{p}: too short for a KL-divergence base file ({size} bytes)")
    magic, version, n_vocab, n_ctx, n_chunks, top_k, fp = KLD_HEADER.unpack(head)
    if magic != KLD_MAGIC:
        raise ValueError(f"{p}: not a Colibri KL-divergence base file (written by --kl-divergence-base)")
    if version != KLD_VERSION:
        raise ValueError(f"{p}: base file version {version}; this Colibri reads version {KLD_VERSION}")
    if not (8 <= n_ctx <= 1 << 22 and 1 <= n_chunks <= 1 << 20 and 1 <= top_k <= n_vocab <= 1 << 24):
        raise ValueError(
            f"{p}: implausible header (n_vocab {n_vocab}, n_ctx {n_ctx}, n_chunks {n_chunks}, top_k {top_k})"
        )
    want = file_bytes(n_chunks, n_ctx, top_k, n_vocab)
    if size != want:
        raise ValueError(f"{p}: {size} bytes, but its header describes {want} (truncated or corrupt)")
    tokens = np.fromfile(p, dtype="<i4", count=n_chunks * n_ctx, offset=KLD_HEADER.size)
    tokens = tokens.reshape(n_chunks, n_ctx).astype(np.int32)
    payload = np.memmap(p, dtype=_record_dtype(n_ctx, top_k, n_vocab), mode="r",
                        offset=KLD_HEADER.size + 4 * n_chunks * n_ctx, shape=(n_chunks,))  # fmt: skip
    nll = np.array(payload["nll"], dtype=np.float32)
    if tokens.min() < 0 or tokens.max() >= n_vocab:
        raise ValueError(f"{p}: token ids out of range for a vocabulary of {n_vocab}")
    if not np.isfinite(nll).all() or (nll < 0).any():
        raise ValueError(f"{p}: corrupt log-probabilities")
    if top_k < n_vocab:
        ids = payload["ids"]
        if ids.min() < 0 or ids.max() >= n_vocab:
            raise ValueError(f"{p}: token ids out of range for a vocabulary of {n_vocab}")
    if not all(np.isfinite(payload[i]["logp"]).all() for i in range(n_chunks)):
        raise ValueError(f"{p}: corrupt log-probabilities (not finite)")
    return KldBase(n_vocab, n_ctx, n_chunks, top_k, fp, tokens, nll, payload)


def check_base_matches(base: KldBase, n_vocab: int, fingerprint: bytes, where: str) -> None:
    """Refuse a base file made with another vocabulary (other tokens or other ids)."""
    if base.n_vocab != n_vocab:
        raise ValueError(
            f"{where} was made for a vocabulary of {base.n_vocab} tokens, this model has {n_vocab}: "
            f"KL divergence needs the same tokenizer"
        )
    if base.fingerprint != fingerprint:
        raise ValueError(
            f"{where} was made with another tokenizer (different tokens or token ids): "
            f"KL divergence needs the same vocabulary"
        )


def _rest_log(p_top: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mass outside the top-K, its log; -inf where there is none)."""
    rest = np.clip(1.0 - p_top.sum(axis=1), 0.0, 1.0)
    with np.errstate(divide="ignore"):
        return rest, np.log(rest)


def compare_rows(
    rows: np.ndarray, targets: np.ndarray, base_nll: np.ndarray, base_ids: np.ndarray, base_logp: np.ndarray
) -> dict[str, np.ndarray]:
    """Per scored token: nll, KLD(base || this), Δp, same top token, base rest mass."""
    n = rows.shape[0]
    idx = np.arange(n)
    nll = -rows[idx, targets]
    lp = base_logp.astype(np.float64)
    lq = np.take_along_axis(rows, base_ids.astype(np.int64), axis=1)
    p = np.exp(lp)
    kld = (p * (lp - lq)).sum(axis=1)
    p_rest, lp_rest = _rest_log(p)
    q_rest, lq_rest = _rest_log(np.exp(lq))
    has_rest = (p_rest > 0) & (base_ids.shape[1] < rows.shape[1])
    with np.errstate(invalid="ignore", divide="ignore"):
        rest_term = np.where(has_rest, p_rest * (lp_rest - np.maximum(lq_rest, -745.0)), 0.0)
    kld = np.maximum(kld + rest_term, 0.0)
    dp = np.exp(-nll) - np.exp(-base_nll.astype(np.float64))
    base_top = np.take_along_axis(base_ids, base_logp.argmax(axis=1)[:, None], axis=1)[:, 0]
    same = rows.argmax(axis=1) == base_top
    return {"nll": nll, "kld": kld, "dp": dp, "same_top": same, "rest": np.where(has_rest, p_rest, 0.0)}


def kld_summary(nll: np.ndarray, base_nll: np.ndarray, kld: np.ndarray, dp: np.ndarray, same: np.ndarray,
                rest: np.ndarray) -> dict[str, Any]:  # fmt: skip
    """llama-perplexity's statistics block of a --kl-divergence run (all as plain floats)."""
    nll = np.asarray(nll, dtype=np.float64)
    bn = np.asarray(base_nll, dtype=np.float64)
    n = nll.size
    q, q_err = mean_and_error(nll)
    b, b_err = mean_and_error(bn)
    cov = float((nll * bn).mean() - q * b) / (n - 1) if n >= 10 else 0.0
    cor = cov / (q_err * b_err) if q_err > 0 and b_err > 0 else 0.0
    ln_ratio = q - b
    ln_ratio_err = math.sqrt(max(q_err * q_err + b_err * b_err - 2.0 * cov, 0.0))
    ppl_q, ppl_b = math.exp(q), math.exp(b)
    ppl_diff_err = math.sqrt(
        max((ppl_q * q_err) ** 2 + (ppl_b * b_err) ** 2 - 2.0 * ppl_q * ppl_b * cov, 0.0)
    )
    k_mean, k_err = mean_and_error(kld)
    d_mean, d_err = mean_and_error(dp)
    mse, mse_err = mean_and_error(np.asarray(dp, dtype=np.float64) ** 2)
    rms = math.sqrt(mse)
    top = float(np.mean(same))
    return {
        "n_tokens": int(n),
        "ppl": ppl_q,
        "ppl_error": ppl_q * q_err,
        "ppl_base": ppl_b,
        "ppl_base_error": ppl_b * b_err,
        "ln_ppl_correlation": cor,
        "ln_ppl_ratio": ln_ratio,
        "ln_ppl_ratio_error": ln_ratio_err,
        "ppl_ratio": math.exp(ln_ratio),
        "ppl_ratio_error": math.exp(ln_ratio) * ln_ratio_err,
        "ppl_diff": ppl_q - ppl_b,
        "ppl_diff_error": ppl_diff_err,
        "kld_mean": k_mean,
        "kld_error": k_err,
        "kld_max": float(np.max(kld)),
        "kld_percentiles": {f"{p:g}": percentile(kld, p) for p in KLD_PERCENTILES},
        "kld_min": float(np.min(kld)),
        "dp_mean": d_mean,
        "dp_error": d_err,
        "dp_max": float(np.max(dp)),
        "dp_percentiles": {f"{p:g}": percentile(dp, p) for p in DP_PERCENTILES},
        "dp_min": float(np.min(dp)),
        "dp_rms": rms,
        "dp_rms_error": 0.5 / rms * mse_err if rms > 0 else 0.0,
        "same_top": top,
        "same_top_error": math.sqrt(top * (1.0 - top) / (n - 1)) if n > 1 else 0.0,
        "base_rest_mass_mean": float(np.mean(rest)),
        "base_rest_mass_max": float(np.max(rest)),
    }


def format_ppl(s: dict[str, float]) -> str:
    return f"Final estimate: PPL = {s['ppl']:.4f} +/- {s['ppl_error']:.5f}  ({s['n_tokens']} tokens scored)"


def _percentile_lines(what: str, percentiles: Sequence[float], value: Callable[[float], str]) -> list[str]:
    """One line a percentile, labelled as llama-perplexity labels them ("Median" for the 50th)."""
    return [f"{'Median ' if p == 50.0 else f'{p:4.1f}%  '} {what}: {value(p)}" for p in percentiles]


def format_kld(s: dict[str, Any]) -> str:
    """The statistics as llama-perplexity prints them."""
    kp, dpp = s["kld_percentiles"], s["dp_percentiles"]
    lines = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s['ppl']:10.6f} ± {s['ppl_error']:10.6f}",
        f"Mean PPL(base)                : {s['ppl_base']:10.6f} ± {s['ppl_base_error']:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['ln_ppl_correlation']:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ppl_ratio']:10.6f} ± {s['ln_ppl_ratio_error']:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {s['ppl_ratio']:10.6f} ± {s['ppl_ratio_error']:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {s['ppl_diff']:10.6f} ± {s['ppl_diff_error']:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {s['kld_mean']:10.6f} ± {s['kld_error']:10.6f}",
        f"Maximum KLD: {s['kld_max']:10.6f}",
    ]
    lines += _percentile_lines("KLD", KLD_PERCENTILES, lambda p: f"{kp[f'{p:g}']:10.6f}")
    lines += [
        f"Minimum KLD: {s['kld_min']:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {100 * s['dp_mean']:6.3f} ± {100 * s['dp_error']:5.3f} %",
        f"Maximum Δp: {100 * s['dp_max']:6.3f}%",
    ]
    lines += _percentile_lines("Δp", DP_PERCENTILES, lambda p: f"{100 * dpp[f'{p:g}']:6.3f}%")
    lines += [
        f"Minimum Δp: {100 * s['dp_min']:6.3f}%",
        f"RMS Δp    : {100 * s['dp_rms']:6.3f} ± {100 * s['dp_rms_error']:5.3f} %",
        f"Same top p: {100 * s['same_top']:6.3f} ± {100 * s['same_top_error']:5.3f} %",
    ]
    if s["base_rest_mass_max"] > 0:
        lines.append(
            f"(base probability outside its stored top-K: mean {s['base_rest_mass_mean']:.2e}, "
            f"max {s['base_rest_mass_max']:.2e}; the KLD is exact up to that mass)"
        )
    return "\n".join(lines)


def evaluate(
    logits_of: Callable[[np.ndarray], np.ndarray],
    chunks: np.ndarray,
    *,
    n_vocab: int,
    base: KldBase | None = None,
    writer: BaseWriter | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, np.ndarray]:
    """Run every chunk through `logits_of` (teacher-forced logits [n_ctx, V] of a chunk) and collect
    per-token statistics: {"nll"} alone, or with `base` also kld/dp/same_top/rest/base_nll. With a
    writer, each chunk's log-probabilities also go to a base file."""
    ns = n_scored(chunks.shape[1])
    keys = ("nll", "kld", "dp", "same_top", "rest") if base is not None else ("nll",)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    for i, chunk in enumerate(chunks):
        logits = logits_of(chunk)
        if logits.shape != (chunk.size, n_vocab):
            raise ValueError(f"logits of shape {logits.shape}, expected {(chunk.size, n_vocab)}")
        rows, targets = scored_logprobs(logits, chunk)
        if base is not None:
            ids, lp = base.chunk(i)
            got = compare_rows(rows, targets, base.nll[i], ids, lp)
            for k in keys:
                parts[k].append(got[k])
        else:
            parts["nll"].append(-rows[np.arange(ns), targets])
        if writer is not None:
            writer.add(rows, targets)
        if progress is not None:
            progress(i + 1)
    out = {k: np.concatenate(v) for k, v in parts.items()}
    if base is not None:
        out["base_nll"] = base.nll[: chunks.shape[0]].reshape(-1).astype(np.float64)
    return out


__all__ = [
    "BaseWriter",
    "KldBase",
    "check_base_matches",
    "evaluate",
    "file_bytes",
    "format_kld",
    "format_ppl",
    "kld_summary",
    "make_chunks",
    "ppl_summary",
    "read_base",
    "vocab_fingerprint",
]
