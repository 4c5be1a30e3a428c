"""Convert a Hugging Face checkpoint directory into a llama.cpp-compatible GGUF file.

Supported architectures (config.json `model_type`): llama (dense), mixtral, qwen2_moe, qwen3_moe, olmoe,
granitemoe, granitemoeshared, gpt_oss, qwen3_5_moe_text and qwen3_5_moe (its text model), gemma4_text and
gemma4 (its text model), deepseek_v2, deepseek_v3, glm4_moe, glm4_moe_lite, lfm2, lfm2_moe. The output uses
llama.cpp's tensor names and metadata keys, so the same file runs in llama.cpp and in Colibri; that is what
the conformance suite and the benchmarks rely on.

Only numpy, the `gguf` package and the standard library are used: no torch. Safetensors files are read through
their JSON header and a memory map, one tensor at a time, so converting a checkpoint larger than memory is
possible (peak memory is about one layer's stacked expert tensor of one projection, in float32).

Layout decisions (the same as llama.cpp's converter, so both engines read the file identically):
* q/k projection rows of llama-family attention (llama, mixtral, granitemoe) are permuted so that llama.cpp's
  "normal" RoPE (adjacent pairs) equals transformers' rotate_half RoPE; qwen and olmoe use NeoX RoPE and are
  written as they are.
* experts are stacked per layer and projection: blk.N.ffn_{gate,up,down}_exps.weight [n_expert, rows, cols].
* 1-D tensors, norms and routers stay F32 whatever the requested type; matrices whose row length is not a
  multiple of the quantization block fall back to F16.
* tensor data uses GGUF's default alignment (32 bytes) and declares no general.alignment: llama.cpp's reader
  wants every tensor's offset to be exactly the previous one's end padded to the alignment, and its quantizer
  copies a declared alignment but pads its own output to 32, so a 4096-byte alignment made llama.cpp's
  requantized files unreadable. The expert store reads page-aligned windows around experts for direct I/O.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("colibri.convert")

ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT; never declared (see the module doc)
OUT_TYPES = ("f32", "f16", "q8_0", "q4_0")
SUPPORTED_MODEL_TYPES = (
    "llama",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "granitemoe",
    "granitemoeshared",
    "gpt_oss",
    "qwen3_5_moe_text",
    "qwen3_5_moe",
    "gemma4_text",
    "gemma4",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "glm4_moe_lite",
    "lfm2",
    "lfm2_moe",
)
# DeepSeek-V2 / V3 and GLM-4.7-Flash (glm4_moe_lite: V3's recipe): one GGUF architecture, deepseek2
# (multi-head latent attention).
_DEEPSEEK = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
# Qwen3.5 / 3.6 MoE: the text model alone, or the text half of the vision-language checkpoint.
_QWEN35 = ("qwen3_5_moe_text", "qwen3_5_moe")
# Gemma 4: the text model alone (gemma4_text) or inside the multimodal checkpoint (gemma4, whose text_config
# and model.language_model.* weights are converted; the vision and audio towers are left out).
_GEMMA4 = ("gemma4_text", "gemma4")
# GraniteMoE with and without the always-on shared MLP: one GGUF architecture, granitemoe.
_GRANITE = ("granitemoe", "granitemoeshared")
# LFM2 (dense, GGUF lfm2) and LFM2-MoE (lfm2moe): short convolutions and attention layers.
_LFM2 = ("lfm2", "lfm2_moe")


class ConversionError(ValueError):
    """The checkpoint cannot be converted (unsupported feature, missing or inconsistent files)."""


# ----------------------------------------------------------------------------------------------------
# safetensors reading (header + memory map; bf16 widened by hand because numpy has no bfloat16)

_ST_DTYPES: dict[str, tuple[str, int]] = {
    "F32": ("<f4", 4),
    "F16": ("<f2", 2),
    "BF16": ("<u2", 2),
    "F64": ("<f8", 8),
    "U8": ("<u1", 1),  # gpt-oss's MXFP4 blocks and scales
}


@dataclass
class _StTensor:
    file: Path
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def _read_safetensors_header(path: Path) -> dict[str, _StTensor]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConversionError(f"{path}: too short to be a safetensors file")
        (hlen,) = struct.unpack("<Q", raw)
        if hlen <= 0 or 8 + hlen > size or hlen > 100 * 1024 * 1024:
            raise ConversionError(f"{path}: invalid safetensors header length {hlen}")
        try:
            header = json.loads(f.read(hlen))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConversionError(f"{path}: unreadable safetensors header: {exc}") from exc
    base = 8 + hlen
    out: dict[str, _StTensor] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = meta.get("dtype")
        if dtype not in _ST_DTYPES:
            raise ConversionError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        shape = tuple(int(d) for d in meta["shape"])
        begin, end = (int(x) for x in meta["data_offsets"])
        expected = math.prod(shape) * _ST_DTYPES[dtype][1]
        if end - begin != expected or begin < 0 or base + end > size:
            raise ConversionError(f"{path}: tensor {name} has inconsistent data offsets")
        out[name] = _StTensor(path, dtype, shape, base + begin, expected)
    return out


class _Checkpoint:
    """All tensors of a checkpoint directory, read lazily as float32."""

    def __init__(self, hf_dir: Path) -> None:
        index = hf_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({hf_dir / f for f in weight_map.values()})
        else:
            files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            if any(hf_dir.glob("*.bin")) or any(hf_dir.glob("*.pt")):
                raise ConversionError(
                    f"{hf_dir}: only PyTorch pickle weights found; re-save the checkpoint with safetensors "
                    "(model.save_pretrained(dir, safe_serialization=True)) and convert again"
                )
            raise ConversionError(f"{hf_dir}: no *.safetensors weights found")
        self.tensors: dict[str, _StTensor] = {}
        for f in files:
            if not f.exists():
                raise ConversionError(f"{f}: listed in the index but missing")
            for name, t in _read_safetensors_header(f).items():
                if name in self.tensors:
                    raise ConversionError(f"tensor {name} appears in more than one safetensors file")
                self.tensors[name] = t
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self._get(name).shape

    def _get(self, name: str) -> _StTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ConversionError(f"checkpoint lacks tensor {name}") from None

    def mark(self, name: str) -> None:
        self._get(name)
        self.used.add(name)

    def load(self, name: str) -> np.ndarray:
        t = self._get(name)
        npdtype, _ = _ST_DTYPES[t.dtype]
        count = math.prod(t.shape)
        with open(t.file, "rb") as f:
            f.seek(t.offset)
            buf = f.read(t.nbytes)
        if len(buf) != t.nbytes:
            raise ConversionError(f"{t.file}: truncated data for tensor {name}")
        raw = np.frombuffer(buf, dtype=npdtype, count=count)
        if t.dtype == "BF16":
            # bf16 is the top half of an IEEE float32: widen by shifting into the high 16 bits.
            arr = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            arr = raw.astype(np.float32)
        return arr.reshape(t.shape)


# ----------------------------------------------------------------------------------------------------
# model description from config.json


@dataclass
class _Hparams:
    model_type: str
    arch: str  # GGUF general.architecture
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx: int
    rms_eps: float
    rope_theta: float
    vocab_size: int
    tie_embeddings: bool
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    norm_topk: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _first(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def _rope_theta_and_check(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        # transformers 5 may nest per-attention-type parameters ({"full_attention": {...}}).
        if "rope_type" not in params and "rope_theta" not in params and len(params) == 1:
            params = next(iter(params.values()))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ConversionError(
                f"RoPE scaling '{rope_type}' is not supported yet (rope_parameters={params})"
            )
        theta = params.get("rope_theta", cfg.get("rope_theta"))
    else:
        scaling = cfg.get("rope_scaling")
        if scaling:
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in (None, "default"):
                raise ConversionError(
                    f"RoPE scaling '{rope_type}' is not supported yet (rope_scaling={scaling})"
                )
        theta = cfg.get("rope_theta")
    return float(theta if theta is not None else 10000.0)


def _gptoss_hparams(cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: sliding window on even layers, YaRN RoPE, the clamped SwiGLU with llama.cpp's constants."""
    n_layer = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)
    ]
    if list(types) != ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]:
        raise ConversionError(f"gpt-oss layer_types {types} are not the alternating sliding/full pattern")
    window = cfg.get("sliding_window")
    if not window or int(window) < 1:
        raise ConversionError(f"gpt-oss needs a positive sliding_window (got {window!r})")
    # llama.cpp hard-codes alpha 1.702 and limit 7.0; a file cannot say otherwise
    for key, want in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
        if not math.isclose(float(cfg.get(key, want)), want, rel_tol=1e-6):
            raise ConversionError(f"gpt-oss {key}={cfg[key]} is not supported (GGUF files assume {want})")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    out: dict[str, Any] = {
        "sliding_window": int(window),
        "rope_theta": float(rope.get("rope_theta", 150000.0)),
    }
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "yarn":
        if rope.get("truncate", True):
            raise ConversionError("gpt-oss with a truncated YaRN ramp (truncate: true) is not supported")
        if rope.get("attention_factor") is not None or rope.get("mscale") or rope.get("mscale_all_dim"):
            raise ConversionError("YaRN attention_factor / mscale overrides are not supported for gpt-oss")
        out["yarn"] = {
            "factor": float(rope["factor"]),
            "original_context": int(rope["original_max_position_embeddings"]),
            "beta_fast": float(rope.get("beta_fast") or 32.0),
            "beta_slow": float(rope.get("beta_slow") or 1.0),
        }
    elif rope_type not in (None, "default"):
        raise ConversionError(f"RoPE scaling '{rope_type}' is not supported for gpt-oss")
    return out


