"""State blobs (native/src/kv_io.c) for every cache kind: the latent (MLA) cache of DeepSeek-V2, the
sliding-window rings of gpt-oss and Gemma 4, the recurrent state of Qwen3.5-MoE; and that kind's
recurrent state per sequence (several sequences in one context, batched bit-identically to alone).

* A prefix's state saved from one context and restored into a fresh one (into sequence 0, and into
  sequence 1 while sequence 0 runs another prompt in the same batched steps) continues with logits
  bit-identical to a cold run of the whole prompt.
* What a blob can be saved at: any n for the latent cache (and a shorter prefix of it restored by a
  cut); for a ring only while it still holds the rows (the whole length, or a prefix the ring never
  wrapped past); for a recurrent state its position, its checkpoint or 0. Refusals name the reason.
* Bad blobs (truncated, a flipped byte, an unknown version, a ring of another size, another sequence id)
  are refused and the context is left as it was; so are blobs whose fields were changed and whose
  checksum was then made valid again (the test's own colibri-mx64), each by the engine's length checks.
* The engine's prefix cache on these models: a prompt that extends an earlier one (an agent's next
  turn) restores the earlier prompt's stored state (a ring's entry also serves a prompt differing in its
  last tokens, within the ring's reach), and its tokens and log-probabilities equal a cold run;
  the same through the batch scheduler, the next turn restored into a sequence of its own.
* Qwen3.5-MoE with 3 sequences: every sequence's logits in mixed batched steps equal that prompt alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tiny_models as tm

SPECS = ["qwen35moe", "deepseek_v2", "gemma4", "gpt_oss"]
RING = {"gemma4", "gpt_oss"}
N_PREFIX, N_ALL, N_CTX = 64, 96, 160  # the tiny rings keep 2 * window - 1 = 23 rows: 64 wraps them
RING_REACH = 12  # 23 rows - window 12 + 1: how far a restored ring can be cut back


def _load(colibri: Any, gguf: Any, **kw: Any) -> Any:
    return colibri.load(gguf, threads=tm.ENGINE_THREADS, context_length=N_CTX, prefix_cache_size=0, **kw)


def _eval_all(m: Any, ids: list[int]) -> np.ndarray:
    """Logits of every token of ids appended to sequence 0 (colibri_eval, all rows)."""
    from colibri_backend import _native

    arr = np.asarray(ids, dtype=np.int32)
    out = np.empty((arr.size, m.info.n_vocab), dtype=np.float32)
    status = m._lib.colibri_eval(m._ctx, _native.i32_ptr(arr), int(arr.size), _native.f32_ptr(out), 1)
    m._lib.check(status, "eval")
    return out


def _load_blob(m: Any, blob: bytes, seq: int = 0) -> int:
    """colibri_seq_state_load's status (0: loaded)."""
    return int(m._lib.colibri_seq_state_load(m._ctx, seq, blob, len(blob)))


def _prefix_blob(colibri: Any, gguf: Any, ids: list[int]) -> bytes:
    """The state blob of ids[:N_PREFIX], saved from a fresh context."""
    with _load(colibri, gguf) as m:
        m.next_logits(ids[:N_PREFIX])
        return m._save_state(N_PREFIX)


@pytest.fixture(scope="module")
def cold(tiny_zoo: Any, colibri: Any) -> dict[str, tuple[list[int], np.ndarray]]:
    """Each model's prompt and its teacher-forced logits in one fresh context."""
    out = {}
    for name in SPECS:
        ids = tm.token_ids(tiny_zoo.checkpoint(name), N_ALL, seed=3)
        with _load(colibri, tiny_zoo.gguf(name, "f32")) as m:
            out[name] = (ids, m.logits(ids))
    return out


