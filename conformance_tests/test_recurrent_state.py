"""The recurrent state of Qwen3.5-MoE's linear-attention layers (Gated DeltaNet) and of LFM2-MoE's short
convolutions as part of the context.

* Prefill of a chunk equals token-by-token decode: the same logits with the whole prompt in one chunk, in
  chunks of 7 and one token at a time (batch_size 1), bit for bit; and with 1 thread as with 2.
* A prompt that shares only a prefix with the previous one: the state cannot be cut back, so the context
  resumes from its checkpoint (taken before the last token of the latest multi-token eval) or from 0, and
  the logits equal a fresh context's, bit for bit; how many tokens were re-evaluated is checked too.
* The ledger's recurrent-state bytes (`colibri plan`) against transformers' own cache of the same states.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny_models as tm

SPECS = [s.name for s in tm.SPECS if s.model_type in ("qwen3_5_moe_text", "lfm2", "lfm2_moe")]
N_POS = 48


@pytest.mark.parametrize("name", SPECS)
def test_prefill_equals_token_by_token(tiny_zoo: Any, colibri: Any, name: str) -> None:
    ckpt = tiny_zoo.checkpoint(name)
    ids = tm.token_ids(ckpt, N_POS, seed=5)
    gguf = tiny_zoo.gguf(name, "f32")
    runs = {}
    for batch in (None, 7, 1):
        with colibri.load(gguf, threads=tm.ENGINE_THREADS, context_length=128, batch_size=batch) as model:
            runs[batch] = model.logits(ids)
    with colibri.load(gguf, threads=1, context_length=128) as model:  # threads split the v heads
        one_thread = model.logits(ids)
    assert np.array_equal(runs[None], one_thread), "1 thread and 2 threads differ"
    diff = {b: float(np.abs(runs[b] - runs[None]).max()) for b in (7, 1)}
    tm.report(f"{name}: prefill in one chunk vs chunks of 7 / token by token: max|dlogit| {diff}")
    assert np.array_equal(runs[None], runs[7]), "chunks of 7 differ from one chunk"
    assert np.array_equal(runs[None], runs[1]), "token-by-token decode differs from one-chunk prefill"


def _evaluated(model: Any) -> int:
    return int(model.stats()["n_prompt_tokens"]) + int(model.stats()["n_decode_tokens"])


@pytest.mark.parametrize("name", SPECS)
def test_shared_prefix_resumes_from_checkpoint_or_zero(tiny_zoo: Any, colibri: Any, name: str) -> None:
    ckpt = tiny_zoo.checkpoint(name)
    a = tm.token_ids(ckpt, 40, seed=1)
    b = tm.token_ids(ckpt, 12, seed=2)
    c = tm.token_ids(ckpt, 9, seed=4)
    gguf = tiny_zoo.gguf(name, "f32")

    def fresh(ids: list[int]) -> np.ndarray:
        with colibri.load(gguf, threads=tm.ENGINE_THREADS, context_length=128) as m:
            return m.next_logits(ids)

    with colibri.load(gguf, threads=tm.ENGINE_THREADS, context_length=128) as model:
        model.next_logits(a + b)
        # 1. the same prompt again: its last token is re-run from the checkpoint before it
        model.reset_stats()
        again = model.next_logits(a + b)
        assert _evaluated(model) == 1, "the repeated prompt was not resumed from the checkpoint"
        assert np.array_equal(again, fresh(a + b))
        # 2. the prompt extended (the cache holds all of it): only the new tokens run
        model.reset_stats()
        longer = model.next_logits(a + b + c)
        assert _evaluated(model) == len(c)
        assert np.array_equal(longer, fresh(a + b + c))
        # 3. a shorter prefix than the checkpoint (a + b + c - 1): the state restarts from 0
        model.reset_stats()
        other = model.next_logits(a + c)
        assert _evaluated(model) == len(a + c)
        assert np.array_equal(other, fresh(a + c))
        # 4. after decoding past a prompt, a prompt that shares up to the checkpoint resumes from it
        model.next_logits(a + b)
        for i in range(1, 4):  # one token at a time, as generation feeds them
            model.next_logits(a + b + c[:i])
        model.reset_stats()
        branch = model.next_logits(a + b[:-1] + c[5:])
        assert _evaluated(model) == len(c[5:]), "the checkpoint before the prompt's last token was not used"
        assert np.array_equal(branch, fresh(a + b[:-1] + c[5:]))
    tm.report(f"{name}: shared-prefix prompts equal fresh contexts, resumed from the checkpoint or 0")


@pytest.mark.parametrize("name", SPECS)
def test_plan_state_bytes_against_transformers_cache(tiny_zoo: Any, colibri: Any, name: str) -> None:
    from colibri_backend import LoadOptions
    from colibri_backend.budget import format_plan
    from colibri_backend.engine import plan_memory

    plan = plan_memory(str(tiny_zoo.gguf(name, "f32")), LoadOptions(context_length=64, threads=2))
    assert "recurrent states" in format_plan(plan)
    if tm.reference_engine("transformers") is None:  # a failure instead under CI=true
        pytest.skip("transformers is not installed: its cache cannot be measured")
    import torch

    ckpt = tiny_zoo.checkpoint(name)
    model = tm.transformers_model(ckpt)
    with torch.no_grad():
        cache = model(torch.tensor([list(range(3, 13))]), use_cache=True).past_key_values
    theirs = conv_rows = 0
    for layer in cache.layers:
        if hasattr(layer, "keys"):
            continue
        conv, rec = layer.conv_states[0], layer.recurrent_states[0]  # no matrix state (None): a short conv
        theirs += (conv.numel() + (rec.numel() if rec is not None else 0)) * conv.element_size()
        conv_rows += conv.shape[-2]  # transformers keeps K inputs per channel, Colibri the K-1 it needs
    ours_one = plan["state_bytes"] // 2  # the live state and its checkpoint
    tm.report(
        f"{name}: recurrent state bytes: Colibri {plan['state_bytes']} (live + checkpoint), "
        f"transformers {theirs} (conv keeps K inputs, Colibri K-1)"
    )
    assert plan["state_bytes"] == 2 * ours_one
    assert ours_one == theirs - conv_rows * 4


def test_mtp_block_loaded_and_ignored(tiny_zoo: Any, colibri: Any) -> None:
    """llama.cpp's converter writes the checkpoint's multi-token-prediction block as an extra layer
    (nextn_predict_layers); Colibri runs the trunk only (the logits tests above pass on that file)."""
    from gguf import GGUFReader

    spec = tm.SPEC_BY_NAME["qwen35moe"]
    assert spec.config.get("mtp_num_hidden_layers") == 1
    path = tiny_zoo.gguf("qwen35moe", "f32", "llama.cpp")
    fields = GGUFReader(path).fields
    assert fields["qwen35moe.nextn_predict_layers"].contents() == 1
    assert fields["qwen35moe.block_count"].contents() == spec.config["num_hidden_layers"] + 1
    with colibri.load(path, threads=1, context_length=64) as model:
        assert model.info.n_layer == spec.config["num_hidden_layers"]


def test_mtp_block_left_out_of_the_memory_plan(tiny_zoo: Any, colibri: Any) -> None:
    """The multi-token-prediction block of llama.cpp's file is never run, so the memory plan holds none of
    it: resident and expert bytes are the trunk's tensors alone, the store's slots and per-expert tables are
    sized for the trunk's layers, and a 25% budget streams the same logits as the whole model."""
    from gguf import GGUFReader

    from colibri_backend import LoadOptions
    from colibri_backend.engine import plan_memory

    spec = tm.SPEC_BY_NAME["qwen35moe"]
    n_layer = spec.config["num_hidden_layers"]
    path = tiny_zoo.gguf("qwen35moe", "f32", "llama.cpp")
    tensors = GGUFReader(path).tensors
    mtp = [t for t in tensors if t.name.startswith(f"blk.{n_layer}.")]
    assert any(t.name.endswith("_exps.weight") for t in mtp), "llama.cpp's file has no MTP experts"
    assert any(t.name.endswith("nextn.eh_proj.weight") for t in mtp)
    trunk = [t for t in tensors if t not in mtp]
    experts = sum(int(t.n_bytes) for t in trunk if t.name.endswith("_exps.weight"))
    resident = sum(int(t.n_bytes) for t in trunk if not t.name.endswith("_exps.weight"))
    everything = plan_memory(str(path), LoadOptions(context_length=64, threads=1))
    tm.report(
        f"qwen35moe (llama.cpp's file, {len(mtp)} MTP tensors of "
        f"{sum(int(t.n_bytes) for t in mtp)} B): plan resident {everything['resident_weight_bytes']} "
        f"expert {everything['expert_total_bytes']} (trunk {resident} / {experts})"
    )
    assert everything["resident_weight_bytes"] == resident
    assert everything["expert_total_bytes"] == experts
    assert everything["n_expert_total"] == n_layer * spec.config["num_experts"]
    # the store of Colibri's file (no MTP block) and of llama.cpp's plan the same slot bytes
    ours = plan_memory(str(tiny_zoo.gguf("qwen35moe", "f32")), LoadOptions(context_length=64, threads=1))
    assert everything["expert_slot_bytes"] == ours["expert_slot_bytes"]
    assert everything["expert_total_bytes"] == ours["expert_total_bytes"]

    ids = tm.token_ids(tiny_zoo.checkpoint("qwen35moe"), 48, seed=2)
    with colibri.load(path, threads=1, context_length=64) as model:
        full = model.logits(ids)
    quarter = max(spec.config["num_experts_per_tok"], n_layer * spec.config["num_experts"] // 4)
    with colibri.load(path, threads=1, context_length=64, expert_slots=quarter) as model:
        plan = model.memory_plan()
        streamed = model.logits(ids)
    assert plan["n_expert_slots"] == quarter and not plan["all_resident"]
    assert np.array_equal(full, streamed)


def test_mtp_block_pages_given_back_and_verify_passes(tiny_zoo: Any, colibri: Any, tmp_path: Path) -> None:
    """The resident copy gives the MTP block's pages back after the load, and the digest check of the
    engine's copy (verify=True, `colibri verify`'s sidecar) leaves those never-held tensors out: a file with
    digests loads and runs, all-resident and streamed, with the same logits."""
    import shutil

    from colibri_backend import cli

    src = tiny_zoo.gguf("qwen35moe", "f32", "llama.cpp")
    path = tmp_path / src.name
    shutil.copyfile(src, path)
    assert cli.main(["verify", "--write", str(path)]) == 0
    ids = tm.token_ids(tiny_zoo.checkpoint("qwen35moe"), 16, seed=4)
    runs = []
    for slots in (0, 8):
        opts = {"expert_slots": slots} if slots else {"memory_budget": 0}
        with colibri.load(path, threads=1, context_length=64, verify=True, **opts) as model:
            runs.append(model.logits(ids))
    assert np.array_equal(runs[0], runs[1])


def test_vision_language_checkpoint_converts_its_text_model(tiny_zoo: Any, tmp_path: Path) -> None:
    """Qwen3.5-MoE as the Hub ships it (Qwen3_5MoeForConditionalGeneration: text_config, weights under
    model.language_model., a vision tower, an MTP block): Colibri's converter writes the same tensors as
    for the text-only checkpoint."""
    import json
    import shutil

    from gguf import GGUFReader
    from safetensors.numpy import load_file, save_file

    from colibri_backend.convert import convert

    src = tiny_zoo.checkpoint("qwen35moe")
    vl = tmp_path / "vl"
    shutil.copytree(src, vl)
    cfg = json.loads((src / "config.json").read_text())
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "tie_word_embeddings")}
    text["model_type"] = "qwen3_5_moe_text"
    (vl / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                "model_type": "qwen3_5_moe",
                "tie_word_embeddings": cfg["tie_word_embeddings"],
                "text_config": text,
                "vision_config": {"depth": 1},
            }
        )
    )
    weights = load_file(str(src / "model.safetensors"))
    renamed = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in weights.items()
    }
    renamed["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), dtype=np.float32)
    save_file(renamed, str(vl / "model.safetensors"), metadata={"format": "pt"})
    a = GGUFReader(tiny_zoo.gguf("qwen35moe", "f32"))
    b = GGUFReader(convert(vl, tmp_path / "vl.gguf", out_type="f32", progress=False))
    ta = {t.name: np.asarray(t.data) for t in a.tensors}
    tb = {t.name: np.asarray(t.data) for t in b.tensors}
    assert sorted(ta) == sorted(tb)
    for name, data in ta.items():
        assert np.array_equal(data, tb[name]), name
    assert b.fields["general.architecture"].contents() == "qwen35moe"
