"""The HF -> GGUF converter, checked without Colibri's engine.

* The tiny checkpoints have exactly the tensor names and shapes transformers' save_pretrained writes.
* llama.cpp running our F32 GGUF reproduces transformers' logits: this proves tensor names, layouts (the q/k
  RoPE permutation, stacked experts), metadata and tokenizer are what llama.cpp expects, independently of
  Colibri. Where llama.cpp is absent (never under CI=true), the recorded llama.cpp outputs are used, after
  checking that today's converter writes the very same bytes they were recorded on.
* File structure: alignment, tensor types, metadata, tokenizer; exact F32 round trip; bf16/f16 inputs;
  quantized outputs; sharded checkpoints; refusals with clear messages; the CLI.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny_models as tm
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize

from colibri_backend.convert import ALIGNMENT, ConversionError, convert

COMPATIBLE = [s.name for s in tm.SPECS if s.llama_cpp_compatible]
ALL = [s.name for s in tm.SPECS]
# Gemma 4's keys and tokenizer differ in kind (per-layer arrays, "gemma4" vocabulary): test_gemma4 checks them
# against llama.cpp's converter's file.
NOT_GEMMA4 = [s.name for s in tm.SPECS if s.model_type != "gemma4_text"]
N_POS = 128  # teacher-forced positions for the transformers comparisons (the issue asks for >= 64)


def _fields(reader: GGUFReader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, f in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        out[k] = f.contents()
    return out


def _tensors(reader: GGUFReader) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def _as_array(t: Any) -> np.ndarray:
    """A GGUF tensor as float32 in numpy order (outermost dimension first)."""
    shape = tuple(int(d) for d in reversed(t.shape))
    return dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)


# ----------------------------------------------------------------------------------------------------
# the tiny checkpoints are what transformers itself writes


def test_tiny_checkpoints_have_transformers_layout(tiny_zoo: Any) -> None:
    layout_path = tm.REFERENCE_DIR / "tiny_layout.json"
    # Qwen3.5's multi-token-prediction block (mtp.*) is in the Hub's files but not in transformers' model
    ours = {
        s.name: {k: list(v.shape) for k, v in tm.make_weights(s).items() if not k.startswith("mtp.")}
        for s in tm.SPECS
    }
    if tm.reference_engine("transformers") is not None:
        theirs = {s.name: tm.transformers_layout(s) for s in tm.SPECS}
        source = "live transformers"
    else:
        theirs = json.loads(layout_path.read_text())
        source = f"recorded {layout_path.name}"
    for name in ours:
        assert ours[name] == theirs[name], f"{name}: tensor names/shapes differ from {source}"
    tm.report(f"tiny checkpoint layouts match {source} for {len(ours)} specs")


# ----------------------------------------------------------------------------------------------------
# llama.cpp on our F32 file == transformers on the checkpoint


@pytest.mark.parametrize("name", COMPATIBLE)
def test_llama_cpp_runs_converted_f32_like_transformers(tiny_zoo: Any, name: str) -> None:
    ckpt = tiny_zoo.checkpoint(name)
    gguf_path = tiny_zoo.gguf(name, "f32")
    ids = tm.token_ids(ckpt, N_POS)
    rec_name = f"tiny_{name}"
    llama_cpp = tm.reference_engine("llama_cpp")
    hf = tm.reference_engine("transformers")
    ours = ref = None
    if llama_cpp is not None:
        ours = tm.llama_cpp_logits(gguf_path, ids, f32_kv=True)
    else:
        rec = tm.load_record(rec_name)
        assert str(rec["gguf_sha_f32"]) == tm.file_sha(gguf_path), (
            "the converter's F32 output changed since llama.cpp's outputs were recorded; rerun "
            "conformance_tests/reference/regenerate.py where llama-cpp-python is installed"
        )
    if hf is not None:
        ref = tm.transformers_logits(ckpt, ids)
    else:
        rec = tm.load_record(rec_name)
        assert str(rec["fingerprint"]) == tm.checkpoint_fingerprint(ckpt), "recorded for another checkpoint"
    if ours is not None and ref is not None:
        cmp = tm.compare(ref, ours)
        source = "live"
    elif ref is not None:
        cmp = tm.compare_to_record(_sub(tm.load_record(rec_name), "llama_f32kv"), ref)
        source = "recorded llama.cpp vs live transformers"
    elif ours is not None:
        cmp = tm.compare_to_record(_sub(tm.load_record(rec_name), "hf"), ours)
        source = "live llama.cpp vs recorded transformers"
    else:
        # Neither engine here: the file is byte-identical to the one both engines agreed on when recorded.
        tm.report(f"{name}: F32 GGUF identical to the recorded, llama.cpp-validated file")
        return
    tm.report(cmp.line(f"{name} F32 GGUF in llama.cpp vs transformers ({source})"))
    assert cmp.rel_diff <= 1e-3, cmp.line(name)
    assert not cmp.argmax_mismatches, f"argmax differs at positions {cmp.argmax_mismatches}"


def _sub(rec: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix) + 1 :]: v for k, v in rec.items() if k.startswith(prefix + "_")}


TOKENIZER_SAMPLES = (
    "def f(x):\n    return x ** 2  # square\n\n\n",
    "Ünïcödé — “quotes”, emoji 🦜🐦 and CJK 漢字かな",
    "   leading spaces, trailing tabs\t\t, numbers 1234567 3.14159",
    "<|im_start|>user\nhello<|im_end|>",
)


def test_llama_cpp_tokenizes_like_hf(tiny_zoo: Any) -> None:
    """The GGUF tokenizer metadata (tokens, merges, types, pre-tokenizer name) makes llama.cpp tokenize
    exactly as the HF tokenizer.json does, special tokens included."""
    from tokenizers import Tokenizer

    ckpt = tiny_zoo.checkpoint("llama")
    hf = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    texts = [*TOKENIZER_SAMPLES, tm.corpus_text()[5000:9000]]
    expected = [hf.encode(t, add_special_tokens=False).ids for t in texts]
    if tm.reference_engine("llama_cpp") is not None:
        got = tm.llama_cpp_tokenize(tiny_zoo.gguf("llama", "f32"), texts)
        source = "live"
    else:
        rec = tm.load_record("tiny_llama")
        flat, lens = rec["llama_tok_ids"].tolist(), rec["llama_tok_lens"].tolist()
        got = [flat[sum(lens[:i]) : sum(lens[: i + 1])] for i in range(len(lens))]
        source = "recorded"
    for text, e, g in zip(texts, expected, got, strict=True):
        assert g == e, f"llama.cpp ({source}) tokenizes {text[:40]!r} differently: {g[:20]} vs HF {e[:20]}"
    tm.report(f"llama.cpp tokenization of our GGUF == HF tokenizer on {len(texts)} texts ({source})")


@pytest.mark.parametrize("pre", tm.PRE_TOKENIZERS)
def test_byte_level_pre_tokenizers(tmp_path: Path, tiny_zoo: Any, pre: str) -> None:
    """Each recognised HF pre-tokenizer pipeline is written under the llama.cpp name whose built-in regexes
    split text the same way (checked by tokenizing in llama.cpp)."""
    from tokenizers import Tokenizer

    tok_dir = tm.build_tokenizer(tmp_path / f"tok_{pre}", pre=pre)
    ckpt = tm.build_checkpoint(tm.SPEC_BY_NAME["olmoe"], tmp_path / f"olmoe_{pre}", tok_dir)
    gguf_path = convert(ckpt, tmp_path / f"{pre}.gguf", "f16", progress=False)
    assert _fields(GGUFReader(gguf_path))["tokenizer.ggml.pre"] == pre
    hf = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    texts = [*TOKENIZER_SAMPLES, "call 12345 or 2024-01-31\r\n\n  x's  we'll", tm.corpus_text()[20000:23000]]
    expected = [hf.encode(t, add_special_tokens=False).ids for t in texts]
    if tm.reference_engine("llama_cpp") is None:
        tm.report(f"pre-tokenizer {pre}: name checked; llama.cpp absent, tokenization not compared")
        return
    got = tm.llama_cpp_tokenize(gguf_path, texts)
    for text, e, g in zip(texts, expected, got, strict=True):
        assert g == e, f"{pre}: llama.cpp tokenizes {text[:40]!r} as {g[:16]}, HF as {e[:16]}"
    tm.report(f"pre-tokenizer {pre}: llama.cpp == HF on {len(texts)} texts")


SPM_SAMPLES = (
    "Hello world, this is a test.",
    "def f(x):\n    return x ** 2  # square",
    "  two leading spaces and   runs   of spaces",
    "Ünïcödé — emoji 🦜 and CJK 漢字 fall back to bytes",
)


def test_sentencepiece_style_tokenizer(tmp_path: Path, tiny_zoo: Any) -> None:
    """A byte-fallback BPE tokenizer.json (Llama 2 / Mistral / Mixtral style) becomes tokenizer.ggml.model
    "llama" with scores that make llama.cpp's merge order equal the BPE merge ranks."""
    from tokenizers import Tokenizer

    tok_dir = tm.build_spm_tokenizer(tmp_path / "spm_tok")
    spec = tm.SPEC_BY_NAME["mixtral"]
    ckpt = tm.build_checkpoint(spec, tmp_path / "mixtral_spm", tok_dir)
    gguf_path = convert(ckpt, tmp_path / "spm.gguf", "f16", progress=False)
    f = _fields(GGUFReader(gguf_path))
    assert f["tokenizer.ggml.model"] == "llama" and "tokenizer.ggml.merges" not in f
    assert f["tokenizer.ggml.add_space_prefix"] is True and f["tokenizer.ggml.add_bos_token"] is True
    types = f["tokenizer.ggml.token_type"]
    tokens = f["tokenizer.ggml.tokens"]
    assert types[0] == 2 and tokens[0] == "<unk>"  # UNKNOWN
    assert types[1] == 3 and types[2] == 3  # <s>, </s>: CONTROL
    assert sum(t == 6 for t in types) == 256  # BYTE
    hf = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    texts = [*SPM_SAMPLES, tm.corpus_text()[12000:15000]]
    expected = [hf.encode(t, add_special_tokens=False).ids for t in texts]
    if tm.reference_engine("llama_cpp") is None:
        tm.report(
            "SentencePiece-style tokenizer: metadata checked; llama.cpp absent, tokenization not compared"
        )
        return
    llm = tm.open_llama_cpp(gguf_path, vocab_only=True)
    try:
        got = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in texts]
    finally:
        llm.close()
    for text, e, g in zip(texts, expected, got, strict=True):
        assert g == e, f"llama.cpp tokenizes {text[:40]!r} as {g[:16]}, HF as {e[:16]}"
    tm.report(f"SentencePiece-style tokenizer: llama.cpp == HF on {len(texts)} texts")


