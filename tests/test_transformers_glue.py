"""ColibriForCausalLM behind transformers: Auto classes, generate(), pipeline(), streaming, forward().

The reference for greedy output is transformers' own model on the conformance suite's tiny random checkpoints
(llama, mixtral, qwen2_moe, qwen3_moe, olmoe), converted to F32 GGUF so the comparison is at full precision.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CONFORMANCE = Path(__file__).resolve().parent.parent / "conformance_tests"
if str(CONFORMANCE) not in sys.path:
    sys.path.insert(0, str(CONFORMANCE))

import tiny_models  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    TextIteratorStreamer,
    pipeline,
)

import colibri_backend  # noqa: E402
from colibri_backend import transformers_glue  # noqa: E402
from colibri_backend.convert import convert  # noqa: E402

ColibriConfig = transformers_glue.ColibriConfig
ColibriForCausalLM = transformers_glue.ColibriForCausalLM

GREEDY_ARCHS = ("llama", "mixtral", "qwen2moe", "qwen3moe", "olmoe")
N_NEW = 32


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny checkpoints (HF dirs) and their F32 GGUFs, keyed "NAME" and "NAME.gguf"."""
    root = tmp_path_factory.mktemp("glue_zoo")
    tok_dir = tiny_models.build_tokenizer(root / "tokenizer")
    out: dict[str, Path] = {}
    for name in GREEDY_ARCHS:
        ckpt = tiny_models.build_checkpoint(tiny_models.SPEC_BY_NAME[name], root / name, tok_dir)
        out[name] = ckpt
        out[f"{name}.gguf"] = convert(ckpt, root / f"{name}.f32.gguf", out_type="f32", progress=False)
    return out


@pytest.fixture(scope="module")
def mixtral(zoo: dict[str, Path]):
    model = ColibriForCausalLM.from_pretrained(zoo["mixtral.gguf"], threads=2, context_length=256)
    yield model
    model.close()


def prompt_ids(ckpt: Path, n: int = 12, seed: int = 0) -> list[int]:
    return tiny_models.token_ids(ckpt, n, seed=seed)


# ---- registration --------------------------------------------------------------------------------------


def test_registered_with_auto_classes() -> None:
    cfg = AutoConfig.for_model("colibri")
    assert isinstance(cfg, ColibriConfig) and cfg.model_type == "colibri"
    assert transformers.MODEL_FOR_CAUSAL_LM_MAPPING[ColibriConfig] is ColibriForCausalLM
    assert ColibriForCausalLM.can_generate()


def test_registered_by_importing_the_glue_and_transformers_is_left_alone() -> None:
    code = (
        "import sys\n"
        "n_finders = len(sys.meta_path)\n"
        "import colibri_backend\n"  # cheap, and no import hook patching transformers' loader
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "assert len(sys.meta_path) == n_finders\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "try:\n"
        "    AutoConfig.for_model('colibri')\n"
        "    raise SystemExit('registered without importing the glue')\n"
        "except ValueError:\n"
        "    pass\n"
        "import colibri_backend.transformers_glue\n"  # AutoConfig.register / AutoModelForCausalLM.register
        "cfg = AutoConfig.for_model('colibri')\n"
        "print(type(cfg).__name__, AutoModelForCausalLM._model_mapping[type(cfg)].__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ColibriConfig", "ColibriForCausalLM"]


# ---- greedy equality with transformers ---------------------------------------------------------------


@pytest.mark.parametrize("name", GREEDY_ARCHS)
def test_greedy_equals_transformers(zoo: dict[str, Path], name: str) -> None:
    ckpt = zoo[name]
    prompt = prompt_ids(ckpt, 12, seed=3)
    expected = tiny_models.transformers_greedy(ckpt, prompt, N_NEW)
    eos = tiny_models.config_of(ckpt)["eos_token_id"]
    model = ColibriForCausalLM.from_pretrained(zoo[f"{name}.gguf"], threads=2)
    try:
        mask = torch.ones(1, len(prompt), dtype=torch.long)
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=N_NEW,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    finally:
        model.close()
    got = out[0, len(prompt) :].tolist()
    pairs = zip(got, expected, strict=False)
    first_diff = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(got), len(expected)))
    assert got == expected, f"{name}: greedy tokens differ from transformers' from position {first_diff}"


