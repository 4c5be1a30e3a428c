"""Plugin system (pluggy hooks + entry points), the backend registry, `colibri backends`, and the
shared generation helpers every step-wise backend uses (sampling, stop strings, UTF-8 safety)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib.metadata import entry_points

import numpy as np
import pytest
from smollm2 import smollm2_path

from colibri_backend import cli
from colibri_backend.adapters.sampling import SamplingParams
from colibri_backend.backends import BaseModel, Capabilities, LoadedModel, StepModel
from colibri_backend.config import ModelConfig
from colibri_backend.errors import ContextFullError
from colibri_backend.generation import IncrementalDecoder, StopMatcher, bytes_decoder, sample_token
from colibri_backend.hookspecs import hookimpl
from colibri_backend.registry import (
    BackendUnavailableError,
    Registry,
    UnknownBackendError,
    get_registry,
    make_plugin_manager,
)

BUILTIN = {"colibri", "llama_cpp", "transformers"}

# ------------------------------------------------------------------ a scripted test backend

# Byte pieces; 4 + 5 together are "é" (C3 A9), split across two tokens like byte-level BPE does.
PIECES = [b"", b"Hello", b" world", b"!", b"\xc3", b"\xa9", b" END", b" more", b"\n"]
EOS = 0


class ScriptedModel(StepModel):
    """Puts all probability mass on the next token of a fixed script (then EOS)."""

    backend = "scripted"

    def __init__(self, cfg: ModelConfig, script: Sequence[int]) -> None:
        super().__init__()
        self.name = cfg.alias
        self.context_length = cfg.context_length or 64
        self.capabilities = Capabilities(logits=False, logprobs=True, chat=True)
        self.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
        self.eos_token_ids = frozenset({EOS})
        self.script = list(script)
        self.step = 0

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * max(1, len(text.split()))

    def detokenize(self, ids: Sequence[int]) -> str:
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return PIECES[token_id].decode("utf-8", errors="replace")

    def _new_decoder(self, prompt_ids: list[int]) -> IncrementalDecoder:
        return IncrementalDecoder(bytes_decoder(lambda t: PIECES[t]))

    def _logits(self) -> np.ndarray:
        x = np.full(len(PIECES), -10.0, dtype=np.float32)
        x[self.script[self.step] if self.step < len(self.script) else EOS] = 10.0
        return x

    def _prefill(self, prompt_ids: list[int]) -> np.ndarray:
        self.step = 0
        return self._logits()

    def _decode(self, token_id: int) -> np.ndarray:
        self.step += 1
        return self._logits()


class ScriptedBackend:
    name = "scripted"
    description = "test backend"

    def __init__(self, script: Sequence[int] = (1, 2, 3)) -> None:
        self.script = script

    def unavailable_reason(self) -> str | None:
        return None

    def load(self, model: ModelConfig) -> ScriptedModel:
        return ScriptedModel(model, self.script)


class MissingPackageBackend:
    name = "needs_pkg"
    description = "a backend whose package is absent"

    def unavailable_reason(self) -> str | None:
        return "Python package 'nonexistent_pkg' is not installed"

    def load(self, model: ModelConfig) -> LoadedModel:
        raise AssertionError("must not be called")


class ThirdPartyPlugin:
    @hookimpl
    def colibri_register_backends(self, register):
        register(ScriptedBackend())
        register(MissingPackageBackend())


class BrokenPlugin:
    @hookimpl
    def colibri_register_backends(self, register):
        register(object())  # not a backend
        raise RuntimeError("boom")


class DuplicatePlugin:
    @hookimpl
    def colibri_register_backends(self, register):
        register(ScriptedBackend())


def registry_with(*plugins: object, entry_points_too: bool = False) -> Registry:
    pm, problems = make_plugin_manager(load_entry_points=entry_points_too)
    for i, p in enumerate(plugins):
        pm.register(p, name=f"test{i}")
    return Registry(pm, problems)


# ------------------------------------------------------------------ registry


def test_builtin_backends_come_through_entry_points() -> None:
    declared = {ep.name: ep.value for ep in entry_points(group="colibri")}
    assert BUILTIN <= set(declared)
    assert declared["colibri"] == "colibri_backend.plugins.colibri_native"
    reg = get_registry(refresh=True)
    assert BUILTIN <= set(reg.names())
    for name in BUILTIN:
        entry = reg.get(name)
        assert entry.plugin == name  # registered by the plugin loaded from that entry point
        reason = entry.unavailable_reason()
        assert reason is None or isinstance(reason, str) and reason
    assert not [p for p in reg.problems if p.plugin in BUILTIN]


def test_third_party_plugin_registers_like_builtins() -> None:
    reg = registry_with(ThirdPartyPlugin(), entry_points_too=True)
    assert {"scripted", "needs_pkg"} | BUILTIN <= set(reg.names())
    assert reg.get("scripted").plugin == "test0"
    model = reg.load_model(ModelConfig(alias="s", path="unused", backend="scripted"))
    assert isinstance(model, LoadedModel)
    assert model.generate("hi", max_tokens=10) == "Hello world!"


def test_unknown_and_unavailable_backends() -> None:
    reg = registry_with(ThirdPartyPlugin())
    with pytest.raises(UnknownBackendError, match="unknown backend 'nope' .*registered: needs_pkg, scripted"):
        reg.get("nope")
    with pytest.raises(BackendUnavailableError, match="needs_pkg.*nonexistent_pkg"):
        reg.load_model(ModelConfig(alias="x", path="unused", backend="needs_pkg"))


def test_a_broken_plugin_does_not_hide_the_others() -> None:
    # pluggy calls the last registered plugin first; the first registration of a name wins.
    reg = registry_with(BrokenPlugin(), DuplicatePlugin(), ThirdPartyPlugin())
    assert "scripted" in reg.names() and reg.get("scripted").plugin == "test2"
    assert "needs_pkg" in reg.names()
    msgs = [(p.plugin, p.message) for p in reg.problems]
    assert any(pl == "test0" and "lacks" in m for pl, m in msgs)
    assert any(pl == "test0" and "RuntimeError: boom" in m for pl, m in msgs)
    assert any(pl == "test1" and "already registered by plugin 'test2'" in m for pl, m in msgs)
    assert len(msgs) == 3


class FirstPlugin:
    """tryfirst: its registration of 'scripted' wins over a plugin registered after it."""

    @hookimpl(tryfirst=True)
    def colibri_register_backends(self, register):
        register(ScriptedBackend(script=(2,)))


class WrapperPlugin:
    """A hook wrapper around every other implementation: sees how many registered before it."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    @hookimpl(wrapper=True)
    def colibri_register_backends(self, register):
        result = yield
        self.seen.append("after")
        backend = ScriptedBackend()
        backend.name = "wrapped"
        register(backend)
        return result