# ----------------------------------------------------------------------------------------------------
# file structure


@pytest.mark.parametrize("name", NOT_GEMMA4)
def test_metadata_tokenizer_and_alignment(tiny_zoo: Any, name: str) -> None:
    spec = tm.SPEC_BY_NAME[name]
    ckpt = tiny_zoo.checkpoint(name)
    reader = GGUFReader(tiny_zoo.gguf(name, "q8_0"))
    f = _fields(reader)
    cfg = spec.config
    arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}.get(
        spec.model_type, spec.model_type
    )
    arch = {
        "granitemoeshared": "granitemoe",
        "gpt_oss": "gpt-oss",
        "qwen3_5_moe_text": "qwen35moe",
        "lfm2_moe": "lfm2moe",
    }.get(arch, arch)
    deepseek = spec.model_type in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
    if deepseek:
        arch = "deepseek2"
    glm = spec.model_type == "glm4_moe"
    if glm:
        arch = "glm4moe"
    assert f["general.architecture"] == arch
    assert "general.alignment" not in f  # GGUF's default (32): what llama.cpp's quantizer writes back
    assert f[f"{arch}.block_count"] == cfg["num_hidden_layers"]
    assert f[f"{arch}.embedding_length"] == cfg["hidden_size"]
    assert f[f"{arch}.attention.head_count"] == cfg["num_attention_heads"]
    if deepseek:
        _check_deepseek_metadata(f, cfg, spec.model_type)
    elif arch in ("lfm2", "lfm2moe"):
        _check_lfm2_metadata(f, cfg, arch)
    else:
        assert f[f"{arch}.attention.head_count_kv"] == cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)  # partial rotary
    if glm:
        assert f[f"{arch}.rope.dimension_count"] == int(head_dim * partial)
        _check_glm4moe_metadata(f, cfg)
    elif not deepseek:
        assert f[f"{arch}.rope.dimension_count"] == int(head_dim * partial)
    if head_dim * cfg["num_attention_heads"] != cfg["hidden_size"] and not deepseek:
        assert f[f"{arch}.attention.key_length"] == head_dim
        assert f[f"{arch}.attention.value_length"] == head_dim
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    assert math.isclose(f[f"{arch}.rope.freq_base"], theta)
    eps = cfg["norm_eps"] if arch in ("lfm2", "lfm2moe") else cfg["rms_norm_eps"]
    assert math.isclose(f[f"{arch}.attention.layer_norm_rms_epsilon"], eps, rel_tol=1e-6)
    n_expert = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if n_expert:
        assert f[f"{arch}.expert_count"] == n_expert
        assert f[f"{arch}.expert_used_count"] == cfg["num_experts_per_tok"]
        always = (
            "mixtral",
            "granitemoe",
            "granitemoeshared",
            "gpt_oss",
            "qwen3_5_moe_text",
        )  # top-k sums to 1
        expected_norm = True if spec.model_type in always else cfg["norm_topk_prob"]
        assert f[f"{arch}.expert_weights_norm"] is expected_norm

    # tokenizer: ids, merges, special tokens, chat template
    tj = json.loads((ckpt / "tokenizer.json").read_text())
    tokens = f["tokenizer.ggml.tokens"]
    assert len(tokens) == cfg["vocab_size"]
    for tok, idx in tj["model"]["vocab"].items():
        assert tokens[idx] == tok
    types = f["tokenizer.ggml.token_type"]
    for at in tj["added_tokens"]:
        assert tokens[at["id"]] == at["content"] and types[at["id"]] == 3  # CONTROL
    for i in range(len(tj["model"]["vocab"]), cfg["vocab_size"]):
        assert tokens[i] == f"[PAD{i}]" and types[i] == 5  # UNUSED padding rows
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    assert f["tokenizer.ggml.merges"] == merges
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert f["tokenizer.ggml.bos_token_id"] == 0 and f["tokenizer.ggml.eos_token_id"] == 2
    assert f["tokenizer.chat_template"] == tm.CHAT_TEMPLATE

    # tensors: 32-aligned data, F32 norms/routers, stacked experts [E, rows, cols]
    tensors = _tensors(reader)
    for t in reader.tensors:
        assert t.data_offset % ALIGNMENT == 0, f"{t.name} at {t.data_offset} is not {ALIGNMENT}-aligned"
    for tname, t in tensors.items():
        # biases (gpt-oss's expert ones are 2-D), routers, Qwen3.5's short convolution kernel
        small = tname.endswith((".bias", "ffn_gate_inp.weight", "ssm_conv1d.weight", "shortconv.conv.weight"))
        if len(t.shape) == 1 or "norm" in tname or small:
            assert t.tensor_type == Q.F32, f"{tname} should stay F32, is {t.tensor_type.name}"
        elif int(t.shape[0]) % 32:  # rows shorter than whole Q8_0 blocks
            assert t.tensor_type == Q.F16, (
                f"{tname} has {int(t.shape[0])}-wide rows: F16, is {t.tensor_type.name}"
            )
        else:
            assert t.tensor_type == Q.Q8_0, f"{tname} should be Q8_0, is {t.tensor_type.name}"
    if n_expert:
        ff = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        h, moe = cfg["hidden_size"], cfg.get("num_dense_layers", 0)  # the first layer with experts
        assert [int(d) for d in tensors[f"blk.{moe}.ffn_gate_exps.weight"].shape] == [h, ff, n_expert]
        assert [int(d) for d in tensors[f"blk.{moe}.ffn_down_exps.weight"].shape] == [ff, h, n_expert]
        assert [int(d) for d in tensors[f"blk.{moe + 1}.ffn_gate_inp.weight"].shape] == [h, n_expert]
    has_output = "output.weight" in tensors
    tied = cfg["tie_word_embeddings"]
    # llama.cpp requires output.weight for qwen2moe, olmoe and gpt-oss, tied or not.
    assert has_output == (not tied or spec.model_type in ("qwen2_moe", "olmoe", "gpt_oss"))


