"""Bad input for the newer architectures: a file of each with a missing or inconsistent hyper-parameter is
refused at load with a message naming the key (issue 10, item 8), and the same file unmodified loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny_models as tm
from gguf import GGUFValueType as V
from reference.quantization_error import dequantized_copy

U32, F32, STR = V.UINT32, V.FLOAT32, V.STRING

# (spec, key -> (value, type) or None to drop it, a key or phrase the message must name)
CASES = [
    ("gpt_oss", {"gpt-oss.attention.sliding_window": None}, "gpt-oss.attention.sliding_window is missing"),
    ("gpt_oss", {"gpt-oss.attention.sliding_window": (4096, U32)}, "larger than gpt-oss.context_length"),
    ("gpt_oss", {"gpt-oss.attention.sliding_window": (0, U32)}, "gpt-oss.attention.sliding_window = 0"),
    ("gpt_oss", {"gpt-oss.rope.scaling.original_context_length": None}, "original_context_length is missing"),
    ("gpt_oss", {"gpt-oss.rope.scaling.factor": (0.5, F32)}, "gpt-oss.rope.scaling.factor = 0.5"),
    ("gpt_oss", {"gpt-oss.rope.scaling.type": ("longrope", STR)}, "RoPE scaling 'longrope'"),
    ("gpt_oss", {"gpt-oss.expert_count": None}, "gpt-oss.expert_count > 0"),
    ("gpt_oss", {"gpt-oss.attention.sliding_window_pattern": ([True, False], V.ARRAY, V.BOOL)}, "_pattern"),
    ("granitemoe", {"granitemoe.logit_scale": (0.0, F32)}, "granitemoe.logit_scale = 0"),
    ("granitemoe", {"granitemoe.residual_scale": (-1.0, F32)}, "granitemoe.residual_scale = -1"),
    ("granitemoe", {"granitemoe.attention.scale": (-0.5, F32)}, "granitemoe.attention.scale = -0.5"),
    ("granitemoeshared", {"granitemoe.expert_shared_feed_forward_length": (7, U32)}, "disagrees"),
    ("qwen35moe", {"qwen35moe.ssm.conv_kernel": None}, "qwen35moe.ssm.conv_kernel is missing"),
    ("qwen35moe", {"qwen35moe.ssm.conv_kernel": (0, U32)}, "qwen35moe.ssm.conv_kernel = 0"),
    ("qwen35moe", {"qwen35moe.ssm.time_step_rank": (5, U32)}, "qwen35moe.ssm.time_step_rank 5 (v heads)"),
    ("qwen35moe", {"qwen35moe.ssm.inner_size": (70, U32)}, "qwen35moe.ssm.inner_size 70"),
    ("qwen35moe", {"qwen35moe.ssm.state_size": (8, U32)}, "blk.0.attn_qkv.weight has shape"),
    ("qwen35moe", {"qwen35moe.attention.recurrent_layers": None}, "recurrent_layers is missing"),
    ("qwen35moe", {"qwen35moe.attention.recurrent_layers": ([True] * 3, V.ARRAY, V.BOOL)}, "has 3 entries"),
    (
        "qwen35moe",
        {"qwen35moe.attention.recurrent_layers": ([True] * 4, V.ARRAY, V.BOOL)},
        "every layer recurrent",
    ),
    (
        "qwen35moe",
        {"qwen35moe.attention.recurrent_layers": ([1, 1, 0, 1], V.ARRAY, V.UINT8)},
        "array of bools",
    ),
    ("qwen35moe", {"qwen35moe.nextn_predict_layers": (4, U32)}, "qwen35moe.nextn_predict_layers = 4"),
    ("gemma4", {"gemma4.attention.sliding_window": (4096, U32)}, "larger than gemma4.context_length"),
    ("gemma4", {"gemma4.attention.sliding_window": None}, "gemma4.attention.sliding_window is missing"),
    ("gemma4", {"gemma4.attention.sliding_window_pattern": None}, "sliding_window_pattern (the local/global"),
    ("gemma4", {"gemma4.attention.sliding_window_pattern": ([True, False], V.ARRAY, V.BOOL)}, "has 2 values"),
    ("gemma4", {"gemma4.attention.head_count_kv": ([3, 1, 3, 1], V.ARRAY, V.INT32)}, "head_count_kv[0] = 3"),
    ("gemma4", {"gemma4.embedding_length_per_layer_input": (256, U32)}, "per_layer_input = 256"),
    ("gemma4", {"gemma4.attention.shared_kv_layers": (2, U32)}, "gemma4.attention.shared_kv_layers = 2"),
    ("gemma4", {"gemma4.rope.dimension_count_swa": (8, U32)}, "gemma4.rope.dimension_count_swa = 8"),
    ("gemma4", {"gemma4.final_logit_softcapping": (-1.0, F32)}, "gemma4.final_logit_softcapping must be"),
    ("gemma4", {"gemma4.attention.key_length_swa": (23, U32)}, "value_length_swa = 24 differs"),
    ("gpt_oss", {"gpt-oss.attention.head_count_kv": ([2, 2], V.ARRAY, V.INT32)}, "is a per-layer array"),
    ("deepseek_v3", {"deepseek2.expert_group_count": (5, U32)}, "does not divide deepseek2.expert_count 12"),
    ("deepseek_v3", {"deepseek2.expert_group_used_count": (5, U32)}, "expert_group_used_count = 5 is out of"),
    ("deepseek_v3", {"deepseek2.expert_group_used_count": (1, U32)}, "expert_used_count 4 exceeds the 3"),
    ("deepseek_v3", {"deepseek2.expert_weights_scale": (0.0, F32)}, "deepseek2.expert_weights_scale = 0"),
    (
        "deepseek_v3",
        {"deepseek2.attention.kv_lora_rank": None},
        "with deepseek2.attention.kv_lora_rank",
    ),
    ("deepseek_v3", {"deepseek2.attention.key_length": (99, U32)}, "deepseek2.attention.key_length = 99"),
    (
        "deepseek_v2",
        {"deepseek2.attention.key_length_mla": (8, U32)},
        "must be below deepseek2.attention.key",
    ),
    ("deepseek_v2", {"deepseek2.leading_dense_block_count": (3, U32)}, "leading_dense_block_count = 3"),
    ("deepseek_v2", {"deepseek2.expert_shared_count": (3, U32)}, "expert_shared_count 3"),
    ("deepseek_v2", {"deepseek2.attention.q_lora_rank": (16, U32)}, "blk.0.attn_q_a.weight is missing"),
    ("glm4_moe", {"glm4moe.expert_group_count": (3, U32)}, "does not divide glm4moe.expert_count 8"),
    ("glm4_moe", {"glm4moe.expert_gating_func": (1, U32)}, "glm4moe.expert_gating_func = 1"),
    ("glm4_moe", {"glm4moe.leading_dense_block_count": (3, U32)}, "glm4moe.leading_dense_block_count = 3"),
    ("glm4_moe", {"glm4moe.nextn_predict_layers": (3, U32)}, "glm4moe.nextn_predict_layers = 3"),
    ("glm4_moe_air", {"glm4moe.expert_shared_count": (2, U32)}, "glm4moe.expert_shared_count 2"),
    ("lfm2moe", {"lfm2moe.shortconv.l_cache": None}, "lfm2moe.shortconv.l_cache is missing"),
    ("lfm2moe", {"lfm2moe.shortconv.l_cache": (1, U32)}, "lfm2moe.shortconv.l_cache = 1"),
    ("lfm2moe", {"lfm2moe.shortconv.l_cache": (4, U32)}, "blk.0.shortconv.conv.weight has shape"),
    ("lfm2moe", {"lfm2moe.attention.head_count_kv": (2, U32)}, "lfm2moe.attention.head_count_kv must list"),
    ("lfm2moe", {"lfm2moe.attention.head_count_kv": ([0, 0, 2, 0], V.ARRAY, U32)}, "has 4 values"),
    ("lfm2moe", {"lfm2moe.attention.head_count_kv": ([0, 0, 3, 0, 2], V.ARRAY, U32)}, "head_count_kv[2] = 3"),
    ("lfm2moe", {"lfm2moe.attention.head_count_kv": ([0, 0, 2, 0, 1], V.ARRAY, U32)}, "head_count_kv[4] = 1"),
    ("lfm2moe", {"lfm2moe.attention.head_count_kv": ([0] * 5, V.ARRAY, U32)}, "marks every layer a conv"),
    ("lfm2moe", {"lfm2moe.attention.head_count_kv": ([2, 0, 2, 0, 2], V.ARRAY, U32)}, "blk.0.attn_q.weight"),
    ("lfm2moe", {"lfm2moe.expert_gating_func": (1, U32)}, "lfm2moe.expert_gating_func = 1"),
    ("lfm2moe", {"lfm2moe.leading_dense_block_count": (5, U32)}, "lfm2moe.leading_dense_block_count = 5"),
    ("lfm2moe", {"lfm2moe.expert_group_count": (4, U32)}, "does not divide lfm2moe.expert_count 6"),
    ("lfm2moe", {"lfm2moe.expert_weights_scale": (0.0, F32)}, "lfm2moe.expert_weights_scale = 0"),
    ("lfm2", {"lfm2.expert_count": (4, U32), "lfm2.expert_used_count": (2, U32)}, "lfm2 is dense (LFM2-MoE"),
    ("lfm2", {"lfm2.shortconv.l_cache": None}, "lfm2.shortconv.l_cache is missing"),
    ("lfm2", {"lfm2.attention.head_count_kv": ([0] * 4, V.ARRAY, U32)}, "marks every layer a conv"),
    ("lfm2", {"lfm2.feed_forward_length": (144, U32)}, "feed_forward_length 144 disagrees"),
    ("lfm2_bias", {"lfm2.shortconv.l_cache": (3, U32)}, "blk.1.shortconv.conv.weight has shape"),
]


@pytest.mark.parametrize(("name", "edits", "needle"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_inconsistent_hparams_refused(
    tiny_zoo: Any, colibri: Any, tmp_path: Path, name: str, edits: dict, needle: str
) -> None:
    from colibri_backend.errors import EngineError

    bad = dequantized_copy(tiny_zoo.gguf(name, "f32"), tmp_path / "bad.gguf", edits)
    with pytest.raises(EngineError) as err:
        colibri.load(bad, threads=1, context_length=64)
    tm.report(f"{name} {sorted(edits)}: {err.value}")
    assert needle in str(err.value)


@pytest.mark.parametrize("name", sorted({c[0] for c in CASES}))
def test_unmodified_copy_loads(tiny_zoo: Any, colibri: Any, tmp_path: Path, name: str) -> None:
    good = dequantized_copy(tiny_zoo.gguf(name, "f32"), tmp_path / "good.gguf")
    with colibri.load(good, threads=1, context_length=64) as model:
        assert model.logits([5, 6, 7]).shape[0] == 3


@pytest.mark.parametrize("name", ["lfm2_bias", "lfm2moe_bias"])
def test_partial_conv_biases_refused(tiny_zoo: Any, colibri: Any, tmp_path: Path, name: str) -> None:
    """conv_bias gives a short convolution all three biases (in_proj, conv, out_proj) or none: a file with
    only some of them is refused naming the layer, not run with the others silently zero."""
    from colibri_backend.errors import EngineError

    layer = tm.SPEC_BY_NAME[name].config["layer_types"].index("conv")
    drop = frozenset({f"blk.{layer}.shortconv.conv.bias"})
    bad = dequantized_copy(tiny_zoo.gguf(name, "f32"), tmp_path / "bad.gguf", drop=drop)
    with pytest.raises(EngineError) as err:
        colibri.load(bad, threads=1, context_length=64)
    tm.report(f"{name} without blk.{layer}.shortconv.conv.bias: {err.value}")
    assert f"layer {layer} has 2 of the 3 short-convolution biases" in str(err.value)


@pytest.mark.parametrize("name", ["deepseek_v2", "glm4_moe_lite"])
def test_latent_cache_refuses_int8_and_runs_f16(tiny_zoo: Any, colibri: Any, name: str) -> None:
    """The MLA latent cache is F32 or F16: an INT8 KV cache is refused with a message naming it, and an F16
    cache of an F32 file stays within 1e-2 of max |logit| of the F32 one (only the cached rows are
    rounded)."""
    from colibri_backend.errors import EngineError

    gguf = tiny_zoo.gguf(name, "f32")
    with pytest.raises(EngineError) as err:
        colibri.load(gguf, threads=1, context_length=64, kv_cache_type="int8")
    assert "COLIBRI_KV_INT8 is not supported with the latent (MLA) cache" in str(err.value)
    ids = tm.token_ids(tiny_zoo.checkpoint(name), 48)
    logits = []
    for kv in (None, "f16"):
        with colibri.load(gguf, threads=1, context_length=64, kv_cache_type=kv) as model:
            logits.append(model.logits(ids))
            cfg = tm.config_of(tiny_zoo.checkpoint(name))
            row = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]  # latent + rope key, per layer and position
            assert model.stats()["kv_bytes"] == (2 if kv else 4) * 64 * model.info.n_layer * row
    rel = float(np.abs(logits[0] - logits[1]).max() / np.abs(logits[0]).max())
    tm.report(f"{name}: F16 latent cache vs F32, max dlogit {rel:.2e} of max")
    assert 0 < rel <= 1e-2
