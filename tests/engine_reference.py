"""A float64 numpy reference of the forward pass, and tiny random GGUF models to check the engine with.

The reference follows Hugging Face transformers' modeling (see shared/reference/moe_router_spec.md):
pre-norm decoder, RMSNorm, GQA attention with rotate_half RoPE, SwiGLU FFN, softmax router with
top-k and optional renormalisation, qwen2moe's sigmoid-gated shared expert, qwen3moe's per-head
q/k norm and olmoe's whole-projection q/k norm. Weights are kept in Hugging Face layout: for the
llama architecture the GGUF stores the q/k rows permuted (llama.cpp's convention) and this module
undoes that, so a match also checks the engine's RoPE pairing against the permutation.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

ARCHS = ("llama", "mixtral", "qwen2moe", "qwen3moe", "olmoe")


@dataclass
class RefModel:
    arch: str  # "llama" (dense or Mixtral-style MoE), "qwen2moe", "qwen3moe", "olmoe"
    hp: dict[str, Any]
    w: dict[str, np.ndarray] = field(default_factory=dict)  # GGUF names, HF layout, float64


# ---- llama.cpp's q/k row permutation ------------------------------------------------------------


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate_half row order -> llama.cpp's interleaved pairs, per head."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- forward ---------------------------------------------------------------------------------


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float) -> np.ndarray:
    """rotate_half RoPE on the first n_rot dims of x [T, heads, head_dim]."""
    half = n_rot // 2
    inv = 1.0 / base ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    ang = pos[:, None].astype(np.float64) * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    x1, x2 = x[..., :half], x[..., half:n_rot]
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:n_rot] = x2 * cos + x1 * sin
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _swiglu(h: np.ndarray, g: np.ndarray, u: np.ndarray, d: np.ndarray) -> np.ndarray:
    return (_silu(h @ g.T) * (h @ u.T)) @ d.T


def reference_forward(
    m: RefModel, tokens: list[int], kv_f16: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Teacher-forced logits [T, n_vocab] and routing (ids [T, n_layer, k], weights) of a fresh sequence.
    kv_f16 rounds the keys and values to float16 as a KV cache in F16 stores them."""
    hp, w = m.hp, m.w
    nh, nkv, hd, eps = hp["n_head"], hp["n_head_kv"], hp["head_dim"], hp["eps"]
    k_used, n_layer = hp["n_expert_used"], hp["n_layer"]
    T = len(tokens)
    pos = np.arange(T)
    x = w["token_embd.weight"][np.asarray(tokens)]
    ids = np.zeros((T, n_layer, max(k_used, 1)), dtype=np.int64)
    wts = np.zeros((T, n_layer, max(k_used, 1)))
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for il in range(n_layer):
        p = f"blk.{il}."
        h = _rms(x, w[p + "attn_norm.weight"], eps)
        q = h @ w[p + "attn_q.weight"].T
        k = h @ w[p + "attn_k.weight"].T
        v = h @ w[p + "attn_v.weight"].T
        if p + "attn_q.bias" in w:
            q, k, v = q + w[p + "attn_q.bias"], k + w[p + "attn_k.bias"], v + w[p + "attn_v.bias"]
        if m.arch == "olmoe":
            q, k = _rms(q, w[p + "attn_q_norm.weight"], eps), _rms(k, w[p + "attn_k_norm.weight"], eps)
        q, k, v = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        if m.arch == "qwen3moe":
            q, k = _rms(q, w[p + "attn_q_norm.weight"], eps), _rms(k, w[p + "attn_k_norm.weight"], eps)
        q, k = _rope(q, pos, hp["n_rot"], hp["rope_base"]), _rope(k, pos, hp["n_rot"], hp["rope_base"])
        if kv_f16:
            k, v = k.astype(np.float16).astype(np.float64), v.astype(np.float16).astype(np.float64)
        o = np.zeros((T, nh, hd))
        for hh in range(nh):
            kh = hh // (nh // nkv)
            s = q[:, hh] @ k[:, kh].T / np.sqrt(hd) + mask
            o[:, hh] = _softmax(s) @ v[:, kh]
        x = x + o.reshape(T, nh * hd) @ w[p + "attn_output.weight"].T
        h = _rms(x, w[p + "ffn_norm.weight"], eps)
        if hp["n_expert"] == 0:
            x = x + _swiglu(h, w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"], w[p + "ffn_down.weight"])
            continue
        probs = _softmax(h @ w[p + "ffn_gate_inp.weight"].T)
        y = np.zeros_like(x)
        for t in range(T):
            sel = np.argsort(-probs[t], kind="stable")[:k_used]
            sw = probs[t, sel]
            if hp["norm"]:
                sw = sw / sw.sum()
            ids[t, il], wts[t, il] = sel, sw
            for e, we in zip(sel, sw, strict=True):
                y[t] += (
                    we
                    * _swiglu(
                        h[t : t + 1],
                        w[p + "ffn_gate_exps.weight"][e],
                        w[p + "ffn_up_exps.weight"][e],
                        w[p + "ffn_down_exps.weight"][e],
                    )[0]
                )
        if p + "ffn_gate_shexp.weight" in w:
            gate = 1.0 / (1.0 + np.exp(-(h @ w[p + "ffn_gate_inp_shexp.weight"])))
            y += gate[:, None] * _swiglu(
                h,
                w[p + "ffn_gate_shexp.weight"],
                w[p + "ffn_up_shexp.weight"],
                w[p + "ffn_down_shexp.weight"],
            )
        x = x + y
    x = _rms(x, w["output_norm.weight"], eps)
    out = w.get("output.weight", w["token_embd.weight"])
    return x @ out.T, ids, wts


# ---- tiny random GGUF models ---------------------------------------------------------------------

QTYPES = {
    "F32": QT.F32,
    "F16": QT.F16,
    "BF16": QT.BF16,
    "Q8_0": QT.Q8_0,
    "Q4_0": QT.Q4_0,
    "Q4_1": QT.Q4_1,
    "Q5_0": QT.Q5_0,
    "Q5_1": QT.Q5_1,
    "MXFP4": QT.MXFP4,
    "Q2_K": QT.Q2_K,
    "Q3_K": QT.Q3_K,
    "Q4_K": QT.Q4_K,
    "Q5_K": QT.Q5_K,
    "Q6_K": QT.Q6_K,
    "IQ4_NL": QT.IQ4_NL,
    "IQ4_XS": QT.IQ4_XS,
    "Q8_1": QT.Q8_1,
}  # Q8_1: a valid ggml type the engine does not compute with (error-path tests)

# Types the gguf package cannot quantize: byte offsets of their fp16 scale d and minimum scale (or None).
# Their tensors are random blocks whose two scales are set so the weights have about the wanted spread.
RANDOM_BLOCKS = {
    "Q2_K": (80, 82),
    "Q3_K": (108, None),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208, None),
    "IQ4_NL": (0, None),
    "IQ4_XS": (0, None),
    "Q8_1": (0, 2),
}