def _check_deepseek_metadata(f: dict[str, Any], cfg: dict[str, Any], model_type: str) -> None:
    """deepseek2's latent-attention and router keys, as llama.cpp's converter writes them."""
    c, r = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    v3 = model_type in ("deepseek_v3", "glm4_moe_lite")
    want = {
        "attention.head_count_kv": 1,
        "attention.kv_lora_rank": c,
        "attention.q_lora_rank": cfg.get("q_lora_rank") or 0,
        "attention.key_length": c + r,
        "attention.value_length": c,
        "attention.key_length_mla": cfg["qk_nope_head_dim"] + r,
        "attention.value_length_mla": cfg["v_head_dim"],
        "rope.dimension_count": r,
        "leading_dense_block_count": cfg.get("first_k_dense_replace")
        if "mlp_layer_types" not in cfg
        else cfg["mlp_layer_types"].count("dense"),
        "expert_count": cfg["n_routed_experts"],
        "expert_used_count": cfg["num_experts_per_tok"],
        "expert_shared_count": cfg["n_shared_experts"],
        "expert_gating_func": 2 if v3 else 1,
        "expert_weights_norm": bool(cfg.get("norm_topk_prob")) if v3 else False,
    }
    if (v3 and cfg.get("n_group", 1) > 1) or cfg.get("topk_method") == "group_limited_greedy":
        want["expert_group_count"] = cfg["n_group"]
        want["expert_group_used_count"] = cfg["topk_group"]
    for key, value in want.items():
        assert f[f"deepseek2.{key}"] == value, f"deepseek2.{key} = {f[f'deepseek2.{key}']}, expected {value}"
    assert math.isclose(f["deepseek2.expert_weights_scale"], cfg["routed_scaling_factor"], rel_tol=1e-6)


