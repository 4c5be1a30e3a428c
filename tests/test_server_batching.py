"""Continuous batching through a real `colibri serve --max-concurrency N` on loopback (SmolLM2 on
Colibri's engine), driven by the official openai client: concurrent streaming requests give exactly
the text they give alone (greedy, seeded sampling, a JSON grammar) while the server decodes them together; a
client that goes away in the middle of its prompt's prefill is cancelled there; a full queue is a
429 with Retry-After; benchmarks/concurrency.py runs."""

from __future__ import annotations

import json
import pstats
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_server import API_KEY, Server, assert_error, raw, smollm2_path

CONTEXT = 1024
SMOL = 'model{alias="smol"}'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = tmp_path_factory.mktemp("srv-batch") / "colibri.toml"
    cfg.write_text(
        'backend = "colibri"\nmodel = "smol"\n\n'
        f'[models.smol]\npath = "{smollm2_path()}"\nthreads = 2\ncontext_length = {CONTEXT}\n'
        # prompts in 64-token steps also when nothing else is decoding (the cancel test needs several)
        "[models.smol.options]\nbatch_size = 64\n",
        encoding="utf-8",
    )
    srv = Server(cfg, "--max-queue", "1", "--max-concurrency", "3")
    try:
        yield srv
    finally:
        srv.stop()


def metric(srv: Server, name: str) -> float:
    return srv.metrics()[name + '{model="smol"}']


REQUESTS = [
    ("Name three colours.", {"temperature": 0}),
    ("Write a haiku about the sea.", {"temperature": 0.9, "seed": 7}),
    ("Tell me a fact about cats.", {"temperature": 0.7, "top_p": 0.9, "seed": 99}),
    # grammar-constrained: each request's own grammar state beside the others'
    (
        "Give a JSON object with a name and an age.",
        {"temperature": 0, "response_format": {"type": "json_object"}},
    ),
]


def streamed(srv: Server, content: str, kw: dict) -> str:
    stream = srv.client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": content}],
        max_tokens=20,
        stream=True,
        **kw,
    )
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def wait_idle(srv: Server, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and metric(srv, "colibri_requests_in_flight") != 0:
        time.sleep(0.05)
    assert metric(srv, "colibri_requests_in_flight") == 0


def test_concurrent_streams_equal_alone(server: Server) -> None:
    alone = [streamed(server, c, kw) for c, kw in REQUESTS]
    assert all(alone)
    peak = [0.0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], metric(server, "colibri_batch_size"))
            time.sleep(0.02)

    names = (
        "steps",
        "step_tokens",
        "step_engine_seconds",
        "step_between_seconds",
        "partial_steps",
        "step_prompt_tokens",
        "prefill_steps",
        "prefill_step_engine_seconds",
        "decode_only_step_tokens",
    )
    before = {n: metric(server, f"colibri_batch_{n}_total") for n in names}
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(REQUESTS)) as pool:
            # the fourth waits in the queue (--max-queue 1) for a sequence: it joins when one is freed
            together = list(pool.map(lambda r: streamed(server, *r), REQUESTS))
    finally:
        done.set()
        watcher.join()
    assert together == alone
    assert peak[0] >= 2  # they really were decoded together
    d = {n: metric(server, f"colibri_batch_{n}_total") - before[n] for n in names}
    assert d["step_tokens"] > d["steps"] > 0  # steps carried several tokens
    assert d["step_engine_seconds"] > 0 and d["step_between_seconds"] > 0
    assert 0 <= d["partial_steps"] < d["steps"]
    # every request's prompt went through the steps (at least its last token, after prefix reuse)
    assert d["step_tokens"] > d["step_prompt_tokens"] > 0
    assert 0 < d["prefill_steps"] < d["steps"]
    assert 0 < d["prefill_step_engine_seconds"] < d["step_engine_seconds"]
    # the decode-only steps' tokens: at least one a step, and no more than the decode tokens of all steps
    decode_only = d["steps"] - d["prefill_steps"]
    assert decode_only <= d["decode_only_step_tokens"] <= d["step_tokens"] - d["step_prompt_tokens"]


