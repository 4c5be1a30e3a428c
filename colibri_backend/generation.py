"""The one generation loop every backend runs, and its parts: the event type, the stop matcher, the
incremental UTF-8 decoder, log-probabilities and the reference (numpy) sampler.

A backend provides a prefill (prompt ids -> next-token logits), a one-token decode and a sampler;
:func:`generation_events` does the rest identically for all of them: sampling, end-of-sequence and
stop strings (which never leak into the text), whole characters only, logprobs, and the finish
reason. Its rules, which every backend therefore shares:

* the prompt must hold at least one token, and at most the context length (else ``ContextFullError``);
* ``max_tokens`` >= 0; 0 prefills the prompt (warming the cache) and yields no event;
* the last event carries ``finish_reason`` "stop" (an end-of-sequence token, or a stop string, cut
  before it) or "length" (``max_tokens`` reached, or the context full: the token sampled when the
  cache is full is the last one, as it needs no cache slot).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from colibri_backend.adapters.sampling import SamplingParams
from colibri_backend.errors import ContextFullError


@dataclass(frozen=True)
class GenerationEvent:
    """One generated token.

    ``text`` is the text this token releases: "" while it is held back (an incomplete UTF-8 sequence,
    or what may be the start of a stop string), possibly several tokens' worth later. ``logprob`` and
    ``top_logprobs`` are set when logprobs were asked for (``top_logprobs`` is None for logprobs=0).
    ``finish_reason`` is set on the last event only: "stop" or "length".
    """

    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: dict[str, float] | None = None
    finish_reason: str | None = None
    # On the first event only, for backends that say: how many prompt tokens were not evaluated
    # because their KV state was reused (the prefix cache, colibri_backend.prefix_cache).
    cached_tokens: int | None = None


def stop_list(stop: str | Iterable[str] | None) -> list[str]:
    """Stop strings as a list without empty ones ("abc" is one stop string, not three)."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else list(stop)
    return [s for s in items if s]


class StopMatcher:
    """Holds back text that could still become a stop string, so stop strings never leak."""

    def __init__(self, stop: str | Iterable[str] | None) -> None:
        self.stops = stop_list(stop)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped). Once stopped, what followed the stop string is gone."""
        if not self.stops:
            return text, False
        self.pending += text
        first = -1
        for s in self.stops:
            i = self.pending.find(s)
            if i >= 0 and (first < 0 or i < first):
                first = i
        if first >= 0:
            out, self.pending = self.pending[:first], ""
            return out, True
        hold = 0  # the longest end of the pending text that begins some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class IncrementalDecoder:
    """Text deltas that are always whole characters, from any whole-sequence decoder.

    It decodes a short window of recent ids twice (with and without the newest ones) and emits the
    difference only when it does not end in U+FFFD, the mark of an incomplete UTF-8 sequence (a
    byte-level token can carry half a character). Decoding with the previous ids as context keeps the
    spacing right for decoders that strip a leading space; ``context`` (a few prompt ids) does the same
    for the first generated token.
    """

    STUCK = 8  # ids that never complete a character are invalid UTF-8: stop waiting after this many

    def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = [int(t) for t in list(context)[-4:]]
        self._prefix = 0  # start of the context window
        self._read = len(self._ids)  # ids before this index have been emitted

    def add(self, token_id: int) -> str:
        """Feed one id; return the text that is now complete (possibly "")."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        stuck = len(self._ids) - self._read >= self.STUCK
        if len(new_text) > len(prefix_text) and (stuck or not new_text.endswith("\ufffd")):
            delta = new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete sequence shows as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]


def bytes_decoder(piece: Callable[[int], bytes]) -> Callable[[list[int]], str]:
    """A whole-sequence decoder from per-token byte pieces (llama.cpp style vocabularies)."""
    return lambda ids: codecs.decode(b"".join(piece(t) for t in ids), "utf-8", "replace")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64, copy=False)
    m = float(np.max(x))
    return x - m - np.log(np.sum(np.exp(x - m)))