def test_forward_logits_match_transformers(zoo: dict[str, Path]) -> None:
    ckpt = zoo["qwen3moe"]
    ids = prompt_ids(ckpt, 64, seed=1)
    ref = tiny_models.transformers_logits(ckpt, ids)
    model = ColibriForCausalLM.from_pretrained(zoo["qwen3moe.gguf"], threads=2)
    try:
        got = model(torch.tensor([ids])).logits[0].numpy()
    finally:
        model.close()
    assert got.shape == ref.shape
    assert np.max(np.abs(got - ref)) <= 1e-3 * np.max(np.abs(ref))
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_from_pretrained_hf_checkpoint_dir(zoo: dict[str, Path]) -> None:
    """A Hugging Face checkpoint directory is converted by colibri_backend and runs."""
    model = ColibriForCausalLM.from_pretrained(zoo["llama"], threads=2)
    try:
        assert model.config.arch == "llama" and model.config.vocab_size == 1000
        tok = model.get_tokenizer()
        enc = tok("def main():", return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=5, do_sample=False)
        assert out.shape == (1, enc["input_ids"].shape[1] + 5)
    finally:
        model.close()


# ---- forward ----------------------------------------------------------------------------------------


def test_forward_reuses_engine_cache(mixtral, zoo: dict[str, Path]) -> None:
    ids = prompt_ids(zoo["mixtral"], 20, seed=5)
    full = mixtral.engine.logits(ids)
    first = mixtral(torch.tensor([ids[:19]]), logits_to_keep=1).logits
    before = mixtral.engine.stats()
    second = mixtral(torch.tensor([ids]), logits_to_keep=1).logits
    after = mixtral.engine.stats()
    vocab = mixtral.config.vocab_size
    assert first.shape == (1, 1, vocab) and second.shape == (1, 1, vocab)
    np.testing.assert_allclose(first[0, 0].numpy(), full[18], rtol=0, atol=1e-4)
    np.testing.assert_allclose(second[0, 0].numpy(), full[19], rtol=0, atol=1e-4)
    # Only the one new token was evaluated for the second call: the prefix came from the KV cache.
    assert after["n_decode_tokens"] - before["n_decode_tokens"] == 1
    assert after["n_prompt_tokens"] == before["n_prompt_tokens"]


def test_forward_padding_and_loss(mixtral, zoo: dict[str, Path]) -> None:
    ids = prompt_ids(zoo["mixtral"], 10, seed=7)
    short = ids[:6]
    batch = torch.tensor([ids, [0] * 4 + short])
    mask = torch.tensor([[1] * 10, [0] * 4 + [1] * 6])
    logits = mixtral(batch, attention_mask=mask).logits
    np.testing.assert_allclose(logits[0].numpy(), mixtral.engine.logits(ids), atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits[1, 4:].numpy(), mixtral.engine.logits(short), atol=1e-4, rtol=0)
    assert float(logits[1, :4].abs().max()) == 0.0
    labels = torch.tensor([ids])
    out = mixtral(labels, labels=labels)
    manual = torch.nn.functional.cross_entropy(out.logits[0, :-1], labels[0, 1:])
    assert abs(float(out.loss) - float(manual)) < 1e-5


# ---- generate() arguments ----------------------------------------------------------------------------


def test_generate_maps_sampling_onto_native(mixtral, zoo: dict[str, Path]) -> None:
    from colibri_backend.adapters.sampling import SamplingParams

    prompt = prompt_ids(zoo["mixtral"], 8, seed=2)
    x = torch.tensor([prompt])
    # top_k=1 sampling is greedy whatever the temperature.
    greedy = mixtral.generate(x, do_sample=False, max_new_tokens=12)
    topk1 = mixtral.generate(x, do_sample=True, top_k=1, temperature=0.7, max_new_tokens=12)
    assert greedy.tolist() == topk1.tolist()
    # Seeded through torch's generator, as transformers users expect (set_seed / manual_seed).
    torch.manual_seed(123)
    a = mixtral.generate(x, do_sample=True, temperature=1.3, top_p=0.95, top_k=0, max_new_tokens=16)
    torch.manual_seed(123)
    b = mixtral.generate(x, do_sample=True, temperature=1.3, top_p=0.95, top_k=0, max_new_tokens=16)
    assert a.tolist() == b.tolist()
    # repetition_penalty reaches the native sampler: same tokens as the engine's own generation.
    rep = mixtral.generate(x, do_sample=False, repetition_penalty=1.5, max_new_tokens=12)
    sp = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    events = mixtral.engine.generate_tokens(prompt, max_tokens=12, sampling=sp, stop=None, logprobs=None)
    native = [e.token_id for e in events]
    assert rep[0, len(prompt) :].tolist()[: len(native)] == native