def test_hooks_go_through_pluggy_so_ordering_and_wrappers_work() -> None:
    wrapper = WrapperPlugin()
    reg = registry_with(FirstPlugin(), ThirdPartyPlugin(), wrapper)
    assert reg.get("scripted").plugin == "test0"  # tryfirst beat the later-registered plugin
    assert any(p.plugin == "test1" and "already registered" in p.message for p in reg.problems)
    assert wrapper.seen == ["after"] and reg.get("wrapped").plugin == "test2"


def test_entry_point_that_fails_to_import_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import EntryPoint

    import colibri_backend.registry as registry

    bad = EntryPoint(name="ghost", value="colibri_no_such_module_xyz", group="colibri")
    real = registry.entry_points
    monkeypatch.setattr(registry, "entry_points", lambda group: [*real(group=group), bad])
    pm, problems = make_plugin_manager()
    reg = Registry(pm, problems)
    assert BUILTIN <= set(reg.names())
    assert any(
        p.plugin == "ghost" and "cannot import colibri_no_such_module_xyz" in p.message for p in reg.problems
    )


def test_colibri_backends_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["backends", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in data["backends"]}
    assert BUILTIN <= set(rows)
    for r in rows.values():
        assert r["available"] == (r["reason"] is None)
    assert cli.main(["backends"]) == 0
    text = capsys.readouterr().out
    for name in BUILTIN:
        assert name in text
        assert ("available" in text) or ("unavailable:" in text)


