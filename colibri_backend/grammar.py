"""Grammar-constrained generation through llguidance: a JSON schema (or any JSON object, or a Lark
grammar) becomes a per-step allowed-token bitmask that the sampler applies before temperature and the
filters (``colibri_sampler_set_allowed`` in the native engine; the same mask on the logits for the
Python-sampling backends).

A :class:`Grammar` is compiled and validated once per request (a schema llguidance rejects raises
:class:`GrammarError` with its message); :meth:`Grammar.constraint` gives each generation its own
:class:`TokenConstraint`, the matcher that follows the sampled tokens.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import numpy as np

from colibri_backend.errors import ColibriError


class GrammarError(ColibriError, ValueError):
    """The schema or grammar cannot be compiled, or the model's tokenizer cannot be constrained."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a dependency of the package; a broken install says so
        raise GrammarError(f"structured output needs the llguidance package: {exc}") from None
    return llguidance


# Any JSON object: what response_format {"type": "json_object"} asks for.
ANY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The llguidance grammar of a JSON schema (whitespace kept compact so output stays short)."""
    llg = _llguidance()
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": False}
        )
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from None


def lark_grammar(source: str) -> str:
    return _llguidance().LLMatcher.grammar_from_lark(source)


_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def _tokenizer_source(model: Any) -> tuple[str, list[int], int | None]:
    """(tokenizer.json text, end-of-generation ids, logits width) of a loaded model."""
    tok = getattr(model, "tokenizer", None)
    hf = getattr(tok, "hf", None) or getattr(tok, "backend_tokenizer", None)
    if hf is None or not hasattr(hf, "to_str"):
        raise GrammarError(
            f"backend {getattr(model, 'backend', '?')!r} has no Hugging Face tokenizer to build a token "
            "mask from; structured output runs on the colibri and transformers backends"
        )
    stops = getattr(tok, "stop_token_ids", None) or getattr(model, "eos_token_ids", None) or ()
    n_vocab = getattr(model, "n_vocab", None) or getattr(getattr(model, "info", None), "n_vocab", None)
    return hf.to_str(), sorted(int(t) for t in stops), int(n_vocab) if n_vocab else None


def can_constrain(model: Any) -> bool:
    """Whether ``model`` has a tokenizer a token mask can be built from."""
    try:
        _tokenizer_source(model)
    except GrammarError:
        return False
    return True


def grammar_tokenizer(model: Any) -> Any:
    """llguidance's view of ``model``'s vocabulary, built once per model (about a second)."""
    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.get(model)
        if cached is not None:
            return cached
        text, stops, n_vocab = _tokenizer_source(model)
        llg = _llguidance()
        try:
            lltok = llg.LLTokenizer(text, n_vocab=n_vocab, eos_token=stops or None)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(f"llguidance cannot use this model's tokenizer: {exc}") from None
        _TOKENIZERS[model] = lltok
        return lltok


class TokenConstraint:
    """One generation's matcher: the mask for the next token, then the token that was chosen."""

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        self._m = matcher
        self.n_vocab = n_vocab
        self.n_words = (n_vocab + 31) // 32
        self.mask = np.zeros(self.n_words, dtype=np.uint32)  # bit t % 32 of word t // 32: t allowed

    def fill(self) -> np.ndarray:
        """The allowed-token bitmask for the next step (the same array, refilled)."""
        self._m.unsafe_compute_mask_ptr(self.mask.ctypes.data, self.mask.nbytes)
        self._check()
        return self.mask

    def consume(self, token: int) -> None:
        self._m.consume_token(int(token))
        self._check()

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more: generation ends here."""
        return bool(self._m.is_stopped())

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarError(f"grammar-constrained sampling failed: {self._m.get_error()}")


class Grammar:
    """A compiled, validated grammar for one model; each generation takes its own constraint."""

    def __init__(self, model: Any, grammar: str) -> None:
        llg = _llguidance()
        self.lltok = grammar_tokenizer(model)
        self.grammar = grammar
        error = llg.LLMatcher.validate_grammar(grammar, self.lltok)
        if error and not error.startswith("WARNING"):
            raise GrammarError(error)

    @classmethod
    def from_json_schema(cls, model: Any, schema: dict[str, Any]) -> Grammar:
        return cls(model, json_schema_grammar(schema))

    @classmethod
    def from_lark(cls, model: Any, source: str) -> Grammar:
        return cls(model, lark_grammar(source))

    def constraint(self) -> TokenConstraint:
        llg = _llguidance()
        matcher = llg.LLMatcher(self.lltok, self.grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return TokenConstraint(matcher, self.lltok.vocab_size)
