"""benchmarks/soak.py on the bundled model, briefly: concurrent streaming clients against a small queue, so
some are turned away; every finished output equals the same request served alone, every 429 carries
Retry-After, and the report says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_short_soak_has_no_failures_and_every_429_says_when(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--clients", "6", "--duration", "8",
           "--warmup", "2", "--max-concurrency", "2", "--max-queue", "1", "--max-tokens", "12",
           "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["requests_finished"] > 0
    assert report["failed"] == 0 and report["corrupted"] == 0, report["errors"]
    # six clients against two running and one waiting: some must have been turned away, each with Retry-After
    assert report["rejected_429"] > 0
    assert report["rejected_429_without_retry_after"] == 0
    assert report["rss_final_mib"] > 0
