"""OpenAI-compatible HTTP server (FastAPI + uvicorn) on top of any registered backend.

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (JSON or SSE streaming ending in ``data: [DONE]``), ``GET /health``,
``GET /metrics`` (Prometheus), ``GET /openapi.json``.

Layout (docs/server.md): ``schemas`` (request bodies, the only parse), ``security`` (API key
dependency, Host / Content-Type / size guard), ``state`` (model slots, queue, limits), ``generation``
(shared checks, admission, the event stream), ``responses`` (the one response builder), one
``routes_*`` router per API, ``metrics`` (prometheus-client), ``app`` (create_app, serve).

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 400 bad value, invalid
JSON or Host, 401 missing / wrong API key, 404 unknown model or route, 413 body or prompt too long, 415
not JSON, 422 wrong types, 429 queue full (with ``Retry-After``), 503 model not loaded / shutting down.
"""

from colibri_backend.server.app import create_app, serve
from colibri_backend.server.errors import APIError
from colibri_backend.server.state import Limits, ModelSlot, ServerState

__all__ = ["APIError", "Limits", "ModelSlot", "ServerState", "create_app", "serve"]
