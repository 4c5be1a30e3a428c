"""Tokenizer adapter: the Hugging Face `tokenizers` library behind one small interface.

A Tokenizer comes from a tokenizer.json (next to the GGUF or in a Hugging Face checkpoint dir),
or is built from the GGUF's own metadata the way llama.cpp reads it:
  tokenizer.ggml.model == "gpt2": byte-level BPE over tokenizer.ggml.tokens / merges, with the
  pre-tokenizer regexes of tokenizer.ggml.pre as the models' tokenizer.json files write them (and their NFC
  normalization for the Qwen names, which llama.cpp leaves out); control tokens (token_type 3)
  become special added tokens, user-defined ones (4) plain added tokens; BOS is prepended when
  tokenizer.ggml.add_bos_token says so.
  tokenizer.ggml.model == "llama": SentencePiece BPE over tokens and scores with byte fallback, the
  way llama.cpp runs it (see _spm_tokenizer).
  tokenizer.ggml.model == "gemma4": Gemma 4's SentencePiece-style BPE over tokens and ranked merges
  (see _gemma4_tokenizer).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from colibri_backend.errors import ModelFormatError, UnsupportedModelError

if TYPE_CHECKING:
    from colibri_backend.generation import IncrementalDecoder

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama 3 and Qwen2 as their tokenizer.json files write them. llama.cpp spells the contractions
# '[sS]|'[tT]|..., which differs from (?i:...): Oniguruma's case folding also matches U+017F (long s) for s,
# so `it'ſx` is it 'ſ x for Hugging Face and it 'ſx for llama.cpp.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5 / 3.6, as their tokenizer.json writes it: qwen2's with combining marks kept in words
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# o200k (gpt-oss, GPT-4o): case-aware word pieces with optional contractions, digits in threes.
_O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DeepSeek-V3 (and R1, V3.x): digits in threes, runs of CJK ideographs and kana, then words with a leading
# ASCII punctuation mark, letters with marks, punctuation and symbol runs, newlines and spaces.
_DEEPSEEK_V3 = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"  # as DeepSeek's tokenizer.json spells it
    r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]

# DeepSeek-LLM / DeepSeek-V2: newlines alone, Latin/Greek/Cyrillic/... letter runs with an optional leading
# space, ASCII and full-width punctuation runs, trailing whitespace, CJK and Hangul runs, then each digit
# alone: their tokenizer.json ends with Digits(individual_digits=true). llama.cpp has \p{N}+ there, which
# gives the same ids on DeepSeek's vocabularies (they merge no digits) but not on one that merges digits.
_CJK_HANGUL = "[一-龥ࠀ-一가-퟿]+"
_DEEPSEEK_LLM = [
    "[\r\n]",
    (
        "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ"
        "-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ"
        "-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+"
    ),
    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
    "\\s+$",
    _CJK_HANGUL,
    r"\p{N}",
]

# DeepSeek-Coder, as its tokenizer.json writes it: newlines alone, letter runs and punctuation runs with an
# optional leading whitespace character, CJK and Hangul runs, each digit alone (Digits(individual_digits)).
_DEEPSEEK_CODER = ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"]

# Falcon, as llama.cpp splits it (no Falcon tokenizer.json is at hand to check against): runs of punctuation
# and the ASCII symbols $+<=>^~|`, then GPT-2's regex, then digits in threes.
_FALCON = [r"[\p{P}$+<=>^~|`]+", _GPT2, r"[0-9][0-9][0-9]"]

# llama.cpp's "default", which it also uses when tokenizer.ggml.pre is missing (with a warning that generation
# may be degraded): runs of punctuation and the ASCII symbols $+<=>^~|, then GPT-2's regex, then runs of
# digits, then digits in threes.
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]

# tokenizer.ggml.pre -> the regexes applied in sequence (each splits the pieces of the one before),
# as llama.cpp's vocabulary loader chooses them.
PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    "default": _DEFAULT,
    "llama-bpe": [_LLAMA3],
    "llama3": [_LLAMA3],
    "llama-v3": [_LLAMA3],
    # GLM-4 / 4.5 / 4.7 / 5 and LFM2 (LFM2-MoE), as llama.cpp's converter names them: llama3's split
    "glm4": [_LLAMA3],
    "glm5": [_LLAMA3],
    "lfm2": [_LLAMA3],
    "dbrx": [_LLAMA3],
    "smaug-bpe": [_LLAMA3],
    "falcon3": [_LLAMA3],
    "pixtral": [_LLAMA3],
    "gpt-2": [_GPT2],
    "gpt2": [_GPT2],
    "olmo": [_GPT2],
    "mpt": [_GPT2],
    "jais": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "starcoder": [r"\p{N}", _GPT2],
    "refact": [r"\p{N}", _GPT2],
    "command-r": [r"\p{N}", _GPT2],
    "codeshell": [r"\p{N}", _GPT2],
    "exaone": [r"\p{N}", _GPT2],
    "minerva-7b": [r"\p{N}", _GPT2],
    "qwen2": [_QWEN2],
    "stablelm2": [_QWEN2],
    "deepseek-r1-qwen": [_QWEN2],
    "megrez": [_QWEN2],
    "hunyuan": [_QWEN2],
    "qwen35": [_QWEN35],
    "gpt-4o": [_O200K],
    "llama4": [_O200K],
    # MiniMax-M2 (and M1, Text-01: the same tokenizer.json): o200k's split after an NFC normalizer
    "minimax-m2": [_O200K],
    "deepseek-v3": _DEEPSEEK_V3,
    # llama.cpp's converter names DeepSeek-V3's own tokenizer this (by its hash, under transformers 5) and
    # splits it with DeepSeek-V3's regexes
    "joyai-llm": _DEEPSEEK_V3,
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
    "falcon": _FALCON,
}

# The names whose tokenizer.json files normalize the text to NFC before splitting it: every Qwen2 / 2.5 / 3 /
# QwQ / 3.5, DeepSeek-R1-Distill-Qwen and MiniMax tokenizer.json does (normalizer {"type": "NFC"}), so
# Hugging Face composes "e" + U+0301 into "é" before the regex sees it. llama.cpp does not (it ignores the
# normalizer), so on text that is not in NFC the ids differ from llama.cpp's and follow Hugging Face's. The C
# tokenizer has the same list (normalizes_to_nfc in native/src/tokenizer.c); conformance_tests/test_nfc.py
# holds them equal.
_NFC_PRES = ("qwen2", "qwen35", "deepseek-r1-qwen", "minimax-m2")

# The names under which llama.cpp takes a pre-token that is itself a token whole, before any merge (their
# tokenizer.json says ignore_merges); dbrx and smaug-bpe split as llama3 does but merge every word.
_IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "glm4", "glm5", "lfm2")

# The byte-level BPE names for which llama.cpp adds BOS when tokenizer.ggml.add_bos_token is missing (its
# llama3 group); every other one adds none then. SentencePiece vocabularies add it by default, Gemma 4's
# always (llama.cpp overrides a false key there: Gemma 4 needs its <bos>).
_BOS_BY_DEFAULT = ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "lfm2")

# Where generation ends: llama.cpp's rules (its vocabulary loader), so that a model stops where it stops under
# llama.cpp. A token with one of these texts, whatever its type, ends generation; so do the EOS, EOT and EOM
# ids, and the fill-in-the-middle pad, repository and file-separator tokens (their GGUF keys, else the first
# token with one of their texts). Two exceptions: where <|return|> or <|flush|> sits beside <|call|> (or
# <|calls|>), <|end|> ends a message, not the turn (harmony: an analysis message ends in <|end|> and the
# answer follows; openai-harmony's stop_tokens_for_assistant_actions says the same), and where
# <|tool_response> (Gemma 4) or <|plamo:eos|> is a stop, </s> is a normal token. native/src/tokenizer.c
# has the same lists.
END_OF_TURN_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
)
_FIM_TEXTS = {
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
FIM_KEYS = {kind: f"tokenizer.ggml.fim_{kind}_token_id" for kind in _FIM_TEXTS}


def end_of_generation_ids(
    token_to_id: Callable[[str], int | None],
    end_ids: Iterable[int | None] = (),
    fim_ids: Mapping[str, int] | None = None,
) -> frozenset[int]:
    """The ids that end generation (see END_OF_TURN_TEXTS): token_to_id looks a token up by its text;
    end_ids: EOS, EOT, EOM (None where a vocabulary has none); fim_ids: FIM ids its metadata names."""
    ids: set[int] = {i for i in end_ids if i is not None}
    for kind, texts in _FIM_TEXTS.items():
        known = (fim_ids or {}).get(kind)
        found = [i for t in texts if (i := token_to_id(t)) is not None]
        if known is not None:
            ids.add(known)
        elif found:
            ids.add(min(found))
    ids.update(i for t in END_OF_TURN_TEXTS if (i := token_to_id(t)) is not None)
    # the exceptions look at the stops' texts
    texts = (
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|calls|>",
        "<|flush|>",
        "</s>",
        "<|tool_response>",
        "<|plamo:eos|>",
    )
    stop = {t: i for t in texts if (i := token_to_id(t)) is not None and i in ids}
    call = "<|call|>" in stop or "<|calls|>" in stop
    if "<|end|>" in stop and call and ("<|return|>" in stop or "<|flush|>" in stop):
        ids.discard(stop["<|end|>"])
    if "</s>" in stop and ("<|tool_response>" in stop or "<|plamo:eos|>" in stop):
        ids.discard(stop["</s>"])
    return frozenset(ids)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    try:
        regexes = PRE_TOKENIZER_REGEXES[pre]
    except KeyError:
        known = ", ".join(sorted(PRE_TOKENIZER_REGEXES))
        raise UnsupportedModelError(
            "COLIBRI_E_UNSUPPORTED", f"unknown tokenizer.ggml.pre {pre!r} (known: {known})"
        ) from None
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False) for rx in regexes
    ]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _as_int(value: Any, default: int | None = None) -> int | None:
    if value is None:
        return default
    return int(value)


def _byte_level_bpe_tokenizer(
    meta: dict[str, Any], tokens: list[str], types: list[int], vocab: dict[str, int], source: str
) -> HFTokenizer:
    """GPT-2 style byte-level BPE: tokens and merges as stored, llama.cpp's pre-tokenizer regexes."""
    merges_raw: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ModelFormatError("COLIBRI_E_FORMAT", f"{source}: malformed merge {m!r}")
        merges.append((left, right))
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    unk_id = _as_int(meta.get("tokenizer.ggml.unknown_token_id"))
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    bpe = BPE(
        vocab=vocab,
        merges=merges,
        unk_token=unk if unk_id is not None and types[unk_id] == TOKEN_UNKNOWN else None,
        fuse_unk=False,
        byte_fallback=False,
        # llama.cpp looks a whole pre-token up in the vocabulary first only for llama-3 vocabularies.
        ignore_merges=pre in _IGNORE_MERGES,
    )
    hf = HFTokenizer(bpe)
    if pre in _NFC_PRES:
        hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = _pre_tokenizer(pre)
    hf.decoder = decoders.ByteLevel()
    return hf