def test_cancel_mid_prefill_and_queue_overflow(server: Server) -> None:
    wait_idle(server)
    words = "one two three four five six seven eight nine ten " * 90  # about 900 tokens
    body = {"model": "smol", "prompt": words, "max_tokens": 50, "temperature": 0, "stream": True}
    prompt0 = server.metrics()['colibri_engine_n_prompt_tokens{model="smol"}']
    decode0 = server.metrics()['colibri_engine_n_decode_tokens{model="smol"}']
    cancelled0 = server.metrics()["colibri_cancelled_requests_total"]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            deadline = time.time() + 30
            while metric(server, "colibri_batch_size") < 1 and time.time() < deadline:
                time.sleep(0.01)
            time.sleep(0.5)  # its prompt's first chunks (64 tokens a step) are in; then the client goes away
    wait_idle(server)
    # the engine's counters are read when the request's thread ends, just after its ticket is released
    deadline = time.time() + 10
    while (
        server.metrics()['colibri_engine_n_prompt_tokens{model="smol"}'] == prompt0 and time.time() < deadline
    ):
        time.sleep(0.05)
    m = server.metrics()
    assert m["colibri_cancelled_requests_total"] == cancelled0 + 1
    # stopped in the middle of the prompt: part of it evaluated, no token generated
    assert 0 < m['colibri_engine_n_prompt_tokens{model="smol"}'] - prompt0 < 850
    assert m['colibri_engine_n_decode_tokens{model="smol"}'] == decode0

    # three sequences busy and one request waiting: the next one is told to come back later
    # SmolLM2 may answer this prompt with an end token at once (greedy, on the AVX-512 kernels it does):
    # the end tokens are biased away, so the three sequences really are busy for 400 tokens
    no_end = {"0": -100, "2": -100}  # <|endoftext|>, <|im_end|>
    story = "Write a very long story about a dragon."
    long = {**body, "prompt": story, "max_tokens": 400, "logit_bias": no_end}
    clients = [httpx.Client(base_url=server.base, timeout=60) for _ in range(4)]
    streams = []
    try:
        for c in clients:
            s = c.stream("POST", "/v1/completions", json=long, headers=headers)
            streams.append(s)
            assert s.__enter__().status_code == 200
        deadline = time.time() + 30
        while metric(server, "colibri_requests_in_flight") < 4 and time.time() < deadline:
            time.sleep(0.05)
        assert metric(server, "colibri_requests_in_flight") == 4  # three decoding, one queued
        full = raw(server, "/v1/completions", {**long, "stream": False, "max_tokens": 2})
        assert_error(full, 429, "queue_full")
        assert int(full.headers["Retry-After"]) >= 1
    finally:
        for s in streams:
            s.__exit__(None, None, None)
        for c in clients:
            c.close()
    wait_idle(server)
    r = server.client.completions.create(model="smol", prompt="Hi", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens <= 2


def test_concurrency_benchmark_script(tmp_path: Path) -> None:
    """benchmarks/concurrency.py runs end to end (a script, not a timed test: no speed is checked)."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "concurrency.py"
    out = tmp_path / "concurrency.json"
    cmd = [sys.executable, str(script), "--model", str(smollm2_path()), "--clients", "1,2"]
    cmd += ["--max-tokens", "4", "--prompt-words", "8", "--threads", "2", "--json", str(out)]
    cmd += ["--profile", str(tmp_path / "prof")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert set(report["modes"]) == {"one_at_a_time", "batched"}
    for mode in report["modes"].values():
        assert [r["clients"] for r in mode] == [1, 2]
        assert all(r["completion_tokens"] > 0 and r["aggregate_tok_s"] > 0 for r in mode)
        assert all(0 < r["ttft_p50_s"] <= r["ttft_p99_s"] for r in mode)
    assert all(r["identical_to_one_at_a_time"] for r in report["modes"]["batched"])
    assert "speedup" in result.stdout
    for r in report["modes"]["batched"]:  # the step split: every prompt came through the steps
        st = r["steps"]
        assert 0 < st["prefill_steps"] <= st["steps"] and st["prompt_tokens"] > 0
        assert 0 < st["prefill_step_engine_share_of_wall"] <= st["engine_share_of_wall"] <= 1
    # --profile: each server's event loop profile, written when it stopped
    for mode in ("one_at_a_time", "batched"):
        assert pstats.Stats(str(tmp_path / "prof" / f"{mode}.prof")).total_calls > 0