def token_logprobs(
    logits: np.ndarray, token: int, top_n: int, token_text: Callable[[int], str]
) -> tuple[float, dict[str, float] | None]:
    """Log-probability of ``token`` under the raw logits (before penalties and filters) and the
    ``top_n`` most likely tokens by their text (the first of equal texts wins; None for top_n 0)."""
    lp = log_softmax(logits)
    if top_n <= 0:
        return float(lp[token]), None
    n = min(top_n, lp.shape[0])
    idx = np.argpartition(-lp, n - 1)[:n] if n < lp.shape[0] else np.arange(lp.shape[0])
    idx = idx[np.argsort(-lp[idx], kind="stable")]
    top: dict[str, float] = {}
    for i in idx:
        top.setdefault(token_text(int(i)), float(lp[i]))
    return float(lp[token]), top


class Sampler(Protocol):
    """Picks the next token from logits; ``accept`` tells it which token was taken (penalties);
    ``allow`` restricts the following samples to a bitmask of tokens (bit t % 32 of word t // 32), or
    lifts the restriction (None)."""

    def sample(self, logits: np.ndarray) -> int: ...

    def accept(self, token: int) -> None: ...

    def allow(self, mask: np.ndarray | None) -> None: ...


def sample_token(
    logits: np.ndarray, s: SamplingParams, history: Sequence[int], rng: np.random.Generator
) -> int:
    """Pick the next token the way colibri_sampler does: logit bias; repetition, presence and
    frequency penalties over the last ``penalty_last_n`` tokens of prompt + output (all when <= 0);
    then greedy (temperature 0) or top-k, top-p, min-p and temperature sampling."""
    x = np.array(logits, dtype=np.float64, copy=True)
    for tok, bias in (s.logit_bias or {}).items():
        if 0 <= tok < x.shape[0]:
            x[tok] += bias
    window = history[-s.penalty_last_n :] if s.penalty_last_n > 0 else history
    if len(window) and (s.repetition_penalty != 1.0 or s.presence_penalty or s.frequency_penalty):
        ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        if s.repetition_penalty != 1.0:
            v = x[ids]
            x[ids] = np.where(v > 0, v / s.repetition_penalty, v * s.repetition_penalty)
        if s.presence_penalty or s.frequency_penalty:
            x[ids] -= s.presence_penalty + s.frequency_penalty * counts
    if s.temperature <= 0.0:
        return int(np.argmax(x))
    order = np.argsort(-x, kind="stable")
    if s.top_k and s.top_k > 0:
        order = order[: s.top_k]
    cand = x[order]
    if s.top_p < 1.0:
        p = np.exp(cand - cand[0])
        p /= p.sum()
        keep = int(np.searchsorted(np.cumsum(p), s.top_p) + 1)
        order, cand = order[:keep], cand[:keep]
    if s.min_p > 0.0:
        keep = max(1, int(np.sum(np.exp(cand - cand[0]) >= s.min_p)))
        order, cand = order[:keep], cand[:keep]
    p = np.exp((cand - cand[0]) / s.temperature)
    p /= p.sum()
    return int(order[rng.choice(len(order), p=p)])


class NumpySampler:
    """:func:`sample_token` with its own history and seeded random stream: the sampler of backends
    that hand back logits (llama.cpp, transformers)."""

    def __init__(self, s: SamplingParams, prompt: Sequence[int]) -> None:
        self.s = s
        self.history = [int(t) for t in prompt]
        self.rng = np.random.default_rng(s.effective_seed())
        self.banned: np.ndarray | None = None  # [n_vocab] bool: tokens the allowed mask excludes

    def allow(self, mask: np.ndarray | None) -> None:
        if mask is None:
            self.banned = None
        else:
            self.banned = (
                np.unpackbits(np.asarray(mask, dtype=np.uint32).view(np.uint8), bitorder="little") == 0
            )

    def sample(self, logits: np.ndarray) -> int:
        if self.banned is not None:
            # Banned before the bias, where the native sampler bans after it: -inf plus a bias is -inf.
            logits = np.array(logits, dtype=np.float64, copy=True)
            logits[self.banned[: logits.shape[0]]] = -np.inf
        return sample_token(logits, self.s, self.history, self.rng)

    def accept(self, token: int) -> None:
        self.history.append(int(token))


