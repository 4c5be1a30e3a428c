"""Hostile and careless clients (issue 12, item 10), against the ASGI app in-process and a real
`colibri serve` on loopback: unparseable bodies answer 400 (never 500, never a reset), a size limit,
JSON-only content types, a Host allow-list, 429 with Retry-After, tokenizing off the event loop,
/openapi.json, and a bounded Schemathesis run over that schema with no 5xx."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, settings

from colibri_backend.backends import Capabilities
from colibri_backend.config import Config, ModelConfig
from colibri_backend.generation import GenerationEvent
from colibri_backend.server import Limits, ServerState, create_app

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from _serve import ServeProcess  # noqa: E402  (the one `colibri serve` starter)

ERROR_KEYS = {"message", "type", "param", "code"}
schemathesis = pytest.importorskip("schemathesis")  # in the test extra; CI treats a skip as a failure


class _Fake:
    """A loaded model that answers "ab..." and can be told to tokenize slowly."""

    name, backend, context_length = "fake", "fake", 128

    def __init__(self, tokenize_seconds: float = 0.0) -> None:
        self.capabilities = Capabilities(logprobs=True, chat=True)
        self.n_vocab = 100
        self.tokenize_seconds = tokenize_seconds

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        time.sleep(self.tokenize_seconds)  # CPU-bound work stands in as a blocking call
        return [ord(c) % 100 for c in text[:60]] or [0]

    def detokenize(self, ids) -> str:
        return "".join("ab"[i % 2] for i in ids)

    def token_text(self, token_id: int) -> str:
        return "ab"[token_id % 2]

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(str(m.get("content") or "") for m in messages)

    def generate_tokens(self, prompt_ids, *, max_tokens, sampling=None, stop=None, logprobs=None):
        for i in range(min(max_tokens, 4)):
            last = i == min(max_tokens, 4) - 1
            lp = -0.5 if logprobs is not None else None
            yield GenerationEvent(
                i, "ab"[i % 2], lp, {"a": -0.5} if logprobs else None, "length" if last else None
            )

    def stats(self) -> dict:
        return {"expert_hits": 3}

    def close(self) -> None:
        pass


def make_state(model: _Fake | None = None, **kw) -> ServerState:
    cfg = Config(models={"m": ModelConfig(alias="m", path="x", backend="fake")}, default_model="m")
    state = ServerState(cfg, api_key=None, loader=lambda c: model or _Fake(), **kw)
    state.slots["m"].load(state.loader)
    return state


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.fixture()
def client() -> Iterator[httpx.Client]:
    from fastapi.testclient import TestClient

    state = make_state(limits=Limits(max_body_bytes=1 << 20, max_prompt_chars=4096))
    with TestClient(create_app(state)) as c:
        yield c


CHAT = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}


def test_unparseable_bodies_are_400(client: httpx.Client) -> None:
    nested = (
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "x": ' + b"[" * 1000 + b"]" * 1000
    )
    assert_error(client.post(CHAT, content=nested + b"}", headers=JSON), 400, "invalid_json")
    huge = b'{"model": "m", "seed": ' + b"9" * 5000 + b', "messages": [{"role": "user", "content": "x"}]}'
    assert_error(client.post(CHAT, content=huge, headers=JSON), 400, "invalid_json")
    for body in (b"\xff\xfe", b'{"model": "m"', b"[]", b"null", b'"text"', b""):
        assert_error(client.post(CHAT, content=body, headers=JSON), 400, "invalid_json")
    # after all that the app still answers normally
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post(CHAT, json=ok).json()["choices"][0]["message"]["content"] == "ab"


def test_content_type_must_be_json(client: httpx.Client) -> None:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        assert_error(
            client.post(CHAT, content=body, headers={"Content-Type": ctype}), 415, "unsupported_media_type"
        )
    assert_error(client.post(CHAT, content=body, headers={}), 415)
    ok = client.post(CHAT, content=body, headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_size_limits_come_before_parsing_and_tokenizing(client: httpx.Client) -> None:
    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"a" * (2 << 20) + b'"}]}'
    assert_error(client.post(CHAT, content=big, headers=JSON), 413, "request_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is counted as the body arrives
        yield b'{"model": "m", "prompt": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    assert_error(client.post("/v1/completions", content=chunks(), headers=JSON), 413, "request_too_large")
    long_prompt = {"model": "m", "messages": [{"role": "user", "content": "a" * 5000}]}
    err = assert_error(client.post(CHAT, json=long_prompt), 413, "context_length_exceeded")
    assert "characters" in err["message"]


def test_host_allow_list_on_loopback() -> None:
    from fastapi.testclient import TestClient

    state = make_state(limits=Limits(allowed_hosts=("127.0.0.1", "localhost", "::1")))
    with TestClient(create_app(state), base_url="http://localhost:8000") as c:
        assert c.get("/health").status_code == 200
        assert c.get("/health", headers={"Host": "127.0.0.1:9"}).status_code == 200
        assert c.get("/health", headers={"Host": "[::1]:8000"}).status_code == 200
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
            assert_error(c.get("/v1/models", headers={"Host": host}), 400, "invalid_host")


def test_queue_full_is_429_with_retry_after() -> None:
    from fastapi.testclient import TestClient

    state = make_state(max_queue=0)
    with TestClient(create_app(state)) as c:
        ticket = state.admit(state.slots["m"])  # the one running request
        r = c.post(CHAT, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert_error(r, 429, "queue_full")
        assert int(r.headers["Retry-After"]) >= 1
        ticket.release()
        assert (
            c.post(CHAT, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}).status_code
            == 200
        )
        metrics = c.get("/metrics").text
        assert 'colibri_rejected_requests_total{model="m"} 1.0' in metrics
        assert 'colibri_engine_expert_hits{model="m"} 3.0' in metrics
        assert "colibri_time_to_first_token_seconds_count" in metrics and "colibri_batch_size" in metrics


def test_tokenizing_runs_off_the_event_loop() -> None:
    """A slow tokenize (2 s) must not hold /health: it answers while the request is being tokenized."""
    state = make_state(_Fake(tokenize_seconds=2.0))
    app = create_app(state)

    async def scenario() -> tuple[float, int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            slow = asyncio.create_task(c.post(CHAT, json=body, timeout=30))
            await asyncio.sleep(0.3)  # the request is inside tokenize() now
            t0 = time.perf_counter()
            health = await c.get("/health")
            waited = time.perf_counter() - t0
            assert health.status_code == 200
            assert not slow.done()
            return waited, (await slow).status_code

    waited, status = asyncio.run(scenario())
    assert status == 200 and waited < 0.5, waited


def test_openapi_schema_is_served(client: httpx.Client) -> None:
    schema = client.get("/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(schema["paths"])
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    ref = body["schema"]["$ref"].rsplit("/", 1)[1]
    assert ref == "ChatRequest" and "messages" in schema["components"]["schemas"][ref]["properties"]


def test_built_responses_match_the_documented_schemas(client: httpx.Client) -> None:
    import json

    from colibri_backend.server import schemas as S

    msgs = [{"role": "user", "content": "hi"}]
    chat = client.post(CHAT, json={"model": "m", "messages": msgs, "logprobs": True, "top_logprobs": 1})
    S.ChatCompletion.model_validate(chat.json())
    comp = client.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "logprobs": 1})
    assert len(S.Completion.model_validate(comp.json()).choices) == 2
    S.ModelList.model_validate(client.get("/v1/models").json())
    S.ModelCard.model_validate(client.get("/v1/models/m").json())
    S.ErrorResponse.model_validate(client.get("/v1/models/nope").json())
    for path, body, chunk_model in (
        (CHAT, {"model": "m", "messages": msgs}, S.ChatCompletionChunk),
        ("/v1/completions", {"model": "m", "prompt": "x"}, S.Completion),
    ):
        opts = {"stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", path, json={**body, **opts}) as r:
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [chunk_model.model_validate(json.loads(ln[6:])) for ln in lines[:-1]]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


# ---- property-based: every request Schemathesis makes from the schema gets a non-5xx answer ----------

_schema_state = make_state(limits=Limits(max_body_bytes=1 << 20, max_prompt_chars=4096))
_schema_app = create_app(_schema_state)


async def _without_lifespan(scope, receive, send) -> None:
    """The app with its lifespan left out: Schemathesis starts and stops the app around every call, and
    the app's shutdown closes its models (a 503 afterwards), which is right for a server but not here."""
    if scope["type"] != "lifespan":
        await _schema_app(scope, receive, send)
        return
    while True:
        message = await receive()
        await send({"type": message["type"] + ".complete"})
        if message["type"] == "lifespan.shutdown":
            return


