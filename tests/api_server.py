"""A real `colibri serve` on loopback for the API tests (tools, structured output, Responses, Messages):
SmolLM2-135M-Instruct on Colibri's engine under two aliases, ``smol`` with the model's own chat template
and ``tools`` with a Hermes-style template that renders tools and tool results
(tests/data/hermes_tools.jinja), so tool calls can be asked for in the model's prompt."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_server import API_KEY, Server, smollm2_path

TOOLS_TEMPLATE = Path(__file__).parent / "data" / "hermes_tools.jinja"

__all__ = ["API_KEY", "Server", "start", "server_fixture", "TOOLS_TEMPLATE"]


def start(directory: Path) -> Server:
    config = directory / "colibri.toml"
    model = smollm2_path()
    config.write_text(
        'backend = "colibri"\nmodel = "smol"\n\n'
        f'[models.smol]\npath = "{model}"\nthreads = 2\ncontext_length = 1024\n\n'
        f'[models.tools]\npath = "{model}"\nthreads = 2\ncontext_length = 1024\n'
        f'chat_template = "{TOOLS_TEMPLATE}"\n',
        encoding="utf-8",
    )
    return Server(config, "--max-queue", "16")


def server_fixture(name: str) -> Any:
    """A module-scoped `server` fixture: one server for a test file, in a folder named `name`, stopped
    after the file's last test. Use: ``server = server_fixture("tools")``."""

    @pytest.fixture(scope="module")
    def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
        srv = start(tmp_path_factory.mktemp(name))
        try:
            yield srv
        finally:
            srv.stop()

    return server
