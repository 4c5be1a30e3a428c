"""Tokenizer conformance: the tokenizer Colibri builds from GGUF metadata gives the reference's ids.

(a) SmolLM2's GGUF: our tokenizer against llama.cpp's tokenizer on the very same file.
(b) Byte-level BPE tokenizers trained here with `tokenizers` (three pre-tokenizer styles), written
    into GGUF metadata with gguf.GGUFWriter: our GGUF-built tokenizer against the HF tokenizer.
(c) A SentencePiece-style vocabulary (tokens + scores + byte tokens, tokenizer.ggml.model "llama",
    as Mixtral's GGUFs carry) trained here: our tokenizer against llama.cpp on the same file.
Each runs over the same corpus of more than 200 varied strings.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from colibri_backend.adapters.gguf_metadata import read_metadata
from colibri_backend.adapters.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, Tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus() -> list[str]:
    """More than 200 strings: prose, code, unicode scripts, emoji, whitespace runs, numbers,
    special tokens, contractions, edge cases (empty, lone spaces, lone combining marks)."""
    base = [
        "",
        " ",
        "  ",
        "\n",
        "\t",
        "\n\n\n",
        " \n ",
        "Hello world",
        "Hello, world!",
        " Hello world",
        "hello   world",
        "The quick brown fox jumps over the lazy dog.",
        "I'm sure you'll see they've done it, we'd say it's fine.",
        "I'M SURE YOU'LL SEE THEY'VE DONE IT",
        "don't won't can't shan't",
        "1234567890",
        "3.14159265358979",
        "1,000,000 and 2.5e-10",
        "Phone: +1 (555) 123-4567",
        "2024-01-31T12:34:56Z",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
        "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
        '#include <stdio.h>\nint main(void) { printf("%d\\n", 42); return 0; }',
        "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
        "const f = async (x) => { await g(x?.y ?? 0); };",
        '<div class="a">text &amp; more</div>',
        '{"key": [1, 2, {"nested": null}], "b": true}',
        "x = [i**2 for i in range(10) if i % 2 == 0]",
        "    indented with four spaces",
        "\tindented with a tab",
        "trailing spaces   ",
        "mixed \t whitespace \n\n  runs\t\t\t",
        "a\r\nb\r\n",
        "Ünïcödé façade naïve café résumé",
        "Straße Größe Übermaß",
        "Привет, как дела? Всё хорошо.",
        "Γειά σου Κόσμε",
        "שלום עולם",
        "مرحبا بالعالم",
        "नमस्ते दुनिया",
        "こんにちは世界、元気ですか？",
        "你好，世界！我们今天学习分词。",
        "안녕하세요 세계",
        "ไทย ภาษา",
        "Tiếng Việt có dấu",
        "😀😃😄😁",
        "👍🏽 thumbs up with skin tone",
        "👨‍👩‍👧‍👦 family",
        "🇫🇷🇩🇪🇯🇵 flags",
        "emoji at end 🎉",
        "∑_{i=1}^{n} i = n(n+1)/2 ∀ n ∈ ℕ",
        "→ ← ↑ ↓ ⇒ ⇔",
        "e\u0301 combining acute",
        "\u0301",
        "zero\u200bwidth\u200bspace",
        "non\u00a0breaking\u00a0space",
        "full\u3000width\u3000space",
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|>",
        "text<|endoftext|>more text",
        "<|im_start|><|im_end|>",
        "<|im_start|>system\nYou are helpful.<|im_end|>",
        "not a <|special|> token",
        "<|im_start",
        "im_end|>",
        "''''''",
        "\"quoted\" 'single'",
        "!!!???...,,,;;;",
        "---===+++***",
        "a-b_c.d/e\\f",
        "https://example.com/path?query=1&x=y#frag",
        "user@example.com",
        "CamelCaseIdentifierName snake_case_name kebab-case-name",
        "ALLCAPS lowercase MiXeD",
        "$100 €50 £20 ¥1000",
        "100% of 50°C",
        "tab\tseparated\tvalues\t1\t2",
        "line1\nline2\nline3",
        "   leading spaces",
        "word" * 20,
        "a " * 50,
        "😀" * 10,
        "\n" * 10,
        " " * 17,
        "0" * 25,
        "123 456 7890 12 3",
        "x1 y22 z333 w4444",
        "version 3.11.7 and v2.0.0-rc1",
        "'s 't 're 've 'm 'll 'd",
        " 's",
        "it's",
        "IT'S",
    ]
    words = ["alpha", "Beta", "GAMMA", "délta", "ε", "42", "3.5", "🙂", "über", "日本", "x_y", "--", "'ll"]
    seps = [" ", "  ", "\t", "\n", " \n", "", ", ", ". "]
    generated = []
    for i in range(120):
        parts = [words[(i * 7 + j * 3) % len(words)] for j in range(1 + i % 6)]
        sep = seps[i % len(seps)]
        s = sep.join(parts)
        if i % 5 == 0:
            s = " " + s
        if i % 9 == 0:
            s = s + "  "
        if i % 11 == 0:
            s = SPECIALS[i % len(SPECIALS)] + s
        generated.append(s)
    strings = base + generated
    assert len(strings) >= 200
    return strings


CORPUS = corpus()


def _assert_encodes_as(ours: Tokenizer, expected: Callable[[str], list[int]]) -> None:
    """`ours` encodes every CORPUS string (no special tokens added) to the ids `expected` gives for it."""
    mismatches = []
    for s in CORPUS:
        want = expected(s)
        got = ours.encode(s, add_special_tokens=False)
        if got != want:
            mismatches.append((s, want, got))
    assert not mismatches, f"{len(mismatches)} of {len(CORPUS)} differ; first: {mismatches[0]!r}"


# ---------------------------------------------------------------------------------------------
# (a) SmolLM2 GGUF vs llama.cpp on the same file


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    import tiny_models as tm

    return tm.resolve_smollm2()


def test_smollm2_matches_llama_cpp(smollm2_gguf: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the reference here")
    ref = llama_cpp.Llama(model_path=str(smollm2_gguf), vocab_only=True, verbose=False)
    ours = Tokenizer.from_gguf_metadata(read_metadata(smollm2_gguf), source=str(smollm2_gguf))
    _assert_encodes_as(ours, lambda s: ref.tokenize(s.encode("utf-8"), add_bos=False, special=True))


def test_smollm2_roundtrip_and_specials(smollm2_gguf: Path) -> None:
    tok = Tokenizer.from_gguf_metadata(read_metadata(smollm2_gguf))
    for s in CORPUS:
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end is not None and im_end in tok.stop_token_ids
    assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == tok.token_to_id("<|im_start|>")


# ---------------------------------------------------------------------------------------------
# (b) tokenizers-trained BPE -> GGUF metadata -> our tokenizer == the HF tokenizer


def _train(pre: str, digit_runs: bool = False) -> object:
    """A 1200-token BPE trained with the pre-tokenizer `pre` names. digit_runs (deepseek-llm): trained with
    llama.cpp's \\p{N}+ in place of Digits(individual_digits), so that the vocabulary merges digits; it then
    splits as DeepSeek's tokenizer.json does."""
    from tokenizers import Regex, decoders, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    from colibri_backend.adapters.tokenizer import PRE_TOKENIZER_REGEXES

    tok = HFTokenizer(BPE())
    if pre == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:  # the llama-3 style split(s) (DeepSeek-V3: three), written out as its tokenizer.json does
        regexes = PRE_TOKENIZER_REGEXES[pre]
        # DeepSeek-LLM's and DeepSeek-Coder's tokenizer.json end their splits with Digits(individual_digits)
        digits = pre in ("deepseek-llm", "deepseek-coder")
        splits = [
            pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in regexes[: -1 if digits else None]
        ]
        byte_level = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        spec = pre_tokenizers.Sequence(
            splits + ([pre_tokenizers.Digits(individual_digits=True)] if digits else []) + byte_level
        )
        runs = [pre_tokenizers.Split(Regex(r"\p{N}+"), behavior="isolated")]
        tok.pre_tokenizer = pre_tokenizers.Sequence(splits + runs + byte_level) if digit_runs else spec
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        min_frequency=1,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    training = list(CORPUS) * 3
    for path in sorted((Path(__file__).resolve().parent.parent / "colibri_backend").glob("*.py")):
        training.append(path.read_text(encoding="utf-8"))
    tok.train_from_iterator(training, trainer=trainer)
    if digit_runs:
        tok.pre_tokenizer = spec
    return tok