def _qwen35_hparams(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE: the Gated DeltaNet sizes, which layers are linear attention, partial rotary RoPE and
    the MRoPE sections llama.cpp requires (text positions make them plain RoPE)."""
    n_layer = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [
        "linear_attention" if (i + 1) % int(cfg.get("full_attention_interval", 4)) else "full_attention"
        for i in range(n_layer)
    ]
    if len(types) != n_layer or any(t not in ("linear_attention", "full_attention") for t in types):
        raise ConversionError(f"layer_types {types} are not {n_layer} of linear_attention / full_attention")
    if "full_attention" not in types:
        raise ConversionError("Qwen3.5-MoE without any full_attention layer is not supported")
    nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
    if nv % nk:
        raise ConversionError(f"linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}")
    rope = dict(cfg.get("rope_parameters") or {})
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    n_rot = int(head_dim * partial)
    if n_rot < 2 or n_rot % 2:
        raise ConversionError(
            f"partial_rotary_factor {partial} gives {n_rot} rotary dimensions (need even, >= 2)"
        )
    sections = [int(x) for x in rope.get("mrope_section", [11, 11, 10])][:4]
    return {
        "recurrent": [t == "linear_attention" for t in types],
        "conv_kernel": int(cfg["linear_conv_kernel_dim"]),
        "k_heads": nk,
        "v_heads": nv,
        "k_dim": int(cfg["linear_key_head_dim"]),
        "v_dim": int(cfg["linear_value_head_dim"]),
        "n_rot": n_rot,
        "sections": sections + [0] * (4 - len(sections)),
        "prefix": "model.language_model." if cfg.get("model_type") == "qwen3_5_moe" else "model.",
    }


def _gemma4_layer_geometry(cfg: dict[str, Any], types: list[str]) -> tuple[int, int]:
    """The global layers' head_dim and KV head count: `global_head_dim` / `num_global_key_value_heads` when
    the config carries them (published checkpoints do), else a full-attention layer's `per_layer_config` entry
    (what transformers 5.24 writes), else transformers' defaults (512; the local layers' KV heads). As in
    transformers, the global KV head count applies only with attention_k_eq_v."""
    per_layer = cfg.get("per_layer_config") or {}
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    entry: dict[str, Any] = {}
    for i in full:
        entry = per_layer.get(str(i)) or per_layer.get(i) or {}
        if entry:
            break
    hd = cfg.get("global_head_dim", entry.get("head_dim", 512))
    n_kv = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    if cfg.get("attention_k_eq_v", False):
        n_kv = cfg.get("num_global_key_value_heads") or entry.get("num_key_value_heads") or n_kv
    elif "num_key_value_heads" in entry:
        n_kv = entry["num_key_value_heads"]
    return int(hd), int(n_kv)


def _gemma4_hparams(cfg: dict[str, Any]) -> _Hparams:
    """Gemma 4's text model (transformers Gemma4TextConfig, its defaults where a key is absent)."""
    if cfg.get("model_type") == "gemma4":
        if not isinstance(cfg.get("text_config"), dict):
            raise ConversionError("gemma4 config.json has no text_config")
        cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
        prefix = "model.language_model."
    else:
        prefix = "model."
    n_layer = int(cfg["num_hidden_layers"])
    n_head = int(cfg["num_attention_heads"])
    n_embd = int(cfg["hidden_size"])
    act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConversionError(f"gemma4 hidden_activation '{act}' is not supported (only gelu_pytorch_tanh)")
    unsupported = {
        "hidden_size_per_layer_input": (cfg.get("hidden_size_per_layer_input", 256) or 0) > 0,
        "num_kv_shared_layers": int(cfg.get("num_kv_shared_layers") or 0) > 0,
        "use_double_wide_mlp": bool(cfg.get("use_double_wide_mlp")),
        "attention_bias": bool(cfg.get("attention_bias")),
        "use_bidirectional_attention": cfg.get("use_bidirectional_attention") == "all",
    }
    for key, bad in unsupported.items():
        if bad:
            raise ConversionError(f"gemma4 {key}={cfg.get(key, 256)!r} is not supported")
    types = list(
        cfg.get("layer_types")
        or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layer)]
    )
    if len(types) != n_layer or set(types) - {"sliding_attention", "full_attention"}:
        raise ConversionError(f"gemma4 layer_types {types} are not {n_layer} sliding/full entries")
    types[-1] = "full_attention"  # as transformers forces it
    rope = cfg.get("rope_parameters") or {}
    local = rope.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10000.0}
    glob = rope.get("full_attention") or {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    }
    glob_type = glob.get("rope_type")
    if local.get("rope_type", "default") != "default" or glob_type not in ("proportional", "default"):
        raise ConversionError(f"gemma4 rope_parameters {rope} are not supported (default / proportional)")
    if float(glob.get("factor", 1.0)) != 1.0:
        raise ConversionError(f"gemma4 full_attention rope factor {glob['factor']} is not supported")
    hd_local = int(cfg.get("head_dim") or 256)
    hd_global, kv_global = _gemma4_layer_geometry(cfg, types)
    kv_local = int(cfg.get("num_key_value_heads") or n_head)
    for hd in (hd_local, hd_global):
        if hd % 2:
            raise ConversionError(f"gemma4 head_dim {hd} must be even for RoPE")
    for kv in (kv_local, kv_global):
        if n_head % kv:
            raise ConversionError(f"num_attention_heads {n_head} is not a multiple of {kv} KV heads")
    partial = float(glob.get("partial_rotary_factor", 1.0)) if glob_type == "proportional" else 1.0
    n_ctx = int(cfg.get("max_position_embeddings", 131072))
    window = int(cfg.get("sliding_window", 512))
    if "sliding_attention" in types and not 0 < window <= n_ctx:
        raise ConversionError(f"gemma4 sliding_window {window} must be in [1, context {n_ctx}]")
    hp = _Hparams(
        model_type="gemma4_text",
        arch="gemma4",
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=kv_local,
        head_dim=hd_local,
        n_ff=int(cfg["intermediate_size"]),
        n_ctx=n_ctx,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(glob.get("rope_theta", 1_000_000.0)),
        vocab_size=int(cfg["vocab_size"]),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )
    if cfg.get("enable_moe_block"):
        hp.n_expert = int(cfg["num_experts"])
        hp.n_expert_used = int(cfg["top_k_experts"])
        hp.n_ff_exp = int(cfg["moe_intermediate_size"])
        hp.norm_topk = True
        if hp.n_expert <= 1 or not 0 < hp.n_expert_used <= hp.n_expert:
            raise ConversionError(f"invalid expert counts: {hp.n_expert} experts, {hp.n_expert_used} used")
    hp.extra = {
        "prefix": prefix,
        "types": types,
        "window": window,
        "head_dim_global": hd_global,
        "kv_global": kv_global,
        "k_eq_v": bool(cfg.get("attention_k_eq_v", False)),
        "rope_theta_local": float(local.get("rope_theta", 10000.0)),
        # rotated pairs of the global layers' head (the rest keep their values: transformers' zero frequency)
        "rot_pairs_global": int(partial * hd_global // 2),
        "softcap": float(cfg.get("final_logit_softcapping") or 0.0),
    }
    return hp


def _yarn_mscale(factor: float, m: float) -> float:
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1.0 else 1.0


def _deepseek_hparams(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3: latent attention sizes, leading dense layers, the router (V2: softmax, greedy or
    group-limited by the group's best score; V3: sigmoid + correction bias, groups scored by their best two),
    YaRN as transformers computes it (attention factor and mscale_all_dim's softmax scale).

    Published checkpoints carry `scoring_func` and `topk_method`, which transformers 5.24 neither writes nor
    reads (its V2 router reads topk_method): they are checked against what transformers computes."""
    mt = cfg["model_type"]
    v3 = mt in ("deepseek_v3", "glm4_moe_lite")  # GLM-4.7-Flash routes and attends as V3 does
    if cfg.get("attention_bias"):
        raise ConversionError(f"attention_bias=True is not supported for {mt}")
    if v3 and cfg.get("rope_interleave") is False:
        raise ConversionError("deepseek_v3 with rope_interleave=false (rotate_half RoPE) is not supported")
    scoring = cfg.get("scoring_func", "sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ConversionError(
            f"{mt} scoring_func '{scoring}' differs from what transformers computes for {mt}"
        )
    method = cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
    if v3 and method != "noaux_tc":
        raise ConversionError(f"deepseek_v3 topk_method '{method}' is not supported (transformers: noaux_tc)")
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise ConversionError(
            f"deepseek_v2 topk_method '{method}' is not supported (greedy, group_limited_greedy)"
        )
    n_expert = int(cfg["n_routed_experts"])
    groups = v3 or method == "group_limited_greedy"
    n_group = int(cfg.get("n_group") or 1) if groups else 1
    topk_group = int(cfg.get("topk_group") or n_group) if groups else 1
    if n_group < 1 or n_expert % n_group:
        raise ConversionError(f"{mt} n_group={n_group} does not divide n_routed_experts={n_expert}")
    if not 1 <= topk_group <= n_group:
        raise ConversionError(f"{mt} topk_group={topk_group} is not in [1, n_group={n_group}]")
    q_lora = cfg.get("q_lora_rank")
    dense_lead = int(cfg.get("first_k_dense_replace", 3 if v3 else 0) or 0)
    if mt == "glm4_moe_lite":  # its layer pattern: leading "dense" layers, then "sparse" ones
        n_layer = int(cfg["num_hidden_layers"])
        types = list(cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n_layer - 1))
        dense_lead = next((i for i, t in enumerate(types) if t != "dense"), len(types))
        if types != ["dense"] * dense_lead + ["sparse"] * (n_layer - dense_lead):
            raise ConversionError(
                f"glm4_moe_lite mlp_layer_types {types}: only leading dense layers are supported"
            )
    out: dict[str, Any] = {
        "dense_lead": dense_lead,
        "q_lora": int(q_lora) if q_lora else 0,
        "kv_lora": int(cfg["kv_lora_rank"]),
        "rope": int(cfg["qk_rope_head_dim"]),
        "nope": int(cfg["qk_nope_head_dim"]),
        "v": int(cfg["v_head_dim"]),
        "n_shared": int(cfg.get("n_shared_experts") or 0),
        "scale": float(
            cfg.get("routed_scaling_factor", {"deepseek_v3": 2.5, "glm4_moe_lite": 1.8}.get(mt, 1.0))
        ),
        # transformers' V2 router never renormalises (it does not read norm_topk_prob)
        "norm": bool(cfg.get("norm_topk_prob", True)) if v3 else False,
        "sigmoid": v3,
        "n_group": n_group,
        "topk_group": topk_group,
        "mtp_layers": int(cfg.get("num_nextn_predict_layers") or 0),
    }
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "rope_type" not in rope and "rope_theta" not in rope and len(rope) == 1:
        rope = dict(next(iter(rope.values())))
    out["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "yarn":
        if not rope.get("truncate", True):
            raise ConversionError(f"{mt} with an untruncated YaRN ramp (truncate: false) is not supported")
        orig = int(rope["original_max_position_embeddings"])
        factor = rope.get("factor")
        factor = float(factor) if factor is not None else int(cfg["max_position_embeddings"]) / orig
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attn = rope.get("attention_factor")
        if attn is None:
            attn = (
                _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
                if m and m_all
                else _yarn_mscale(factor, 1)
            )
        out["yarn"] = {
            "factor": factor,
            "original_context": orig,
            "beta_fast": float(rope.get("beta_fast") or 32.0),
            "beta_slow": float(rope.get("beta_slow") or 1.0),
            "attn_factor": float(attn),
            "log_mul": 0.1 * float(m_all or 0.0),
        }
    elif rope_type not in (None, "default"):
        raise ConversionError(f"RoPE scaling '{rope_type}' is not supported for {mt}")
    return out


def _glm4moe_hparams(cfg: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5: leading dense layers, the sigmoid router with correction bias and groups (scored by their best
    two, as DeepSeek-V3), shared experts, optional per-head q/k norm, partial rotary embedding."""
    n_expert = int(cfg["n_routed_experts"])
    n_group = int(cfg.get("n_group") or 1)
    topk_group = int(cfg.get("topk_group") or n_group)
    if n_expert % n_group or not 1 <= topk_group <= n_group:
        raise ConversionError(
            f"glm4_moe n_group={n_group} / topk_group={topk_group} do not fit {n_expert} experts"
        )
    rope = dict(cfg.get("rope_parameters") or {})
    prf = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 0.5))
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    return {
        "dense_lead": int(cfg.get("first_k_dense_replace", 1) or 0),
        "n_shared": int(cfg.get("n_shared_experts") or 0),
        "scale": float(cfg.get("routed_scaling_factor", 1.0)),
        "sigmoid": True,
        "n_group": n_group,
        "topk_group": topk_group,
        "qk_norm": bool(cfg.get("use_qk_norm", False)),
        "rope": int(head_dim * prf),
        "mtp_layers": int(cfg.get("num_nextn_predict_layers") or 0),
    }


def _lfm2_ff_width(cfg: dict[str, Any]) -> int:
    """Dense LFM2's FFN width as transformers' Lfm2MLP derives it from intermediate_size: with
    block_auto_adjust_ff_dim two thirds of it and, with a block_ffn_dim_multiplier, times that and rounded up
    to a multiple of block_multiple_of (transformers rounds only then; llama.cpp's converter always)."""
    ff = int(_first(cfg, "block_ff_dim", "intermediate_size"))
    if cfg.get("block_auto_adjust_ff_dim", True):
        ff = int(2 * ff / 3)
        if cfg.get("block_ffn_dim_multiplier") is not None:
            ff = int(float(cfg["block_ffn_dim_multiplier"]) * ff)
            multiple = int(cfg.get("block_multiple_of", 256))
            ff = multiple * ((ff + multiple - 1) // multiple)
    return ff


def _lfm2_hparams(cfg: dict[str, Any], moe: bool) -> dict[str, Any]:
    """LFM2 / LFM2-MoE: which layers are short convolutions, their kernel and biases; for the MoE its
    leading dense layers and the sigmoid router (its expert bias, renormalisation and scaling)."""
    n_layer = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None and not moe and cfg.get("full_attn_idxs") is not None:  # older LFM2 configs
        types = ["full_attention" if i in cfg["full_attn_idxs"] else "conv" for i in range(n_layer)]
    kinds = ("conv", "full_attention")
    if not isinstance(types, list) or len(types) != n_layer or any(t not in kinds for t in types):
        raise ConversionError(f"layer_types {types} are not {n_layer} of conv / full_attention")
    if "full_attention" not in types:
        raise ConversionError("LFM2 without any full_attention layer is not supported")
    x: dict[str, Any] = {
        "recurrent": [t == "conv" for t in types],
        "conv_kernel": int(cfg.get("conv_L_cache", 3)),
        "conv_bias": bool(cfg.get("conv_bias", False)),
        "dense_lead": n_layer,
    }
    if not moe:
        return x
    dense_lead = int(cfg.get("num_dense_layers", 2))
    if not 0 <= dense_lead < n_layer:
        raise ConversionError(f"num_dense_layers={dense_lead} leaves no MoE layer of {n_layer}")
    return {
        **x,
        "dense_lead": dense_lead,
        "n_shared": 0,
        "scale": float(cfg.get("routed_scaling_factor", 1.0)),
        "sigmoid": True,
        "n_group": 1,
        "expert_bias": bool(cfg.get("use_expert_bias", True)),
    }


def _hparams(cfg: dict[str, Any]) -> _Hparams:
    mt = cfg.get("model_type")
    if mt == "qwen3_5_moe":  # the vision-language config: its text model
        if not isinstance(cfg.get("text_config"), dict):
            raise ConversionError("qwen3_5_moe config without a text_config")
        cfg = {**cfg["text_config"], "model_type": mt, "tie_word_embeddings": cfg.get("tie_word_embeddings")}
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(
            f"model_type '{mt}' is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if mt in _GEMMA4:
        return _gemma4_hparams(cfg)
    n_embd = int(cfg["hidden_size"])
    n_head = int(cfg["num_attention_heads"])
    n_head_kv = int(_first(cfg, "num_key_value_heads", default=n_head))
    head_dim = int(_first(cfg, "head_dim", default=n_embd // n_head))
    if n_head % n_head_kv:
        raise ConversionError(
            f"num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_head_kv}"
        )
    if head_dim % 2:
        raise ConversionError(f"head_dim {head_dim} must be even for RoPE")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConversionError(f"hidden_act '{cfg.get('hidden_act')}' is not supported (only SiLU/SwiGLU)")
    if cfg.get("attention_bias") and mt in ("llama", "mixtral", "olmoe", *_GRANITE):
        raise ConversionError(f"attention_bias=True is not supported for {mt}")
    if cfg.get("mlp_bias"):
        raise ConversionError("mlp_bias=True is not supported")
    n_ctx = int(_first(cfg, "max_position_embeddings", default=4096))
    # Sliding-window attention changes the math only when the window is shorter than the context.
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", mt in ("llama", "mixtral"))
    if uses_window and window and int(window) < n_ctx:
        raise ConversionError(
            f"sliding-window attention (window {window} < context {n_ctx}) is not supported yet"
        )
    if mt in ("qwen2_moe", "qwen3_moe"):
        if cfg.get("mlp_only_layers"):
            raise ConversionError("mlp_only_layers (dense layers inside a Qwen MoE) is not supported yet")
        if int(cfg.get("decoder_sparse_step", 1)) != 1:
            raise ConversionError(
                "decoder_sparse_step != 1 (dense layers inside a Qwen MoE) is not supported yet"
            )
    if mt == "olmoe" and cfg.get("clip_qkv") is not None:
        raise ConversionError("OLMoE clip_qkv is not supported yet")

    arch = {
        "mixtral": "llama",
        "qwen2_moe": "qwen2moe",
        "qwen3_moe": "qwen3moe",
        "gpt_oss": "gpt-oss",
        "deepseek_v2": "deepseek2",
        "deepseek_v3": "deepseek2",
        "glm4_moe_lite": "deepseek2",
        "glm4_moe": "glm4moe",
        "lfm2_moe": "lfm2moe",
    }.get(mt, mt)
    if mt in _QWEN35:
        arch = "qwen35moe"
    if mt in _GRANITE:
        arch = "granitemoe"
    gptoss = _gptoss_hparams(cfg) if mt == "gpt_oss" else None
    deepseek = _deepseek_hparams(cfg) if mt in _DEEPSEEK else None
    if deepseek:  # latent attention: one KV "head" whose key is the latent plus the rope key
        n_head_kv = 1
        head_dim = deepseek["kv_lora"] + deepseek["rope"]
    hp = _Hparams(
        model_type=mt,
        arch=arch,
        n_layer=int(cfg["num_hidden_layers"]),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=int(cfg.get("intermediate_size") or 0),
        n_ctx=n_ctx,
        rms_eps=float(_first(cfg, "rms_norm_eps", default=1e-6)),
        rope_theta=(gptoss or deepseek or {}).get("rope_theta") or _rope_theta_and_check(cfg),
        vocab_size=int(cfg["vocab_size"]),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", mt in _GRANITE)),
    )
    if mt not in ("llama", "lfm2"):
        hp.n_expert = int(_first(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0))
        hp.n_expert_used = int(_first(cfg, "num_experts_per_tok", "top_k", default=0))
        if hp.n_expert <= 0 or not 0 < hp.n_expert_used <= hp.n_expert:
            raise ConversionError(f"invalid expert counts: {hp.n_expert} experts, {hp.n_expert_used} used")
    if mt in ("qwen2_moe", "qwen3_moe"):
        hp.n_ff_exp = int(cfg["moe_intermediate_size"])
        hp.norm_topk = bool(cfg.get("norm_topk_prob", False))
    if mt in _QWEN35:  # the router always renormalises its top-k
        hp.n_ff_exp = int(cfg["moe_intermediate_size"])
        hp.n_ff_shexp = int(cfg["shared_expert_intermediate_size"])
        hp.norm_topk = True
        hp.extra = _qwen35_hparams(cfg)
    elif mt in ("mixtral", "olmoe", "gpt_oss", *_GRANITE):
        hp.n_ff_exp = hp.n_ff
        hp.norm_topk = (
            True if mt in ("mixtral", "gpt_oss", *_GRANITE) else bool(cfg.get("norm_topk_prob", False))
        )
    if mt == "qwen2_moe":
        hp.n_ff_shexp = int(cfg.get("shared_expert_intermediate_size") or 0)
    if mt == "glm4_moe":
        glm = _glm4moe_hparams(cfg)
        hp.n_ff_exp = int(cfg["moe_intermediate_size"])
        hp.n_ff_shexp = hp.n_ff_exp * glm["n_shared"]
        hp.norm_topk = bool(cfg.get("norm_topk_prob", True))
        hp.extra = glm
        if not 0 <= glm["dense_lead"] < hp.n_layer:
            raise ConversionError(
                f"first_k_dense_replace={glm['dense_lead']} leaves no MoE layer of {hp.n_layer}"
            )
    if deepseek:
        hp.n_ff_exp = int(cfg["moe_intermediate_size"])
        hp.n_ff_shexp = hp.n_ff_exp * deepseek["n_shared"]
        hp.norm_topk = deepseek["norm"]
        hp.extra = deepseek
        if not 0 <= deepseek["dense_lead"] < hp.n_layer:
            raise ConversionError(
                f"first_k_dense_replace={deepseek['dense_lead']} leaves no MoE layer of {hp.n_layer}"
            )
    if gptoss:
        hp.extra = gptoss
    if mt in _LFM2:
        hp.extra = _lfm2_hparams(cfg, moe=mt == "lfm2_moe")
        if mt == "lfm2":
            hp.n_ff = _lfm2_ff_width(cfg)
        else:
            hp.n_ff_exp = int(cfg["moe_intermediate_size"])
            hp.norm_topk = bool(cfg.get("norm_topk_prob", True))
        hp.rms_eps = float(cfg.get("norm_eps", 1e-5))
        hp.tie_embeddings = bool(_first(cfg, "tie_word_embeddings", "tie_embedding", default=True))
        if not _first(cfg, "rope_parameters", "rope_theta"):
            hp.rope_theta = 1000000.0  # transformers' default_theta for LFM2 and LFM2-MoE
    if mt == "granitemoeshared":
        hp.n_ff_shexp = int(cfg.get("shared_intermediate_size") or 0)
    if mt in _GRANITE:
        hp.extra = {
            "attention_scale": float(cfg.get("attention_multiplier", 1.0)),
            "embedding_scale": float(cfg.get("embedding_multiplier", 1.0)),
            "residual_scale": float(cfg.get("residual_multiplier", 1.0)),
            "logit_scale": float(cfg.get("logits_scaling", 1.0)),
        }
    return hp


# ----------------------------------------------------------------------------------------------------
# tensor plan: output name, logical shape (numpy order) and a producer that yields the data in chunks


@dataclass
class _OutTensor:
    name: str
    shape: tuple[int, ...]
    keep_f32: bool  # norms, routers, 1-D tensors: never quantized
    chunks: Callable[[], Iterator[np.ndarray]]  # yields float32 arrays whose concatenation is the tensor
    qtype: int = 0  # GGMLQuantizationType, decided later
    nbytes: int = 0
    raw: bool = False  # chunks are already encoded bytes of type qtype (the checkpoint's own MXFP4 blocks)


def _layer_index(name: str) -> int | None:
    """N of a tensor named model.layers.N.*, else None."""
    parts = name.split(".")
    return (
        int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else None
    )


def _permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder q/k projection rows from rotate_half pairing (i, i+d/2) to adjacent pairing (2i, 2i+1).

    Within each head the first half of the rows holds the "real" parts and the second half the "imaginary"
    parts for transformers' rotate_half RoPE; llama.cpp's normal RoPE rotates adjacent elements, so the rows
    are interleaved: new row 2i = old row i, new row 2i+1 = old row i + d/2.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Planner:
    def __init__(self, ckpt: _Checkpoint, hp: _Hparams) -> None:
        self.ck = ckpt
        self.hp = hp
        self.out: list[_OutTensor] = []

    def add(
        self,
        name: str,
        src: str,
        *,
        keep_f32: bool = False,
        transform: Callable[[np.ndarray], np.ndarray] | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        self.ck.mark(src)
        ck = self.ck

        def chunks() -> Iterator[np.ndarray]:
            a = ck.load(src)
            yield transform(a) if transform else a

        real_shape = shape if shape is not None else ck.shape(src)
        self.out.append(_OutTensor(name, tuple(real_shape), keep_f32 or len(real_shape) == 1, chunks))

    def add_stacked(self, name: str, srcs: list[str]) -> None:
        """One [n_expert, rows, cols] tensor from per-expert 2-D tensors, read one expert at a time."""
        shapes = {self.ck.shape(s) for s in srcs}
        if len(shapes) != 1:
            raise ConversionError(f"experts of {name} have different shapes: {sorted(shapes)}")
        for s in srcs:
            self.ck.mark(s)
        ck = self.ck

        def chunks() -> Iterator[np.ndarray]:
            for s in srcs:
                yield ck.load(s)

        self.out.append(_OutTensor(name, (len(srcs), *shapes.pop()), False, chunks))

    def add_split_stacked(self, name: str, src: str, part: slice, rows: int) -> None:
        """One expert projection taken from a fused [n_expert, 2I, H] tensor (rows `part` of every expert)."""
        self.ck.mark(src)
        ck = self.ck
        e, _, cols = ck.shape(src)

        def chunks() -> Iterator[np.ndarray]:
            full = ck.load(src)
            for i in range(e):
                yield np.ascontiguousarray(full[i, part, :])

        self.out.append(_OutTensor(name, (e, rows, cols), False, chunks))

    def add_stacked_from(
        self, name: str, src: str, shape: tuple[int, ...], expert: Callable[[np.ndarray, int], np.ndarray]
    ) -> None:
        """A [n_expert, rows, cols] tensor whose expert x is expert(full source, x) (a view to copy)."""
        self.ck.mark(src)
        ck = self.ck

        def chunks() -> Iterator[np.ndarray]:
            full = ck.load(src)
            for x in range(shape[0]):
                yield np.ascontiguousarray(expert(full, x))

        self.out.append(_OutTensor(name, shape, False, chunks))

    def add_mxfp4(self, name: str, src: str, shape: tuple[int, int, int], rows: slice) -> None:
        """A [n_expert, rows, cols] MXFP4 tensor from the Hub's `src`_blocks [E, R, cols/32, 16] and
        `src`_scales [E, R, cols/32] (rows `rows` of R): the same 4-bit codes and E8M0 scales, moved into
        GGML's block layout (scale byte, then byte j = element j | element j+16 << 4; the Hub's byte k holds
        elements 2k and 2k+1)."""
        from gguf import GGMLQuantizationType as Q

        bname, sname = src + "_blocks", src + "_scales"
        e, r, c = shape
        for n, want in ((bname, (e, None, c // 32, 16)), (sname, (e, None, c // 32))):
            got = self.ck.shape(n)
            if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want, strict=True)):
                raise ConversionError(f"{n} has shape {got}, expected {want} (None: any)")
            self.ck.mark(n)
        ck = self.ck

        def chunks() -> Iterator[np.ndarray]:
            blocks, scales = ck.load(bname), ck.load(sname)
            for x in range(e):
                b, s = blocks[x, rows].astype(np.uint8), scales[x, rows].astype(np.uint8)
                if b.shape[0] != r:
                    raise ConversionError(f"{bname}: {b.shape[0]} rows selected, expected {r}")
                codes = np.empty((*b.shape[:-1], 32), dtype=np.uint8)
                codes[..., 0::2], codes[..., 1::2] = b & 0x0F, b >> 4
                qs = codes[..., :16] | (codes[..., 16:] << 4)
                yield np.concatenate([s[..., None], qs], axis=-1).reshape(r, -1)

        self.out.append(_OutTensor(name, shape, False, chunks, qtype=int(Q.MXFP4), raw=True))

    def add_whole_stacked(self, name: str, src: str) -> None:
        self.ck.mark(src)
        ck = self.ck

        def chunks() -> Iterator[np.ndarray]:
            full = ck.load(src)
            for i in range(full.shape[0]):
                yield full[i]

        self.out.append(_OutTensor(name, tuple(ck.shape(src)), False, chunks))


def _plan_gptoss_layer(p: _Planner, ck: _Checkpoint, hp: _Hparams, pre: str, blk: str) -> None:
    """gpt-oss's sinks, biased router and experts. transformers stores the experts transposed,
    gate_up_proj [E, H, 2I] with gate and up interleaved (even / odd columns) and down_proj [E, I, H];
    GGUF wants gate/up [E, I, H] and down [E, H, I], as llama.cpp's converter writes them. Hub checkpoints
    hold the experts as MXFP4 (`*_blocks` [E, rows, cols/32, 16], `*_scales`), not transposed; those are
    repacked into GGML's MXFP4 blocks without requantizing."""
    p.add(blk + "attn_sinks.weight", pre + "self_attn.sinks", keep_f32=True)
    moe = pre + "mlp."
    p.add(blk + "ffn_gate_inp.weight", moe + "router.weight", keep_f32=True)
    p.add(blk + "ffn_gate_inp.bias", moe + "router.bias", keep_f32=True)
    e, i, h = hp.n_expert, hp.n_ff_exp, hp.n_embd
    gu, dn = moe + "experts.gate_up_proj", moe + "experts.down_proj"
    if gu + "_blocks" in ck:  # the Hub's MXFP4 experts, repacked bit for bit
        p.add_mxfp4(blk + "ffn_gate_exps.weight", gu, (e, i, h), slice(0, None, 2))
        p.add_mxfp4(blk + "ffn_up_exps.weight", gu, (e, i, h), slice(1, None, 2))
        p.add_mxfp4(blk + "ffn_down_exps.weight", dn, (e, h, i), slice(None))
    else:
        for src, want in ((gu, (e, h, 2 * i)), (dn, (e, i, h))):
            if ck.shape(src) != want:
                raise ConversionError(f"{src} has shape {ck.shape(src)}, expected {want}")
        p.add_stacked_from(blk + "ffn_gate_exps.weight", gu, (e, i, h), lambda w, x: w[x, :, 0::2].T)
        p.add_stacked_from(blk + "ffn_up_exps.weight", gu, (e, i, h), lambda w, x: w[x, :, 1::2].T)
        p.add_stacked_from(blk + "ffn_down_exps.weight", dn, (e, h, i), lambda w, x: w[x].T)
    gub = gu + "_bias"
    for name, part in (("ffn_gate_exps.bias", slice(0, None, 2)), ("ffn_up_exps.bias", slice(1, None, 2))):
        p.add(
            blk + name,
            gub,
            keep_f32=True,
            shape=(e, i),
            transform=lambda b, s=part: np.ascontiguousarray(b[:, s]),
        )
    p.add(blk + "ffn_down_exps.bias", dn + "_bias", keep_f32=True)


def _tiled_v_heads(w: np.ndarray, axis: int, k_heads: int, v_heads: int, width: int) -> np.ndarray:
    """Reorder v heads along `axis` from grouped by k head (transformers: head g*r + i reads k head g) to
    tiled (head i*G + g reads k head g = head % G), the order llama.cpp's converter writes."""
    w = np.moveaxis(w, axis, 0)
    shape = w.shape
    w = w.reshape(k_heads, v_heads // k_heads, width, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.ascontiguousarray(np.moveaxis(w, 0, axis))


def _plan_gated_shared_expert(p: _Planner, hp: _Hparams, moe: str, blk: str) -> None:
    """Qwen2-MoE's and Qwen3.5-MoE's shared expert: a SwiGLU under `moe`shared_expert and its sigmoid gate,
    [1, H] in the checkpoint, which llama.cpp declares as a vector {n_embd}."""
    for proj, gname in (
        ("gate_proj", "ffn_gate_shexp"),
        ("up_proj", "ffn_up_shexp"),
        ("down_proj", "ffn_down_shexp"),
    ):
        p.add(f"{blk}{gname}.weight", f"{moe}shared_expert.{proj}.weight")
    p.add(
        blk + "ffn_gate_inp_shexp.weight",
        moe + "shared_expert_gate.weight",
        keep_f32=True,
        transform=lambda w: w.reshape(-1),
        shape=(hp.n_embd,),
    )


def _plan_qwen35moe(ck: _Checkpoint, hp: _Hparams) -> list[_OutTensor]:
    """Qwen3.5-MoE's tensors as llama.cpp's converter writes them: zero-centred RMSNorm weights stored as
    1 + w (the gated norm's as is), A_log as a = -exp(A_log), the conv kernel [C, K], v heads tiled
    (_tiled_v_heads) in every linear-attention tensor that has them. The vision tower and the
    multi-token-prediction block (model.visual.*, mtp.*) are not converted."""
    p = _Planner(ck, hp)
    x = hp.extra
    nk, nv, dk, dv = x["k_heads"], x["v_heads"], x["k_dim"], x["v_dim"]
    qk = 2 * nk * dk
    pre0 = x["prefix"]

    def plus_one(w: np.ndarray) -> np.ndarray:
        return w + np.float32(1.0)

    def tiled(axis: int, width: int) -> Callable[[np.ndarray], np.ndarray]:
        return lambda w: _tiled_v_heads(w, axis, nk, nv, width)

    def qkv_rows(w: np.ndarray) -> np.ndarray:
        return np.concatenate([w[:qk], _tiled_v_heads(w[qk:], 0, nk, nv, dv)])

    p.add("token_embd.weight", pre0 + "embed_tokens.weight")
    for i in range(hp.n_layer):
        pre, blk = f"{pre0}layers.{i}.", f"blk.{i}."
        p.add(blk + "attn_norm.weight", pre + "input_layernorm.weight", keep_f32=True, transform=plus_one)
        p.add(
            blk + "post_attention_norm.weight",
            pre + "post_attention_layernorm.weight",
            keep_f32=True,
            transform=plus_one,
        )
        if x["recurrent"][i]:
            la = pre + "linear_attn."
            p.add(blk + "attn_qkv.weight", la + "in_proj_qkv.weight", transform=qkv_rows)
            p.add(blk + "attn_gate.weight", la + "in_proj_z.weight", transform=tiled(0, dv))
            p.add(blk + "ssm_beta.weight", la + "in_proj_b.weight", transform=tiled(0, 1))
            p.add(blk + "ssm_alpha.weight", la + "in_proj_a.weight", transform=tiled(0, 1))
            p.add(blk + "ssm_out.weight", la + "out_proj.weight", transform=tiled(1, dv))
            c, _, k = ck.shape(la + "conv1d.weight")
            p.add(
                blk + "ssm_conv1d.weight",
                la + "conv1d.weight",
                keep_f32=True,
                shape=(c, k),
                transform=lambda w: qkv_rows(w.reshape(w.shape[0], -1)),
            )
            p.add(blk + "ssm_dt.bias", la + "dt_bias", transform=tiled(0, 1))
            p.add(blk + "ssm_a", la + "A_log", transform=lambda w: _tiled_v_heads(-np.exp(w), 0, nk, nv, 1))
            p.add(blk + "ssm_norm.weight", la + "norm.weight", keep_f32=True)
        else:
            _plan_attention(p, pre + "self_attn.", blk, "o_proj", ("q_norm", "k_norm"), plus_one)
        moe = pre + "mlp."
        p.add(blk + "ffn_gate_inp.weight", moe + "gate.weight", keep_f32=True)
        fused = moe + "experts.gate_up_proj"
        if (
            fused in ck
        ):  # transformers' in-memory layout: gate_up [E, 2I, H] (gate rows first), down [E, H, I]
            e, two_i, _ = ck.shape(fused)
            half = two_i // 2
            p.add_split_stacked(blk + "ffn_gate_exps.weight", fused, slice(0, half), half)
            p.add_split_stacked(blk + "ffn_up_exps.weight", fused, slice(half, two_i), half)
            p.add_whole_stacked(blk + "ffn_down_exps.weight", moe + "experts.down_proj")
        else:  # as save_pretrained and the Hub write them: one tensor per expert and projection
            for gname, proj in (
                ("ffn_gate_exps", "gate_proj"),
                ("ffn_up_exps", "up_proj"),
                ("ffn_down_exps", "down_proj"),
            ):
                p.add_stacked(
                    f"{blk}{gname}.weight", [f"{moe}experts.{e}.{proj}.weight" for e in range(hp.n_expert)]
                )
        _plan_gated_shared_expert(p, hp, moe, blk)
    p.add("output_norm.weight", pre0 + "norm.weight", keep_f32=True, transform=plus_one)
    if hp.tie_embeddings:
        ck.used.discard("lm_head.weight")  # a tied copy saved anyway is not converted
        ck.used.add("lm_head.weight")
    else:
        p.add("output.weight", "lm_head.weight")
    skipped = ("model.visual.", "mtp.", "model.mtp.")
    leftovers = sorted(n for n in ck.tensors if n not in ck.used and not n.startswith(skipped))
    if leftovers:
        shown = ", ".join(leftovers[:8]) + (" ..." if len(leftovers) > 8 else "")
        raise ConversionError(f"{len(leftovers)} checkpoint tensors have no GGUF mapping: {shown}")
    return p.out


def _plan_gemma4(ck: _Checkpoint, hp: _Hparams) -> list[_OutTensor]:
    """Gemma 4 under llama.cpp's tensor names, except the experts' gate/up, written as two stacked tensors
    (ffn_gate_exps / ffn_up_exps) where llama.cpp writes one fused ffn_gate_up_exps. The global layers'
    partial RoPE is llama.cpp's rope_freqs tensor: factor 1 for the rotated pairs, 1e30 (frequency ~0) for
    the others."""
    p = _Planner(ck, hp)
    x = hp.extra
    pre0 = x["prefix"]
    e_shape = ck.shape(pre0 + "embed_tokens.weight")
    if e_shape != (hp.vocab_size, hp.n_embd):
        raise ConversionError(f"embed_tokens has shape {e_shape}, config says {(hp.vocab_size, hp.n_embd)}")
    p.add("token_embd.weight", pre0 + "embed_tokens.weight")
    half = x["head_dim_global"] // 2
    factors = np.array([1.0] * x["rot_pairs_global"] + [1e30] * (half - x["rot_pairs_global"]), np.float32)
    p.out.append(_OutTensor("rope_freqs.weight", (half,), True, lambda: iter([factors])))
    for i in range(hp.n_layer):
        pre, blk = f"{pre0}layers.{i}.", f"blk.{i}."
        glob = x["types"][i] == "full_attention"
        hd = x["head_dim_global"] if glob else hp.head_dim
        n_kv = x["kv_global"] if glob else hp.n_head_kv
        a = pre + "self_attn."
        shapes = {
            "q_proj": (hp.n_head * hd, hp.n_embd),
            "k_proj": (n_kv * hd, hp.n_embd),
            "o_proj": (hp.n_embd, hp.n_head * hd),
        }
        if not (glob and x["k_eq_v"]):
            shapes["v_proj"] = (n_kv * hd, hp.n_embd)
        names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
        for proj, want in shapes.items():
            got = ck.shape(a + proj + ".weight")
            if got != want:
                raise ConversionError(f"{a}{proj}.weight has shape {got}, expected {want}")
            p.add(f"{blk}{names[proj]}.weight", a + proj + ".weight")
        norms = {
            "attn_norm": "input_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
        }
        if hp.n_expert:
            norms.update(
                pre_ffw_norm_2="pre_feedforward_layernorm_2",
                post_ffw_norm_1="post_feedforward_layernorm_1",
                post_ffw_norm_2="post_feedforward_layernorm_2",
            )
        for gname, hname in norms.items():
            p.add(f"{blk}{gname}.weight", f"{pre}{hname}.weight", keep_f32=True)
        for proj, gname in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            p.add(f"{blk}{gname}.weight", f"{pre}mlp.{proj}.weight")
        if pre + "layer_scalar" in ck:
            p.add(blk + "layer_output_scale.weight", pre + "layer_scalar", keep_f32=True)
        if not hp.n_expert:
            continue
        e, f, h = hp.n_expert, hp.n_ff_exp, hp.n_embd
        r = pre + "router."
        if (got := ck.shape(r + "proj.weight")) != (e, h):
            raise ConversionError(f"{r}proj.weight has shape {got}, expected {(e, h)}")
        p.add(blk + "ffn_gate_inp.weight", r + "proj.weight", keep_f32=True)
        p.add(blk + "ffn_gate_inp.scale", r + "scale", keep_f32=True)
        p.add(blk + "ffn_down_exps.scale", r + "per_expert_scale", keep_f32=True)
        gu, dn = pre + "experts.gate_up_proj", pre + "experts.down_proj"
        for src, want in ((gu, (e, 2 * f, h)), (dn, (e, h, f))):
            if ck.shape(src) != want:
                raise ConversionError(f"{src} has shape {ck.shape(src)}, expected {want}")
        p.add_split_stacked(blk + "ffn_gate_exps.weight", gu, slice(0, f), f)
        p.add_split_stacked(blk + "ffn_up_exps.weight", gu, slice(f, 2 * f), f)
        p.add_whole_stacked(blk + "ffn_down_exps.weight", dn)
    p.add("output_norm.weight", pre0 + "norm.weight", keep_f32=True)
    if not hp.tie_embeddings:
        p.add("output.weight", "lm_head.weight")
    elif "lm_head.weight" in ck:
        ck.used.add("lm_head.weight")  # a tied copy saved anyway: the embedding is authoritative
    towers = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
    leftovers = sorted(n for n in ck.tensors if n not in ck.used and not n.startswith(towers))
    if leftovers:
        shown = ", ".join(leftovers[:8]) + (" ..." if len(leftovers) > 8 else "")
        raise ConversionError(f"{len(leftovers)} checkpoint tensors have no GGUF mapping: {shown}")
    return p.out


def _plan_deepseek_layer(p: _Planner, ck: _Checkpoint, hp: _Hparams, pre: str, blk: str, il: int) -> None:
    """DeepSeek-V2/V3 latent attention and FFN. kv_b_proj [H*(N+V), C] is split as llama.cpp's converter
    splits it, so the engine can absorb it: attn_k_b [H, C, N] (each head's W_UK transposed) and attn_v_b
    [H, V, C]. Leading layers have a dense MLP; the others a router (+ V3's e_score_correction_bias as
    exp_probs_b), stacked experts and the ungated shared experts."""
    d = hp.extra
    h, c, r, n, v = hp.n_head, d["kv_lora"], d["rope"], d["nope"], d["v"]
    a = pre + "self_attn."
    want = {a + "kv_a_proj_with_mqa.weight": (c + r, hp.n_embd), a + "kv_b_proj.weight": (h * (n + v), c)}
    want[a + "o_proj.weight"] = (hp.n_embd, h * v)
    if d["q_lora"]:
        want[a + "q_a_proj.weight"] = (d["q_lora"], hp.n_embd)
        want[a + "q_b_proj.weight"] = (h * (n + r), d["q_lora"])
    else:
        want[a + "q_proj.weight"] = (h * (n + r), hp.n_embd)
    for src, shape in want.items():
        if ck.shape(src) != shape:
            raise ConversionError(f"{src} has shape {ck.shape(src)}, expected {shape}")
    if d["q_lora"]:
        p.add(blk + "attn_q_a.weight", a + "q_a_proj.weight")
        p.add(blk + "attn_q_a_norm.weight", a + "q_a_layernorm.weight", keep_f32=True)
        p.add(blk + "attn_q_b.weight", a + "q_b_proj.weight")
    else:
        p.add(blk + "attn_q.weight", a + "q_proj.weight")
    p.add(blk + "attn_kv_a_mqa.weight", a + "kv_a_proj_with_mqa.weight")
    p.add(blk + "attn_kv_a_norm.weight", a + "kv_a_layernorm.weight", keep_f32=True)
    kvb = a + "kv_b_proj.weight"
    p.add(
        blk + "attn_k_b.weight",
        kvb,
        shape=(h, c, n),
        transform=lambda w: np.ascontiguousarray(w.reshape(h, n + v, c)[:, :n, :].transpose(0, 2, 1)),
    )
    p.add(
        blk + "attn_v_b.weight",
        kvb,
        shape=(h, v, c),
        transform=lambda w: np.ascontiguousarray(w.reshape(h, n + v, c)[:, n:, :]),
    )
    p.add(blk + "attn_output.weight", a + "o_proj.weight")
    _plan_grouped_ffn(p, ck, hp, pre, blk, il)


def _plan_grouped_ffn(p: _Planner, ck: _Checkpoint, hp: _Hparams, pre: str, blk: str, il: int) -> None:
    """DeepSeek's and GLM-4.5's FFN: a dense MLP in the first hp.extra["dense_lead"] layers, else router
    (+ e_score_correction_bias as exp_probs_b), stacked experts and the ungated shared experts."""
    m = pre + "mlp."
    if il < hp.extra["dense_lead"]:
        for proj, gname in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            p.add(f"{blk}{gname}.weight", f"{m}{proj}.weight")
        return
    if ck.shape(m + "gate.weight") != (hp.n_expert, hp.n_embd):
        raise ConversionError(f"{m}gate.weight has shape {ck.shape(m + 'gate.weight')}")
    p.add(blk + "ffn_gate_inp.weight", m + "gate.weight", keep_f32=True)
    if m + "gate.e_score_correction_bias" in ck:
        p.add(blk + "exp_probs_b.bias", m + "gate.e_score_correction_bias", keep_f32=True)
    fused = m + "experts.gate_up_proj"
    if fused in ck:  # transformers' fused in-memory layout saved as is: [E, 2I, H] gate rows first, [E, H, I]
        e, two_i, _ = ck.shape(fused)
        p.add_split_stacked(blk + "ffn_gate_exps.weight", fused, slice(0, two_i // 2), two_i // 2)
        p.add_split_stacked(blk + "ffn_up_exps.weight", fused, slice(two_i // 2, two_i), two_i // 2)
        p.add_whole_stacked(blk + "ffn_down_exps.weight", m + "experts.down_proj")
    else:
        for gname, hname in (
            ("ffn_gate_exps", "gate_proj"),
            ("ffn_up_exps", "up_proj"),
            ("ffn_down_exps", "down_proj"),
        ):
            p.add_stacked(
                f"{blk}{gname}.weight", [f"{m}experts.{e}.{hname}.weight" for e in range(hp.n_expert)]
            )
    if hp.n_ff_shexp:
        for proj, gname in (
            ("gate_proj", "ffn_gate_shexp"),
            ("up_proj", "ffn_up_shexp"),
            ("down_proj", "ffn_down_shexp"),
        ):
            p.add(f"{blk}{gname}.weight", f"{m}shared_experts.{proj}.weight")


def _plan_attention(
    p: _Planner,
    at: str,
    blk: str,
    out_proj: str,
    qk_norms: tuple[str, str],
    norm_transform: Callable[[np.ndarray], np.ndarray] | None = None,
) -> None:
    """An attention block with per-head q/k RMSNorms under llama.cpp's names (Qwen3.5's, LFM2's): the four
    projections of `at` (q/k/v_proj and `out_proj`) and its q and k norms (kept F32, through norm_transform
    where the checkpoint stores them zero-centred)."""
    for proj, gname in (
        ("q_proj", "attn_q"),
        ("k_proj", "attn_k"),
        ("v_proj", "attn_v"),
        (out_proj, "attn_output"),
    ):
        p.add(f"{blk}{gname}.weight", f"{at}{proj}.weight")
    for hname, gname in zip(qk_norms, ("attn_q_norm", "attn_k_norm"), strict=True):
        p.add(f"{blk}{gname}.weight", f"{at}{hname}.weight", keep_f32=True, transform=norm_transform)


def _plan_short_conv(p: _Planner, ck: _Checkpoint, hp: _Hparams, cv: str, blk: str) -> None:
    """LFM2's gated short convolution under llama.cpp's names (shortconv.*; the depthwise kernel [C, 1, K]
    as [C, K]), with the in/conv/out biases of a conv_bias checkpoint."""
    p.add(blk + "shortconv.in_proj.weight", cv + "in_proj.weight")
    p.add(blk + "shortconv.out_proj.weight", cv + "out_proj.weight")
    c, _, k = ck.shape(cv + "conv.weight")
    p.add(
        blk + "shortconv.conv.weight",
        cv + "conv.weight",
        keep_f32=True,
        shape=(c, k),
        transform=lambda w: w.reshape(w.shape[0], -1),
    )
    if hp.extra["conv_bias"]:
        for part in ("in_proj", "conv", "out_proj"):
            p.add(f"{blk}shortconv.{part}.bias", f"{cv}{part}.bias", keep_f32=True)


def _plan_lfm2(ck: _Checkpoint, hp: _Hparams) -> list[_OutTensor]:
    """LFM2 and LFM2-MoE under llama.cpp's tensor names: shortconv.* for the convolution layers, the final
    embedding_norm as token_embd_norm, the router's expert_bias as exp_probs_b. Dense LFM2 has
    hp.extra["dense_lead"] = n_layer."""
    p = _Planner(ck, hp)
    x = hp.extra
    p.add("token_embd.weight", "model.embed_tokens.weight")
    for i in range(hp.n_layer):
        pre, blk = f"model.layers.{i}.", f"blk.{i}."
        p.add(blk + "attn_norm.weight", pre + "operator_norm.weight", keep_f32=True)
        p.add(blk + "ffn_norm.weight", pre + "ffn_norm.weight", keep_f32=True)
        if x["recurrent"][i]:
            _plan_short_conv(p, ck, hp, pre + "conv.", blk)
        else:
            _plan_attention(p, pre + "self_attn.", blk, "out_proj", ("q_layernorm", "k_layernorm"))
        ff = pre + "feed_forward."
        if i < x["dense_lead"]:
            if ck.shape(ff + "w1.weight") != (hp.n_ff, hp.n_embd):
                raise ConversionError(
                    f"{ff}w1.weight has shape {ck.shape(ff + 'w1.weight')}, expected {(hp.n_ff, hp.n_embd)}"
                )
            for proj, gname in (("w1", "ffn_gate"), ("w3", "ffn_up"), ("w2", "ffn_down")):
                p.add(f"{blk}{gname}.weight", f"{ff}{proj}.weight")
            continue
        _plan_lfm2moe_ffn(p, ck, hp, ff, blk)
    p.add("token_embd_norm.weight", "model.embedding_norm.weight", keep_f32=True)
    if hp.tie_embeddings:
        ck.used.add("lm_head.weight")  # a tied copy saved anyway is not converted
    else:
        p.add("output.weight", "lm_head.weight")
    leftovers = sorted(n for n in ck.tensors if n not in ck.used)
    if leftovers:
        shown = ", ".join(leftovers[:8]) + (" ..." if len(leftovers) > 8 else "")
        raise ConversionError(f"{len(leftovers)} checkpoint tensors have no GGUF mapping: {shown}")
    return p.out


def _plan_lfm2moe_ffn(p: _Planner, ck: _Checkpoint, hp: _Hparams, ff: str, blk: str) -> None:
    """An LFM2-MoE routed layer: router, its expert_bias as exp_probs_b, the stacked experts."""
    p.add(blk + "ffn_gate_inp.weight", ff + "gate.weight", keep_f32=True)
    if ff + "expert_bias" in ck:
        p.add(blk + "exp_probs_b.bias", ff + "expert_bias", keep_f32=True)
    fused = ff + "experts.gate_up_proj"
    if fused in ck:  # transformers' in-memory layout: gate_up [E, 2I, H] (gate first), down [E, H, I]
        e, two_i, _ = ck.shape(fused)
        half = two_i // 2
        p.add_split_stacked(blk + "ffn_gate_exps.weight", fused, slice(0, half), half)
        p.add_split_stacked(blk + "ffn_up_exps.weight", fused, slice(half, two_i), half)
        p.add_whole_stacked(blk + "ffn_down_exps.weight", ff + "experts.down_proj")
    else:  # as the Hub writes them: one tensor per expert and projection
        for gname, proj in (("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")):
            srcs = [f"{ff}experts.{e}.{proj}.weight" for e in range(hp.n_expert)]
            p.add_stacked(f"{blk}{gname}.weight", srcs)


def _plan(ck: _Checkpoint, hp: _Hparams) -> list[_OutTensor]:
    if hp.model_type in _QWEN35:
        return _plan_qwen35moe(ck, hp)
    if hp.model_type in _LFM2:
        return _plan_lfm2(ck, hp)
    if hp.arch == "gemma4":
        return _plan_gemma4(ck, hp)
    p = _Planner(ck, hp)
    mt = hp.model_type
    permute = mt in ("llama", "mixtral", *_GRANITE)

    p.add("token_embd.weight", "model.embed_tokens.weight")
    emb_shape = ck.shape("model.embed_tokens.weight")
    if emb_shape != (hp.vocab_size, hp.n_embd):
        raise ConversionError(f"embed_tokens has shape {emb_shape}, config says {(hp.vocab_size, hp.n_embd)}")

    for i in range(hp.n_layer):
        pre = f"model.layers.{i}."
        blk = f"blk.{i}."
        p.add(blk + "attn_norm.weight", pre + "input_layernorm.weight", keep_f32=True)
        ffn_norm = "post_attention_norm.weight" if mt in ("gpt_oss", "glm4_moe") else "ffn_norm.weight"
        p.add(blk + ffn_norm, pre + "post_attention_layernorm.weight", keep_f32=True)
        if mt in _DEEPSEEK:
            _plan_deepseek_layer(p, ck, hp, pre, blk, i)
            continue
        q_rows = hp.n_head * hp.head_dim
        kv_rows = hp.n_head_kv * hp.head_dim
        for proj, gname, rows, heads in (
            ("q_proj", "attn_q", q_rows, hp.n_head),
            ("k_proj", "attn_k", kv_rows, hp.n_head_kv),
            ("v_proj", "attn_v", kv_rows, 0),
        ):
            src = pre + f"self_attn.{proj}.weight"
            if ck.shape(src) != (rows, hp.n_embd):
                raise ConversionError(f"{src} has shape {ck.shape(src)}, expected {(rows, hp.n_embd)}")
            tf = None
            if permute and heads:
                tf = lambda w, h=heads: _permute_rope_rows(w, h)  # noqa: E731
            p.add(blk + gname + ".weight", src, transform=tf)
            bias = pre + f"self_attn.{proj}.bias"
            if bias in ck:
                btf = None
                if permute and heads:
                    btf = lambda b, h=heads: _permute_rope_rows(b, h)  # noqa: E731
                p.add(blk + gname + ".bias", bias, transform=btf)
        p.add(blk + "attn_output.weight", pre + "self_attn.o_proj.weight")
        if pre + "self_attn.o_proj.bias" in ck:
            p.add(blk + "attn_output.bias", pre + "self_attn.o_proj.bias")
        if mt in ("qwen3_moe", "olmoe") or (mt == "glm4_moe" and hp.extra["qk_norm"]):
            p.add(blk + "attn_q_norm.weight", pre + "self_attn.q_norm.weight", keep_f32=True)
            p.add(blk + "attn_k_norm.weight", pre + "self_attn.k_norm.weight", keep_f32=True)
        if mt == "glm4_moe":
            _plan_grouped_ffn(p, ck, hp, pre, blk, i)
            continue

        if mt == "llama":
            for proj, gname in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                p.add(f"{blk}{gname}.weight", f"{pre}mlp.{proj}.weight")
            continue

        if mt == "gpt_oss":
            _plan_gptoss_layer(p, ck, hp, pre, blk)
            continue

        if mt in _GRANITE:
            moe = pre + "block_sparse_moe."
            p.add(blk + "ffn_gate_inp.weight", moe + "router.layer.weight", keep_f32=True)
            e, two_i, h = ck.shape(moe + "input_linear.weight")
            half = two_i // 2
            p.add_split_stacked(
                blk + "ffn_gate_exps.weight", moe + "input_linear.weight", slice(0, half), half
            )
            p.add_split_stacked(
                blk + "ffn_up_exps.weight", moe + "input_linear.weight", slice(half, two_i), half
            )
            p.add_whole_stacked(blk + "ffn_down_exps.weight", moe + "output_linear.weight")
            if hp.n_ff_shexp:
                # shared_mlp.input_linear [2S, H]: gate rows first, as in the experts
                sh, s = pre + "shared_mlp.", hp.n_ff_shexp
                if ck.shape(sh + "input_linear.weight") != (2 * s, hp.n_embd):
                    raise ConversionError(
                        f"{sh}input_linear.weight has shape {ck.shape(sh + 'input_linear.weight')}, "
                        f"expected {(2 * s, hp.n_embd)}"
                    )
                for gname, part in (("ffn_gate_shexp", slice(0, s)), ("ffn_up_shexp", slice(s, 2 * s))):
                    p.add(
                        f"{blk}{gname}.weight",
                        sh + "input_linear.weight",
                        transform=lambda w, part=part: np.ascontiguousarray(w[part]),
                        shape=(s, hp.n_embd),
                    )
                p.add(blk + "ffn_down_shexp.weight", sh + "output_linear.weight")
            continue

        if mt == "mixtral":
            moe = pre + "block_sparse_moe."
            router = moe + "gate.weight"
            names = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
        else:
            moe = pre + "mlp."
            router = moe + "gate.weight"
            names = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
        if ck.shape(router) != (hp.n_expert, hp.n_embd):
            raise ConversionError(
                f"{router} has shape {ck.shape(router)}, expected {(hp.n_expert, hp.n_embd)}"
            )
        p.add(blk + "ffn_gate_inp.weight", router, keep_f32=True)
        fused = moe + "experts.gate_up_proj"
        if fused in ck or fused + ".weight" in ck:
            # transformers' fused layout saved as is: gate_up [E, 2I, H] (gate rows first), down [E, H, I].
            fname = fused if fused in ck else fused + ".weight"
            e, two_i, h = ck.shape(fname)
            half = two_i // 2
            p.add_split_stacked(blk + "ffn_gate_exps.weight", fname, slice(0, half), half)
            p.add_split_stacked(blk + "ffn_up_exps.weight", fname, slice(half, two_i), half)
            dname = moe + "experts.down_proj"
            p.add_whole_stacked(blk + "ffn_down_exps.weight", dname if dname in ck else dname + ".weight")
        else:
            for gname, hname in names.items():
                p.add_stacked(
                    f"{blk}{gname}.weight",
                    [f"{moe}experts.{e}.{hname}.weight" for e in range(hp.n_expert)],
                )
        if mt == "qwen2_moe" and hp.n_ff_shexp:
            _plan_gated_shared_expert(p, hp, moe, blk)

    p.add("output_norm.weight", "model.norm.weight", keep_f32=True)
    # llama.cpp's qwen2moe and olmoe loaders require output.weight even when the embeddings are tied.
    needs_output = mt in ("qwen2_moe", "olmoe", "gpt_oss")
    if not hp.tie_embeddings and "lm_head.weight" in ck:
        p.add("output.weight", "lm_head.weight")
    elif not hp.tie_embeddings:
        raise ConversionError(
            "config says tie_word_embeddings=false but the checkpoint has no lm_head.weight"
        )
    elif needs_output:
        ck.used.add("model.embed_tokens.weight")
        p.add("output.weight", "model.embed_tokens.weight")
    if hp.tie_embeddings and "lm_head.weight" in ck:
        ck.used.add("lm_head.weight")  # a tied copy saved anyway: the embedding is authoritative

    # multi-token-prediction layers (model.layers.N and above) are left out, as llama.cpp's converter does
    if mt in (*_DEEPSEEK, "glm4_moe"):
        ck.used.update(n for n in ck.tensors if _layer_index(n) is not None and _layer_index(n) >= hp.n_layer)
    leftovers = sorted(n for n in ck.tensors if n not in ck.used and not n.endswith("rotary_emb.inv_freq"))
    if leftovers:
        shown = ", ".join(leftovers[:8]) + (" ..." if len(leftovers) > 8 else "")
        raise ConversionError(f"{len(leftovers)} checkpoint tensors have no GGUF mapping: {shown}")
    return p.out


# ----------------------------------------------------------------------------------------------------
# tokenizer metadata from tokenizer.json / tokenizer_config.json

_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5 / 3.6: qwen2's with combining marks kept in words (\p{M} beside \p{L})
_QWEN35_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer_name(pre: dict[str, Any] | None, normalizer: dict[str, Any] | None = None) -> str:
    """Name llama.cpp uses for the HF pre-tokenizer pipeline, recognised by its structure (and, where two
    tokenizers split alike, by their normalizer: MiniMax's NFC one)."""
    if not pre:
        raise ConversionError(
            "tokenizer.json has no pre_tokenizer; only byte-level BPE tokenizers are supported"
        )
    steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if not kinds or kinds[-1] != "ByteLevel":
        raise ConversionError(
            f"pre-tokenizer {kinds} is not byte-level BPE, and the BPE model has no byte fallback "
            "(SentencePiece-style tokenizers need byte_fallback=true)"
        )
    last = steps[-1]
    if last.get("add_prefix_space"):
        raise ConversionError("ByteLevel pre-tokenizer with add_prefix_space=true is not supported")
    if len(steps) == 1 and last.get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and last.get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not last.get("use_regex", True):
        pattern = steps[0].get("pattern", {})
        regex = pattern.get("Regex", pattern.get("String"))
        if regex == _QWEN2_RE:
            return "qwen2"
        if regex == _QWEN35_RE:
            return "qwen35"
        if regex == _LLAMA3_RE:
            return "llama-bpe"
        if regex == _GPT2_RE:
            return "gpt-2"
        from colibri_backend.adapters.tokenizer import PRE_TOKENIZER_REGEXES

        if regex == PRE_TOKENIZER_REGEXES["gpt-4o"][0]:  # o200k, as gpt-oss's tokenizer.json writes it
            # MiniMax's tokenizer.json composes the text to NFC first; gpt-oss's takes it as it is
            return "minimax-m2" if normalizer == {"type": "NFC"} else "gpt-4o"
    splits = kinds[:-1]
    if splits and splits[-1] == "Digits" and steps[-2].get("individual_digits"):
        # DeepSeek-LLM / V2 and DeepSeek-Coder end their splits with Digits(individual_digits), which is the
        # \p{N} split the tokenizer's regex list ends with
        splits = splits[:-1]
    if len(splits) > 1 and set(splits) == {"Split"} and not last.get("use_regex", True):
        # several regex splits in sequence (DeepSeek-V3's three, DeepSeek-LLM / V2's five, DeepSeek-Coder's
        # four), as tokenizer.json spells them
        from colibri_backend.adapters.tokenizer import PRE_TOKENIZER_REGEXES

        def spelled(rx: str | None) -> str | None:
            # a carriage return or newline written as itself (DeepSeek-V3's tokenizer.json) or as an escape
            return rx.replace("\r", "\\r").replace("\n", "\\n") if rx else rx

        regexes = [spelled(st.get("pattern", {}).get("Regex")) for st in steps[: len(splits)]]
        if len(splits) < len(kinds) - 1:
            regexes.append(PRE_TOKENIZER_REGEXES["deepseek-llm"][-1])
        behaviours = {str(st.get("behavior", "")).lower() for st in steps[: len(splits)]}
        if behaviours == {"isolated"} and not any(st.get("invert") for st in steps[: len(splits)]):
            for name in ("deepseek-v3", "deepseek-llm", "deepseek-coder"):
                if regexes == [spelled(rx) for rx in PRE_TOKENIZER_REGEXES[name]]:
                    return name
    raise ConversionError(
        f"unrecognised byte-level pre-tokenizer {json.dumps(pre)[:300]}; "
        "llama.cpp would not tokenize it the same"
    )


def _is_byte_token(tok: str) -> bool:
    return (
        len(tok) == 6
        and tok.startswith("<0x")
        and tok.endswith(">")
        and all(c in "0123456789ABCDEF" for c in tok[3:5])
    )


def _spm_space_prefix(tj: dict[str, Any]) -> bool:
    """Whether a SentencePiece-style tokenizer.json turns spaces into U+2581 and prefixes one; refuse others.

    Two spellings exist: normalizer Sequence[Prepend("\u2581"), Replace(" ", "\u2581")] with no
    pre-tokenizer (Llama 2 / Mistral), or a Metaspace pre-tokenizer (newer files).
    """
    norm = tj.get("normalizer") or {}
    steps = norm.get("normalizers", []) if norm.get("type") == "Sequence" else ([norm] if norm else [])
    kinds = [n.get("type") for n in steps]
    pre = tj.get("pre_tokenizer")
    if pre is None and "Replace" in kinds and set(kinds) <= {"Prepend", "Replace"}:
        return "Prepend" in kinds
    if pre and pre.get("type") == "Metaspace" and not steps:
        if pre.get("split", False):
            raise ConversionError("Metaspace pre-tokenizer with split=true is not supported")
        scheme = pre.get("prepend_scheme", "always" if pre.get("add_prefix_space", True) else "never")
        return scheme in ("first", "always")
    raise ConversionError(
        f"unrecognised SentencePiece-style tokenizer (normalizer {kinds}, pre-tokenizer "
        f"{(pre or {}).get('type')}); llama.cpp would not tokenize it the same"
    )


def _token_content(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


@dataclass
class _Vocab:
    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece-style BPE), "gemma4"
    tokens: list[str]
    types: list[int]
    merges: list[str]  # gpt2 and gemma4
    scores: list[float]  # llama only
    add_space_prefix: bool  # llama only
    pre: str  # gpt2 only
    special_ids: dict[str, int]
    add_bos: bool
    add_eos: bool
    chat_template: str | list[dict[str, str]] | None


def _extra_ends(gen_eos: Any, eos: int | None, tokens: list[str]) -> dict[str, int]:
    """generation_config.json's further end-of-generation tokens as the GGUF's eot and eom ids.

    A model may stop at several tokens (GLM-4.5 / 4.7: <|endoftext|>, <|user|>, <|observation|>), the GGUF
    names one eos and llama.cpp reads an eot and an eom beside it, which both of Colibri's tokenizers stop
    at too. Tokens that a tokenizer already stops at by their text (END_OF_TURN_TEXTS) need no key; more
    than two others cannot be written, so the conversion is refused, naming them."""
    from colibri_backend.adapters.tokenizer import END_OF_TURN_TEXTS

    ids = gen_eos if isinstance(gen_eos, list) else []
    extra: list[int] = []
    for i in ids:
        valid = isinstance(i, int) and 0 <= i < len(tokens) and i != eos
        if valid and i not in extra and tokens[i] not in END_OF_TURN_TEXTS:
            extra.append(i)
    if len(extra) > 2:
        names = ", ".join(repr(tokens[i]) for i in extra)
        raise ConversionError(
            f"generation_config.json ends generation at {len(extra)} tokens besides eos ({names}); a GGUF "
            "holds two more (eot, eom)"
        )
    return dict(zip(("eot", "eom"), extra, strict=False))


def _vocab(hf_dir: Path, cfg: dict[str, Any], n_vocab: int, gemma4: bool = False) -> _Vocab:
    """The GGUF tokenizer of tokenizer.json. gemma4: a SentencePiece-style BPE is written as llama.cpp writes
    Gemma 4's ("gemma4": ranked merges, no space prefix), not as a "llama" vocabulary."""
    from gguf import TokenType

    tj_path = hf_dir / "tokenizer.json"
    if not tj_path.exists():
        raise ConversionError(f"{hf_dir}: tokenizer.json is missing (needed for the GGUF tokenizer)")
    tj = json.loads(tj_path.read_text(encoding="utf-8"))
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise ConversionError(
            f"tokenizer model {model.get('type')} is not supported; only BPE tokenizers (byte-level, or "
            "SentencePiece-style with byte fallback) are"
        )
    spm = bool(model.get("byte_fallback"))
    space_prefix = _spm_space_prefix(tj) if spm else False
    pre = "" if spm else _pre_tokenizer_name(tj.get("pre_tokenizer"), tj.get("normalizer"))
    id_of: dict[str, int] = dict(model["vocab"])
    special: set[int] = set()
    added: set[int] = set()
    for at in tj.get("added_tokens", []):
        id_of[at["content"]] = int(at["id"])
        (special if at.get("special") else added).add(int(at["id"]))
    by_id: dict[int, str] = {}
    for tok, idx in id_of.items():
        by_id[int(idx)] = tok
    if by_id and max(by_id) >= n_vocab:
        raise ConversionError(f"tokenizer has token id {max(by_id)} but the model vocab_size is {n_vocab}")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    # SentencePiece-style: llama.cpp merges the adjacent pair whose concatenation has the highest score, so
    # the token made by the merge of rank r scores -r and the merge order equals the BPE rank order.
    score_of: dict[str, float] = {}
    if spm:
        for rank, merge in enumerate(merges):
            left, _, right = merge.partition(" ")
            score_of.setdefault(left + right, -float(rank + 1))
    unk = model.get("unk_token")
    tokens: list[str] = []
    types: list[int] = []
    scores: list[float] = []
    for i in range(n_vocab):
        tok = by_id.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(int(TokenType.UNUSED))
            scores.append(-1e9)
            continue
        tokens.append(tok)
        scores.append(score_of.get(tok, 0.0))
        if spm and tok == unk:
            types.append(int(TokenType.UNKNOWN))
        elif spm and _is_byte_token(tok):
            types.append(int(TokenType.BYTE))
        elif i in special:
            types.append(int(TokenType.CONTROL))
        elif i in added:
            types.append(int(TokenType.USER_DEFINED))
        else:
            types.append(int(TokenType.NORMAL))
    if spm and sum(t == TokenType.BYTE for t in types) != 256:
        raise ConversionError("byte-fallback tokenizer without the 256 <0xNN> byte tokens")

    tc_path = hf_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.exists() else {}
    gen_path = hf_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.exists() else {}

    special_ids: dict[str, int] = {}
    for kind in ("bos", "eos", "pad", "unk"):
        content = _token_content(tc.get(f"{kind}_token"))
        if content is not None and content in id_of:
            special_ids[kind] = id_of[content]
            continue
        for source in (gen, cfg):
            val = source.get(f"{kind}_token_id")
            if isinstance(val, list) and val:
                val = val[0]
            if isinstance(val, int) and 0 <= val < n_vocab:
                special_ids[kind] = val
                break

    special_ids.update(_extra_ends(gen.get("eos_token_id"), special_ids.get("eos"), tokens))

    add_bos = tc.get("add_bos_token")
    add_eos = tc.get("add_eos_token")
    post = tj.get("post_processor") or {}
    if add_bos is None:
        add_bos = False
        if post.get("type") == "TemplateProcessing" and "bos" in special_ids:
            single = post.get("single", [])
            add_bos = (
                bool(single)
                and "SpecialToken" in single[0]
                and single[0]["SpecialToken"].get("id") == tokens[special_ids["bos"]]
            )

    template = tc.get("chat_template")
    jinja = hf_dir / "chat_template.jinja"
    if template is None and jinja.exists():
        template = jinja.read_text(encoding="utf-8")
    kind = "gpt2"
    if spm:
        kind = "gemma4" if gemma4 else "llama"
    if kind == "gemma4" and space_prefix:
        raise ConversionError("a Gemma 4 tokenizer.json that prepends a space is not Gemma 4's tokenizer")
    return _Vocab(
        model=kind,
        tokens=tokens,
        types=types,
        merges=[] if kind == "llama" else merges,
        scores=scores if spm else [],
        add_space_prefix=space_prefix,
        pre=pre,
        special_ids=special_ids,
        add_bos=bool(add_bos),
        add_eos=bool(add_eos),
        chat_template=template,
    )


# ----------------------------------------------------------------------------------------------------
# writing


def _choose_types(tensors: list[_OutTensor], out_type: str) -> None:
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    main = {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[out_type]
    has_output = any(t.name == "output.weight" for t in tensors)
    for t in tensors:
        if t.raw:  # pre-encoded: keep the checkpoint's own type
            block, type_size = GGML_QUANT_SIZES[Q(t.qtype)]
            t.nbytes = math.prod(t.shape[:-1]) * (t.shape[-1] // block) * type_size
            continue
        q = Q.F32 if t.keep_f32 else main
        # Q4_0 on the output head costs much more quality than anywhere else (llama.cpp keeps it at a higher
        # precision too): the output projection, or the tied embedding that serves as it, gets Q8_0.
        if q == Q.Q4_0 and (t.name == "output.weight" or (t.name == "token_embd.weight" and not has_output)):
            q = Q.Q8_0
        block, type_size = GGML_QUANT_SIZES[q]
        if t.shape[-1] % block:
            log.info("%s: row length %d is not a multiple of %d; writing F16", t.name, t.shape[-1], block)
            q = Q.F16
            block, type_size = GGML_QUANT_SIZES[q]
        t.qtype = int(q)
        t.nbytes = math.prod(t.shape[:-1]) * (t.shape[-1] // block) * type_size


def _file_type(out_type: str) -> int:
    from gguf import LlamaFileType

    return int(
        {
            "f32": LlamaFileType.ALL_F32,
            "f16": LlamaFileType.MOSTLY_F16,
            "q8_0": LlamaFileType.MOSTLY_Q8_0,
            "q4_0": LlamaFileType.MOSTLY_Q4_0,
        }[out_type]
    )


def _write_gemma4_metadata(w: Any, hp: _Hparams) -> None:
    """Gemma 4's keys as llama.cpp's converter writes them: the global layers' geometry under the plain keys,
    the local layers' under the _swa ones, the layer pattern and per-layer KV head counts as arrays."""
    x = hp.extra
    kv = [x["kv_global"] if t == "full_attention" else hp.n_head_kv for t in x["types"]]
    w.add_head_count_kv(kv if len(set(kv)) > 1 else kv[0])
    w.add_key_length(x["head_dim_global"])
    w.add_value_length(x["head_dim_global"])
    w.add_key_length_swa(hp.head_dim)
    w.add_value_length_swa(hp.head_dim)
    w.add_rope_dimension_count(x["head_dim_global"])
    w.add_rope_dimension_count_swa(hp.head_dim)
    w.add_rope_freq_base(hp.rope_theta)
    w.add_rope_freq_base_swa(x["rope_theta_local"])
    w.add_sliding_window(x["window"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in x["types"]])
    w.add_shared_kv_layers(0)
    w.add_embedding_length_per_layer_input(0)
    if x["softcap"]:
        w.add_final_logit_softcapping(x["softcap"])


def _write_grouped_router_metadata(w: Any, d: dict[str, Any]) -> None:
    """DeepSeek's and GLM-4.5's router and FFN layout keys (llama.cpp's names)."""
    import gguf

    w.add_leading_dense_block_count(d["dense_lead"])
    w.add_expert_shared_count(d["n_shared"])
    w.add_expert_weights_scale(d["scale"])
    w.add_expert_gating_func(
        gguf.ExpertGatingFuncType.SIGMOID if d["sigmoid"] else gguf.ExpertGatingFuncType.SOFTMAX
    )
    if d["n_group"] > 1:
        w.add_expert_group_count(d["n_group"])
        w.add_expert_group_used_count(d["topk_group"])


def _write_deepseek_metadata(w: Any, hp: _Hparams) -> None:
    """deepseek2's keys as llama.cpp writes them: key/value lengths of the cached latent (C+R, C), the heads'
    own lengths as *_mla, the router (gating function, groups, scale) and YaRN (its attention factor written
    out, since transformers derives it from mscale / mscale_all_dim, which GGUF has no key for)."""
    import gguf

    d = hp.extra
    # written as 0 without a q-LoRA too: llama.cpp requires the key unless the layer count is V2-Lite's
    w.add_q_lora_rank(d["q_lora"])
    w.add_kv_lora_rank(d["kv_lora"])
    w.add_key_length(d["kv_lora"] + d["rope"])
    w.add_value_length(d["kv_lora"])
    w.add_key_length_mla(d["nope"] + d["rope"])
    w.add_value_length_mla(d["v"])
    _write_grouped_router_metadata(w, d)
    if "yarn" in d:
        y = d["yarn"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(y["factor"])
        w.add_rope_scaling_orig_ctx_len(y["original_context"])
        w.add_rope_scaling_yarn_beta_fast(y["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(y["beta_slow"])
        w.add_rope_scaling_yarn_attn_factor(y["attn_factor"])
        w.add_rope_scaling_yarn_log_mul(y["log_mul"])


def _write_metadata(w: Any, hp: _Hparams, vocab: _Vocab, name: str, out_type: str) -> None:
    w.add_type("model")
    w.add_name(name)
    w.add_file_type(_file_type(out_type))
    w.add_quantization_version(2)
    w.add_vocab_size(hp.vocab_size)
    w.add_context_length(hp.n_ctx)
    w.add_embedding_length(hp.n_embd)
    w.add_block_count(hp.n_layer)
    w.add_feed_forward_length(hp.n_ff if hp.n_ff else hp.n_ff_exp)
    w.add_head_count(hp.n_head)
    if hp.arch == "gemma4":
        w.add_layer_norm_rms_eps(hp.rms_eps)
        _write_gemma4_metadata(w, hp)
    else:
        if hp.model_type in _LFM2:  # per layer, 0 for a convolution layer (which layers are which)
            w.add_head_count_kv([0 if r else hp.n_head_kv for r in hp.extra["recurrent"]])
        else:
            w.add_head_count_kv(hp.n_head_kv)
        rope = (
            hp.extra["rope"]
            if hp.model_type in (*_DEEPSEEK, "glm4_moe")
            else hp.extra.get("n_rot", hp.head_dim)
        )
        w.add_rope_dimension_count(rope)
        w.add_rope_freq_base(hp.rope_theta)
        w.add_layer_norm_rms_eps(hp.rms_eps)
        if hp.model_type in ("glm4_moe", "lfm2_moe"):
            _write_grouped_router_metadata(w, hp.extra)
        if hp.model_type in _DEEPSEEK:
            _write_deepseek_metadata(w, hp)
        elif hp.head_dim * hp.n_head != hp.n_embd or hp.model_type in ("qwen3_moe", *_QWEN35):
            w.add_key_length(hp.head_dim)
            w.add_value_length(hp.head_dim)
    if hp.n_expert:
        w.add_expert_count(hp.n_expert)
        w.add_expert_used_count(hp.n_expert_used)
        w.add_expert_weights_norm(hp.norm_topk)
        if hp.model_type in (
            "qwen2_moe",
            "qwen3_moe",
            "olmoe",
            "mixtral",
            "gpt_oss",
            *_GEMMA4,
            *_GRANITE,
            *_QWEN35,
            *_DEEPSEEK,
            "glm4_moe",
            "lfm2_moe",
        ):
            w.add_expert_feed_forward_length(hp.n_ff_exp)
    # deepseek2 / glm4moe: expert_shared_count shared experts of n_ff_exp instead
    if hp.n_ff_shexp and hp.model_type not in (*_DEEPSEEK, "glm4_moe"):
        w.add_expert_shared_feed_forward_length(hp.n_ff_shexp)
    if hp.model_type == "gpt_oss":
        w.add_sliding_window(hp.extra["sliding_window"])
        if "yarn" in hp.extra:
            import gguf

            y = hp.extra["yarn"]
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(y["factor"])
            w.add_rope_scaling_orig_ctx_len(y["original_context"])
            w.add_rope_scaling_yarn_beta_fast(y["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(y["beta_slow"])
    if hp.model_type in _QWEN35:
        x = hp.extra
        w.add_ssm_conv_kernel(x["conv_kernel"])
        w.add_ssm_state_size(x["k_dim"])
        w.add_ssm_group_count(x["k_heads"])
        w.add_ssm_time_step_rank(x["v_heads"])
        w.add_ssm_inner_size(x["v_heads"] * x["v_dim"])
        # the installed gguf package predates these two keys' helpers: written by name
        w.add_array(f"{hp.arch}.attention.recurrent_layers", [bool(r) for r in x["recurrent"]])
        w.add_array(f"{hp.arch}.rope.dimension_sections", [int(v) for v in x["sections"]])
    if hp.model_type in _LFM2:
        w.add_shortconv_l_cache(hp.extra["conv_kernel"])
    if hp.model_type in _GRANITE:
        w.add_attention_scale(hp.extra["attention_scale"])
        w.add_embedding_scale(hp.extra["embedding_scale"])
        w.add_residual_scale(hp.extra["residual_scale"])
        w.add_logit_scale(hp.extra["logit_scale"])

    w.add_tokenizer_model(vocab.model)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.model == "gemma4":  # as llama.cpp's converter writes Gemma 4's: ranked merges and scores
        w.add_token_merges(vocab.merges)
        w.add_token_scores(vocab.scores)
        w.add_add_space_prefix(False)
    elif vocab.model == "gpt2":
        w.add_tokenizer_pre(vocab.pre)
        w.add_token_merges(vocab.merges)
    else:
        w.add_token_scores(vocab.scores)
        w.add_add_space_prefix(vocab.add_space_prefix)
    setters = {
        "bos": w.add_bos_token_id,
        "eos": w.add_eos_token_id,
        "pad": w.add_pad_token_id,
        "unk": w.add_unk_token_id,
        "eot": w.add_eot_token_id,
        "eom": w.add_eom_token_id,
    }
    for kind, idx in vocab.special_ids.items():
        setters[kind](idx)
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)


def _encode(chunk: np.ndarray, qtype: int) -> np.ndarray:
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    q = Q(qtype)
    if chunk.dtype == np.uint8:  # already encoded (a raw tensor)
        return np.ascontiguousarray(chunk)
    if q == Q.F32:
        return np.ascontiguousarray(chunk, dtype=np.float32)
    if q == Q.F16:
        return np.ascontiguousarray(chunk, dtype=np.float16)
    return quants.quantize(np.ascontiguousarray(chunk, dtype=np.float32), q)


def convert(
    hf_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    out_type: str = "f16",
    progress: bool = True,
) -> Path:
    """Convert the Hugging Face checkpoint in `hf_dir` to a GGUF file at `out_path` and return its path.

    `out_type` is one of f32, f16, q8_0, q4_0 (norms, routers and vectors stay F32). The file is written to a
    temporary name beside `out_path` and renamed when complete, so a reader never sees a partial file.
    Raises ConversionError (a ValueError) with a clear message for anything this converter cannot represent
    exactly.
    """
    import gguf

    from colibri_backend.digests import write_digests

    out_type = out_type.lower()
    if out_type not in OUT_TYPES:
        raise ConversionError(f"unknown output type '{out_type}'; choose one of {', '.join(OUT_TYPES)}")
    src = Path(hf_dir)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise ConversionError(f"{src}: not a Hugging Face checkpoint directory (config.json is missing)")
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    hp = _hparams(cfg)
    ck = _Checkpoint(src)
    tensors = _plan(ck, hp)
    vocab = _vocab(src, cfg, hp.vocab_size, gemma4=hp.arch == "gemma4")
    _choose_types(tensors, out_type)

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    name = str(cfg.get("_name_or_path") or src.resolve().name)
    w = gguf.GGUFWriter(tmp, hp.arch)
    try:
        _write_metadata(w, hp, vocab, name, out_type)
        for t in tensors:
            w.add_tensor_info(
                t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=gguf.GGMLQuantizationType(t.qtype)
            )
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None
        fout = w.fout[0]
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(
                total=sum(t.nbytes for t in tensors), unit="B", unit_scale=True, desc=f"convert {out.name}"
            )
        for t in tensors:
            pad = -fout.tell() % ALIGNMENT
            fout.write(b"\0" * pad)
            written = 0
            for chunk in t.chunks():
                data = _encode(chunk, t.qtype)
                fout.write(data.tobytes())
                written += data.nbytes
                if bar is not None:
                    bar.update(data.nbytes)
            if written != t.nbytes:
                raise ConversionError(f"internal error: {t.name} wrote {written} bytes, planned {t.nbytes}")
        fout.write(b"\0" * (-fout.tell() % ALIGNMENT))
        if bar is not None:
            bar.close()
        w.close()
        os.replace(tmp, out)
        write_digests(out)  # MODEL.digests: `colibri verify`, verify=True and the streamed-expert check
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


__all__ = ["ALIGNMENT", "OUT_TYPES", "SUPPORTED_MODEL_TYPES", "ConversionError", "convert"]