_schema = schemathesis.openapi.from_asgi("/openapi.json", _without_lifespan)


@_schema.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_schemathesis_finds_no_server_error(case) -> None:
    response = case.call()
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
    if response.status_code >= 400:
        body = response.json()
        if case.path.startswith("/v1/messages"):  # Anthropic's API, Anthropic's error shape
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        else:
            assert set(body["error"]) == ERROR_KEYS


# ---- a real server process on loopback ---------------------------------------------------------------


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[str, int]]:
    """`colibri serve` on the bundled colibri-moe model; (base url, pid)."""
    srv = ServeProcess(
        [sys.executable, "-m", "colibri_backend", "serve", "--model", "colibri-moe", "--port", "0",
         "--threads", "1", "--context-length", "256", "--log-level", "warning"],
        timeout=120,
    )  # fmt: skip
    try:
        yield srv.base, srv.proc.pid
    finally:
        srv.stop(30)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_live_server_refuses_hostile_requests_fast(live: tuple[str, int]) -> None:
    base, pid = live
    with httpx.Client(base_url=base, timeout=30) as c:
        assert c.get("/health").json()["status"] == "ok"
        c.post(
            CHAT,
            json={"model": "colibri-moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        )
        rss0 = _rss_kib(pid)
        ten_mb = b'{"model": "colibri-moe", "prompt": "' + b"a" * (10 << 20) + b'"}'
        nested = b'{"model": "colibri-moe", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"
        huge = b'{"model": "colibri-moe", "prompt": "x", "seed": ' + b"9" * 5000 + b"}"
        for body, status in ((ten_mb, 413), (nested, 400), (huge, 400)) * 3:
            t0 = time.perf_counter()
            r = c.post("/v1/completions", content=body, headers=JSON)
            took = time.perf_counter() - t0
            assert r.status_code == status and set(r.json()["error"]) == ERROR_KEYS
            assert took < 1.0, took  # the target is 100 ms; a shared CI machine gets slack
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            assert time.perf_counter() - t0 < 0.5
        assert _rss_kib(pid) - rss0 < 64 << 10  # the 10 MB bodies were never kept
        assert_error(c.post(CHAT, content=b"{}", headers={"Content-Type": "text/plain"}), 415)
        # DNS rebinding: a page on another origin that resolves its name to 127.0.0.1
        assert_error(c.get("/v1/models", headers={"Host": "attacker.example"}), 400, "invalid_host")
        assert c.get("/v1/models", headers={"Host": f"localhost:{base.rsplit(':', 1)[1]}"}).status_code == 200
        assert "/v1/chat/completions" in c.get("/openapi.json").json()["paths"]