def test_missing_package_reason_names_the_package() -> None:
    from colibri_backend.backends import missing_module_reason

    assert missing_module_reason("json") is None
    reason = missing_module_reason("colibri_surely_missing_pkg", extra="llama-cpp")
    assert "colibri_surely_missing_pkg" in reason and "colibri-backend[llama-cpp]" in reason


# ------------------------------------------------------------------ shared generation helpers


def scripted(script: Sequence[int], **kw) -> ScriptedModel:
    return ScriptedModel(ModelConfig(alias="s", path="unused", backend="scripted", **kw), script)


def test_generation_events_finish_reasons_and_utf8() -> None:
    m = scripted([1, 4, 5, 3])  # "Hello" "\xc3" "\xa9" "!" then EOS
    evs = list(m.generate_tokens([1], max_tokens=10, sampling=SamplingParams()))
    assert [e.token_id for e in evs] == [1, 4, 5, 3, EOS]
    assert [e.text for e in evs] == ["Hello", "", "é", "!", ""]  # half a character is held back
    assert evs[-1].finish_reason == "stop" and all(e.finish_reason is None for e in evs[:-1])
    evs = list(m.generate_tokens([1], max_tokens=2))
    assert [e.text for e in evs] == ["Hello", "\ufffd"]  # cut inside a character: flushed as U+FFFD
    assert evs[-1].finish_reason == "length"


def test_stop_strings_never_leak() -> None:
    m = scripted([1, 2, 6, 7])  # "Hello world END more"
    assert m.generate("x", max_tokens=10, stop=[" END"]) == "Hello world"
    assert m.generate("x", max_tokens=10, stop=["ld E"]) == "Hello wor"
    evs = list(m.generate_tokens([1], max_tokens=10, stop=[" END"]))
    assert evs[-1].finish_reason == "stop" and evs[-1].token_id == 6
    assert "".join(e.text for e in evs) == "Hello world"
    # a stop string that only starts to match is released when the match fails
    assert m.generate("x", max_tokens=10, stop=[" ENDING"]) == "Hello world END more"


