"""`colibri serve` as a real process on loopback, driven by the official `openai` client and raw HTTP.

Each backend (Colibri's native engine, llama.cpp) gets its own server on SmolLM2-135M-Instruct
Q4_1; a third server with no queue room checks 429 and cancellation on client disconnect.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from smollm2 import smollm2_path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _serve import ServeProcess  # noqa: E402  (the one `colibri serve` starter)

API_KEY = "sk-colibri-test"
CONTEXT = 256
ERROR_KEYS = {"message", "type", "param", "code"}


class Server(ServeProcess):
    """A `colibri serve` child process (benchmarks/_serve.py's starter) with an HTTP and an openai client;
    a model that fails to load (the config's `broken` alias) does not stop the start."""

    def __init__(self, config: Path, *extra: str) -> None:
        cmd = [
            sys.executable,
            "-m",
            "colibri_backend.cli",
            "serve",
            "--config",
            str(config),
            "--port",
            "0",
            "--api-key",
            API_KEY,
            "--log-level",
            "warning",
            *extra,
        ]
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("COLIBRI_") or k in ("COLIBRI_LIB", "COLIBRI_CACHE")
        }
        super().__init__(cmd, timeout=120, env=env, require_loaded=False)
        self.http = httpx.Client(base_url=self.base, timeout=120)
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


def write_config(path: Path, backend: str) -> Path:
    path.write_text(
        f'backend = "{backend}"\nmodel = "smol"\n\n'
        f'[models.smol]\npath = "{smollm2_path()}"\nthreads = 2\ncontext_length = {CONTEXT}\n\n'
        f'[models.broken]\npath = "{path.parent / "missing.gguf"}"\n',
        encoding="utf-8",
    )
    return path


@pytest.fixture(scope="module", params=["colibri", "llama_cpp"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = write_config(tmp_path_factory.mktemp(f"srv-{request.param}") / "colibri.toml", request.param)
    srv = Server(cfg, "--max-queue", "32")
    srv.backend = request.param
    try:
        yield srv
    finally:
        srv.stop()


def chat(srv: Server, content: str, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return srv.client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": content}], **kw
    )


# ------------------------------------------------------------------ happy paths


def test_health_models_and_metrics(server: Server) -> None:
    h = server.http.get("/health")
    assert h.status_code == 503  # one configured alias cannot load
    body = h.json()
    assert body["models"]["smol"]["state"] == "ready" and body["models"]["broken"]["state"] == "error"
    assert "missing.gguf" in body["models"]["broken"]["error"]
    ids = {m.id for m in server.client.models.list()}
    assert ids == {"smol", "broken"}
    card = server.client.models.retrieve("smol")
    assert card.id == "smol" and card.owned_by == "colibri"
    m = server.metrics()
    assert m[f'colibri_model_ready{{backend="{server.backend}",model="smol"}}'] == 1
    assert m[f'colibri_model_ready{{backend="{server.backend}",model="broken"}}'] == 0
    assert 'colibri_queue_depth{model="smol"}' in m
    assert any(k.startswith("colibri_engine_") and 'model="smol"' in k for k in m)  # the backend's stats()
    if server.backend == "colibri":  # the engine reports its plan; a decode step allocates nothing
        assert m['colibri_engine_allocs_last_eval{model="smol"}'] == 0
        assert m['colibri_engine_memory_plan_total_bytes{model="smol"}'] > 0


def test_chat_non_streaming_and_streaming_agree(server: Server) -> None:
    r = chat(server, "Give me three tips for staying healthy.", max_tokens=16)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == "smol"
    assert choice.message.role == "assistant" and len(choice.message.content.split()) >= 5
    assert choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 16 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(
        chat(
            server,
            "Give me three tips for staying healthy.",
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    if server.backend == "colibri":  # the second request's prompt was in the KV cache already
        assert (
            server.metrics()['colibri_cached_prompt_tokens_total{model="smol"}'] >= r.usage.prompt_tokens - 1
        )


def test_sse_wire_format_ends_with_done(server: Server) -> None:
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with server.http.stream("POST", "/v1/chat/completions", json=body, headers=server.auth()) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


def test_completions_stop_length_and_streaming(server: Server) -> None:
    prompt = "The numbers from one to ten are: one, two, three,"
    full = server.client.completions.create(model="smol", prompt=prompt, max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert full.object == "text_completion" and text.strip()
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    streamed = "".join(
        c.choices[0].text
        for c in server.client.completions.create(
            model="smol", prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == text
    # stop at the first comma after the prompt: never included, finish_reason "stop"
    assert "," in text
    cut = server.client.completions.create(
        model="smol", prompt=prompt, max_tokens=12, temperature=0, stop=[","]
    )
    assert cut.choices[0].text == text[: text.index(",")] and cut.choices[0].finish_reason == "stop"
    one = server.client.completions.create(model="smol", prompt=prompt, max_tokens=1, temperature=0)
    assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"
    # max_completion_tokens (chat) is honoured like max_tokens
    r = chat(server, "Tell me a long story.", max_tokens=None, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_logprobs(server: Server) -> None:
    r = chat(server, "Say hello.", max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) <= 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy picks the most likely token
        assert entry.bytes == list(entry.token.encode("utf-8"))
    c = server.client.completions.create(
        model="smol", prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert lp.text_offset[0] == 0 and all(len(t) <= 2 for t in lp.top_logprobs)


def test_sampling_parameters(server: Server) -> None:
    kw = dict(
        max_tokens=10, temperature=0.9, top_p=0.95, seed=1234, presence_penalty=0.5, frequency_penalty=0.2
    )
    a = chat(server, "Write a word.", **kw).choices[0].message.content
    b = chat(server, "Write a word.", **kw).choices[0].message.content
    assert a == b  # same seed, same output
    two = chat(server, "Write a word.", n=2, **kw)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content == a  # choice 0 uses the seed itself, choice i seed + i


# ------------------------------------------------------------------ errors


def raw(
    srv: Server,
    path: str,
    body: object | None = None,
    *,
    content: bytes | None = None,
    headers: dict[str, str] | None = None,
    method: str = "POST",
) -> httpx.Response:
    hdrs = srv.auth() if headers is None else headers
    if content is not None:
        return srv.http.request(
            method, path, content=content, headers={**hdrs, "Content-Type": "application/json"}
        )
    return srv.http.request(method, path, json=body, headers=hdrs)


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def test_error_objects(server: Server) -> None:
    ok = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    # 400: invalid JSON, bad values, unsupported n
    assert_error(raw(server, "/v1/chat/completions", content=b'{"model": "smol", '), 400, "invalid_json")
    assert_error(raw(server, "/v1/chat/completions", content=b"[1, 2]"), 400, "invalid_json")
    assert_error(
        raw(server, "/v1/chat/completions", {**ok, "temperature": 3.5}), 400, "invalid_value", "temperature"
    )
    assert_error(
        raw(server, "/v1/chat/completions", {**ok, "max_tokens": 0}), 400, "invalid_value", "max_tokens"
    )
    assert_error(raw(server, "/v1/chat/completions", {**ok, "n": 50}), 400, "invalid_value", "n")
    assert_error(raw(server, "/v1/chat/completions", {**ok, "top_logprobs": 2}), 400, param="top_logprobs")
    assert_error(
        raw(server, "/v1/chat/completions", {"model": "smol"}), 400, "missing_required_parameter", "messages"
    )
    # 422: wrong types
    assert_error(
        raw(server, "/v1/chat/completions", {**ok, "max_tokens": "2"}), 422, "invalid_type", "max_tokens"
    )
    assert_error(
        raw(server, "/v1/chat/completions", {**ok, "messages": "Hi"}), 422, "invalid_type", "messages"
    )
    assert_error(raw(server, "/v1/chat/completions", {**ok, "stream": "yes"}), 422, "invalid_type", "stream")
    assert_error(
        raw(server, "/v1/completions", {"model": "smol", "prompt": {"a": 1}}), 422, "invalid_type", "prompt"
    )
    # 401: missing or wrong key
    assert_error(raw(server, "/v1/chat/completions", ok, headers={}), 401, "missing_api_key")
    assert_error(
        raw(server, "/v1/models", method="GET", headers={"Authorization": "Bearer nope"}),
        401,
        "invalid_api_key",
    )
    # 404: unknown model, unknown route
    assert_error(
        raw(server, "/v1/chat/completions", {**ok, "model": "gpt-9"}), 404, "model_not_found", "model"
    )
    assert_error(raw(server, "/v1/models/gpt-9", method="GET"), 404, "model_not_found")
    assert_error(raw(server, "/v1/embeddings", {"input": "x"}), 404, "unknown_url")
    # 413: a prompt longer than the context
    long_prompt = "word " * (CONTEXT * 2)
    assert_error(
        raw(server, "/v1/completions", {"model": "smol", "prompt": long_prompt}),
        413,
        "context_length_exceeded",
    )
    assert_error(
        raw(server, "/v1/chat/completions", {**ok, "messages": [{"role": "user", "content": long_prompt}]}),
        413,
        "context_length_exceeded",
    )
    # 503: a configured model whose backend could not load it
    err = assert_error(
        raw(server, "/v1/chat/completions", {**ok, "model": "broken"}), 503, "model_unavailable"
    )
    assert "missing.gguf" in err["message"]
    # the openai client surfaces the same objects
    with pytest.raises(openai.NotFoundError) as info:
        server.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0).models.list()
    m = server.metrics()
    assert m['colibri_requests_total{endpoint="/v1/chat/completions",status="422"}'] >= 3


# ------------------------------------------------------------------ concurrency


PROMPTS = [f"Question {i}: what is {i} plus {i + 1}?" for i in range(20)]


def test_twenty_concurrent_streams_do_not_mix(server: Server) -> None:
    def reference(p: str) -> str:
        return chat(server, p, max_tokens=6).choices[0].message.content

    expected = [reference(p) for p in PROMPTS]  # one at a time
    assert len(set(expected)) > 1  # the prompts really differ in their answers

    barrier = threading.Barrier(len(PROMPTS))

    def streamed(p: str) -> str:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
        barrier.wait()
        parts = []
        for c in client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": p}], max_tokens=6, temperature=0, stream=True
        ):
            if c.choices and c.choices[0].delta.content:
                parts.append(c.choices[0].delta.content)
        return "".join(parts)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(streamed, PROMPTS))
    assert got == expected
    assert server.metrics()['colibri_requests_in_flight{model="smol"}'] == 0


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    cfg = write_config(tmp_path_factory.mktemp("srv-tight") / "colibri.toml", "colibri")
    srv = Server(cfg, "--max-queue", "0")
    try:
        yield srv
    finally:
        srv.stop()


def test_queue_full_and_disconnect_cancels(tight_server: Server) -> None:
    srv = tight_server
    body = {
        "model": "smol",
        "messages": [{"role": "user", "content": "Write a very long essay about birds."}],
        "max_tokens": CONTEXT,
        "temperature": 0,
        "stream": True,
    }
    before = srv.metrics()
    with srv.http.stream("POST", "/v1/chat/completions", json=body, headers=srv.auth()) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(ln for ln in lines if ln.startswith("data: "))  # generation has started
        # max-queue 0: nothing may wait behind the running request
        full = raw(srv, "/v1/chat/completions", {**body, "stream": False, "max_tokens": 2})
        assert_error(full, 429, "queue_full")
        assert int(full.headers["Retry-After"]) >= 1
    # the client went away: its generation must stop long before CONTEXT tokens
    deadline = time.time() + 30
    while time.time() < deadline:
        m = srv.metrics()
        if m['colibri_requests_in_flight{model="smol"}'] == 0:
            break
        time.sleep(0.1)
    m = srv.metrics()
    assert m['colibri_requests_in_flight{model="smol"}'] == 0
    assert m["colibri_cancelled_requests_total"] == before["colibri_cancelled_requests_total"] + 1
    t0 = time.time()
    r = chat(srv, "Hi", max_tokens=2)
    assert r.usage.completion_tokens <= 2 and time.time() - t0 < 30
    assert m['colibri_engine_n_decode_tokens{model="smol"}'] < CONTEXT - 20


def test_serve_refuses_bad_arguments_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    from colibri_backend import cli

    assert cli.main(["serve", "--model", "smollm2", "--backend", "no_such_backend"]) == 1
    assert "unknown backend 'no_such_backend'" in capsys.readouterr().err
    assert cli.main(["serve", "--model", "smollm2", "--port", "70000"]) == 1
    assert "--port must be between 0 and 65535" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--config", "x.toml", "--model", "y"])  # mutually exclusive


def test_loading_and_shutting_down_answer_503() -> None:
    """In-process (no model file): a model still loading, then a server shutting down."""
    from fastapi.testclient import TestClient

    from colibri_backend.config import Config, ModelConfig
    from colibri_backend.server import ServerState, create_app

    release = threading.Event()

    def slow_loader(cfg: ModelConfig):
        release.wait(30)
        raise RuntimeError("no such engine")

    cfg = Config(models={"m": ModelConfig(alias="m", path="x.gguf", backend="fake")}, default_model="m")
    state = ServerState(cfg, api_key=None, loader=slow_loader)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(create_app(state)) as client:
        assert client.get("/health").json()["status"] == "loading"
        assert_error(client.post("/v1/chat/completions", json=body), 503, "model_loading")
        release.set()
        state.wait_loaded(30)
        assert client.get("/health").json()["models"]["m"]["error"] == "RuntimeError: no such engine"
        assert_error(client.post("/v1/chat/completions", json=body), 503, "model_unavailable")
        state.begin_shutdown()
        assert_error(client.post("/v1/chat/completions", json=body), 503, "shutting_down")
        assert client.get("/health").json()["status"] == "shutting_down"


class _Echo:
    """A fake loaded model for in-process tests: repeats 'ab' and counts its prompts."""

    name, backend, context_length = "echo", "fake", 64

    def __init__(self) -> None:
        from colibri_backend.backends import Capabilities

        self.capabilities = Capabilities(logprobs=True, chat=True)
        self.n_vocab = 100

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 100 for c in text] or [0]

    def detokenize(self, ids) -> str:
        return "".join(chr(97 + i % 2) for i in ids)

    def token_text(self, token_id: int) -> str:
        return chr(97 + token_id % 2)

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] for m in messages)

    def generate_tokens(self, prompt_ids, *, max_tokens, sampling=None, stop=None, logprobs=None):
        from colibri_backend.backends import GenerationEvent

        for i in range(max_tokens):
            yield GenerationEvent(
                i,
                "ab"[i % 2],
                -0.5 if logprobs is not None else None,
                {"a": -0.5, "b": -1.0} if logprobs else None,
                "length" if i == max_tokens - 1 else None,
            )

    def stats(self) -> dict:
        return {"experts": {"hits": 7, "misses": 3}, "bytes_read": 1024, "name": "not a number"}

    def close(self) -> None:
        pass


def test_multiple_choices_prompts_and_engine_metrics_in_process() -> None:
    from fastapi.testclient import TestClient

    from colibri_backend.config import Config, ModelConfig
    from colibri_backend.server import ServerState, create_app

    cfg = Config(models={"e": ModelConfig(alias="e", path="x", backend="fake")}, default_model="e")
    state = ServerState(cfg, api_key=None, loader=lambda c: _Echo())
    with TestClient(create_app(state)) as client:
        state.wait_loaded(10)
        r = client.post(
            "/v1/completions",
            json={"model": "e", "prompt": ["hi", "yo"], "max_tokens": 3, "n": 2, "logprobs": 1},
        ).json()
        assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
        assert all(c["text"] == "aba" and c["finish_reason"] == "length" for c in r["choices"])
        assert r["choices"][0]["logprobs"]["text_offset"] == [0, 1, 2]
        assert r["usage"] == {
            "prompt_tokens": 4,
            "completion_tokens": 12,
            "total_tokens": 16,
            "prompt_tokens_details": {"cached_tokens": 0},  # a backend that reuses nothing
        }
        body = {
            "model": "e",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 2,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with client.stream("POST", "/v1/chat/completions", json=body) as s:
            events = [json.loads(ln[6:]) for ln in s.iter_lines() if ln.startswith("data: {")]
        texts: dict[int, str] = {}
        for e in events:
            for c in e["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
        assert texts == {0: "ab", 1: "ab"}
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
        bad = dict(body, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
        assert_error(client.post("/v1/chat/completions", json=bad), 400, "invalid_value", "messages")
        assert_error(
            client.post("/v1/chat/completions", json=dict(body, tools=[{"type": "function"}])),
            400,
            param="tools",
        )
        metrics = client.get("/metrics").text
        assert 'colibri_engine_experts_hits{model="e"} 7.0' in metrics
        assert 'colibri_engine_bytes_read{model="e"} 1024.0' in metrics
        assert "not a number" not in metrics


def test_serve_fails_fast_when_its_only_backend_cannot_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from colibri_backend import cli
    from colibri_backend.registry import get_registry

    entry = get_registry().get("transformers")
    monkeypatch.setattr(
        entry.backend, "unavailable_reason", lambda: "Python package 'torch' is not installed"
    )
    assert cli.main(["serve", "--model", "smollm2", "--backend", "transformers"]) == 1
    assert (
        "backend 'transformers' is unavailable: Python package 'torch' is not installed"
        in capsys.readouterr().err
    )