def _check_lfm2_metadata(f: dict[str, Any], cfg: dict[str, Any], arch: str) -> None:
    """lfm2's / lfm2moe's keys, as llama.cpp's converter writes them: KV heads per layer (0 for a convolution
    layer), the convolution's kernel, the FFN width (dense LFM2: transformers' adjusted one) and, for the MoE,
    leading dense layers and the sigmoid router."""
    kv = [0 if t == "conv" else cfg["num_key_value_heads"] for t in cfg["layer_types"]]
    assert list(f[f"{arch}.attention.head_count_kv"]) == kv
    want = {"shortconv.l_cache": cfg["conv_L_cache"]}
    if arch == "lfm2":
        want["feed_forward_length"] = tm.lfm2_ff_width(cfg)
        assert f"{arch}.expert_count" not in f
    else:
        want.update(
            {
                "leading_dense_block_count": cfg["num_dense_layers"],
                "expert_feed_forward_length": cfg["moe_intermediate_size"],
                "feed_forward_length": cfg["intermediate_size"],
                "expert_gating_func": 2,
            }
        )
        assert math.isclose(f["lfm2moe.expert_weights_scale"], cfg["routed_scaling_factor"], rel_tol=1e-6)
    for key, value in want.items():
        assert f[f"{arch}.{key}"] == value, f"{arch}.{key} = {f[f'{arch}.{key}']}, expected {value}"


