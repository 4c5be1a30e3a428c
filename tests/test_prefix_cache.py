"""The prefix cache (colibri_backend.prefix_cache): KV states reused across requests that share a prefix.

* the cache itself: longest prefix, token-exact, the live context as a candidate, LRU in bytes,
  superseded prefixes dropped, files written atomically and indexed again by a new cache, broken files
  ignored with a warning and removed;
* the engine: a request sharing a 1,500-token prefix with an earlier one evaluates only the rest, gives
  the same tokens and log-probabilities as a cold run and reports cached_tokens; a model loaded again
  with the same kv_cache_dir reuses it; a corrupt blob is refused by the engine, dropped, and the
  request is answered cold and identically; on the batched path a slow disk write of one request's entry
  holds no lock, so another request decodes meanwhile, and the file appears whole once written;
* a real `colibri serve --kv-cache-dir` on loopback: usage.prompt_tokens_details.cached_tokens
  (completions, chat), input_tokens_details.cached_tokens (responses), cache_read_input_tokens
  (messages), before and after a restart.

The model is a tiny random Mixtral (2 layers of width 64) with SmolLM2's tokenizer and chat template,
so 1,500 tokens evaluate in about a second.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import colibri_backend
from colibri_backend.adapters.sampling import SamplingParams
from colibri_backend.convert import convert
from colibri_backend.load_options import LoadOptions
from colibri_backend.prefix_cache import BLOCK, SUFFIX, PrefixCache
from colibri_backend.server.scheduler import BatchScheduler

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import make_bench_models as mbm  # noqa: E402
from test_server import API_KEY, Server  # noqa: E402

PREFIX = 1500
TOKENS_AT = 56  # a cache file's tokens start after its 24-byte header and 32-byte digest
SAMPLING = SamplingParams(temperature=0.8, seed=11)


def arr(xs: list[int]) -> np.ndarray:
    return np.asarray(xs, dtype=np.int32)


# ---- the cache on its own ------------------------------------------------------------------------


def test_longest_prefix_token_exact_and_live_context() -> None:
    cache = PrefixCache(1 << 20)
    a = arr(list(range(100, 100 + 3 * BLOCK)))
    cache.put(a, lambda: b"A" * 10)
    b = a.copy()
    b[2 * BLOCK + 5] = 7  # shares 2 blocks and 5 tokens with a
    r = cache.best(b, arr([]), b.size - 1)
    assert r.entry is not None and r.n == 2 * BLOCK + 5
    assert cache.blob(r.entry) == b"A" * 10
    # the live context wins when it shares more, and costs nothing to restore
    r = cache.best(b, b[:-1], b.size - 1)
    assert r.entry is None and r.n == b.size - 1
    # a prompt that shares less than one block with every entry finds none
    c = a.copy()
    c[3] = 9
    assert cache.best(c, arr([]), c.size - 1).entry is None
    # the limit caps the reuse (the last prompt token is always evaluated)
    assert cache.best(a, arr([]), a.size - 1).n == a.size - 1
    # an entry longer than the context is kept (on disk, for a longer context) but never offered
    short = PrefixCache(1 << 20, max_tokens=2 * BLOCK)
    short.put(a, lambda: b"A")
    assert short.stats()["prefix_cache_entries"] == 1 and short.best(a, arr([]), a.size - 1).entry is None


def test_lru_bound_and_superseded_prefixes() -> None:
    cache = PrefixCache(250)
    base = list(range(1000, 1000 + 2 * BLOCK))
    p1 = arr(base)
    cache.put(p1, lambda: b"x" * 100)
    p2 = arr(base + list(range(50, 50 + BLOCK)))  # extends p1: p1 is dropped
    cache.put(p2, lambda: b"y" * 100)
    assert cache.stats()["prefix_cache_entries"] == 1 and cache.bytes == 100
    calls = []
    assert cache.put(p1, lambda: calls.append(1) or b"z") is None and not calls  # covered: not even saved
    others = [arr([i] * (2 * BLOCK)) for i in (1, 2)]
    for o in others:
        cache.put(o, lambda: b"o" * 100)
    # 300 bytes > 250: the least recently used (p2) went first
    assert cache.bytes == 200
    assert cache.best(p2, arr([]), p2.size).entry is None
    r = cache.best(others[0], arr([]), others[0].size)
    cache.used(r.entry, r.n)  # others[0] is now the most recent
    cache.put(arr([3] * (2 * BLOCK)), lambda: b"t" * 100)
    assert cache.best(others[0], arr([]), others[0].size).entry is not None
    assert cache.best(others[1], arr([]), others[1].size).entry is None
    # too short to store, or bigger than the whole cache
    assert cache.put(arr([5] * (BLOCK - 1)), lambda: b"s") is None
    assert cache.put(arr([6] * BLOCK), lambda: b"b" * 251) is None
    assert PrefixCache(0).put(arr([7] * BLOCK), lambda: b"n") is None


def test_files_survive_and_broken_ones_are_removed(tmp_path: Path) -> None:
    cache = PrefixCache(1 << 20, "ns", tmp_path)
    toks = [arr([i] * BLOCK + list(range(BLOCK))) for i in range(5)]
    for i, t in enumerate(toks):
        cache.put(t, lambda i=i: bytes([i]) * 64)
    files = sorted((tmp_path / "ns").glob(f"*{SUFFIX}"))
    assert len(files) == 5 and not list((tmp_path / "ns").glob(".tmp-*"))
    by_first = {int(np.frombuffer(f.read_bytes()[TOKENS_AT : TOKENS_AT + 4], "<i4")[0]): f for f in files}
    by_first[1].write_bytes(by_first[1].read_bytes()[:-1])  # truncated
    data = bytearray(by_first[2].read_bytes())
    data[TOKENS_AT + 8] ^= 1  # a token flipped: the digest no longer matches
    by_first[2].write_bytes(bytes(data))
    by_first[3].write_bytes(b"not a cache file")
    (tmp_path / "ns" / f".tmp-crashed{SUFFIX}").write_bytes(b"partial")
    with pytest.warns(UserWarning, match="prefix cache: ignoring") as caught:
        again = PrefixCache(1 << 20, "ns", tmp_path)
    assert len(caught) == 3
    assert sorted((tmp_path / "ns").glob(f"*{SUFFIX}")) == sorted([by_first[0], by_first[4]])
    assert not list((tmp_path / "ns").glob(".tmp-*"))
    for i in (0, 4):
        r = again.best(toks[i], arr([]), toks[i].size)
        assert r.entry is not None and r.n == toks[i].size and again.blob(r.entry) == bytes([i]) * 64
    # a file changed after it was indexed: dropped when read, with a warning
    r = again.best(toks[4], arr([]), toks[4].size)
    again._entries[r.entry.key].blob = None
    by_first[4].write_bytes(b"gone")
    with pytest.warns(UserWarning, match="ignoring"):
        assert again.blob(r.entry) is None
    assert not by_first[4].exists()
    with pytest.raises(ValueError, match="kv_cache_dir: cannot use"):
        PrefixCache(1 << 20, "ns", by_first[0])  # a file, not a directory
    # another namespace (model, KV type) never sees these files
    assert PrefixCache(1 << 20, "other", tmp_path).stats()["prefix_cache_entries"] == 0


# ---- the engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prefix_model")
    spec = dataclasses.replace(
        mbm.SPECS["bench-a"],
        name="tiny-prefix",
        n_layer=2,
        hidden=64,
        n_head=4,
        n_head_kv=2,
        head_dim=16,
        n_ff_exp=32,
        n_expert=4,
        n_expert_used=2,
    )
    smol = Path(colibri_backend.resolve_model("smollm2").gguf)
    mbm.write_checkpoint(spec, root / "hf", smol, log=lambda *a: None)
    return convert(root / "hf", root / "tiny.f32.gguf", out_type="f32", progress=False)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(5)
    prefix = rng.integers(100, 40000, PREFIX).tolist()
    return {k: prefix + rng.integers(100, 40000, 24).tolist() for k in ("a", "b", "c")}


def run(model: colibri_backend.Model, ids: list[int]) -> tuple[list[tuple[int, float]], int | None]:
    evs = list(model.generate_tokens(ids, max_tokens=12, sampling=SAMPLING, logprobs=0))
    return [(e.token_id, e.logprob) for e in evs], evs[0].cached_tokens


@pytest.fixture(scope="module")
def cold(tiny: Path, prompts: dict[str, list[int]]) -> dict[str, list[tuple[int, float]]]:
    out = {}
    with colibri_backend.load(tiny, threads=2, prefix_cache_size=0) as m:
        for k, ids in prompts.items():
            m._reset_cache()  # nothing from the previous prompt either
            out[k], cached = run(m, ids)
            assert cached == 0
    return out


def test_shared_prefix_reused_identically_and_after_reload(
    tiny: Path, prompts: dict[str, list[int]], cold: dict, tmp_path: Path
) -> None:
    opts = LoadOptions(threads=2, kv_cache_dir=tmp_path)
    with colibri_backend.load(tiny, opts) as m:
        got, cached = run(m, prompts["a"])
        assert (got, cached) == (cold["a"], 0)
        m._reset_cache()  # so the reuse below comes from the stored state, not the live context
        got, cached = run(m, prompts["b"])
        assert got == cold["b"] and cached is not None and cached >= PREFIX
        assert m.last_request["cached_prompt_tokens"] == cached
        s = m.stats()
        assert s["prefix_cache_hits"] == 1 and s["prefix_cache_entries"] == 2
    with colibri_backend.load(tiny, opts) as m:  # a restart: the entries come from the directory
        assert m.prefix_cache.stats()["prefix_cache_entries"] == 2
        got, cached = run(m, prompts["c"])
        assert got == cold["c"] and cached is not None and cached >= PREFIX


def test_corrupt_blob_is_refused_and_answered_cold(
    tiny: Path, prompts: dict[str, list[int]], cold: dict, tmp_path: Path
) -> None:
    opts = LoadOptions(threads=2, kv_cache_dir=tmp_path)
    with colibri_backend.load(tiny, opts) as m:
        run(m, prompts["a"])
    (f,) = list(tmp_path.glob(f"*/*{SUFFIX}"))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40  # inside the KV rows: only the engine's checksum can tell
    f.write_bytes(bytes(data))
    with colibri_backend.load(tiny, opts) as m:
        with pytest.warns(UserWarning, match="checksum"):
            got, cached = run(m, prompts["b"])
        assert got == cold["b"] and cached == 0
        assert not f.exists() and m.stats()["prefix_cache_dropped_files"] == 1


def test_prefix_cache_options_and_budget(tiny: Path) -> None:
    with pytest.raises(ValueError, match="prefix_cache_size"):
        LoadOptions(prefix_cache_size="150%")
    with pytest.raises(ValueError, match="prefix_cache_size"):
        LoadOptions(prefix_cache_size="lots")
    assert LoadOptions(prefix_cache_size="0").prefix_cache_size == 0
    assert LoadOptions(prefix_cache_size="64M").prefix_cache_size == 64 << 20
    with pytest.raises(ValueError, match="kv_cache_dir"):
        LoadOptions(kv_cache_dir=str(tiny))  # a file
    budget = 512 << 20
    plan = colibri_backend.plan_memory(tiny, LoadOptions(memory_budget=budget, prefix_cache_size="25%"))
    assert plan["prefix_cache_bytes"] == budget // 4 and plan["budget"] == budget - budget // 4
    with colibri_backend.load(tiny, threads=2, memory_budget=budget, prefix_cache_size="25%") as m:
        assert m.prefix_cache.max_bytes == budget // 4
        assert m.memory_plan()["budget"] == budget - budget // 4


# ---- the server --------------------------------------------------------------------------------------


def serve(tiny: Path, directory: Path, cache_dir: Path) -> Server:
    config = directory / "colibri.toml"
    config.write_text(
        f'backend = "colibri"\nmodel = "tiny"\n\n[models.tiny]\npath = "{tiny}"\nthreads = 2\n'
        "context_length = 4096\n",
        encoding="utf-8",
    )
    return Server(config, "--kv-cache-dir", str(cache_dir))


def test_server_reports_cached_tokens_and_keeps_them_over_a_restart(tiny: Path, tmp_path: Path) -> None:
    with colibri_backend.load(tiny, threads=2, prefix_cache_size=0) as m:
        system = m.detokenize(np.random.default_rng(9).integers(100, 40000, PREFIX).tolist())
        n_system = len(m.tokenize(system))
        prompts = {k: f"{system} {k}" for k in ("first", "second", "third")}
        want = {}
        for k, p in prompts.items():
            m._reset_cache()
            want[k] = m.generate(p, max_tokens=8, temperature=0.0)
    assert n_system >= PREFIX
    cache_dir = tmp_path / "kv"

    def completion(s: Server, key: str) -> tuple[str, int]:
        r = s.client.completions.create(model="tiny", prompt=prompts[key], max_tokens=8, temperature=0.0)
        return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens

    def chat(s: Server, question: str) -> int:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        r = s.client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        return r.usage.prompt_tokens_details.cached_tokens

    s = serve(tiny, tmp_path, cache_dir)
    try:
        assert completion(s, "first") == (want["first"], 0)
        text, cached = completion(s, "second")
        assert text == want["second"] and cached >= n_system - BLOCK
        assert chat(s, "What is it?") < n_system  # a chat prompt starts with the template, not the text
        assert chat(s, "And why?") >= n_system
    finally:
        s.stop()
    s = serve(tiny, tmp_path, cache_dir)
    try:
        text, cached = completion(s, "third")
        assert text == want["third"] and cached >= n_system - BLOCK
        assert chat(s, "Once more?") >= n_system
        h = s.auth()
        body = {"model": "tiny", "instructions": system, "input": "Again?", "max_output_tokens": 4}
        r = s.http.post("/v1/responses", json=body, headers=h).json()
        assert r["usage"]["input_tokens_details"]["cached_tokens"] >= n_system
        body = {
            "model": "tiny",
            "system": system,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "Last one?"}],
        }
        r = s.http.post("/v1/messages", json=body, headers={**h, "x-api-key": API_KEY}).json()
        u = r["usage"]
        assert u["cache_read_input_tokens"] >= n_system and 0 < u["input_tokens"] < 100
    finally:
        s.stop()


def test_batched_requests_share_a_prefix(tiny: Path, tmp_path: Path) -> None:
    """Two concurrent requests on the batched path (--max-concurrency 2): the second joins while the first
    still streams, restores the first prompt's stored prefix into its own sequence, reports it as
    cached_tokens, and both outputs equal cold runs."""
    with colibri_backend.load(tiny, threads=2, prefix_cache_size=0) as m:
        system = m.detokenize(np.random.default_rng(4).integers(100, 40000, PREFIX).tolist())
        n_system = len(m.tokenize(system))
        prompts = {k: f"{system} {k}" for k in ("first", "second")}
        want = {}
        for k, n in (("first", 200), ("second", 8)):
            m._reset_cache()
            want[k] = m.generate(prompts[k], max_tokens=n, temperature=0.0)
    config = tmp_path / "colibri.toml"
    config.write_text(
        f'backend = "colibri"\nmodel = "tiny"\n\n[models.tiny]\npath = "{tiny}"\nthreads = 2\n'
        "context_length = 4096\n",
        encoding="utf-8",
    )
    s = Server(config, "--max-concurrency", "2")
    try:
        first = s.client.completions.create(
            model="tiny", prompt=prompts["first"], max_tokens=200, temperature=0.0, stream=True
        )
        chunks = iter(first)
        text = next(chunks).choices[0].text  # the first prompt is prefilled (and stored) by now
        r = s.client.completions.create(model="tiny", prompt=prompts["second"], max_tokens=8, temperature=0.0)
        text += "".join(c.choices[0].text for c in chunks if c.choices)
        assert r.choices[0].text == want["second"]
        assert r.usage.prompt_tokens_details.cached_tokens >= n_system - BLOCK
        assert text == want["first"]
    finally:
        s.stop()


def test_batched_disk_write_leaves_other_sequences_decoding(
    tiny: Path, prompts: dict[str, list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batched path (seq_remember) makes an entry's blob under the model's lock and writes its file
    after letting go of it: while one request's write hangs, another request's decode steps complete."""
    opts = LoadOptions(threads=2, kv_cache_dir=tmp_path, max_concurrency=2)
    with colibri_backend.load(tiny, opts) as m:
        directory = m.prefix_cache.directory
        assert directory is not None
        sched = BatchScheduler(m, prefill_chunk=64)
        release, writing = threading.Event(), threading.Event()
        try:
            first, second = sched.sequence(), sched.sequence()
            first.prefill(prompts["a"][: 3 * BLOCK + 5])  # stored, its file written as usual
            assert len(list(directory.glob(f"*{SUFFIX}"))) == 1
            real_write = PrefixCache._write

            def slow_write(cache: PrefixCache, entry: object) -> Path:
                writing.set()
                assert release.wait(60)
                return real_write(cache, entry)

            monkeypatch.setattr(PrefixCache, "_write", slow_write)
            joined = threading.Thread(target=second.prefill, args=(prompts["a"][200 : 200 + 3 * BLOCK + 5],))
            joined.start()
            assert writing.wait(60)  # the second prompt is in and its entry's file is being written
            decoded: list[np.ndarray] = []
            steps = threading.Thread(target=lambda: decoded.extend(first.decode(t) for t in (11, 12, 13)))
            steps.start()
            steps.join(60)
            assert len(decoded) == 3 and not steps.is_alive()  # three decode steps while the write hangs
            assert joined.is_alive()
            # the entry serves from memory already; on disk there is no partial file under its name
            assert m.prefix_cache.stats()["prefix_cache_entries"] == 2
            assert len(list(directory.glob(f"*{SUFFIX}"))) == 1
            release.set()
            joined.join(60)
            assert not joined.is_alive()
            assert len(list(directory.glob(f"*{SUFFIX}"))) == 2 and not list(directory.glob(".tmp-*"))
            first.close()
            second.close()
        finally:
            release.set()
            sched.close()
    with colibri_backend.load(tiny, opts) as m:  # both files are whole: a new cache indexes them
        assert m.prefix_cache.stats()["prefix_cache_entries"] == 2
