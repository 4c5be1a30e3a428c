"""Memory budget sizes, the default budget (MemAvailable, cgroup v2 and v1 limits) and the plan table."""

from __future__ import annotations

from pathlib import Path

import pytest

from colibri_backend import budget as B


@pytest.mark.parametrize(
    "text,expected",
    [
        ("512M", 512 << 20),
        ("1.5G", 3 << 29),
        ("2GiB", 2 << 30),
        ("64kb", 64 << 10),
        (" 1T ", 1 << 40),
        ("1048576", 1 << 20),
        (".5G", 1 << 29),
        (4096, 4096),
        ("0", 0),
        ("unlimited", 0),
        ("none", 0),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert B.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12Q", "-5M", "1.2.3G", "M", "0.1"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        B.parse_size(text)


def test_parse_size_rejects_negative_int_and_bool() -> None:
    with pytest.raises(ValueError):
        B.parse_size(-1)
    with pytest.raises(ValueError):
        B.parse_size(True)


def test_format_size() -> None:
    assert B.format_size(900) == "900 B"
    assert B.format_size(512 << 20) == "512.0 MiB"
    assert B.format_size(3 << 29) == "1.50 GiB"


def test_mem_available(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemFree: 1 kB\nMemAvailable:   2000000 kB\n")
    assert B.mem_available(f) == 2000000 * 1024
    f.write_text("MemTotal: 1 kB\n")
    assert B.mem_available(f) is None
    assert B.mem_available(tmp_path / "missing") is None


def test_cgroup_v2_limit_walks_up_to_the_tightest(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    leaf = root / "a" / "b"
    leaf.mkdir(parents=True)
    (root / "a" / "memory.max").write_text(f"{1 << 30}\n")
    (root / "a" / "memory.current").write_text(f"{256 << 20}\n")
    (leaf / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert B.cgroup_limit(proc, root) == (1 << 30) - (256 << 20)
    (leaf / "memory.max").write_text(f"{512 << 20}\n")
    (leaf / "memory.current").write_text("0\n")
    assert B.cgroup_limit(proc, root) == 512 << 20


def test_cgroup_v1_limit_and_unlimited(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    d = root / "memory" / "job"
    d.mkdir(parents=True)
    (d / "memory.limit_in_bytes").write_text(f"{2 << 30}\n")
    (d / "memory.usage_in_bytes").write_text(f"{1 << 30}\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:cpu,cpuacct:/job\n3:memory:/job\n")
    assert B.cgroup_limit(proc, root) == 1 << 30
    (d / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert B.cgroup_limit(proc, root) is None
    assert B.cgroup_limit(tmp_path / "missing", root) is None


def test_default_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLIBRI_MEMORY_BUDGET", "3G")
    assert B.default_budget() == 3 << 30
    assert B.resolve_budget(None) == 3 << 30
    assert B.resolve_budget("1G") == 1 << 30
    monkeypatch.delenv("COLIBRI_MEMORY_BUDGET")
    monkeypatch.setattr(B, "mem_available", lambda: 10 << 30)
    monkeypatch.setattr(B, "cgroup_limit", lambda: 4 << 30)
    assert B.default_budget() == int((4 << 30) * B.DEFAULT_FRACTION)
    monkeypatch.setattr(B, "cgroup_limit", lambda: None)
    assert B.default_budget() == int((10 << 30) * B.DEFAULT_FRACTION)
    monkeypatch.setattr(B, "mem_available", lambda: None)
    assert B.default_budget() == 0


def test_policy_and_prefetch_names() -> None:
    assert B.parse_policy("LFU") == 0 and B.parse_policy("lru") == 1
    assert B.parse_prefetch("none") == 0
    assert B.parse_prefetch("lookahead") == 1 and B.parse_prefetch("temporal") == 2
    assert B.parse_prefetch("lookahead, temporal") == 3 == B.parse_prefetch("both")
    with pytest.raises(ValueError):
        B.parse_policy("fifo")
    with pytest.raises(ValueError):
        B.parse_prefetch("oracle")


def _streamed_plan(**fields: int) -> dict[str, int]:
    """A plan of 64 streamed experts in 1 MiB slots, with `fields` on top."""
    plan = {key: 1 << 20 for key, _ in B.PLAN_ROWS}
    plan.update(
        total_bytes=8 << 20,
        min_budget=6 << 20,
        n_expert_total=64,
        all_resident=0,
        expert_slot_bytes=1 << 20,
        expert_total_bytes=64 << 20,
    )
    plan.update(fields)
    return plan


def test_format_plan_verdicts() -> None:
    plan = _streamed_plan(budget=4 << 20, fits=0, n_expert_slots=1)
    text = B.format_plan(plan)
    assert "does NOT fit" in text and str(6 << 20) in text and "1 of 64 experts" in text
    plan.update(fits=1, budget=0, all_resident=1, n_expert_slots=64)
    text = B.format_plan(plan)
    assert "unlimited -> fits" in text and "all experts resident" in text


def test_format_plan_says_what_sequences_not_under_way_lend() -> None:
    plan = _streamed_plan(budget=8 << 20, fits=1, n_expert_slots=24, max_expert_slots=38)
    assert "24 of 64 experts" in B.format_plan(plan) and "up to 38 slots" in B.format_plan(plan)
    plan.update(max_expert_slots=24)
    assert "up to" not in B.format_plan(plan)
