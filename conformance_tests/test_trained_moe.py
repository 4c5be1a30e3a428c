"""Colibri's own trained MoE (tools/train_moe/release, the bundled default model) against transformers
and llama.cpp.

* F32 conversion vs transformers, teacher-forced over held-out text (a standard-library file of the held-out
  split, by the rule of tools/train_moe/prepare.py): max|dlogit| <= 1e-3 x max|logit| and the same argmax
  at every position; greedy 32-token continuations identical to transformers' generate(do_sample=False).
* The shipped Q8_0 GGUF (colibri_backend/models/) is exactly `colibri convert release --type q8_0`, and
  llama.cpp loads it: raw top-1 agreement and mean KL are reported, and Colibri must be at least as
  faithful to the file's exact math as llama.cpp (test_vs_llama_cpp._check_quantized).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny_models as tm
from test_vs_llama_cpp import _check_quantized, exact_logits

ROOT = Path(__file__).resolve().parent.parent
RELEASE = ROOT / "tools" / "train_moe" / "release"
N_POSITIONS = 192  # teacher-forced positions (the trained context is 1024)
REL_TOL = 1e-3
GREEDY_N = 32
GREEDY_PROMPTS = ("def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n    def __init__(self):")
HELDOUT_PERCENT = 5  # tools/train_moe/prepare.py --heldout-percent (the released run's value)


@pytest.fixture(scope="module")
def release() -> Path:
    if not (RELEASE / "config.json").is_file():
        pytest.fail(f"the released checkpoint is missing: {RELEASE}", pytrace=False)
    return RELEASE


def heldout_text() -> tuple[str, str]:
    """(relative path, text) of the first held-out standard-library file with enough text."""
    spec = importlib.util.spec_from_file_location("train_moe_prepare", ROOT / "tools/train_moe/prepare.py")
    assert spec is not None and spec.loader is not None
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    root = Path(sysconfig.get_paths()["stdlib"])
    for rel in prepare.list_corpus(root):
        if prepare.is_heldout(rel, HELDOUT_PERCENT):
            text = prepare.read_text(root / rel)
            if len(text) > 4 * N_POSITIONS * 8:
                return rel, text
    raise AssertionError(f"no held-out standard-library file under {root}")


@pytest.fixture(scope="module")
def f32_gguf(release: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from colibri_backend.convert import convert

    return convert(
        release, tmp_path_factory.mktemp("trained") / "colibri-moe.f32.gguf", "f32", progress=False
    )


@pytest.fixture(scope="module")
def heldout_ids(release: Path) -> list[int]:
    from tokenizers import Tokenizer

    rel, text = heldout_text()
    ids = Tokenizer.from_file(str(release / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert len(ids) >= N_POSITIONS, f"{rel}: only {len(ids)} tokens"
    tm.report(f"held-out text: {rel} ({N_POSITIONS} of {len(ids)} tokens)")
    return ids[:N_POSITIONS]


def test_logits_match_transformers(
    release: Path, f32_gguf: Path, heldout_ids: list[int], colibri: Any
) -> None:
    if tm.reference_engine("transformers") is None:
        pytest.fail("transformers and torch are needed for this comparison", pytrace=False)
    with colibri.load(f32_gguf, threads=tm.ENGINE_THREADS) as model:
        ours = model.logits(heldout_ids)
    theirs = tm.transformers_logits(release, heldout_ids)
    cmp = tm.compare(theirs, ours)
    tm.report(cmp.line("trained MoE F32 Colibri vs transformers"))
    assert cmp.n >= 64
    assert cmp.rel_diff <= REL_TOL, f"max|dlogit| {cmp.max_abs_diff:.3g} > {REL_TOL} x {cmp.max_abs_ref:.3g}"
    assert not cmp.argmax_mismatches, f"argmax differs at positions {cmp.argmax_mismatches}"


def _colibri_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    from colibri_backend.adapters.sampling import SamplingParams

    events = model.generate_tokens(prompt, max_tokens=n, sampling=SamplingParams(temperature=0.0))
    return [ev.token_id for ev in events if ev.token_id >= 0]


@pytest.mark.parametrize("prompt", GREEDY_PROMPTS)
def test_greedy_matches_transformers(release: Path, f32_gguf: Path, colibri: Any, prompt: str) -> None:
    if tm.reference_engine("transformers") is None:
        pytest.fail("transformers and torch are needed for this comparison", pytrace=False)
    with colibri.load(f32_gguf, threads=tm.ENGINE_THREADS) as model:
        ids = model.tokenize(prompt, add_special_tokens=False)
        ours = _colibri_greedy(model, ids, GREEDY_N)
        text = model.detokenize(ours)
    theirs = tm.transformers_greedy(release, ids, GREEDY_N)
    tm.report(f"trained MoE greedy {prompt!r}: {len(ours)} tokens -> {text!r}")
    assert ours == theirs


def test_shipped_file_is_the_release_converted(release: Path, tmp_path: Path) -> None:
    from colibri_backend.convert import convert
    from colibri_backend.models import bundled_model_path

    shipped = bundled_model_path("colibri-moe")
    fresh = convert(release, tmp_path / "fresh.q8_0.gguf", "q8_0", progress=False)
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (shipped, fresh)]
    assert digest[0] == digest[1], (
        f"{shipped} is not `colibri convert {release} --type q8_0` of this checkout; regenerate it with "
        f"that command"
    )
    assert shipped.stat().st_size <= 30 * 1024 * 1024


def test_shipped_q8_0_vs_llama_cpp(heldout_ids: list[int], colibri: Any, tmp_path: Path) -> None:
    if tm.reference_engine("llama_cpp") is None:
        pytest.fail("llama-cpp-python is needed: pip install 'colibri-backend[llama-cpp]'", pytrace=False)
    from colibri_backend.models import bundled_model_path

    shipped = bundled_model_path("colibri-moe")
    with colibri.load(shipped, threads=tm.ENGINE_THREADS) as model:
        ours = model.logits(heldout_ids)
    theirs = tm.llama_cpp_logits(shipped, heldout_ids)
    exact = exact_logits(colibri, shipped, heldout_ids, tmp_path)
    raw = tm.compare(theirs, ours)
    _check_quantized(raw, tm.compare(exact, ours), tm.compare(exact, theirs), "trained MoE Q8_0 (shipped)")
    # Reported beside the faithfulness bar: the raw figures on a trained model.
    tm.report(f"trained MoE Q8_0 raw: top-1 {raw.top1_agreement:.2%}, mean KL {raw.kl_mean:.3g}")
    assert raw.top1_agreement >= 0.95, f"Colibri and llama.cpp agree on only {raw.top1_agreement:.2%} top-1"
    assert np.isfinite(ours).all()