def _spm_tokenizer(
    meta: dict[str, Any], tokens: list[str], types: list[int], vocab: dict[str, int], source: str
) -> HFTokenizer:
    """SentencePiece BPE (llama, mistral, mixtral vocabularies) as llama.cpp runs it.

    llama.cpp prefixes each text fragment with a space (tokenizer.ggml.add_space_prefix, default
    on; also after every special token), writes spaces as U+2581, then repeatedly merges the
    adjacent pair whose merged piece has the highest score; characters with no piece become
    <0xXX> byte tokens. The same as a BPE whose merge ranks follow the merged piece's score,
    with byte fallback.
    """
    scores_raw = meta.get("tokenizer.ggml.scores")
    if scores_raw is None or len(scores_raw) != len(tokens):
        raise ModelFormatError(
            "COLIBRI_E_FORMAT", f"{source}: tokenizer.ggml.scores missing or the wrong length"
        )
    scores = [float(x) for x in scores_raw]
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for i, (tok, ty) in enumerate(zip(tokens, types, strict=True)):
        if ty not in (TOKEN_NORMAL, TOKEN_USER_DEFINED) or len(tok) < 2 or vocab.get(tok) != i:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                ranked.append((-scores[i], i, li, ri, left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    unk_id = _as_int(meta.get("tokenizer.ggml.unknown_token_id"), 0)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    bpe = BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    hf = HFTokenizer(bpe)
    steps: list[normalizers.Normalizer] = []
    if bool(meta.get("tokenizer.ggml.add_space_prefix", True)):
        steps.append(normalizers.Prepend("\u2581"))
    steps.append(normalizers.Replace(" ", "\u2581"))
    hf.normalizer = normalizers.Sequence(steps)
    dec: list[decoders.Decoder] = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if bool(meta.get("tokenizer.ggml.add_space_prefix", True)):
        dec.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(dec)
    return hf


def _gemma4_tokenizer(meta: dict[str, Any], vocab: dict[str, int], source: str) -> HFTokenizer:
    """Gemma 4's tokenizer as llama.cpp runs a "gemma4" vocabulary: spaces written as U+2581 with no
    space prefix, the text split into runs of newlines and runs of anything else, the ranked merges
    (tokenizer.ggml.merges) applied within each run to its UTF-8 characters, characters with no piece as
    <0xXX> byte tokens."""
    merges_raw = meta.get("tokenizer.ggml.merges")
    if not merges_raw:
        raise ModelFormatError("COLIBRI_E_FORMAT", f"{source}: tokenizer.ggml.merges is missing (gemma4)")
    merges = []
    for m in merges_raw:
        left, sep, right = str(m).partition(" ")
        if not sep:
            raise ModelFormatError("COLIBRI_E_FORMAT", f"{source}: merge {m!r} is not 'left right'")
        merges.append((left, right))
    unk_id = _as_int(meta.get("tokenizer.ggml.unknown_token_id"))
    unk = next((t for t, i in vocab.items() if i == unk_id), None) if unk_id is not None else None
    hf = HFTokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    hf.normalizer = normalizers.Replace(" ", "\u2581")
    hf.pre_tokenizer = pre_tokenizers.Split(Regex("[^\n]+|[\n]+"), behavior="isolated")
    hf.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return hf


class Tokenizer:
    """encode/decode plus the special tokens generation needs."""

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        end_of_turn_ids: Iterable[int] = (),
        fim_ids: Mapping[str, int] | None = None,
        add_bos: bool = False,
        source: str = "",
    ) -> None:
        self._hf = hf
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.source = source
        added = hf.get_added_tokens_decoder()
        self.special_token_ids: set[int] = {i for i, t in added.items() if t.special}
        self.special_tokens: set[str] = {t.content for t in added.values() if t.special}
        # Ids that end generation: EOS plus end-of-turn tokens such as <|im_end|> (end_of_generation_ids).
        self.stop_token_ids: frozenset[int] = end_of_generation_ids(
            hf.token_to_id, (eos_token_id, *end_of_turn_ids), fim_ids
        )

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_tokenizer_json(
        cls, path: str | os.PathLike[str], config: dict[str, Any] | None = None
    ) -> Tokenizer:
        """From a tokenizer.json; `config` is tokenizer_config.json's content if there is one."""
        path = Path(path)
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for malformed files
            raise ModelFormatError("COLIBRI_E_FORMAT", f"cannot read {path}: {exc}") from exc
        if config is None:
            cfg_path = path.with_name("tokenizer_config.json")
            config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}

        def token_id(key: str) -> int | None:
            tok = config.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return hf.token_to_id(tok) if isinstance(tok, str) else None

        bos = token_id("bos_token")
        add_bos = bool(config.get("add_bos_token", False))
        eos = token_id("eos_token")
        return cls(hf, bos_token_id=bos, eos_token_id=eos, add_bos=add_bos, source=str(path))

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: str = "") -> Tokenizer:
        """Build the tokenizer a GGUF describes (see the module docstring)."""
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ModelFormatError("COLIBRI_E_FORMAT", f"{source}: the file has no tokenizer metadata")
        if model not in ("gpt2", "llama", "gemma4"):
            raise UnsupportedModelError(
                "COLIBRI_E_UNSUPPORTED",
                f"{source}: tokenizer.ggml.model={model!r} is not supported without a tokenizer.json; "
                "byte-level BPE ('gpt2'), SentencePiece BPE ('llama') and Gemma 4's ('gemma4') are built "
                "from GGUF metadata",
            )
        tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ModelFormatError("COLIBRI_E_FORMAT", f"{source}: tokenizer.ggml.tokens is empty")
        types_raw = meta.get("tokenizer.ggml.token_type")
        types = [int(t) for t in types_raw] if types_raw is not None else [TOKEN_NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise ModelFormatError(
                "COLIBRI_E_FORMAT",
                f"{source}: {len(types)} token types for {len(tokens)} tokens",
            )
        vocab: dict[str, int] = {}
        for i, tok in enumerate(tokens):
            # A duplicated token text keeps its first id, as llama.cpp's text->id map does.
            vocab.setdefault(tok, i)
        if model == "llama":
            hf = _spm_tokenizer(meta, tokens, types, vocab, source)
            default_add_bos = True
        elif model == "gemma4":
            hf = _gemma4_tokenizer(meta, vocab, source)
            default_add_bos = True
        else:
            hf = _byte_level_bpe_tokenizer(meta, tokens, types, vocab, source)
            default_add_bos = str(meta.get("tokenizer.ggml.pre", "default")) in _BOS_BY_DEFAULT
        added: list[AddedToken] = []
        for i, (tok, ty) in enumerate(zip(tokens, types, strict=True)):
            if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN) and vocab.get(tok) == i:
                added.append(
                    AddedToken(tok, special=ty != TOKEN_USER_DEFINED, normalized=False, single_word=False)
                )
        if added:
            hf.add_tokens(added)
        bos = _as_int(meta.get("tokenizer.ggml.bos_token_id"))
        eos = _as_int(meta.get("tokenizer.ggml.eos_token_id"))
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)) or model == "gemma4"
        add_bos = add_bos and bos is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        if add_bos or add_eos:
            single = (["$A"] if not add_bos else [tokens[bos], "$A"]) + ([tokens[eos]] if add_eos else [])
            pair = single + ["$B:1"]
            specials = []
            if add_bos:
                specials.append((tokens[bos], bos))
            if add_eos and (not add_bos or eos != bos):
                specials.append((tokens[eos], eos))
            hf.post_processor = processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=specials
            )
        eot = [
            _as_int(meta.get(k))
            for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if meta.get(k) is not None
        ]
        fim = {k: _as_int(meta.get(key)) for k, key in FIM_KEYS.items() if meta.get(key) is not None}
        return cls(
            hf,
            bos_token_id=bos,
            eos_token_id=eos,
            end_of_turn_ids=[e for e in eot if e is not None and 0 <= e < len(tokens)],
            fim_ids={k: v for k, v in fim.items() if v is not None and 0 <= v < len(tokens)},
            add_bos=add_bos,
            source=source,
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], meta: dict[str, Any] | None = None) -> Tokenizer:
        """tokenizer.json next to the GGUF if present, else built from the GGUF's metadata."""
        path = Path(path)
        if meta is None:
            from colibri_backend.adapters.gguf_metadata import read_metadata

            meta = read_metadata(path)
        side = path.with_name("tokenizer.json")
        if side.is_file():
            tok = cls.from_tokenizer_json(side)
            # The GGUF's own ids for BOS/EOS are authoritative for the engine.
            bos = _as_int(meta.get("tokenizer.ggml.bos_token_id"), tok.bos_token_id)
            eos = _as_int(meta.get("tokenizer.ggml.eos_token_id"), tok.eos_token_id)
            return cls(tok._hf, bos_token_id=bos, eos_token_id=eos, add_bos=tok.add_bos, source=str(side))
        return cls.from_gguf_metadata(meta, source=str(path))

    # ---- use -----------------------------------------------------------------------------

    @property
    def hf(self) -> HFTokenizer:
        """The underlying tokenizers.Tokenizer."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token texts in it (e.g. <|im_start|>) become their ids;
        add_special_tokens adds what the tokenizer adds around a sequence (BOS for many models)."""
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        encs = self._hf.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encs]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._hf.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def token_text(self, token_id: int) -> str:
        """The text one token stands for on its own (its bytes decoded with replacement)."""
        return self._hf.decode([int(token_id)], skip_special_tokens=False)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """Whole-character text deltas of a stream of ids (colibri_backend.generation.IncrementalDecoder)."""
        from colibri_backend.generation import IncrementalDecoder

        return IncrementalDecoder(lambda ids: self.decode(ids, skip_special_tokens=skip_special_tokens))
