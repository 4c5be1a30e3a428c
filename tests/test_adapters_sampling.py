"""SamplingParams: validation and the mappings from OpenAI requests, HF GenerationConfig, llm options."""

from __future__ import annotations

import math

import pytest

from colibri_backend.adapters.sampling import SamplingParams


def test_defaults_are_greedy_and_off() -> None:
    sp = SamplingParams()
    assert sp.greedy
    assert (sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (1.0, 0, 0.0, 1.0)
    assert sp.stop == [] and sp.logit_bias is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"repetition_penalty": 0.0},
        {"temperature": math.nan},
        {"max_tokens": -1},
        {"top_k": 2.5},
    ],
)
def test_invalid_values_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_stop_string_becomes_list_and_empty_ones_drop() -> None:
    assert SamplingParams(stop="###").stop == ["###"]  # type: ignore[arg-type]
    assert SamplingParams(stop=["", "a"]).stop == ["a"]


def test_from_openai_defaults_and_fields() -> None:
    sp = SamplingParams.from_openai({"messages": []})
    assert sp.temperature == 1.0 and sp.top_p == 1.0 and sp.seed is None
    sp = SamplingParams.from_openai(
        {
            "temperature": 0.2,
            "top_p": 0.9,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "seed": 7,
            "stop": "END",
            "logit_bias": {"42": -100, "7": 3.5},
            "max_completion_tokens": 9,
            "top_k": 40,
            "min_p": 0.05,
            "repeat_penalty": 1.1,
        }
    )
    assert (sp.temperature, sp.top_p, sp.seed, sp.max_tokens) == (0.2, 0.9, 7, 9)
    assert (sp.presence_penalty, sp.frequency_penalty) == (0.5, -0.5)
    assert (sp.top_k, sp.min_p, sp.repetition_penalty) == (40, 0.05, 1.1)
    assert sp.stop == ["END"]
    assert sp.logit_bias == {42: -math.inf, 7: 3.5}
    assert SamplingParams.from_openai({"temperature": 0}).greedy
    assert SamplingParams.from_openai({"max_tokens": 5}).max_tokens == 5


@pytest.mark.parametrize(
    "req",
    [{"temperature": 2.5}, {"presence_penalty": 3}, {"logit_bias": {"x": 1}}, {"logit_bias": {"1": 101}}],
)
def test_from_openai_rejects_out_of_range(req: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams.from_openai(req)


def test_from_generation_config_object() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GenerationConfig(do_sample=False, max_new_tokens=12, repetition_penalty=1.2)
    sp = SamplingParams.from_generation_config(cfg)
    assert sp.greedy and sp.max_tokens == 12 and sp.repetition_penalty == 1.2
    cfg = transformers.GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8)
    sp = SamplingParams.from_generation_config(cfg)
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.7, 0.8, 50)
    sp = SamplingParams.from_generation_config(cfg, top_k=5, stop_strings=["\n\n"])
    assert sp.top_k == 5 and sp.stop == ["\n\n"]


def test_from_generation_config_kwargs_only() -> None:
    assert SamplingParams.from_generation_config(temperature=0.9).greedy  # do_sample defaults to False
    sp = SamplingParams.from_generation_config(do_sample=True, top_k=0, min_p=0.1, seed=3)
    assert (sp.temperature, sp.top_k, sp.min_p, sp.seed) == (1.0, 0, 0.1, 3)


def test_from_llm_options() -> None:
    sp = SamplingParams.from_llm_options({"temperature": 0.5, "max_tokens": 20, "stop": "x", "seed": None})
    assert (sp.temperature, sp.max_tokens, sp.stop, sp.seed) == (0.5, 20, ["x"], None)

    class Options:
        def model_dump(self) -> dict:
            return {"temperature": None, "top_k": 10, "repeat_penalty": 1.3}

    sp = SamplingParams.from_llm_options(Options())
    assert sp.greedy and sp.top_k == 10 and sp.repetition_penalty == 1.3


def test_to_native_fields_and_seed() -> None:
    sp = SamplingParams(
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.2,
        frequency_penalty=0.3,
        penalty_last_n=64,
        seed=123,
    )
    c = sp.to_native()
    assert c.top_k == 40 and c.penalty_last_n == 64 and c.seed == 123
    assert c.temperature == pytest.approx(0.8) and c.top_p == pytest.approx(0.9)
    assert c.min_p == pytest.approx(0.05) and c.repetition_penalty == pytest.approx(1.1)
    assert c.presence_penalty == pytest.approx(0.2) and c.frequency_penalty == pytest.approx(0.3)
    # Without a seed every request gets fresh randomness.
    unseeded = SamplingParams(temperature=1.0)
    assert len({unseeded.to_native().seed for _ in range(4)}) > 1
