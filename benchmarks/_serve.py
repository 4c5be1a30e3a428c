"""A `colibri serve` process on loopback for the benchmark scripts and the tests: started on a free
port, its stderr read in the background (the log stays available for error messages), ready once every
model it serves has finished loading."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

READY = re.compile(r"colibri serve: http://127\.0\.0\.1:(\d+)/v1")


class ServerStartError(SystemExit):
    """The server did not start, or a model it serves did not load; the message holds its log. A
    SystemExit, so a benchmark script that meets it ends with that message rather than a traceback."""


class ServeProcess:
    """`cmd` is the whole `colibri serve ... --port 0` command line; `preexec_fn` runs in the child
    before exec (a cgroup join); `env` replaces the environment. Raises ServerStartError when the server
    does not start within `timeout` seconds, or, with `require_loaded`, when a model fails to load.
    `models` is /health's view of the models once none is loading; `port` and `base` say where it is."""

    def __init__(
        self,
        cmd: Sequence[str],
        preexec_fn: Callable[[], Any] | None = None,
        timeout: float = 600,
        env: dict[str, str] | None = None,
        require_loaded: bool = True,
    ) -> None:
        self.proc = subprocess.Popen(
            list(cmd),
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            preexec_fn=preexec_fn,
            env=env,
        )
        self.log: list[str] = []
        port: list[int] = []
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line)
                m = READY.search(line)
                if m and not port:
                    port.append(int(m.group(1)))
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(timeout) or not port:
            self.stop()
            raise ServerStartError("the server did not start:\n" + "".join(self.log))
        self.port = port[0]
        self.base = f"http://127.0.0.1:{self.port}"
        self.models = self._wait_loaded(timeout, require_loaded)

    def _wait_loaded(self, timeout: float, require_loaded: bool) -> dict[str, Any]:
        """The /health models once none is loading; ServerStartError if one failed and that matters."""
        deadline = time.time() + timeout
        with httpx.Client(base_url=self.base, timeout=30) as http:
            while True:
                models = http.get("/health").json()["models"]
                if all(s["state"] != "loading" for s in models.values()) or time.time() > deadline:
                    break
                time.sleep(0.2)
        if require_loaded and any(s["state"] != "ready" for s in models.values()):
            self.stop()
            raise ServerStartError(f"the model did not load: {models}\n" + "".join(self.log))
        return models

    def stop(self, wait: float = 60) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