@pytest.mark.parametrize("name", SPECS)
def test_restored_prefix_continues_as_a_cold_run(tiny_zoo: Any, colibri: Any, cold: dict, name: str) -> None:
    ids, want = cold[name]
    gguf = tiny_zoo.gguf(name, "f32")
    with _load(colibri, gguf) as m:
        m.next_logits(ids[:N_PREFIX])
        blob = m._save_state(N_PREFIX)
        # how far a restored blob can be cut back: any prefix, a ring's 12 rows past its window, or 0
        reach = {"deepseek_v2": N_CTX, "qwen35moe": 0}.get(name, RING_REACH)
        assert m._lib.colibri_state_reach(m._ctx) == reach
    with _load(colibri, gguf, max_concurrency=2) as m:
        assert _load_blob(m, blob) == 0 and m.seq_n_past(0) == N_PREFIX
        got = _eval_all(m, ids[N_PREFIX:])
        assert np.array_equal(got, want[N_PREFIX:]), "restored into sequence 0: not the cold logits"
        # into sequence 1, its rest batched beside another prompt's tokens on sequence 0
        m.seq_truncate(0, 0)
        assert _load_blob(m, blob, seq=1) == 0 and m.seq_n_past(1) == N_PREFIX
        other = ids[10:30]
        rest = ids[N_PREFIX:]
        seqs = np.array([0] * len(other) + [1] * len(rest))
        rows = m.eval_batch(seqs, np.array(other + rest), np.ones(seqs.size, dtype=np.uint8))
        assert np.array_equal(rows[len(other) :], want[N_PREFIX:]), "sequence 1: not the cold logits"
    tm.report(f"{name}: a {N_PREFIX}-token prefix restored from {len(blob)} bytes continues bit-identically")


@pytest.mark.parametrize("name", SPECS)
def test_what_a_blob_can_be_saved_at(tiny_zoo: Any, colibri: Any, cold: dict, name: str) -> None:
    from colibri_backend.errors import EngineError

    ids, want = cold[name]
    gguf = tiny_zoo.gguf(name, "f32")
    with _load(colibri, gguf) as m:
        m.next_logits(ids)  # the whole prompt: sequence 0 is at N_ALL, a checkpoint at N_ALL - 1
        whole = m._save_state(N_ALL)
        if name == "deepseek_v2":
            part = m._save_state(N_PREFIX)  # the latent rows of any prefix
        else:
            reason = "ring" if name in RING else "recurrent state"
            with pytest.raises(EngineError, match=reason):
                m._save_state(N_PREFIX)
            part = None
        ckpt = m._save_state(N_ALL - 1) if name == "qwen35moe" else None
    with _load(colibri, gguf) as m:
        assert _load_blob(m, whole) == 0 and m.seq_n_past(0) == N_ALL
        if part is not None:  # a latent blob serves any shorter prefix: load, then cut
            assert _load_blob(m, part) == 0
            m.seq_truncate(0, 40)
            assert np.array_equal(_eval_all(m, ids[40:]), want[40:])
        if ckpt is not None:  # the checkpoint's state, restored at its own position
            assert _load_blob(m, ckpt) == 0 and m.seq_n_past(0) == N_ALL - 1
            assert np.array_equal(_eval_all(m, ids[N_ALL - 1 :]), want[N_ALL - 1 :])
    if name in RING:  # a ring that never wrapped holds every row: any prefix of it is saved
        with _load(colibri, gguf) as m:
            m.next_logits(ids[:20])
            short = m._save_state(12)
        with _load(colibri, gguf) as m:
            assert _load_blob(m, short) == 0
            assert np.array_equal(_eval_all(m, ids[12:]), want[12:])


@pytest.mark.parametrize("name", SPECS)
def test_bad_blobs_leave_the_context_as_it_was(tiny_zoo: Any, colibri: Any, cold: dict, name: str) -> None:
    ids, want = cold[name]
    gguf = tiny_zoo.gguf(name, "f32")
    blob = _prefix_blob(colibri, gguf, ids)
    rng = np.random.default_rng(7)
    bad = {"truncated": blob[:-9], "empty": b"", "version": blob[:8] + b"\x07" + blob[9:]}
    for i in range(6):
        flipped = bytearray(blob)
        flipped[int(rng.integers(48, len(blob) - 8))] ^= 1 << int(rng.integers(0, 8))
        bad[f"flipped{i}"] = bytes(flipped)
    with _load(colibri, gguf, max_concurrency=2) as m:
        m.next_logits(ids[:N_PREFIX])  # the context's own state, which a refused blob must not touch
        for what, b in bad.items():
            assert _load_blob(m, b) != 0, what
            assert _load_blob(m, b, seq=1) != 0, what
        assert _load_blob(m, bad["version"]) != 0 and "version 7" in m._lib.last_error()
        assert _load_blob(m, blob, seq=2) != 0 and "sequence 2" in m._lib.last_error()
        assert m.seq_n_past(0) == N_PREFIX and m.seq_n_past(1) == 0
        assert np.array_equal(_eval_all(m, ids[N_PREFIX:]), want[N_PREFIX:])
    if name in RING:  # a context of another batch size keeps rings of another size
        with _load(colibri, gguf, batch_size=4) as m:
            assert _load_blob(m, blob) != 0 and "ring was saved with 23 rows" in m._lib.last_error()


