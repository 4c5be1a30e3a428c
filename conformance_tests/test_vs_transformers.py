"""Colibri against transformers on tiny random checkpoints of every architecture (converted to F32 GGUF).

Per checkpoint and converter (Colibri's, and llama.cpp's own convert_hf_to_gguf.py: the files users download):
teacher-forced logits over 128 positions of real text, max |Δlogit| <= 1e-3 * max |logit| and the same argmax
at every position; a greedy 32-token continuation with identical token ids.
Without torch/transformers (never under CI=true) the recorded transformers outputs in reference/ are used,
after checking that the checkpoint is byte-identical to the one they were recorded from.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tiny_models as tm

N_POS = 128
N_GREEDY = 32
PROMPT_LEN = 16


def _sub(rec: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix) + 1 :]: v for k, v in rec.items() if k.startswith(prefix + "_")}


def _hf_or_record(ckpt: Any, name: str) -> tuple[dict[str, np.ndarray] | None, Any]:
    if tm.reference_engine("transformers") is not None:
        return None, "live"
    rec = tm.load_record(f"tiny_{name}")
    assert str(rec["fingerprint"]) == tm.checkpoint_fingerprint(ckpt), (
        "this tiny checkpoint differs from the one the reference was recorded on; rerun "
        "conformance_tests/reference/regenerate.py where transformers is installed"
    )
    return rec, "recorded"


# llama.cpp's converter writes no expert_weights_norm for qwen3moe / olmoe, so a spec whose norm_topk_prob is
# the other way than llama.cpp's hard-coded default cannot be expressed in its files (docs/conformance.md);
# those run on Colibri's files only.
CASES = [
    (name, converter)
    for name in tm.ENGINE_SPECS
    for converter in ("colibri", "llama.cpp")
    if converter == "colibri" or tm.llama_cpp_converts(tm.SPEC_BY_NAME[name])
]


@pytest.mark.parametrize(("name", "converter"), CASES)
def test_teacher_forced_logits(tiny_zoo: Any, colibri: Any, name: str, converter: str) -> None:
    ckpt = tiny_zoo.checkpoint(name)
    ids = tm.token_ids(ckpt, N_POS)
    gguf = tiny_zoo.gguf(name, "f32", converter)
    with colibri.load(gguf, threads=tm.ENGINE_THREADS, context_length=256) as model:
        ours = model.logits(ids)
    rec, source = _hf_or_record(ckpt, name)
    if rec is None:
        cmp = tm.compare(tm.transformers_logits(ckpt, ids), ours)
    else:
        assert rec["ids"].tolist() == ids
        cmp = tm.compare_to_record(_sub(rec, "hf"), ours)
    tm.report(cmp.line(f"{name} Colibri on {converter}'s F32 vs transformers ({source})"))
    assert cmp.rel_diff <= 1e-3, cmp.line(name)
    assert not cmp.argmax_mismatches, f"argmax differs at positions {cmp.argmax_mismatches}"


@pytest.mark.parametrize(("name", "converter"), CASES)
def test_greedy_continuation(tiny_zoo: Any, colibri: Any, name: str, converter: str) -> None:
    from colibri_backend.adapters.sampling import SamplingParams

    ckpt = tiny_zoo.checkpoint(name)
    prompt = tm.token_ids(ckpt, PROMPT_LEN, seed=3)
    gguf = tiny_zoo.gguf(name, "f32", converter)
    with colibri.load(gguf, threads=tm.ENGINE_THREADS, context_length=256) as model:
        events = list(
            model.generate_tokens(
                prompt, max_tokens=N_GREEDY, sampling=SamplingParams(temperature=0.0), logprobs=0
            )
        )
        stop_ids = set(model.tokenizer.stop_token_ids)
    ours = [e.token_id for e in events if e.token_id >= 0]
    our_lp = np.array([e.logprob for e in events if e.token_id >= 0], dtype=np.float64)
    rec, source = _hf_or_record(ckpt, name)
    if rec is None:
        ref = tm.transformers_greedy(ckpt, prompt, N_GREEDY)
        ref_lp = tm.greedy_logprobs(tm.transformers_logits(ckpt, prompt + ref), len(prompt), ref)
    else:
        assert rec["greedy_prompt"].tolist() == prompt
        ref = rec["hf_greedy"].tolist()
        ref_lp = rec["hf_greedy_logprobs"]
    n = min(len(ours), len(ref))
    lp_diff = float(np.abs(our_lp[:n] - ref_lp[:n]).max()) if n else 0.0
    tm.report(
        f"{name} ({converter}'s file) greedy {N_GREEDY} tokens ({source}): "
        f"identical={ours == ref[: len(ours)]} distinct={len(set(ours))} max|dlogprob|={lp_diff:.2e} "
        f"colibri={ours}"
    )
    # Colibri also stops at the tokenizer's other end-of-generation tokens; transformers only at eos_token_id.
    if len(ours) < len(ref):
        assert ours[-1] in stop_ids, f"Colibri stopped early after {len(ours)} tokens on a non-stop token"
    assert ours == ref[: len(ours)], f"greedy continuations differ: colibri {ours}, transformers {ref}"
    assert len(ours) == len(ref) or ours[-1] in stop_ids
    # the decode path (one token at a time through the KV cache) gives the same probabilities
    assert lp_diff <= 1e-3, f"log-probabilities of the generated tokens differ by up to {lp_diff:.3g}"
