"""Tokenizer adapter, GGUF metadata reader and the stop-string helpers (no native engine needed)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from smollm2 import smollm2_path

from colibri_backend.adapters.gguf_metadata import read_metadata
from colibri_backend.adapters.tokenizer import Tokenizer
from colibri_backend.errors import ModelFormatError, UnsupportedModelError
from colibri_backend.generation import StopMatcher


@pytest.fixture(scope="module")
def meta() -> dict:
    return read_metadata(smollm2_path())


@pytest.fixture(scope="module")
def tok(meta: dict) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(meta)


def test_metadata_equals_gguf_reader(meta: dict) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(smollm2_path()))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") and key not in ("GGUF.version", "GGUF.tensor_count"):
            continue
        expected = field.contents()
        got = meta[key]
        if isinstance(got, np.ndarray):
            assert got.tolist() == list(expected), key
        elif isinstance(expected, float):
            assert got == pytest.approx(expected), key
        else:
            assert got == expected, key


def _gguf_header(n_kv: int, body: bytes = b"", version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, 0, n_kv) + body


def _kv_string(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", 8) + struct.pack("<Q", len(v)) + v


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"GGUF",
        b"GGML" + b"\0" * 30,
        _gguf_header(0, version=7),
        _gguf_header(1),  # promises a key/value that is not there
        _gguf_header(1, _kv_string("general.name", "x")[:-1]),  # string runs past the end
        _gguf_header(1, struct.pack("<Q", 1) + b"k" + struct.pack("<I", 99)),  # unknown value type
        _gguf_header(1, struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 4, 1 << 40)),  # huge array
        _gguf_header(1 << 40),
    ],
)
def test_metadata_reader_rejects_bad_files(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelFormatError):
        read_metadata(path)


def test_metadata_reader_small_file(tmp_path: Path) -> None:
    path = tmp_path / "ok.gguf"
    path.write_bytes(_gguf_header(1, _kv_string("general.name", "tiny")))
    assert read_metadata(path)["general.name"] == "tiny"


def test_special_tokens_and_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.eos_token == "<|im_end|>"
    # <|endoftext|>, <|im_end|> and, as llama.cpp stops there too, the FIM repository token <reponame>
    assert tok.stop_token_ids == {0, 2, 4}
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert tok.decode([1, 4093, 198, 6004, 2], skip_special_tokens=True) == "user\nhi"
    assert not tok.add_bos  # SmolLM2's GGUF says add_bos_token = false


def test_roundtrip(tok: Tokenizer) -> None:
    for s in ["", " ", "x  y\t\n", "héllo 😀 日本語", "def f(x):\n    return x ** 2\n", "1234567"]:
        assert tok.decode(tok.encode(s)) == s
    assert tok.encode("12345") == [33, 34, 35, 36, 37]  # smollm pre-tokenizer splits every digit


def test_incremental_decoder_never_splits_characters(tok: Tokenizer) -> None:
    text = "Grüße 😀👍🏽 日本語 — done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # some characters span several tokens
    dec = tok.incremental_decoder()
    pieces = [dec.add(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces[:-1]


def test_incremental_decoder_flushes_invalid_bytes(tok: Tokenizer) -> None:
    # The byte-level token for a lone UTF-8 lead byte (0xE6): never completed.
    lead = tok.token_to_id("æ")
    assert lead is not None
    dec = tok.incremental_decoder()
    assert dec.add(lead) == ""
    assert dec.flush() == "\ufffd"
    # After a run of invalid bytes the decoder stops waiting and moves on.
    dec = tok.incremental_decoder()
    out = "".join(dec.add(lead) for _ in range(10)) + dec.flush()
    assert out == "\ufffd" * 10


def test_unsupported_tokenizer_model(meta: dict) -> None:
    with pytest.raises(UnsupportedModelError, match="not supported"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.model": "rwkv"})
    with pytest.raises(UnsupportedModelError, match="unknown tokenizer.ggml.pre"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "martian"})
    with pytest.raises(ModelFormatError):
        Tokenizer.from_gguf_metadata({"general.architecture": "llama"})
    with pytest.raises(ModelFormatError, match="scores"):  # a SentencePiece vocabulary needs its scores
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.model": "llama"})


def test_stop_matcher_cuts_the_earliest_and_holds_possible_starts() -> None:
    def fed(text: str, stops: list[str]) -> tuple[str, bool]:
        return StopMatcher(stops).feed(text)

    assert fed("hello world", ["wor", "lo"]) == ("hel", True)  # the earliest stop string wins
    assert fed("hello", ["xyz"]) == ("hello", False)
    assert fed("the end is ne", ["near", "x"]) == ("the end is ", False)  # "ne" may become "near"
    assert fed("abc", ["abcd"]) == ("", False)
    assert fed("abc", ["zz"]) == ("abc", False)
    assert fed("", ["a"]) == ("", False)
    assert fed("a", ["a"]) == ("", True)  # a complete stop string is cut, not held


# Words of the pre-tokenizers as the models' tokenizer.json files split them under Hugging Face tokenizers
# (conformance_tests/test_real_tokenizers.py checks the same on the real files and random strings): the
# contractions of (?i:'s|...) also match the long s U+017F, as Oniguruma folds case; DeepSeek-LLM / V2 and
# DeepSeek-Coder end with Digits(individual_digits), one word per digit; Falcon and "default" (also a
# vocabulary without tokenizer.ggml.pre) as llama.cpp splits them.
@pytest.mark.parametrize(
    "pre, text, words",
    [
        ("llama-bpe", "it'ſx IT'S", ["it", "'ſ", "x", " IT", "'S"]),
        ("qwen2", "we'ſx 12", ["we", "'ſ", "x", " ", "1", "2"]),
        ("qwen35", "it'ſ", ["it", "'ſ"]),
        ("gpt-2", "it'ſx", ["it", "'", "ſx"]),  # GPT-2's contractions are case-sensitive
        ("deepseek-llm", "in 2024, ½", ["in", " ", "2", "0", "2", "4", ",", " ", "½"]),
        ("deepseek-coder", "x = 12; // ok\n", ["x", " = ", "1", "2", ";", " //", " ok", "\n"]),
        ("falcon", "a 1234567 b... $x", ["a", " ", "123", "456", "7", " b", "...", " ", "$", "x"]),
        (
            "default",
            "x2024ab+=1234567 `y` it's",
            ["x", "202", "4", "ab", "+=", "123", "456", "7", " `", "y", "`", " it", "'", "s"],
        ),
    ],
)
def test_pre_tokenizer_words(pre: str, text: str, words: list[str]) -> None:
    from colibri_backend.adapters.tokenizer import _pre_tokenizer

    assert [text[a:b] for _, (a, b) in _pre_tokenizer(pre).pre_tokenize_str(text)] == words


@pytest.mark.parametrize(
    "pre, whole",
    [
        ("llama-bpe", True),
        ("llama3", True),
        ("falcon3", True),
        ("pixtral", True),
        ("glm4", True),
        ("lfm2", True),
        ("dbrx", False),
        ("qwen2", False),
        ("minimax-m2", False),
    ],
)
def test_whole_word_tokens_only_where_llama_cpp_ignores_merges(pre: str, whole: bool) -> None:
    """A token no merge builds ("ab") is taken whole only for the names whose tokenizer.json says
    ignore_merges (llama.cpp's list; dbrx splits as llama3 does but merges), as in the C tokenizer."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": [*alphabet, "ab", "ac"],
        "tokenizer.ggml.merges": ["a c"],
    }
    tok = Tokenizer.from_gguf_metadata(meta)
    ab, ac = len(alphabet), len(alphabet) + 1
    assert tok.encode("ab", add_special_tokens=False) == (
        [ab] if whole else [alphabet.index(c) for c in "ab"]
    )
    assert tok.encode("ac", add_special_tokens=False) == [ac]