_M64 = (1 << 64) - 1
_P1, _P2, _P3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M64


def _digest(data: bytes) -> int:
    """colibri-mx64 (native/src/digest.h: word k to lane k % 4, v = rotl((v ^ w) * P1, 29), then the
    length and an avalanche), so a test can re-seal a blob whose fields it changed."""
    padded = data + b"\0" * (-len(data) % 8)
    words = np.frombuffer(padded, dtype="<u8").tolist()
    v = [_P3 * (i + 1) & _M64 for i in range(4)]
    for k, w in enumerate(words):
        v[k % 4] = _rotl(((v[k % 4] ^ w) * _P1) & _M64, 29)
    h = len(data) * _P2 & _M64
    for lane in v:
        h = _rotl(((h ^ lane) * _P2) & _M64, 31)
    h ^= h >> 33
    h = h * _P2 & _M64
    h ^= h >> 29
    h = h * _P3 & _M64
    return h ^ (h >> 32)


def _sealed(body: bytes) -> bytes:
    return body + _digest(body).to_bytes(8, "little")


def _sections(blob: bytes) -> list[tuple[int, bytes, int]]:
    """(offset, tag, bytes) of each section."""
    out, off = [], 48
    for _ in range(int.from_bytes(blob[12:16], "little")):
        n = int.from_bytes(blob[off + 8 : off + 16], "little")
        out.append((off, blob[off : off + 4], n))
        off += 16 + n
    return out


@pytest.mark.parametrize("name", SPECS)
def test_resealed_blobs_with_wrong_fields_are_refused(
    tiny_zoo: Any, colibri: Any, cold: dict, name: str
) -> None:
    """Fields changed and the checksum made valid again, so the engine's own length and layout checks
    must catch each one (and random changes anywhere either load or are refused, never crash)."""
    ids, want = cold[name]
    gguf = tiny_zoo.gguf(name, "f32")
    blob = _prefix_blob(colibri, gguf, ids)
    assert _sealed(blob[:-8]) == blob, "the test's digest is not the engine's"
    secs = _sections(blob)
    tags = [t for _, t, _ in secs]
    assert tags[0] == b"KVC1" and len(tags) == 2
    assert tags[1] == {"qwen35moe": b"REC1", "deepseek_v2": b"MLA1"}.get(name, b"RNG1")

    def field(off: int, value: int, width: int = 4) -> bytes:
        b = bytearray(blob[:-8])
        b[off : off + width] = value.to_bytes(width, "little")
        return _sealed(bytes(b))

    last_off, _, last_n = secs[-1]
    cases = {
        "version 1": (field(8, 1), "version 1 state holds the KV cache alone"),
        "one token more": (field(40, N_PREFIX + 1), "bytes"),
        "one section fewer": (field(12, 1), "sections"),
        "a swapped tag": (field(last_off, int.from_bytes(b"KVC1", "little")), "is not a"),
        "a section past the end": (field(last_off + 8, 1 << 62, 8), "runs past the blob"),
        "a shorter section": (field(last_off + 8, last_n - 4, 8), "bytes"),
        "too many tokens": (field(40, N_CTX + 1), "tokens"),
        "another KV type": (field(36, 2), "int8"),
    }
    if name in RING:
        cases["another ring"] = (field(last_off + 16, 24), "ring was saved with 24 rows")
    rng = np.random.default_rng(3)
    with _load(colibri, gguf) as m:
        m.next_logits(ids[:N_PREFIX])
        for what, (b, message) in cases.items():
            assert _load_blob(m, b) != 0, what
            assert message in m._lib.last_error(), (what, m._lib.last_error())
        assert m.seq_n_past(0) == N_PREFIX
        assert np.array_equal(_eval_all(m, ids[N_PREFIX:]), want[N_PREFIX:])
        for _ in range(40):  # any byte of the header and section heads, re-sealed
            b = bytearray(blob[:-8])
            off = int(
                rng.choice([int(rng.integers(8, 48)), *(o + int(rng.integers(0, 16)) for o, _, _ in secs)])
            )
            b[off] ^= 1 << int(rng.integers(0, 8))
            status = _load_blob(m, _sealed(bytes(b)))
            assert status != 0 or m.seq_n_past(0) == int.from_bytes(b[40:44], "little")
            m._lib.check(_load_blob(m, blob), "reload")  # back to the saved state either way
        assert np.array_equal(_eval_all(m, ids[N_PREFIX:]), want[N_PREFIX:])