def _write_gguf(hf: object, pre: str | None, path: Path) -> None:
    """The trained tokenizer as a GGUF vocabulary; pre None leaves tokenizer.ggml.pre out."""
    import gguf
    import numpy as np

    spec = json.loads(hf.to_str())  # type: ignore[attr-defined]
    vocab = hf.get_vocab(with_added_tokens=True)  # type: ignore[attr-defined]
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id)))
    tokens = [t for t, _ in by_id]
    types = [TOKEN_CONTROL if t in SPECIALS else TOKEN_NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


TRAINED_PRES = [
    "gpt-2",
    "smollm",
    "llama-bpe",
    "gpt-4o",
    "deepseek-v3",
    "deepseek-llm",
    "deepseek-coder",
    "falcon",
    "default",
]


@pytest.mark.parametrize("pre", TRAINED_PRES)
def test_trained_bpe_via_gguf_matches_hf(pre: str, tmp_path: Path) -> None:
    hf = _train(pre)
    path = tmp_path / f"bpe-{pre}.gguf"
    _write_gguf(hf, pre, path)
    ours = Tokenizer.from_gguf_metadata(read_metadata(path), source=str(path))
    assert ours.vocab_size == hf.get_vocab_size(with_added_tokens=True)  # type: ignore[attr-defined]
    _assert_encodes_as(ours, lambda s: hf.encode(s, add_special_tokens=False).ids)  # type: ignore[attr-defined]
    for s in CORPUS:
        assert ours.decode(ours.encode(s, add_special_tokens=False)) == s
    # the C tokenizer of colibri-run on the same file
    import c_tokenizer as ct

    want = [hf.encode(t, add_special_tokens=False).ids for t in CORPUS]  # type: ignore[attr-defined]
    got = [ids for ids, _ in ct.c_tokenize(path, list(CORPUS))]
    bad = [(t, w, g) for t, w, g in zip(CORPUS, want, got, strict=True) if w != g]
    print(f"\n[conformance] trained {pre} BPE, C tokenizer: {len(CORPUS) - len(bad)} of {len(CORPUS)} as HF")
    assert not bad, f"C tokenizer: {len(bad)} of {len(CORPUS)} differ; first: {bad[0]!r}"


@pytest.mark.parametrize(
    "pre", ["gpt-4o", "deepseek-v3", "deepseek-llm", "deepseek-coder", "falcon", "default", None]
)
def test_o200k_bpe_via_gguf_matches_llama_cpp(pre: str | None, tmp_path: Path) -> None:
    """gpt-oss's pre-tokenizer ("gpt-4o", o200k), DeepSeek's, Falcon's and llama.cpp's "default", which it
    also takes for a file without tokenizer.ggml.pre (None): Colibri's GGUF-built tokenizers (Python and C)
    against llama.cpp's own implementation of it on the same file (a BPE trained here with that split, >= 200
    strings)."""
    import c_tokenizer as ct
    import tiny_models as tm

    if tm.reference_engine("llama_cpp") is None:  # a failure instead under CI=true
        pytest.skip("llama-cpp-python is not installed")
    path = tmp_path / f"bpe-{pre or 'no-pre'}.gguf"
    _write_gguf(_train(pre or "default"), pre, path)
    ours = Tokenizer.from_gguf_metadata(read_metadata(path), source=str(path))
    theirs = tm.llama_cpp_tokenize(path, list(CORPUS))
    c_ids = [ids for ids, _ in ct.c_tokenize(path, list(CORPUS))]
    c_bad = [(s, t, c) for s, t, c in zip(CORPUS, theirs, c_ids, strict=True) if c != t]
    assert not c_bad, f"C tokenizer: {len(c_bad)} of {len(CORPUS)} differ from llama.cpp; first: {c_bad[0]!r}"
    mismatches = [
        (s, t, ours.encode(s, add_special_tokens=False))
        for s, t in zip(CORPUS, theirs, strict=True)
        if ours.encode(s, add_special_tokens=False) != t
    ]
    tm.report(
        f"{pre} BPE: {len(CORPUS) - len(mismatches)} of {len(CORPUS)} strings tokenized as llama.cpp does"
    )
    assert not mismatches, f"{len(mismatches)} of {len(CORPUS)} differ; first: {mismatches[0]!r}"


def test_deepseek_llm_digits_on_a_vocabulary_that_merges_digits(tmp_path: Path) -> None:
    """DeepSeek-LLM / V2's tokenizer.json ends its splits with Digits(individual_digits); llama.cpp has
    \\p{N}+ there. DeepSeek's own vocabulary merges no digits, so both give its ids; on a vocabulary that does
    merge digits (trained here with \\p{N}+) both of Colibri's tokenizers give Hugging Face's ids for the
    tokenizer.json's split, and llama.cpp differs, only on strings with two digits in a row."""
    import re

    import c_tokenizer as ct
    import tiny_models as tm

    hf = _train("deepseek-llm", digit_runs=True)
    path = tmp_path / "bpe-deepseek-llm-digits.gguf"
    _write_gguf(hf, "deepseek-llm", path)
    assert any(t.isdigit() and len(t) > 1 for t in hf.get_vocab())  # type: ignore[attr-defined]
    ours = Tokenizer.from_gguf_metadata(read_metadata(path), source=str(path))
    want = [hf.encode(t, add_special_tokens=False).ids for t in CORPUS]  # type: ignore[attr-defined]
    got = {
        "Python": [ours.encode(t, add_special_tokens=False) for t in CORPUS],
        "C": ct.c_ids(path, list(CORPUS)),
    }
    for name, ids in got.items():
        bad = [(t, w, g) for t, w, g in zip(CORPUS, want, ids, strict=True) if w != g]
        tm.report(f"digit-merging deepseek-llm BPE, {name}: {len(CORPUS) - len(bad)} of {len(CORPUS)} as HF")
        assert not bad, f"{name}: {len(bad)} differ; first {bad[0]!r}"
    if tm.reference_engine("llama_cpp") is None:
        return
    theirs = tm.llama_cpp_tokenize(path, list(CORPUS))
    differ = [t for t, w, g in zip(CORPUS, want, theirs, strict=True) if w != g]
    tm.report(f"  llama.cpp differs on {len(differ)} of {len(CORPUS)}")
    assert differ and all(re.search(r"\d\d", t) for t in differ), differ[:1]


def test_tokenizer_json_beside_gguf_wins(tmp_path: Path) -> None:
    hf = _train("gpt-2")
    path = tmp_path / "m.gguf"
    _write_gguf(hf, "gpt-2", path)
    hf.save(str(tmp_path / "tokenizer.json"))  # type: ignore[attr-defined]
    tok = Tokenizer.from_gguf(path)
    assert tok.source.endswith("tokenizer.json")
    assert tok.eos_token == "<|im_end|>"
    assert (
        tok.encode("Hello <|im_end|>", add_special_tokens=False)
        == hf.encode(  # type: ignore[attr-defined]
            "Hello <|im_end|>", add_special_tokens=False
        ).ids
    )


# ---------------------------------------------------------------------------------------------
# (c) SentencePiece BPE vocabulary ("llama" tokenizer model) vs llama.cpp


def _write_spm_gguf(path: Path) -> None:
    import gguf
    import numpy as np
    from tokenizers import SentencePieceBPETokenizer

    sp = SentencePieceBPETokenizer(unk_token="<unk>", replacement="\u2581", add_prefix_space=True)
    training = list(CORPUS) * 3
    for src in sorted((Path(__file__).resolve().parent.parent / "colibri_backend").glob("*.py")):
        training.append(src.read_text(encoding="utf-8"))
    sp.train_from_iterator(
        training,
        vocab_size=1500,
        min_frequency=1,
        special_tokens=["<unk>", "<s>", "</s>"],
        show_progress=False,
    )
    # llama's layout: <unk> <s> </s>, the 256 byte tokens, then the pieces in merge order (score -rank).
    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = [t for t, _ in sorted(sp.get_vocab().items(), key=lambda kv: kv[1]) if t not in head]
    tokens = head + pieces
    types = [2, TOKEN_CONTROL, TOKEN_CONTROL] + [6] * 256 + [TOKEN_NORMAL] * len(pieces)
    scores = [0.0] * len(head) + [-float(i) for i in range(len(pieces))]
    w = gguf.GGUFWriter(str(path), "llama")
    # Enough hyperparameters for llama.cpp to open the file for its vocabulary.
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    _write_spm_gguf(path)
    return path


def test_spm_vocabulary_roundtrip_and_bos(spm_gguf: Path) -> None:
    tok = Tokenizer.from_gguf_metadata(read_metadata(spm_gguf))
    assert tok.add_bos and tok.encode("Hello")[0] == 1
    for s in CORPUS:
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    # A character the vocabulary lacks falls back to its UTF-8 bytes.
    ids = tok.encode("\u0b95", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids][-3:] == ["<0xE0>", "<0xAE>", "<0x95>"]


def test_spm_vocabulary_matches_llama_cpp(spm_gguf: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is the reference here")
    ref = llama_cpp.Llama(model_path=str(spm_gguf), vocab_only=True, verbose=False)
    ours = Tokenizer.from_gguf_metadata(read_metadata(spm_gguf))
    _assert_encodes_as(ours, lambda s: ref.tokenize(s.encode("utf-8"), add_bos=False, special=True))
