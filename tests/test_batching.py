"""Continuous batching on a tiny random mixtral (a complete checkpoint with its tokenizer): several
sequences in one engine context, and the server's scheduler that batches their steps.

* Model.eval_batch: three sequences joining at different steps, their prompts prefilled in chunks
  beside the others' decode steps, a freed sequence reused: every logits row bit-identical to the
  same sequence decoded alone (single-sequence calls on a one-sequence context), unbudgeted and with
  a quarter of the experts in the expert store's slots.
* BatchScheduler: concurrent generations (greedy and seeded sampling) give the tokens and
  log-probabilities they give alone; a cancel in the middle of a prompt ends that request at the next
  step and frees its sequence while the others go on; errors for bad sequence ids.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import colibri_backend
from colibri_backend.adapters.sampling import SamplingParams
from colibri_backend.errors import ContextFullError, EngineError
from colibri_backend.server.scheduler import BatchScheduler, Cancelled
from colibri_backend.server.thread_names import STEP_THREAD

CTX = 96


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from conformance_tests import tiny_models

    spec = next(s for s in tiny_models.SPECS if s.name == "mixtral")
    root = tmp_path_factory.mktemp("batching")
    tok_dir = tiny_models.build_tokenizer(root / "tok")
    return tiny_models.build_checkpoint(spec, root / "mixtral", tok_dir)


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    mp = pytest.MonkeyPatch()
    mp.setenv("COLIBRI_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def load(checkpoint: Path, n_seq: int, **kw) -> colibri_backend.Model:
    return colibri_backend.load(
        checkpoint, threads=2, context_length=CTX, batch_size=8, max_concurrency=n_seq, memory_budget=0, **kw
    )


PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The quick brown fox",
    "import json\nimport os\n\nclass Config:\n    def __init__(self, path):",
    "Hello, world",
]
GEN = 6


def alone(model: colibri_backend.Model, ids: list[int]) -> list[np.ndarray]:
    """Greedy logits rows of one request on sequence 0 by the single-sequence calls."""
    rows = [model.next_logits(ids)]
    seq = list(ids)
    for _ in range(GEN - 1):
        seq.append(int(rows[-1].argmax()))
        rows.append(model.next_logits(seq))
    return rows


def batched(model: colibri_backend.Model, prompts: list[list[int]], joins: list[int], chunk: int):
    """The requests as a scheduler interleaves them: each step every decoding request's token, then
    at most ``chunk`` prompt tokens of the first one still prefilling; requests take the lowest free
    sequence (the fourth waits for one to be freed)."""
    n_seq = model.max_concurrency
    free = list(range(n_seq))
    seq = [None] * len(prompts)
    fed = [0] * len(prompts)
    nxt = [0] * len(prompts)
    rows: list[list[np.ndarray]] = [[] for _ in prompts]
    for step in range(200):
        for i in range(len(prompts)):
            if seq[i] is None and step >= joins[i] and free and len(rows[i]) < GEN:
                seq[i] = free.pop(0)
                assert model.seq_n_past(seq[i]) == 0
        ids, toks, want, owner = [], [], [], []
        for i, s in enumerate(seq):
            if s is not None and fed[i] == len(prompts[i]):
                ids.append(s), toks.append(nxt[i]), want.append(1), owner.append(i)
        budget = chunk
        for i, s in enumerate(seq):
            while s is not None and budget and fed[i] < len(prompts[i]):
                ids.append(s), toks.append(prompts[i][fed[i]]), owner.append(i)
                fed[i] += 1
                want.append(int(fed[i] == len(prompts[i])))
                budget -= 1
        if not toks:
            if all(len(r) == GEN for r in rows):
                break
            continue
        out = model.eval_batch(np.array(ids), np.array(toks), np.array(want))
        assert model.stats()["allocs_last_eval"] == 0
        r = 0
        for t, i in enumerate(owner):
            if not want[t]:
                continue
            rows[i].append(out[r].copy())
            nxt[i] = int(out[r].argmax())
            r += 1
            if len(rows[i]) == GEN:
                model.seq_truncate(seq[i], 0)
                free.append(seq[i])
                seq[i] = None
    return rows


@pytest.mark.parametrize("slots", [None, "25%"])
def test_batched_logits_bit_identical_to_alone(checkpoint: Path, slots: str | None) -> None:
    extra = {"expert_slots": slots} if slots else {}
    with load(checkpoint, 1, **extra) as one, load(checkpoint, 3, **extra) as many:
        if slots:
            assert many.stats()["expert_slots"] < many.info.n_layer * many.info.n_expert
        prompts = [one.tokenize(p) for p in PROMPTS]
        assert min(len(p) for p in prompts) > 4  # every prompt spans chunks
        ref = [alone(one, p) for p in prompts]
        got = batched(many, prompts, joins=[0, 1, 3, 4], chunk=5)
        for i in range(len(prompts)):
            assert len(got[i]) == GEN
            for g in range(GEN):
                assert np.array_equal(ref[i][g], got[i][g]), f"request {i}, row {g} differs from alone"


def test_eval_batch_errors_change_nothing(checkpoint: Path) -> None:
    with load(checkpoint, 2) as m:
        assert m.max_concurrency == 2
        m.eval_batch(np.array([0, 1, 1]), np.array([5, 6, 7]), np.array([1, 0, 1]))
        assert (m.seq_n_past(0), m.seq_n_past(1)) == (1, 2)
        with pytest.raises(EngineError, match="sequence id 2"):
            m.eval_batch(np.array([0, 2]), np.array([5, 6]), np.array([1, 1]))
        with pytest.raises(ValueError, match="out of range"):
            m.eval_batch(np.array([0]), np.array([m.info.n_vocab]), np.array([1]))
        with pytest.raises(ContextFullError, match="sequence 1"):
            m.eval_batch(np.ones(CTX - 1, dtype=np.int32), np.full(CTX - 1, 5), np.zeros(CTX - 1))
        assert (m.seq_n_past(0), m.seq_n_past(1)) == (1, 2)
        with pytest.raises(ValueError, match="sequence 5"):
            m.seq_n_past(5)
        with pytest.raises(EngineError, match="outside"):
            m.seq_truncate(1, 3)
        m.seq_truncate(1, 0)
        assert m.seq_n_past(1) == 0
        # the single-sequence calls are sequence 0's, and start it afresh after batched use
        ids = m.tokenize("The quick brown fox")
        np.testing.assert_array_equal(m.next_logits(ids), m.logits(ids)[-1])
    with pytest.raises(ValueError, match="max_concurrency"):
        colibri_backend.LoadOptions(max_concurrency=0)


def _generate(model, ids, sampling, steps=None, logprobs=0):
    extra = {"steps": steps} if steps is not None else {}
    evs = list(model.generate_tokens(ids, max_tokens=12, sampling=sampling, logprobs=logprobs, **extra))
    return [e.token_id for e in evs], [e.logprob for e in evs], "".join(e.text for e in evs)


def test_scheduler_outputs_equal_alone_and_cancel_mid_prefill(checkpoint: Path) -> None:
    greedy = SamplingParams(temperature=0.0)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    with load(checkpoint, 3) as m:
        prompts = [m.tokenize(p) for p in PROMPTS]
        cases = [(prompts[i % len(prompts)], greedy if i % 2 else seeded) for i in range(5)]
        ref = [_generate(m, ids, s) for ids, s in cases]  # alone, sequence 0, one at a time
        sched = BatchScheduler(m, prefill_chunk=4)
        stats0 = m.stats()
        try:
            got: list = [None] * len(cases)

            def run(i: int) -> None:
                time.sleep(0.01 * i)  # join at different steps
                with sched.sequence() as seq:
                    got[i] = _generate(m, cases[i][0], cases[i][1], steps=seq)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert got == ref
            assert sched.steps < sum(len(ids) // 4 + 12 for ids, _ in cases)  # steps were shared
            # the step figures (/metrics): every token the engine evaluated came through a step
            stats1 = m.stats()
            evaluated = sum(stats1[k] - stats0[k] for k in ("n_prompt_tokens", "n_decode_tokens"))
            assert sched.step_tokens == evaluated > sched.steps
            engine = sum(stats1[k] - stats0[k] for k in ("decode_seconds", "prefill_seconds"))
            assert sched.engine_seconds >= engine > 0  # the call's wall time holds the engine's own
            assert sched.between_seconds > 0 and 0 <= sched.partial_steps < sched.steps
            # the prompt / decode split: a generation of k tokens evaluates k - 1 of them, the rest
            # of the steps' tokens are prompt tokens, carried by the steps counted as prefill steps
            decoded = sum(len(toks) - 1 for toks, _, _ in got)
            assert sched.step_tokens - sched.prompt_tokens == decoded
            assert 0 < sched.prefill_steps < sched.steps
            assert 0 < sched.prefill_engine_seconds < sched.engine_seconds
            # decode-only steps: each carried at least one token and at most one per sequence, and their
            # tokens are the decode tokens the prompt-carrying steps did not carry
            decode_only = sched.steps - sched.prefill_steps
            assert decode_only <= sched.decode_only_tokens <= min(decoded, 3 * decode_only)
            # the step thread names itself for per-thread CPU figures (top -H, concurrency.py)
            comm = Path(f"/proc/self/task/{sched._thread.native_id}/comm")
            if comm.exists():
                assert comm.read_text().strip() == STEP_THREAD

            # cancel in the middle of a long prompt, while another request decodes
            long_prompt = (prompts[2] * 6)[: CTX - 20]
            cancel = threading.Event()
            outcome: list = []

            def doomed() -> None:
                with sched.sequence(cancel) as seq:
                    try:
                        _generate(m, long_prompt, greedy, steps=seq)
                        outcome.append("finished")
                    except Cancelled:
                        outcome.append(("cancelled", m.seq_n_past(seq.seq)))

            # the client goes away once three chunks of the prompt are in: set from the step itself, so
            # the test does not race the scheduler's thread (a test thread starved by a loaded machine
            # used to see the whole prompt in before it cancelled)
            eval_batch, steps_in = m.eval_batch, [0]

            def eval_and_cancel(*args):
                rows = eval_batch(*args)
                steps_in[0] += 1
                if steps_in[0] == 3:
                    cancel.set()
                return rows

            m.eval_batch = eval_and_cancel
            try:
                t = threading.Thread(target=doomed)
                t.start()
                cancel.wait(30)
            finally:
                m.eval_batch = eval_batch
            with sched.sequence() as seq:
                other = _generate(m, cases[0][0], cases[0][1], steps=seq)
            t.join(30)
            assert outcome and outcome[0][0] == "cancelled"
            assert 4 * 3 <= outcome[0][1] < len(long_prompt)  # stopped part way through the prompt
            assert other == ref[0]
            assert sched.active == 0 and all(m.seq_n_past(s) == 0 for s in range(3))
        finally:
            sched.close()
        with pytest.raises(Cancelled):
            with sched.sequence() as seq:
                seq.prefill(prompts[0])


def test_scheduler_with_streamed_experts_takes_large_prompt_chunks(checkpoint: Path) -> None:
    """A quarter of the experts in the store's slots: the scheduler takes prompt tokens up to the batch
    size while others decode (one read of the experts for a whole chunk), outputs stay the same as alone,
    and the per-kind store counters add up to what the engine counted in the steps."""
    greedy = SamplingParams(temperature=0.0)
    with load(checkpoint, 3, expert_slots="25%") as m:
        prompts = [m.tokenize(p) for p in PROMPTS]
        ref = [_generate(m, ids, greedy) for ids in prompts[:3]]
        sched = BatchScheduler(m, prefill_chunk=2)
        assert sched.streams_experts and sched.busy_chunk == sched.idle_chunk == 8
        stats0 = m.stats()
        try:
            got: list = [None] * 3

            def run(i: int) -> None:
                deadline = time.time() + 30
                # the others arrive once the first decodes: their prompts come in beside its tokens
                while i and sched.steps == sched.prefill_steps and time.time() < deadline:
                    time.sleep(0.001)
                with sched.sequence() as seq:
                    got[i] = _generate(m, prompts[i], greedy, steps=seq)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert got == ref
            stats1 = m.stats()
            # the later prompts came in beside decodes in chunks of up to 8 tokens, not prefill_chunk's 2
            first, later = len(prompts[0]), len(prompts[1]) + len(prompts[2])
            assert sched.prefill_steps <= -(-first // 8) + -(-later // 8) + 1 < later // 2
            for key in ("expert_misses", "expert_bytes_read", "expert_stall_seconds"):
                counted = sched.store["prefill"][key] + sched.store["decode"][key]
                assert counted == pytest.approx(stats1[key] - stats0[key])
            assert (
                sched.store["prefill"]["expert_bytes_read"] > 0 and sched.store["decode"]["expert_misses"] > 0
            )
        finally:
            sched.close()