def test_generate_num_return_sequences_and_dict_output(mixtral, zoo: dict[str, Path]) -> None:
    x = torch.tensor([prompt_ids(zoo["mixtral"], 8, seed=4)])
    torch.manual_seed(0)
    out = mixtral.generate(
        x,
        do_sample=True,
        temperature=1.5,
        max_new_tokens=10,
        num_return_sequences=3,
        return_dict_in_generate=True,
    )
    seqs = out.sequences
    assert seqs.shape[0] == 3 and seqs.shape[1] <= 8 + 10
    assert len({tuple(s.tolist()) for s in seqs}) > 1  # different seeds per sequence


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_beams": 2},
        {"output_scores": True},
        {"no_repeat_ngram_size": 2},
        {"min_new_tokens": 3},
        {"not_an_option": 1},
    ],
)
def test_generate_refuses_what_it_cannot_do(mixtral, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        mixtral.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, **kwargs)


def test_generate_refuses_right_padding(mixtral) -> None:
    with pytest.raises(ValueError, match="left"):
        mixtral.generate(
            torch.tensor([[5, 6, 7], [5, 6, 0]]),
            attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
            max_new_tokens=3,
        )


# ---- pipeline -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_dir(mixtral, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("colibri_saved")
    mixtral.save_pretrained(out, copy_gguf=True)
    return out


def test_save_pretrained_round_trip(saved_dir: Path) -> None:
    cfg = json.loads((saved_dir / "config.json").read_text())
    assert cfg["model_type"] == "colibri" and cfg["gguf_path"] == "model.gguf"
    assert (saved_dir / "model.gguf").is_file() and (saved_dir / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(saved_dir, threads=2)
    try:
        assert isinstance(model, ColibriForCausalLM) and model.config.arch == "mixtral"
    finally:
        model.close()


def test_pipeline_prompt_chat_batch_and_stream(saved_dir: Path, zoo: dict[str, Path]) -> None:
    pipe = pipeline("text-generation", model=str(saved_dir))
    assert isinstance(pipe.model, ColibriForCausalLM)
    engine = pipe.model.engine
    tok = pipe.tokenizer

    # plain prompt: the continuation is the engine's own greedy continuation
    text = "def parse(self, value):"
    out = pipe(text, max_new_tokens=16, do_sample=False, return_full_text=False)[0]["generated_text"]
    native = engine.generate(tok(text)["input_ids"], max_tokens=16)
    assert out == native

    # chat messages go through the chat template
    messages = [{"role": "user", "content": "return the sum"}]
    chat = pipe(messages, max_new_tokens=8, do_sample=False)[0]["generated_text"]
    assert chat[0] == messages[0] and chat[-1]["role"] == "assistant"
    assert chat[-1]["content"] == engine.chat(messages, max_tokens=8)

    # a batch (left padding, different lengths) gives each prompt's unbatched result
    prompts = ["import os", "class Parser(object):\n    def __init__(self):", "x ="]
    batched = pipe(prompts, max_new_tokens=10, do_sample=False, batch_size=3, return_full_text=False)
    single = [pipe(p, max_new_tokens=10, do_sample=False, return_full_text=False) for p in prompts]
    assert [b[0]["generated_text"] for b in batched] == [s[0]["generated_text"] for s in single]

    # streaming with TextIteratorStreamer yields the same text
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    worker = threading.Thread(
        target=pipe, args=(text,), kwargs={"max_new_tokens": 16, "do_sample": False, "streamer": streamer}
    )
    worker.start()
    pieces = list(streamer)
    worker.join(timeout=120)
    assert len(pieces) > 1 and "".join(pieces) == out


def test_from_pretrained_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ColibriForCausalLM.from_pretrained(tmp_path / "missing.gguf")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "colibri", "gguf_path": "nope.gguf"}))
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        ColibriForCausalLM.from_pretrained(tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(colibri_backend.ColibriError):
        ColibriForCausalLM.from_pretrained(bad)