@pytest.mark.parametrize("name", SPECS)
def test_prefix_cache_serves_the_next_turn(tiny_zoo: Any, colibri: Any, name: str) -> None:
    from colibri_backend.adapters.sampling import SamplingParams
    from colibri_backend.prefix_cache import save_point

    ckpt = tiny_zoo.checkpoint(name)
    turn1 = tm.token_ids(ckpt, 70, seed=8)
    turn2 = turn1 + tm.token_ids(ckpt, 20, seed=9)  # the earlier prompt and more: an agent's next turn
    sampling = SamplingParams(temperature=0.8, seed=3)
    gguf = tiny_zoo.gguf(name, "f32")

    def run(m: Any, prompt: list[int]) -> tuple[list[tuple[int, float]], int | None]:
        evs = list(m.generate_tokens(prompt, max_tokens=6, sampling=sampling, logprobs=0))
        return [(e.token_id, e.logprob) for e in evs], evs[0].cached_tokens

    with _load(colibri, gguf) as m:
        want, _ = run(m, turn2)
    with colibri.load(gguf, threads=tm.ENGINE_THREADS, context_length=N_CTX) as m:
        run(m, turn1)
        m._reset_cache()  # so the reuse comes from the stored state, not the live context
        got, cached = run(m, turn2)
        reach = m.prefix_cache.reach
    assert got == want
    assert cached == save_point(len(turn1), reach), cached
    tm.report(f"{name}: the next turn restored {cached} of {len(turn2)} tokens (reach {reach})")


@pytest.mark.parametrize("name", sorted(RING))
def test_ring_entry_serves_prompts_within_its_reach(tiny_zoo: Any, colibri: Any, name: str) -> None:
    """A ring's entry serves a prompt that differs in its last tokens when the ring still holds the rows
    the cut needs (at most the reach, 12 here); a prompt that differs earlier is evaluated from 0.
    Both answers equal cold runs."""
    from colibri_backend.adapters.sampling import SamplingParams

    ckpt = tiny_zoo.checkpoint(name)
    shared = tm.token_ids(ckpt, 64, seed=8)
    first = shared + tm.token_ids(ckpt, RING_REACH - 2, seed=9)
    near = shared + tm.token_ids(ckpt, 7, seed=10)  # the entry is cut back by RING_REACH - 2
    far = shared[:40] + tm.token_ids(ckpt, 30, seed=11)  # it would be cut back by 34 > the reach
    sampling = SamplingParams(temperature=0.0)
    gguf = tiny_zoo.gguf(name, "f32")

    def run(m: Any, prompt: list[int]) -> tuple[list[int], int | None]:
        evs = list(m.generate_tokens(prompt, max_tokens=5, sampling=sampling))
        return [e.token_id for e in evs], evs[0].cached_tokens

    with _load(colibri, gguf) as m:
        want = {}
        for k, p in (("near", near), ("far", far)):
            m._reset_cache()
            want[k] = run(m, p)[0]
    with colibri.load(gguf, threads=tm.ENGINE_THREADS, context_length=N_CTX) as m:
        assert m.prefix_cache.reach == RING_REACH
        run(m, first)
        out = {}
        for k, p in (("near", near), ("far", far)):
            m._reset_cache()
            out[k] = run(m, p)
    assert out["near"] == (want["near"], len(shared))
    assert out["far"] == (want["far"], 0)