def check_prompt(prompt: Sequence[int], context_length: int) -> list[int]:
    """The prompt as a list of ints, checked against the context (the loop's first rule)."""
    ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty: give at least one token")
    if len(ids) > context_length:
        raise ContextFullError(
            "COLIBRI_E_CONTEXT_FULL",
            f"the prompt has {len(ids)} tokens but the context holds {context_length}",
        )
    return ids


def token_room(context_length: int, n_prompt: int) -> int:
    """Tokens a generation after an ``n_prompt``-token prompt can produce before the context is full
    (the last one sampled needs no cache slot, hence the + 1)."""
    return max(0, context_length - n_prompt + 1)


def check_max_tokens(max_tokens: int) -> int:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 0:
        raise ValueError(f"max_tokens must be a whole number >= 0, got {max_tokens!r}")
    return int(max_tokens)


@dataclass
class Step:
    """What :func:`generation_events` needs from a backend for one generation."""

    prefill: Callable[[list[int]], np.ndarray]  # prompt ids -> logits [n_vocab] of the next token
    decode: Callable[[int], np.ndarray]  # one token -> logits of the next one
    sampler: Sampler
    decoder: IncrementalDecoder
    token_text: Callable[[int], str]  # for top-logprob listings
    stop_ids: frozenset[int]  # end-of-sequence tokens (and special tokens named as stop strings)
    on_first_token: Callable[[], None] | None = None
    # A grammar's TokenConstraint (colibri_backend.grammar): each step samples only among the tokens
    # it allows, and generation stops ("stop") once its grammar is complete.
    constraint: Any = None
    # Prompt tokens the prefill reused from a cache (reported on the first event), for backends that know.
    cached_tokens: Callable[[], int] | None = None


def generation_events(
    step: Step,
    prompt: list[int],
    *,
    max_tokens: int,
    context_length: int,
    stop: str | Iterable[str] | None = None,
    logprobs: int | None = None,
) -> Iterator[GenerationEvent]:
    """The generation loop (see the module's rules). ``prompt`` comes from :func:`check_prompt`."""
    if logprobs is not None and logprobs < 0:
        raise ValueError(f"logprobs must be >= 0, got {logprobs}")
    logits = step.prefill(prompt)
    if max_tokens == 0:
        return
    cached_tokens = step.cached_tokens() if step.cached_tokens is not None else None
    matcher = StopMatcher(stop)
    cached = len(prompt)  # tokens whose K/V the backend holds
    constraint = step.constraint
    for n in range(1, max_tokens + 1):
        if constraint is not None:
            step.sampler.allow(constraint.fill())
        tok = step.sampler.sample(logits)
        if constraint is not None:
            constraint.consume(tok)
        if n == 1 and step.on_first_token is not None:
            step.on_first_token()
        step.sampler.accept(tok)
        lp = top = None
        reused = cached_tokens if n == 1 else None
        if logprobs is not None:
            lp, top = token_logprobs(logits, tok, logprobs, step.token_text)
        if tok in step.stop_ids:
            text, _ = matcher.feed(step.decoder.flush())
            yield GenerationEvent(tok, text + matcher.flush(), lp, top, "stop", reused)
            return
        text, stopped = matcher.feed(step.decoder.add(tok))
        if stopped:
            yield GenerationEvent(tok, text, lp, top, "stop", reused)
            return
        complete = constraint is not None and constraint.done
        if complete or n == max_tokens or cached >= context_length:
            tail, stopped = matcher.feed(step.decoder.flush())
            text += tail
            if not stopped:
                text += matcher.flush()
            yield GenerationEvent(tok, text, lp, top, "stop" if stopped or complete else "length", reused)
            return
        yield GenerationEvent(tok, text, lp, top, None, reused)
        logits = step.decode(tok)
        cached += 1
