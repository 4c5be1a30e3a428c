"""Continuous batching: the requests a model serves share its engine context, one sequence each, and
one thread runs every forward step for all of them together.

A request's generation runs the one generation loop (colibri_backend.generation, through
``Model.generate_tokens(steps=...)``) on its own worker thread, with its own sampler, stop matcher,
UTF-8 decoder and grammar; only its forward steps come here, as a :class:`Sequence`. Each call blocks
until the batched step that carries it has run. The step thread forms each step from

* the next token of every sequence that is decoding, and
* at most ``prefill_chunk`` prompt tokens of the sequences still prefilling (oldest first), so a
  long prompt is spread over several steps and the decodes keep flowing beside it (with no sequence
  decoding, nobody waits: a step then takes up to the model's batch size of prompt tokens),

waits a moment (``gather_s``, or longer after a long step: see ``_gather_s``) for sequences that are
between two steps (sampling, sending) so one step carries them all, and runs it as one
``Model.eval_batch``: each expert is read and computed once per step for all the sequences that
route to it. Requests join and leave at any step. A
request whose ``cancel`` event is set (its client went away) leaves at the next step, in the middle
of its prompt included. Logits are bit-identical to the same request served alone (the engine's
batch invariance, native/tests/test_batch.c), so batching never changes an output.

When the expert store holds only part of the experts (a memory budget; the model streams the rest from
its file), the prompt tokens of a step are bounded by the model's batch size instead of
``prefill_chunk``: there a step reads every expert its prompt tokens route to, whatever their number,
so one large chunk reads the experts once where 64-token chunks read them once each. The store's
misses, bytes read and stall seconds are counted per step, split between the steps with prompt
tokens and the decode-only ones (/metrics), to see where a capped step's time goes.

A joining request first restores the prefix cache's longest state for its prompt into its own sequence
(colibri_seq_state_load) and prefills only the rest; its own prompt's state is stored as its prefill
passes the save point (the whole prompt, or for a recurrent state its last whole block: prefix_cache), so
a request arriving while it still decodes finds it. ``Sequence.cached_tokens`` is what it reused.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colibri_backend.server.thread_names import STEP_THREAD, name_this_thread

# Prompt tokens per step, shared by the sequences prefilling: bounds how long a step takes while a
# long prompt comes in, so the sequences decoding beside it keep their pace.
DEFAULT_PREFILL_CHUNK = 64
# How long a step waits for sequences that are between two steps before it runs without them (at
# least; after a long step, longer: BatchScheduler._gather_s), and the most it ever waits.
DEFAULT_GATHER_S = 0.005
MAX_GATHER_S = 0.05
# How often a waiting thread looks at cancellation and shutdown.
_POLL_S = 0.05
# The expert store's counters of the engine's stats() that the steps account for (BatchScheduler.store).
STORE_COUNTERS = ("expert_misses", "expert_bytes_read", "expert_stall_seconds")


class Cancelled(Exception):
    """The request was cancelled (or the server is shutting down) while it waited for a step."""


@dataclass(eq=False)
class _Work:
    """Tokens of one sequence waiting to be evaluated: a prompt (its remainder, while it is being
    prefilled in chunks) or one decode token. ``result`` gets the logits after the last one."""

    seq: int
    tokens: list[int]
    cancel: threading.Event
    prompt: bool = False  # prompt tokens (a prefill), not a decode token
    done: threading.Event = field(default_factory=threading.Event)
    result: np.ndarray | None = None
    error: BaseException | None = None

    def finish(self, result: np.ndarray | None = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class BatchScheduler:
    """The step thread of one model and the sequences of its context (``model.max_concurrency``)."""

    def __init__(
        self,
        model: Any,
        *,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        gather_s: float = DEFAULT_GATHER_S,
    ) -> None:
        """``model``: a colibri engine Model (eval_batch, seq_truncate, seq_n_past, max_concurrency, and
        the prefix cache's seq_restore_prefix, prefix_save_point, seq_remember)."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.model = model
        self.n_seq = int(model.max_concurrency)
        self.prefill_chunk = prefill_chunk
        self.idle_chunk = max(prefill_chunk, int(getattr(model, "batch_size", prefill_chunk)))
        # A model whose expert store holds only part of its experts reads the rest per step: it takes
        # prompt tokens up to idle_chunk a step (module docstring), and its store counters are read
        # after every step.
        plan = model.memory_plan() if hasattr(model, "memory_plan") else {}
        self.streams_experts = not plan.get("all_resident", 1)
        self.busy_chunk = self.idle_chunk if self.streams_experts else prefill_chunk
        self.gather_s = gather_s
        self._cond = threading.Condition()
        self._free = list(range(self.n_seq))  # sequence ids no request holds
        self._held: set[int] = set()
        self._pending: dict[int, _Work] = {}  # sequence -> its work, in arrival order
        self._closed = False
        # What the steps cost, for /metrics and benchmarks/batch_steps.py: steps run, tokens they
        # evaluated, seconds inside the engine, and seconds the engine sat idle between two steps
        # while requests held sequences (their sampling, detokenizing and sending, and the gather);
        # decode steps that ran without every held sequence (one that was late missed the step); and
        # of those, the prompt tokens, and the steps that carried prompt tokens with their engine
        # seconds (a step with a prompt chunk costs several decode steps: where the time goes).
        self.steps = 0
        self.step_tokens = 0
        self.prompt_tokens = 0
        self.prefill_steps = 0
        self.prefill_engine_seconds = 0.0
        self.engine_seconds = 0.0
        self.between_seconds = 0.0
        self.partial_steps = 0
        # Decode tokens of the decode-only steps: over their count (steps - prefill_steps), how many
        # sequences a decode step carried on average (fewer than held at a wave's start and end).
        self.decode_only_tokens = 0
        # The expert store's misses, bytes read and stall seconds during the steps, per kind of step
        # ("prefill": steps with prompt tokens, "decode": the others); counted where experts stream.
        self.store: dict[str, dict[str, float]] = {
            kind: dict.fromkeys(STORE_COUNTERS, 0.0) for kind in ("prefill", "decode")
        }
        self._store_last = self._store_counters()
        self._last_end: float | None = None  # when the last step ended, if sequences were held then
        self._last_step_s = 0.0  # the last step's seconds in the engine
        self._thread = threading.Thread(target=self._loop, name="colibri-batch", daemon=True)
        self._thread.start()

    # ---- what request threads call ---------------------------------------------------------

    def sequence(self, cancel: threading.Event | None = None) -> Sequence:
        """A sequence for one generation (``with scheduler.sequence(job.cancel) as seq:``)."""
        return Sequence(self, cancel if cancel is not None else threading.Event())

    @property
    def active(self) -> int:
        """Sequences held by a generation now (the batch size)."""
        return len(self._held)

    def close(self) -> None:
        """Stop the step thread; every waiting call raises Cancelled."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def _acquire(self, cancel: threading.Event) -> int:
        with self._cond:
            while not self._free:
                if cancel.is_set() or self._closed:
                    raise Cancelled("cancelled while waiting for a sequence")
                self._cond.wait(_POLL_S)
            seq = self._free.pop(0)
            self._held.add(seq)
            return seq

    def _release(self, seq: int) -> None:
        self.model.seq_truncate(seq, 0)
        with self._cond:
            self._held.discard(seq)
            self._free.append(seq)
            if not self._held:  # the engine is idle from here on: no request waits for a step
                self._last_end = None
            self._cond.notify_all()

    def _submit(
        self, seq: int, tokens: list[int], cancel: threading.Event, prompt: bool = False
    ) -> np.ndarray:
        work = _Work(seq, tokens, cancel, prompt)
        with self._cond:
            if self._closed:
                raise Cancelled("the scheduler is closed")
            self._pending[seq] = work
            self._cond.notify_all()
        work.done.wait()
        if work.error is not None:
            raise work.error
        assert work.result is not None
        return work.result

    # ---- the step thread -------------------------------------------------------------------

    def _next_step(self) -> list[tuple[_Work, int]] | None:
        """Under the lock: wait for work, drop cancelled work, and choose the next step's tokens as
        (work, how many of its tokens). None when closed."""
        while True:
            if self._closed:
                for w in self._pending.values():
                    w.finish(error=Cancelled("the server is shutting down"))
                self._pending.clear()
                return None
            for seq, w in list(self._pending.items()):
                if w.cancel.is_set():
                    del self._pending[seq]
                    w.finish(error=Cancelled("cancelled"))
            if not self._pending:
                self._cond.wait(_POLL_S)
                continue
            # Sequences between two steps are about to submit: give them a moment to join this one.
            deadline = time.perf_counter() + self._gather_s()
            while len(self._pending) < len(self._held) and not self._closed:
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self._closed or any(w.cancel.is_set() for w in self._pending.values()):
                continue
            # one-token work (decodes, and one-token prompts) first; the prompt chunk after it, no
            # larger than the engine takes in one call (n_ctx tokens)
            step: list[tuple[_Work, int]] = [(w, 1) for w in self._pending.values() if len(w.tokens) == 1]
            chunk = self.busy_chunk if step else self.idle_chunk
            budget = min(chunk, self.model.context_length - len(step))
            for w in self._pending.values():
                if budget <= 0:
                    break
                if len(w.tokens) > 1:
                    take = min(budget, len(w.tokens))
                    step.append((w, take))
                    budget -= take
            return step

    def _gather_s(self) -> float:
        """Under the lock: how long the next step waits for the held sequences that have not asked for
        it yet. Waiting w delays every held sequence by w; running without a late one delays that one
        by a whole step (its token waits for the next); so it is worth waiting up to a step's time
        divided by the held sequences (a 100 ms step of 8: 12.5 ms), never less than gather_s, never
        more than MAX_GATHER_S."""
        share = self._last_step_s / max(1, len(self._held))
        return min(MAX_GATHER_S, max(self.gather_s, share))

    def _store_counters(self) -> dict[str, float]:
        """The store's counters now (zeros where experts do not stream: nothing to count)."""
        if not self.streams_experts:
            return dict.fromkeys(STORE_COUNTERS, 0.0)
        stats = self.model.stats()
        return {key: float(stats[key]) for key in STORE_COUNTERS}

    def _loop(self) -> None:
        name_this_thread(STEP_THREAD)
        while True:
            with self._cond:
                step = self._next_step()
                if step is not None and len(step) < len(self._held) and all(t == 1 for _, t in step):
                    self.partial_steps += 1
            if step is None:
                return
            self._run(step)

    def _run(self, step: list[tuple[_Work, int]]) -> None:
        seq_ids: list[int] = []
        tokens: list[int] = []
        want: list[int] = []
        for w, take in step:
            seq_ids.extend([w.seq] * take)
            tokens.extend(w.tokens[:take])
            want.extend([0] * (take - 1) + [1 if take == len(w.tokens) else 0])
        t0 = time.perf_counter()
        if self._last_end is not None:
            self.between_seconds += t0 - self._last_end
        try:
            rows = self.model.eval_batch(np.array(seq_ids), np.array(tokens), np.array(want))
        except BaseException as exc:  # every request of the step fails with the engine's error
            self._last_end = None
            with self._cond:
                for w, _ in step:
                    self._pending.pop(w.seq, None)
                    w.finish(error=exc)
            return
        t1 = time.perf_counter()
        self.steps += 1
        self.step_tokens += len(tokens)
        self.engine_seconds += t1 - t0
        prompt_tokens = sum(take for w, take in step if w.prompt)
        if prompt_tokens:
            self.prompt_tokens += prompt_tokens
            self.prefill_steps += 1
            self.prefill_engine_seconds += t1 - t0
        else:
            self.decode_only_tokens += len(tokens)
        self._last_step_s = t1 - t0
        if self.streams_experts:
            now = self._store_counters()
            kind = self.store["prefill" if prompt_tokens else "decode"]
            for key in STORE_COUNTERS:
                kind[key] += now[key] - self._store_last[key]
            self._store_last = now
        r = 0
        with self._cond:
            for w, take in step:
                if take < len(w.tokens):  # a prompt with more to come in the next steps
                    del w.tokens[:take]
                    continue
                self._pending.pop(w.seq, None)
                w.finish(result=rows[r])
                r += 1
            self._last_end = t1 if self._held else None


class Sequence:
    """One generation's sequence of the context (colibri_backend.backends.SequenceSteps): it is taken
    at the prompt and given back, emptied, by close()."""

    def __init__(self, scheduler: BatchScheduler, cancel: threading.Event) -> None:
        self.scheduler = scheduler
        self.cancel = cancel
        self.seq: int | None = None
        self.cached_tokens = 0

    def prefill(self, prompt: list[int]) -> np.ndarray:
        """Restore the prefix cache's longest state for ``prompt`` into the sequence, prefill the rest in
        the batched steps, and offer the prompt's state to the cache at its save point."""
        if not prompt:
            raise ValueError("the prompt is empty")
        sched, model = self.scheduler, self.scheduler.model
        if self.seq is None:
            self.seq = sched._acquire(self.cancel)
        if model.seq_n_past(self.seq):  # sequence 0 may hold a single-sequence call's tokens
            model.seq_truncate(self.seq, 0)
        prompt = list(prompt)
        n = self.cached_tokens = model.seq_restore_prefix(self.seq, prompt)
        mark = model.prefix_save_point(len(prompt))
        if n < mark < len(prompt):  # a recurrent state: stored as the prefill passes its position
            sched._submit(self.seq, prompt[n:mark], self.cancel, prompt=True)
            model.seq_remember(self.seq, prompt[:mark])
            n = mark
        logits = sched._submit(self.seq, prompt[n:], self.cancel, prompt=True)
        if mark == len(prompt):
            model.seq_remember(self.seq, prompt)
        return logits

    def decode(self, token: int) -> np.ndarray:
        if self.seq is None:
            raise RuntimeError("decode before prefill")
        return self.scheduler._submit(self.seq, [int(token)], self.cancel)

    def close(self) -> None:
        if self.seq is not None:
            seq, self.seq = self.seq, None
            self.scheduler._release(seq)

    def __enter__(self) -> Sequence:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