def _random_blocks(a32: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random blocks of `qtype` for an array shaped like a32, scaled like it; (raw bytes, values)."""
    t = QTYPES[qtype]
    block, block_bytes = gguf.GGML_QUANT_SIZES[t]
    rows, cols = a32.shape
    raw = rng.integers(0, 256, size=(rows, cols // block, block_bytes), dtype=np.uint8)
    d_off, m_off = RANDOM_BLOCKS[qtype]

    def set_scales(d: float) -> None:
        h = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
        raw[:, :, d_off : d_off + 2] = h
        if m_off is not None:
            raw[:, :, m_off : m_off + 2] = h

    if t == QT.Q8_1:  # no dequantization in the gguf package, and only error paths use it
        set_scales(1e-3)
        return raw.reshape(rows, -1), np.full(a32.shape, np.nan)
    set_scales(1.0)
    unit = gguf.quants.dequantize(raw.reshape(rows, -1), t)
    set_scales(float(a32.std()) / float(unit.std()))
    return raw.reshape(rows, -1), gguf.quants.dequantize(raw.reshape(rows, -1), t).astype(np.float64)


def _store(a: np.ndarray, qtype: str) -> tuple[np.ndarray, QT | None, np.ndarray]:
    """(data to write, raw dtype for GGUFWriter, the float64 values the file then holds)."""
    a32 = np.ascontiguousarray(a, dtype=np.float32)
    if qtype == "F32":
        return a32, None, a32.astype(np.float64)
    if qtype == "F16":
        h = a32.astype(np.float16)
        return h, None, h.astype(np.float64)
    t = QTYPES[qtype]
    if qtype in RANDOM_BLOCKS:
        seed = zlib.crc32(a32.tobytes()[:256] + qtype.encode())
        raw, eff = _random_blocks(a32.reshape(-1, a32.shape[-1]), qtype, np.random.default_rng(seed))
        return raw, t, eff.reshape(a32.shape)
    q = gguf.quants.quantize(a32, t)
    return q, t, gguf.quants.dequantize(q, t).astype(np.float64).reshape(a32.shape)


def make_tiny_model(
    path: str | Path,
    arch: str,
    *,
    n_vocab: int = 301,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 24,
    n_ff: int = 96,
    n_expert: int = 6,
    n_expert_used: int = 2,
    n_ff_exp: int = 64,
    n_ff_shexp: int = 32,
    norm: bool | None = None,
    tied: bool = False,
    wtype: str = "F32",
    n_rot: int | None = None,
    seed: int = 0,
    skip_tensors: tuple[str, ...] = (),
    tensor_types: dict[str, str] | None = None,
    arch_name: str | None = None,
) -> RefModel:
    """Write a random GGUF model of `arch` ("llama", "mixtral", "qwen2moe", "qwen3moe", "olmoe") and
    return its reference description. Matrices use `wtype`; norms, biases and the router stay F32
    (as llama.cpp's quantizer leaves them). `norm` None writes no expert_weights_norm key.
    For error-path tests: skip_tensors are left out, tensor_types overrides the type of named
    matrices, arch_name overrides general.architecture."""
    if arch not in ARCHS:
        raise ValueError(arch)
    rng = np.random.default_rng(seed)
    gguf_arch = "llama" if arch == "mixtral" else arch
    moe = arch != "llama"
    n_rot = head_dim if n_rot is None else n_rot
    defaults = {"llama": True, "mixtral": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
    hp = {
        "n_head": n_head,
        "n_head_kv": n_head_kv,
        "head_dim": head_dim,
        "eps": 1e-5,
        "n_rot": n_rot,
        "rope_base": 10000.0,
        "n_layer": n_layer,
        "n_expert": n_expert if moe else 0,
        "n_expert_used": n_expert_used if moe else 0,
        "norm": defaults[arch] if norm is None else norm,
        "n_vocab": n_vocab,
    }
    ref = RefModel(arch=gguf_arch, hp=hp)
    writer = gguf.GGUFWriter(str(path), arch_name or gguf_arch)
    types = tensor_types or {}
    if arch_name:
        gguf_arch = arch_name
    writer.add_block_count(n_layer)
    writer.add_context_length(512)
    writer.add_embedding_length(n_embd)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(n_rot)
    writer.add_rope_freq_base(hp["rope_base"])
    writer.add_layer_norm_rms_eps(hp["eps"])
    writer.add_feed_forward_length(n_ff if not moe else n_ff_exp)
    if moe:
        writer.add_expert_count(n_expert)
        writer.add_expert_used_count(n_expert_used)
        writer.add_expert_feed_forward_length(n_ff_exp)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(n_ff_shexp)
        if norm is not None:
            writer.add_expert_weights_norm(norm)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def mat(
        name: str, rows: int, cols: int, qtype: str = wtype, scale: float = 1.0, permute_heads: int = 0
    ) -> None:
        a = rng.standard_normal((rows, cols)) * (scale / np.sqrt(cols))
        data, raw, eff = _store(a, types.get(name, qtype))
        if name in skip_tensors:
            return
        if permute_heads:
            # quantization blocks run along a row, so permuting rows commutes with it
            data = permute_qk(data, permute_heads)
        writer.add_tensor(name, data, raw_dtype=raw)
        ref.w[name] = eff

    def vec(name: str, n: int, center: float, spread: float) -> None:
        a = (center + spread * rng.standard_normal(n)).astype(np.float32)
        if name in skip_tensors:
            return
        writer.add_tensor(name, a)
        ref.w[name] = a.astype(np.float64)

    def experts(name: str, rows: int, cols: int) -> None:
        a = rng.standard_normal((n_expert, rows, cols)) * (1.0 / np.sqrt(cols))
        data, raw, eff = _store(a.reshape(n_expert * rows, cols), types.get(name, wtype))
        if name in skip_tensors:
            return
        if raw is None:
            data = data.reshape(n_expert, rows, cols)
        else:
            data = data.reshape(n_expert, rows, -1)
        writer.add_tensor(name, data, raw_dtype=raw)
        ref.w[name] = eff.reshape(n_expert, rows, cols)

    qd, kvd = n_head * head_dim, n_head_kv * head_dim
    embd = rng.standard_normal((n_vocab, n_embd))
    data, raw, eff = _store(embd, wtype)
    writer.add_tensor("token_embd.weight", data, raw_dtype=raw)
    ref.w["token_embd.weight"] = eff
    vec("output_norm.weight", n_embd, 1.0, 0.1)
    if not tied:
        mat("output.weight", n_vocab, n_embd, scale=3.0)
    for il in range(n_layer):
        p = f"blk.{il}."
        vec(p + "attn_norm.weight", n_embd, 1.0, 0.1)
        perm = gguf_arch == "llama"
        mat(p + "attn_q.weight", qd, n_embd, scale=2.0, permute_heads=n_head if perm else 0)
        mat(p + "attn_k.weight", kvd, n_embd, scale=2.0, permute_heads=n_head_kv if perm else 0)
        mat(p + "attn_v.weight", kvd, n_embd)
        mat(p + "attn_output.weight", n_embd, qd)
        if arch == "qwen2moe":
            vec(p + "attn_q.bias", qd, 0.0, 0.3)
            vec(p + "attn_k.bias", kvd, 0.0, 0.3)
            vec(p + "attn_v.bias", kvd, 0.0, 0.3)
        if arch == "qwen3moe":
            vec(p + "attn_q_norm.weight", head_dim, 1.0, 0.1)
            vec(p + "attn_k_norm.weight", head_dim, 1.0, 0.1)
        if arch == "olmoe":
            vec(p + "attn_q_norm.weight", qd, 1.0, 0.1)
            vec(p + "attn_k_norm.weight", kvd, 1.0, 0.1)
        vec(p + "ffn_norm.weight", n_embd, 1.0, 0.1)
        if not moe:
            mat(p + "ffn_gate.weight", n_ff, n_embd)
            mat(p + "ffn_up.weight", n_ff, n_embd)
            mat(p + "ffn_down.weight", n_embd, n_ff)
            continue
        mat(p + "ffn_gate_inp.weight", n_expert, n_embd, qtype="F32", scale=3.0)
        experts(p + "ffn_gate_exps.weight", n_ff_exp, n_embd)
        experts(p + "ffn_up_exps.weight", n_ff_exp, n_embd)
        experts(p + "ffn_down_exps.weight", n_embd, n_ff_exp)
        if arch == "qwen2moe":
            mat(p + "ffn_gate_shexp.weight", n_ff_shexp, n_embd)
            mat(p + "ffn_up_shexp.weight", n_ff_shexp, n_embd)
            mat(p + "ffn_down_shexp.weight", n_embd, n_ff_shexp)
            vec(p + "ffn_gate_inp_shexp.weight", n_embd, 0.0, 0.3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # ref.w holds the values in HF layout: q/k were permuted only on the way into the file
    return ref


def load_gguf_reference(path: str | Path) -> RefModel:
    """A RefModel from an existing GGUF file (dequantized with the gguf package), e.g. SmolLM2."""
    r = gguf.GGUFReader(str(path))

    def field(key: str, default: Any = None) -> Any:
        f = r.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    n_embd, nh = field(f"{arch}.embedding_length"), field(f"{arch}.attention.head_count")
    nkv = field(f"{arch}.attention.head_count_kv", nh)
    hd = field(f"{arch}.attention.key_length", n_embd // nh)
    n_expert = field(f"{arch}.expert_count", 0)
    defaults = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
    hp = {
        "n_head": nh,
        "n_head_kv": nkv,
        "head_dim": hd,
        "eps": field(f"{arch}.attention.layer_norm_rms_epsilon"),
        "n_rot": field(f"{arch}.rope.dimension_count", hd),
        "rope_base": field(f"{arch}.rope.freq_base", 10000.0),
        "n_layer": field(f"{arch}.block_count"),
        "n_expert": n_expert,
        "n_expert_used": field(f"{arch}.expert_used_count", 0),
        "norm": field(f"{arch}.expert_weights_norm", defaults[arch]),
    }
    m = RefModel(arch=arch, hp=hp)
    for t in r.tensors:
        if t.tensor_type == QT.I32:  # an index table (Colibri's outlier columns), not a weight
            m.w[t.name] = np.asarray(t.data).copy()
            continue
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            a = unpermute_qk(a, nh if "attn_q" in t.name else nkv)
        m.w[t.name] = a
    hp["n_vocab"] = m.w["token_embd.weight"].shape[0]
    return m