@pytest.mark.parametrize("name", SPECS)
def test_batched_requests_restore_stored_prefixes(tiny_zoo: Any, colibri: Any, name: str) -> None:
    """The scheduler's path (server/scheduler.py, 2 sequences, prefill chunks of 8): the first request stores
    its prompt as its prefill passes the save point, a next turn on the other sequence restores it into its
    own sequence, and both outputs equal cold runs."""
    from colibri_backend.adapters.sampling import SamplingParams
    from colibri_backend.prefix_cache import save_point
    from colibri_backend.server.scheduler import BatchScheduler

    ckpt = tiny_zoo.checkpoint(name)
    turn1 = tm.token_ids(ckpt, 70, seed=8)
    turn2 = turn1 + tm.token_ids(ckpt, 20, seed=9)
    sampling = SamplingParams(temperature=0.8, seed=5)
    gguf = tiny_zoo.gguf(name, "f32")

    def run(m: Any, prompt: list[int], steps: Any = None) -> list[tuple[int, float]]:
        extra = {"steps": steps} if steps is not None else {}
        evs = m.generate_tokens(prompt, max_tokens=6, sampling=sampling, logprobs=0, **extra)
        return [(e.token_id, e.logprob) for e in evs]

    with _load(colibri, gguf) as m:
        want = [run(m, turn1), run(m, turn2)]
    with colibri.load(gguf, threads=tm.ENGINE_THREADS, context_length=N_CTX, max_concurrency=2) as m:
        sched = BatchScheduler(m, prefill_chunk=8)
        try:
            with sched.sequence() as first:
                got1 = run(m, turn1, first)
                assert first.cached_tokens == 0
                with sched.sequence() as second:  # joins while the first still holds its sequence
                    got2 = run(m, turn2, second)
                    assert second.seq != first.seq
                    cached = second.cached_tokens
        finally:
            sched.close()
        reach = m.prefix_cache.reach
    assert [got1, got2] == want
    assert cached == save_point(len(turn1), reach)


@pytest.mark.parametrize("spec", ["qwen35moe", "lfm2moe", "lfm2_bias"])
def test_recurrent_sequences_batched_equal_alone(tiny_zoo: Any, colibri: Any, spec: str) -> None:
    """Three prompts of a model with recurrent state (Qwen3.5-MoE's Gated DeltaNet, LFM2's short
    convolutions) joining at different steps, prefilled in chunks of 5 beside the others' decode tokens:
    every logits row equals that prompt's alone, bit for bit."""
    gguf = tiny_zoo.gguf(spec, "f32")
    ckpt = tiny_zoo.checkpoint(spec)
    prompts = [tm.token_ids(ckpt, n, seed=s) for n, s in ((23, 1), (17, 2), (30, 3))]
    joins = [0, 2, 5]
    with _load(colibri, gguf) as m:
        alone = [m.logits(p) for p in prompts]
    with _load(colibri, gguf, max_concurrency=3) as m:
        assert m.max_concurrency == 3
        done = [0, 0, 0]
        got: list[list[np.ndarray]] = [[], [], []]
        step = 0
        while any(d < len(p) for d, p in zip(done, prompts, strict=True)):
            seqs, toks = [], []
            for q, p in enumerate(prompts):
                if step < joins[q] or done[q] >= len(p):
                    continue
                take = 1 if done[q] >= 10 else min(5, len(p) - done[q])  # a prompt, then one token a step
                seqs += [q] * take
                toks += p[done[q] : done[q] + take]
                done[q] += take
            step += 1
            if not seqs:
                continue
            rows = m.eval_batch(np.array(seqs), np.array(toks), np.ones(len(seqs), dtype=np.uint8))
            for q, r in zip(seqs, rows, strict=True):
                got[q].append(r)
    for q in range(3):
        assert np.array_equal(np.stack(got[q]), alone[q]), f"sequence {q} differs from its prompt alone"
    tm.report(f"{spec}: 3 sequences in mixed batched steps bit-identical to each alone")
