"""The repository's tools/ scripts as modules, for the tests that check what they generate or print
(tools/ is a folder of scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/NAME.py, executed once per call as a fresh module named NAME (with tools/ on sys.path, as
    when the script runs, for its imports of tools/generated_header.py)."""
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def assert_check_mode_round_trip(
    gen: ModuleType, stale: Path, header: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A header generator (tools/generated_header.py's command line) pointed at the stale file `stale`:
    --check fails, a plain run rewrites it to the checked-in `header`, and --check then passes."""
    monkeypatch.setattr(gen, "OUT", stale)
    script = f"{gen.__name__}.py"
    monkeypatch.setattr("sys.argv", [script, "--check"])
    assert gen.main() == 1
    monkeypatch.setattr("sys.argv", [script])
    assert gen.main() == 0  # rewritten
    assert stale.read_text(encoding="utf-8") == header.read_text(encoding="utf-8")
    monkeypatch.setattr("sys.argv", [script, "--check"])
    assert gen.main() == 0