def test_logprobs_and_chat() -> None:
    m = scripted([1, 2])
    evs = list(m.generate_tokens([1], max_tokens=5, logprobs=2))
    assert evs[0].logprob == pytest.approx(np.log(1 / (1 + 8 * np.exp(-20.0))), abs=1e-6)
    top = evs[0].top_logprobs
    assert len(top) == 2 and next(iter(top)) == "Hello" and top["Hello"] == pytest.approx(evs[0].logprob)
    assert m.render_chat([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"
    assert m.chat([{"role": "user", "content": "hi"}], max_tokens=5) == "Hello world"


def test_context_limits() -> None:
    m = scripted([1, 2, 3, 7, 7, 7, 7], context_length=4)
    with pytest.raises(ContextFullError):
        list(m.generate_tokens([1, 1, 1, 1, 1], max_tokens=3))
    # The token sampled when the cache is full needs no slot: a full-context prompt still gets one,
    # and two prompt tokens in a context of four leave room for three.
    evs = list(m.generate_tokens([1, 1, 1, 1], max_tokens=3))
    assert len(evs) == 1 and evs[-1].finish_reason == "length"
    evs = list(m.generate_tokens([1, 1], max_tokens=100))
    assert len(evs) == 3 and evs[-1].finish_reason == "length"


def test_max_tokens_zero_prefills_only_and_bad_values_are_refused() -> None:
    """The rule every backend shares (colibri_backend.generation): 0 runs the prefill, yields nothing."""
    m = scripted([1, 2])
    m.step = 5
    assert list(m.generate_tokens([1, 1], max_tokens=0)) == []
    assert m.step == 0 and m.stats()["prompt_tokens"] == 2 and m.stats()["generated_tokens"] == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_tokens"):
            m.generate_tokens([1], max_tokens=bad)
    with pytest.raises(ValueError, match="empty"):
        m.generate_tokens([], max_tokens=1)


def test_stop_matcher_holds_partial_matches() -> None:
    sm = StopMatcher(["</s>", "###"])
    assert sm.feed("abc<") == ("abc", False)
    assert sm.feed("/") == ("", False)
    assert sm.feed("x") == ("</x", False)
    assert sm.feed("#") == ("", False)
    assert sm.feed("## tail") == ("", True)


def test_sampler_greedy_penalties_and_seed() -> None:
    logits = np.array([1.0, 3.0, 2.0, 0.5])
    rng = np.random.default_rng(0)
    assert sample_token(logits, SamplingParams(), [], rng) == 1
    assert sample_token(logits, SamplingParams(logit_bias={3: 10.0}), [], rng) == 3
    assert sample_token(logits, SamplingParams(logit_bias={1: float("-inf")}), [], rng) == 2
    # repetition penalty 4 turns 3.0 into 0.75 for the seen token 1
    assert sample_token(logits, SamplingParams(repetition_penalty=4.0), [1], rng) == 2
    assert sample_token(logits, SamplingParams(presence_penalty=1.5), [1], rng) == 2
    assert sample_token(logits, SamplingParams(frequency_penalty=0.6), [1, 1], rng) == 2
    assert sample_token(logits, SamplingParams(frequency_penalty=0.6, penalty_last_n=1), [1, 0], rng) == 1
    sp = SamplingParams(temperature=1.0, seed=5)
    draws = [sample_token(logits, sp, [], np.random.default_rng(sp.effective_seed())) for _ in range(3)]
    assert len(set(draws)) == 1  # same seed, same draw
    many = {sample_token(logits, SamplingParams(temperature=1.0), [], rng) for _ in range(200)}
    assert many == {0, 1, 2, 3}

    def support(**kw) -> set[int]:
        return {sample_token(logits, SamplingParams(temperature=1.0, **kw), [], rng) for _ in range(200)}

    assert support(top_k=2) == {1, 2}
    assert support(top_p=0.5) == {1}  # p(1) = 0.63 alone covers 0.5
    assert support(min_p=0.3) == {1, 2}  # p(2)/p(1) = 0.37, p(0)/p(1) = 0.14


def test_base_model_default_capabilities() -> None:
    class Minimal(BaseModel):
        name, backend, context_length, capabilities = "m", "minimal", 8, Capabilities()

        def tokenize(self, text, add_special_tokens=True):
            return [0]

        def detokenize(self, ids):
            return ""

        def generate_tokens(self, prompt_ids, *, max_tokens, sampling=None, stop=None, logprobs=None):
            return iter(())

    m = Minimal()
    from colibri_backend.backends import CapabilityError

    with pytest.raises(CapabilityError, match="does not provide logits"):
        m.logits([0])
    with pytest.raises(CapabilityError, match="no chat template"):
        m.chat([{"role": "user", "content": "x"}])
    assert m.stats() == {}


# ------------------------------------------------------------------ the transformers backend


@pytest.fixture(scope="module")
def tiny_hf_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A random 2-layer llama checkpoint with a small byte-level BPE tokenizer and a chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny_hf")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world! héllo wörld 🙂",
        "def f(x): return x",
    ]
    tok.train_from_iterator(
        corpus * 20,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    return out, model, fast


def test_transformers_backend_matches_transformers(tiny_hf_checkpoint) -> None:
    import torch

    path, hf_model, hf_tok = tiny_hf_checkpoint
    reg = get_registry()
    assert reg.get("transformers").unavailable_reason() is None
    m = reg.load_model(ModelConfig(alias="tiny", path=str(path), backend="transformers", threads=2))
    try:
        assert m.context_length == 128 and m.capabilities.logits and m.capabilities.chat
        ids = m.tokenize("The quick brown fox")
        assert ids == hf_tok.encode("The quick brown fox")
        with torch.inference_mode():
            ref = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=12,
                eos_token_id=2,
                pad_token_id=2,
            )
        expected = ref[0, len(ids) :].tolist()
        events = list(m.generate_tokens(ids, max_tokens=12))
        assert [e.token_id for e in events] == expected
        text = "".join(e.text for e in events)
        assert text == hf_tok.decode([t for t in expected if t != 2], skip_special_tokens=True)
        with torch.inference_mode():
            want = hf_model(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(m.logits(ids), want, rtol=1e-5, atol=1e-5)
        rendered = m.render_chat([{"role": "user", "content": "hi"}])
        assert rendered == hf_tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        seeded = [m.generate("Hello", max_tokens=8, temperature=1.0, seed=3) for _ in range(2)]
        assert seeded[0] == seeded[1]
        assert m.stats()["generated_tokens"] > 0
    finally:
        m.close()


def test_memory_budget_warns_when_the_backend_cannot_honour_it() -> None:
    reg = registry_with(ThirdPartyPlugin())
    with pytest.warns(RuntimeWarning, match="does not support memory_budget"):
        reg.load_model(ModelConfig(alias="s", path="unused", backend="scripted", memory_budget=1 << 30))


# ------------------------------------------------------------------ colibri vs llama_cpp on SmolLM2


CHATS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
]


@pytest.fixture(scope="module")
def smol_pair():
    reg = get_registry()
    models = {}
    for backend in ("colibri", "llama_cpp"):
        cfg = ModelConfig(
            alias="smol", path=str(smollm2_path()), backend=backend, threads=2, context_length=512
        )
        models[backend] = reg.load_model(cfg)
    yield models
    for m in models.values():
        m.close()


def test_llama_cpp_backend_reuses_its_cache_correctly(smol_pair) -> None:
    m = smol_pair["llama_cpp"]
    m._prefix_cache = True  # the opt-in path (options.prefix_cache); greedy tokens must not change
    first = m.tokenize("The history of France is")
    longer = m.tokenize("The history of France is long and")
    ref_longer = [e.token_id for e in m.generate_tokens(longer, max_tokens=6)]  # from a cold cache
    list(m.generate_tokens(first, max_tokens=6))  # leaves a shared prefix in the cache
    assert [e.token_id for e in m.generate_tokens(longer, max_tokens=6)] == ref_longer
    logits = m.logits(longer)
    assert logits.shape == (len(longer), m.n_vocab)
    assert int(np.argmax(logits[-1])) == ref_longer[0]


def test_colibri_and_llama_cpp_agree_on_greedy_chat(smol_pair) -> None:
    """Same GGUF, same template, greedy: the same tokens, or a first divergence at a near-tie that
    both engines see (the same two candidates on top, less than half a logit apart in each): the two
    engines round differently (llama.cpp quantizes activations to 8 bits for Q4_1 products)."""
    col, lla = smol_pair["colibri"], smol_pair["llama_cpp"]
    for q in CHATS:
        msgs = [{"role": "user", "content": q}]
        assert col.render_chat(msgs) == lla.render_chat(msgs)
        prompt = col.tokenize(col.render_chat(msgs), add_special_tokens=False)
        assert prompt == lla.tokenize(lla.render_chat(msgs), add_special_tokens=False)
        a = [e.token_id for e in col.generate_tokens(prompt, max_tokens=24)]
        b = [e.token_id for e in lla.generate_tokens(prompt, max_tokens=24)]
        if a == b:
            continue
        k = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
        ctx = prompt + a[:k]
        for row in (col.logits(ctx)[-1], lla.logits(ctx)[-1]):
            top2 = [int(t) for t in np.argsort(-row)[:2]]
            assert sorted(top2) == sorted([a[k], b[k]]), f"{q!r}: token {k}: not a two-way tie ({top2})"
            margin = float(row[top2[0]] - row[top2[1]])
            assert margin < 0.5, f"{q!r}: token {k}: margin {margin:.3f}"