def _check_glm4moe_metadata(f: dict[str, Any], cfg: dict[str, Any]) -> None:
    """glm4moe's router keys, as llama.cpp's converter writes them."""
    want = {
        "leading_dense_block_count": cfg["first_k_dense_replace"],
        "expert_count": cfg["n_routed_experts"],
        "expert_used_count": cfg["num_experts_per_tok"],
        "expert_shared_count": cfg["n_shared_experts"],
        "expert_gating_func": 2,
        "expert_weights_norm": cfg["norm_topk_prob"],
    }
    if cfg["n_group"] > 1:
        want["expert_group_count"] = cfg["n_group"]
        want["expert_group_used_count"] = cfg["topk_group"]
    for key, value in want.items():
        assert f[f"glm4moe.{key}"] == value, f"glm4moe.{key} = {f[f'glm4moe.{key}']}, expected {value}"
    assert math.isclose(f["glm4moe.expert_weights_scale"], cfg["routed_scaling_factor"], rel_tol=1e-6)


def _rope_half(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """transformers' rotate_half RoPE on [n, heads, d]: pairs (i, i + d/2)."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = pos[:, None, None] * inv[None, None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _rope_adjacent(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """llama.cpp's normal RoPE on [n, heads, d]: pairs (2i, 2i + 1)."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = pos[:, None, None] * inv[None, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
    out[..., 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return out


@pytest.mark.parametrize(
    "name", ["llama", "mixtral", "granitemoe", "granitemoeshared", "qwen3moe", "qwen2moe", "olmoe"]
)
def test_f32_tensors_round_trip_and_rope_equivalence(tiny_zoo: Any, name: str) -> None:
    """Every F32 tensor equals its checkpoint source (after the documented transforms), and for llama-family
    models the permuted q/k with adjacent-pair RoPE give the same attention scores as HF's rotate_half."""
    spec = tm.SPEC_BY_NAME[name]
    w = tm.make_weights(spec)
    t = _tensors(GGUFReader(tiny_zoo.gguf(name, "f32")))
    cfg = spec.config
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    assert all(x.tensor_type == Q.F32 for x in t.values())
    np.testing.assert_array_equal(_as_array(t["token_embd.weight"]), w["model.embed_tokens.weight"])
    np.testing.assert_array_equal(
        _as_array(t["blk.1.attn_norm.weight"]), w["model.layers.1.input_layernorm.weight"]
    )
    np.testing.assert_array_equal(
        _as_array(t["blk.0.attn_v.weight"]), w["model.layers.0.self_attn.v_proj.weight"]
    )
    q_g, k_g = _as_array(t["blk.0.attn_q.weight"]), _as_array(t["blk.0.attn_k.weight"])
    q_h, k_h = w["model.layers.0.self_attn.q_proj.weight"], w["model.layers.0.self_attn.k_proj.weight"]
    llama_family = spec.model_type in ("llama", "mixtral", "granitemoe", "granitemoeshared")
    if not llama_family:
        np.testing.assert_array_equal(q_g, q_h)
        np.testing.assert_array_equal(k_g, k_h)
    else:
        assert not np.array_equal(q_g, q_h), "llama-family q must be permuted"
        rng = np.random.default_rng(0)
        x = rng.standard_normal((6, cfg["hidden_size"]))
        pos = np.arange(6, dtype=np.float64) * 7
        theta = cfg["rope_theta"]

        def scores(q_w: np.ndarray, k_w: np.ndarray, rope: Any) -> np.ndarray:
            q = rope((x @ q_w.T).reshape(6, nh, hd), pos, theta)
            k = rope((x @ k_w.T).reshape(6, nkv, hd), pos, theta)
            k = np.repeat(k, nh // nkv, axis=1)
            return np.einsum("ihd,jhd->hij", q, k)

        np.testing.assert_allclose(
            scores(q_g, k_g, _rope_adjacent), scores(q_h, k_h, _rope_half), rtol=1e-9, atol=1e-9
        )
    if spec.model_type == "mixtral":
        stacked = _as_array(t["blk.1.ffn_up_exps.weight"])
        for e in range(cfg["num_local_experts"]):
            np.testing.assert_array_equal(
                stacked[e], w[f"model.layers.1.block_sparse_moe.experts.{e}.w3.weight"]
            )
    if spec.model_type in ("granitemoe", "granitemoeshared"):
        fused = w["model.layers.0.block_sparse_moe.input_linear.weight"]
        ff = cfg["intermediate_size"]
        np.testing.assert_array_equal(_as_array(t["blk.0.ffn_gate_exps.weight"]), fused[:, :ff])
        np.testing.assert_array_equal(_as_array(t["blk.0.ffn_up_exps.weight"]), fused[:, ff:])
    if cfg.get("shared_intermediate_size"):
        sh = w["model.layers.1.shared_mlp.input_linear.weight"]
        s = cfg["shared_intermediate_size"]
        np.testing.assert_array_equal(_as_array(t["blk.1.ffn_gate_shexp.weight"]), sh[:s])
        np.testing.assert_array_equal(_as_array(t["blk.1.ffn_up_shexp.weight"]), sh[s:])
        np.testing.assert_array_equal(
            _as_array(t["blk.1.ffn_down_shexp.weight"]), w["model.layers.1.shared_mlp.output_linear.weight"]
        )
    if spec.model_type == "qwen2_moe":
        np.testing.assert_array_equal(
            _as_array(t["blk.0.ffn_gate_inp_shexp.weight"]),
            w["model.layers.0.mlp.shared_expert_gate.weight"].reshape(-1),
        )
        np.testing.assert_array_equal(
            _as_array(t["blk.0.attn_k.bias"]), w["model.layers.0.self_attn.k_proj.bias"]
        )
    if cfg["tie_word_embeddings"] and "output.weight" in t:
        np.testing.assert_array_equal(_as_array(t["output.weight"]), w["model.embed_tokens.weight"])
    elif not cfg["tie_word_embeddings"]:
        np.testing.assert_array_equal(_as_array(t["output.weight"]), w["lm_head.weight"])


def _to_half_checkpoint(src: Path, dst: Path, kind: str) -> dict[str, np.ndarray]:
    """Copy a checkpoint with its weights stored as bf16 or f16; returns the stored values as float32."""
    from safetensors.numpy import load_file

    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, rounded, offset = [], {}, 0
    for k in sorted(weights):
        v = weights[k].astype(np.float32)
        if kind == "bf16":
            bits = v.view(np.uint32)
            # round to nearest even, as torch does
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            raw = bits.tobytes()
            rounded[k] = (bits.astype(np.uint32) << 16).view(np.float32)
            dtype = "BF16"
        else:
            h = v.astype(np.float16)
            raw = h.tobytes()
            rounded[k] = h.astype(np.float32)
            dtype = "F16"
        header[k] = {"dtype": dtype, "shape": list(v.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    hbytes = json.dumps(header).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    with open(dst / "model.safetensors", "wb") as f:
        f.write(len(hbytes).to_bytes(8, "little"))
        f.write(hbytes)
        for b in blobs:
            f.write(b)
    return rounded


@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_half_precision_checkpoints(tiny_zoo: Any, tmp_path: Path, kind: str) -> None:
    ckpt = _to_half_checkpoint(tiny_zoo.checkpoint("qwen3moe"), tmp_path / kind, kind)
    rounded = ckpt
    out = convert(tmp_path / kind, tmp_path / f"{kind}.gguf", "f32", progress=False)
    t = _tensors(GGUFReader(out))
    np.testing.assert_array_equal(_as_array(t["token_embd.weight"]), rounded["model.embed_tokens.weight"])
    np.testing.assert_array_equal(
        _as_array(t["blk.1.attn_q_norm.weight"]), rounded["model.layers.1.self_attn.q_norm.weight"]
    )
    np.testing.assert_array_equal(
        _as_array(t["blk.0.ffn_down_exps.weight"])[5],
        rounded["model.layers.0.mlp.experts.5.down_proj.weight"],
    )


@pytest.mark.parametrize(
    "out_type,qtype,tol", [("f16", Q.F16, 2e-3), ("q8_0", Q.Q8_0, 1.5e-2), ("q4_0", Q.Q4_0, 0.2)]
)
def test_quantized_outputs(tiny_zoo: Any, out_type: str, qtype: Q, tol: float) -> None:
    spec = tm.SPEC_BY_NAME["qwen3moe"]
    w = tm.make_weights(spec)
    t = _tensors(GGUFReader(tiny_zoo.gguf("qwen3moe", out_type)))
    got = t["blk.1.ffn_gate_exps.weight"]
    assert got.tensor_type == qtype
    for e in (0, 7):
        ref = w[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"]
        err = np.abs(_as_array(got)[e] - ref).max() / np.abs(ref).max()
        assert err <= tol, f"{out_type}: relative error {err:.3g} > {tol}"
    assert t["blk.0.ffn_gate_inp.weight"].tensor_type == Q.F32
    assert t["blk.0.attn_k_norm.weight"].tensor_type == Q.F32
    if out_type == "q4_0":  # the output head keeps 8 bits
        assert t["output.weight"].tensor_type == Q.Q8_0


def test_rows_not_multiple_of_block_fall_back_to_f16(tmp_path: Path, tiny_zoo: Any) -> None:
    base = tm.SPEC_BY_NAME["llama"]
    spec = tm.TinySpec("llama_odd_ff", "llama", dict(base.config, intermediate_size=72), seed=3)
    ckpt = tm.build_checkpoint(spec, tmp_path / "odd", tiny_zoo.tokenizer_dir())
    t = _tensors(GGUFReader(convert(ckpt, tmp_path / "odd.gguf", "q8_0", progress=False)))
    assert t["blk.0.ffn_down.weight"].tensor_type == Q.F16  # rows of 72 values
    assert t["blk.0.ffn_up.weight"].tensor_type == Q.Q8_0  # rows of 128 values


def test_sharded_checkpoint_gives_identical_file(tmp_path: Path, tiny_zoo: Any) -> None:
    from safetensors.numpy import load_file, save_file

    src = tiny_zoo.checkpoint("mixtral")
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    weights = load_file(str(src / "model.safetensors"))
    names = sorted(weights)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a = convert(dst, tmp_path / "sharded.gguf", "f16", progress=False)
    b = tiny_zoo.gguf("mixtral", "f16")
    ra, rb = GGUFReader(a), GGUFReader(b)
    assert [t.name for t in ra.tensors] == [t.name for t in rb.tensors]
    for ta, tb in zip(ra.tensors, rb.tensors, strict=True):
        np.testing.assert_array_equal(np.asarray(ta.data), np.asarray(tb.data))


# ----------------------------------------------------------------------------------------------------
# refusals


def _mutated(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "base,changes,message",
    [
        (
            "mixtral",
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            "RoPE scaling",
        ),
        (
            "llama",
            {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_parameters": None},
            "RoPE scaling",
        ),
        ("mixtral", {"sliding_window": 64}, "sliding-window"),
        ("qwen2moe", {"use_sliding_window": True, "sliding_window": 128}, "sliding-window"),
        ("qwen3moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("qwen2moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
        ("llama", {"model_type": "gpt2"}, "not supported"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama", {"tie_word_embeddings": False}, "lm_head"),
        ("gemma4", {"hidden_size_per_layer_input": 256}, "hidden_size_per_layer_input"),
        ("gemma4", {"hidden_size_per_layer_input": None}, "hidden_size_per_layer_input"),  # default 256
        ("gemma4", {"num_kv_shared_layers": 2}, "num_kv_shared_layers"),
        ("gemma4", {"hidden_activation": "gelu"}, "hidden_activation"),
        ("gemma4", {"sliding_window": 4096}, "sliding_window 4096"),
        ("gemma4", {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
        ("gemma4", {"num_global_key_value_heads": 3}, "not a multiple of 3 KV heads"),
        ("gemma4_sep_v", {"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}, "rope_parameters"),
    ],
)
def test_unsupported_configs_are_refused(
    tmp_path: Path, tiny_zoo: Any, base: str, changes: dict[str, Any], message: str
) -> None:
    ckpt = _mutated(tiny_zoo.checkpoint(base), tmp_path / "m", **changes)
    with pytest.raises(ConversionError, match=message):
        convert(ckpt, tmp_path / "out.gguf", "f16", progress=False)
    assert not (tmp_path / "out.gguf").exists()
    assert not list(tmp_path.glob("*.part"))


def test_bad_checkpoints_are_refused(tmp_path: Path, tiny_zoo: Any) -> None:
    src = tiny_zoo.checkpoint("olmoe")
    with pytest.raises(ConversionError, match="config.json"):
        convert(tmp_path, tmp_path / "x.gguf", progress=False)
    no_tok = tmp_path / "no_tok"
    shutil.copytree(src, no_tok)
    (no_tok / "tokenizer.json").unlink()
    with pytest.raises(ConversionError, match="tokenizer.json"):
        convert(no_tok, tmp_path / "x.gguf", progress=False)
    extra = tmp_path / "extra"
    shutil.copytree(src, extra)
    from safetensors.numpy import load_file, save_file

    w = load_file(str(src / "model.safetensors"))
    w["model.layers.0.mlp.mystery.weight"] = np.zeros((4, 4), np.float32)
    save_file(w, str(extra / "model.safetensors"))
    with pytest.raises(ConversionError, match="no GGUF mapping"):
        convert(extra, tmp_path / "x.gguf", progress=False)
    trunc = tmp_path / "trunc"
    shutil.copytree(src, trunc)
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match="inconsistent data offsets|truncated"):
        convert(trunc, tmp_path / "x.gguf", progress=False)
    with pytest.raises(ConversionError, match="unknown output type"):
        convert(src, tmp_path / "x.gguf", out_type="q2_k", progress=False)
    spm = tmp_path / "spm"
    shutil.copytree(src, spm)
    tj = json.loads((spm / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {
        "type": "Metaspace",
        "replacement": "\u2581",
        "prepend_scheme": "first",
        "split": False,
    }
    (spm / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(ConversionError, match="not byte-level"):
        convert(spm, tmp_path / "x.gguf", progress=False)
    assert not (tmp_path / "x.gguf").exists()


# ----------------------------------------------------------------------------------------------------
# CLI


def test_cli_convert(tmp_path: Path, tiny_zoo: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from colibri_backend.cli import main

    src = tiny_zoo.checkpoint("qwen2moe")
    out = tmp_path / "cli.gguf"
    assert main(["convert", str(src), "-o", str(out), "--type", "q4_0", "--no-progress"]) == 0
    assert GGUFReader(out).fields["general.file_type"].contents() == 2  # MOSTLY_Q4_0
    assert "wrote" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing"), "-o", str(out)]) == 1
    assert "not a directory" in capsys.readouterr().err
    bad = _mutated(src, tmp_path / "bad", mlp_only_layers=[0])
    assert main(["convert", str(bad), "-o", str(tmp_path / "bad.gguf")]) == 1
    assert "mlp_only_layers" in capsys.readouterr().err


def test_older_config_spellings(tmp_path: Path, tiny_zoo: Any) -> None:
    """Hub configs written before transformers 5: top-level rope_theta, num_experts instead of
    num_local_experts; the converter reads both."""
    src = tiny_zoo.checkpoint("mixtral")
    cfg = json.loads((src / "config.json").read_text())
    n_exp = cfg["num_local_experts"]
    old = _mutated(
        src,
        tmp_path / "old",
        rope_parameters=None,
        rope_theta=500000.0,
        num_local_experts=None,
        num_experts=n_exp,
    )
    f = _fields(GGUFReader(convert(old, tmp_path / "old.gguf", "f16", progress=False)))
    assert math.isclose(f["llama.rope.freq_base"], 500000.0)
    assert f["llama.expert_count"] == n_exp


def test_gpt_oss_hub_mxfp4_experts_repacked_exactly(tiny_zoo: Any, colibri: Any, tmp_path: Path) -> None:
    """gpt-oss checkpoints on the Hub keep their experts as MXFP4 (`*_blocks`, `*_scales`): the converter
    moves them into GGML's MXFP4 blocks without requantizing, so gguf's dequantization of the file equals
    transformers' own dequantization of the checkpoint (integrations.mxfp4), value for value."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = tiny_zoo.checkpoint("gpt_oss_plain_rope")
    hub = tmp_path / "hub"
    shutil.copytree(src, hub)
    w = load_file(str(src / "model.safetensors"))
    rng = np.random.default_rng(7)
    ref: dict[str, np.ndarray] = {}
    for name in [n for n in w if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, cols, rows = w.pop(name).shape  # transformers' [E, in, out]
        blocks = rng.integers(0, 256, (e, rows, cols // 32, 16), dtype=np.uint8)
        scales = rng.integers(122, 128, (e, rows, cols // 32), dtype=np.uint8)
        w[name + "_blocks"], w[name + "_scales"] = blocks, scales
        ref[name] = convert_moe_packed_tensors(
            torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
        ).numpy()  # [E, in, out], as the float checkpoint would hold it
    save_file(w, str(hub / "model.safetensors"), metadata={"format": "pt"})
    gguf_path = convert(hub, tmp_path / "hub.gguf", out_type="f32", progress=False)
    t = _tensors(GGUFReader(gguf_path))
    for layer in range(2):
        gu = ref[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        dn = ref[f"model.layers.{layer}.mlp.experts.down_proj"]
        want = {
            "ffn_gate_exps": gu[:, :, 0::2].transpose(0, 2, 1),
            "ffn_up_exps": gu[:, :, 1::2].transpose(0, 2, 1),
            "ffn_down_exps": dn.transpose(0, 2, 1),
        }
        for gname, values in want.items():
            tensor = t[f"blk.{layer}.{gname}.weight"]
            assert tensor.tensor_type == Q.MXFP4
            np.testing.assert_array_equal(_as_array(tensor), values)
    with colibri.load(gguf_path, threads=tm.ENGINE_THREADS, context_length=64) as model:
        logits = model.logits(tm.token_ids(hub, 32))
    assert np.isfinite(logits).all()
