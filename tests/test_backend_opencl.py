"""The OpenCL compute backend (native/src/backend_opencl.c) against the CPU backend.

It runs on whatever OpenCL platform the machine has: PoCL's CPU device in CI (.ci/run installs
pocl-opencl-icd), where a skip counts as a failure. Checked here:

* the bundled MoE's teacher-forced logits through OpenCL against the CPU backend, within twice what
  the CPU's own kernel sets (SIMD against scalar) differ by on the same tokens;
* the conformance suite's tiny models (test_vs_transformers, Colibri's F32 files; CONFORMANCE_SUBSET)
  through OpenCL, selected with COLIBRI_DEVICE=opencl, within the suite's own tolerances;
* a streamed run under a memory budget: every stage of the pipeline timeline (I/O reads, staging
  copies, device compute) busy, the overlap figures consistent, no allocation in a decode step, and
  logits within the same bound as the resident run;
* the memory plan counts the backend's buffers and its staging buffers (what the backend allocates),
  `colibri plan --device opencl` shows them, and a budget that holds the CPU's minimum but not the
  staging buffers is refused;
* the errors: an unknown device name, a missing OpenCL library, a loader with no platform.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri_backend
from colibri_backend import _native
from colibri_backend.errors import ColibriError
from colibri_backend.load_options import LoadOptions
from colibri_backend.models import default_model_path

ROOT = Path(__file__).resolve().parent.parent
TEXT = "The quick brown fox jumps over the lazy dog while the engine streams its experts. " * 3


def _opencl_reason() -> str | None:
    """None when an OpenCL context can be made here, else the engine's reason."""
    try:
        with colibri_backend.load(default_model_path(), threads=2, device="opencl", context_length=64):
            return None
    except ColibriError as exc:
        return str(exc)


@pytest.fixture(scope="module")
def opencl() -> None:
    reason = _opencl_reason()
    if reason is not None:
        pytest.skip(f"no OpenCL device: {reason}")


def _logits(
    device: str, ids: list[int], model: Path | None = None, **options: object
) -> tuple[np.ndarray, dict]:
    path = model or default_model_path()
    with colibri_backend.load(path, threads=2, device=device, context_length=128, **options) as m:
        out = np.asarray(m.logits(ids), dtype=np.float64)
        return out, m.stats()


def _ids(model: Path | None = None, n: int = 48) -> list[int]:
    with colibri_backend.load(model or default_model_path(), threads=2, context_length=64) as m:
        return m.tokenize(TEXT)[:n]


def _kl_mean(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    def lsm(x: np.ndarray) -> np.ndarray:
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = lsm(p_logits), lsm(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


# the CPU's logits, and its scalar kernels' distance from them: max |dlogit|, mean KL, top-1 disagreements
Noise = tuple[list[int], np.ndarray, float, float, int]


def _cpu_noise(model: Path | None = None, n: int = 48) -> Noise:
    """The CPU's logits and how far its scalar kernels are from them: the tolerance scale."""
    ids = _ids(model, n)
    fast, _ = _logits("cpu", ids, model)
    table = _native.cpu_backend()
    _native.set_cpu_backend("scalar")
    try:
        scalar, _ = _logits("cpu", ids, model)
    finally:
        _native.set_cpu_backend(table)
    flips = int((fast.argmax(-1) != scalar.argmax(-1)).sum())
    return ids, fast, float(np.abs(fast - scalar).max()), _kl_mean(fast, scalar), flips


@pytest.fixture(scope="module")
def cpu_noise() -> Noise:
    return _cpu_noise()


def _check_against_cpu(noise: Noise, model: Path | None = None) -> None:
    ids, cpu, noise_abs, noise_kl, noise_flips = noise
    dev, stats = _logits("opencl", ids, model)
    assert stats["device"].startswith("opencl: "), stats["device"]
    assert stats["backend"] == _native.BACKEND_OPENCL
    assert stats["device_jobs"] > 0 and stats["device_errors"] == 0
    assert stats["device_cpu_jobs"] == 0  # every type of these files has a device kernel
    diff = float(np.abs(cpu - dev).max())
    kl = _kl_mean(cpu, dev)
    print(f"opencl vs cpu: max|dlogit| {diff:.3g}, KL {kl:.3g}; cpu scalar vs simd {noise_abs:.3g}")
    assert diff <= 2 * noise_abs + 1e-4, (diff, noise_abs)
    assert _kl_mean(cpu, dev) <= 2 * noise_kl + 1e-7
    assert int((cpu.argmax(-1) != dev.argmax(-1)).sum()) <= 2 * noise_flips + 1


def test_bundled_model_matches_cpu(opencl: None, cpu_noise: Noise) -> None:
    _check_against_cpu(cpu_noise)  # the bundled MoE: Q8_0 experts, F32 norms


def test_smollm2_matches_cpu(opencl: None) -> None:
    """A real trained dense model (llama architecture, Q4_1): 30 layers of requantized activations, so the
    CPU's own kernel sets already differ by about a logit here."""
    from colibri_backend.models import resolve_model

    model = resolve_model("smollm2").gguf
    _check_against_cpu(_cpu_noise(model, 24), model)


def test_streamed_under_budget_timeline(opencl: None, cpu_noise: Noise) -> None:
    ids, cpu, noise_abs, _, _ = cpu_noise
    plan = colibri_backend.plan_memory(
        default_model_path(), LoadOptions(memory_budget=1, context_length=128, device="opencl")
    )
    budget = int(plan["min_budget"] * 1.15)  # streams: far below what holds every expert
    with colibri_backend.load(
        default_model_path(), threads=2, device="opencl", context_length=128, memory_budget=budget
    ) as m:
        assert m.stats()["expert_slots"] > 0  # the store exists: experts stream
        dev = np.asarray(m.logits(ids), dtype=np.float64)
        m.reset_stats()
        gen = list(m.generate_tokens(ids[:8], max_tokens=6))
        s = m.stats()
    assert float(np.abs(cpu - dev).max()) <= 2 * noise_abs + 1e-4
    assert len(gen) > 0
    assert s["allocs_last_eval"] == 0  # the decode step through the device allocates nothing
    pipe = s["pipeline"]
    for stage in ("io", "stage", "compute"):
        st = pipe["stages"][stage]
        assert st["intervals"] > 0 and st["busy_seconds"] > 0, (stage, pipe)
        assert 0 < st["busy_share"] <= 1.0 + 1e-6, (stage, pipe)
    assert s["device_staged_bytes"] > 0 and s["device_buffer_bytes"] > 0
    assert pipe["any_busy_seconds"] <= pipe["span_seconds"] + 1e-9
    busy = {k: v["busy_seconds"] for k, v in pipe["stages"].items()}
    for pair, (a, b) in {
        "io_stage": ("io", "stage"),
        "stage_compute": ("stage", "compute"),
        "io_compute": ("io", "compute"),
    }.items():
        assert 0 <= pipe["overlap_seconds"][pair] <= min(busy[a], busy[b]) + 1e-9, (pair, pipe)
    assert max(busy.values()) <= pipe["any_busy_seconds"] + 1e-9 <= sum(busy.values()) + 2e-9


def _plan(device: str, budget: int | None = 1) -> dict:
    opts = LoadOptions(memory_budget=budget, context_length=128, device=device)
    return colibri_backend.plan_memory(default_model_path(), opts)


def test_plan_counts_device_and_staging_buffers(opencl: None) -> None:
    cpu, dev = _plan("cpu"), _plan("opencl")
    assert cpu["device_buffer_bytes"] == cpu["device_staging_bytes"] == 0
    assert dev["device_buffer_bytes"] > 0
    # three staging buffers, each an expert's gate + up (a slot holds gate + up + down, page padded)
    assert dev["expert_slot_bytes"] < dev["device_staging_bytes"] < 3 * dev["expert_slot_bytes"]
    extra = dev["device_buffer_bytes"] + dev["device_staging_bytes"]
    assert dev["min_budget"] == cpu["min_budget"] + extra
    # every expert resident: no staging buffers, none planned
    resident = _plan("opencl", None)
    assert resident["all_resident"] == 1 and resident["device_staging_bytes"] == 0
    assert resident["total_bytes"] == _plan("cpu", None)["total_bytes"] + resident["device_buffer_bytes"]
    # the plan is what the backend allocates, streamed and resident
    budget = int(dev["min_budget"] * 1.15)
    for b, want in ((budget, extra), (None, resident["device_buffer_bytes"])):
        with colibri_backend.load(
            default_model_path(), threads=2, device="opencl", context_length=128, memory_budget=b
        ) as m:
            assert m.stats()["device_buffer_bytes"] == want
            assert m.memory_plan()["total_bytes"] == _plan("opencl", b)["total_bytes"]
    # a budget that holds the CPU's minimum working set but not the device's buffers is refused
    between = cpu["min_budget"] + extra // 2
    assert _plan("cpu", between)["fits"] == 1 and _plan("opencl", between)["fits"] == 0
    with pytest.raises(ColibriError, match="cannot hold the minimum working set"):
        colibri_backend.load(
            default_model_path(), threads=2, device="opencl", context_length=128, memory_budget=between
        )
    cmd = [sys.executable, "-m", "colibri_backend", "plan", str(default_model_path()), "--context", "128"]
    r = subprocess.run(
        [*cmd, "-b", str(budget), "--device", "opencl"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OpenCL staging buffers" in r.stdout and "OpenCL device buffers" in r.stdout, r.stdout
    r = subprocess.run(
        [*cmd, "-b", str(between), "--device", "opencl"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and f"--memory-budget {dev['min_budget']}" in r.stderr, r.stdout + r.stderr
    r = subprocess.run([*cmd, "-b", str(budget)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OpenCL" not in r.stdout, r.stdout


# One tiny model per FFN shape the device meets: routed experts (mixtral; a dense FFN runs the same job
# lists), a shared expert and q/k/v biases (qwen2moe), gpt-oss's expert biases and clamped SwiGLU (handed to
# the CPU backend). docs/portability.md has the whole suite's run through OpenCL.
CONFORMANCE_SUBSET = ("mixtral", "qwen2moe", "gpt_oss")


def test_conformance_suite_through_opencl(opencl: None) -> None:
    """test_vs_transformers' teacher-forced logits (Colibri's F32 files) of CONFORMANCE_SUBSET, every
    product through OpenCL (COLIBRI_DEVICE), judged by the suite's own tolerances."""
    env = dict(os.environ, COLIBRI_DEVICE="opencl")
    pick = " or ".join(f"[{name}-colibri]" for name in CONFORMANCE_SUBSET)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        f"teacher_forced and ({pick})",
        str(ROOT / "conformance_tests" / "test_vs_transformers.py"),
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert f"{len(CONFORMANCE_SUBSET)} passed" in r.stdout, r.stdout[-2000:]
    assert " failed" not in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]


def test_env_selects_and_bad_names_are_refused(opencl: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLIBRI_DEVICE", "opencl")
    with colibri_backend.load(default_model_path(), threads=2, context_length=64) as m:
        assert m.stats()["device"].startswith("opencl: ")
    with colibri_backend.load(default_model_path(), threads=2, context_length=64, device="cpu") as m:
        assert m.stats()["device"] == "cpu"  # the option wins over the environment
    monkeypatch.setenv("COLIBRI_DEVICE", "tpu")
    with pytest.raises(ColibriError, match="COLIBRI_DEVICE=tpu is not 'cpu' or 'opencl'"):
        colibri_backend.load(default_model_path(), threads=2, context_length=64)
    with pytest.raises(ValueError, match="device must be one of cpu, opencl"):
        LoadOptions(device="gpu")


def _load_in_child(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = (
        "import colibri_backend as c, sys\n"
        "from colibri_backend.models import default_model_path\n"
        "try:\n"
        "    c.load(default_model_path(), threads=1, context_length=32, device='opencl')\n"
        "except c.ColibriError as e:\n"
        "    print('ERROR', e); sys.exit(3)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True, timeout=120
    )


def test_missing_library_is_a_clear_error(tmp_path: Path) -> None:
    r = _load_in_child({"COLIBRI_OPENCL_LIB": str(tmp_path / "libOpenCL.so.1")})
    assert r.returncode == 3, r.stdout + r.stderr
    assert "cannot load" in r.stdout and "pocl-opencl-icd" in r.stdout, r.stdout


def test_no_platform_is_a_clear_error(opencl: None, tmp_path: Path) -> None:
    # the ICD loader finds its drivers in OCL_ICD_VENDORS: an empty directory gives it none
    r = _load_in_child({"OCL_ICD_VENDORS": str(tmp_path)})
    assert r.returncode == 3, r.stdout + r.stderr
    assert "no platform found" in r.stdout, r.stdout


def test_device_pipeline_script(opencl: None, tmp_path: Path) -> None:
    """benchmarks/device_pipeline.py (the docs' timeline command) on the bundled model, streamed."""
    plan = colibri_backend.plan_memory(
        default_model_path(), LoadOptions(memory_budget=1, context_length=512, device="opencl")
    )
    out = tmp_path / "pipe.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "device_pipeline.py"),
        "--model",
        str(default_model_path()),
    ]
    cmd += ["--memory-budget", str(int(plan["min_budget"] * 1.2)), "--max-tokens", "4", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(out.read_text())
    assert got["device"].startswith("opencl: ") and got["generated"] == 4
    assert got["expert_slots"] > 0 and got["device_staged_bytes"] > 0
    assert all(got["pipeline"]["stages"][s]["busy_seconds"] > 0 for s in ("io", "stage", "compute"))
    assert "compute  busy" in r.stdout


def test_cli_device_option(opencl: None) -> None:
    cmd = [
        sys.executable,
        "-m",
        "colibri_backend",
        "run",
        "Once upon a time",
        "--model",
        str(default_model_path()),
    ]
    r = subprocess.run(
        [*cmd, "--device", "opencl", "--max-tokens", "2", "--stats"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stats.device: opencl: " in r.stdout + r.stderr
    bad = subprocess.run([*cmd, "--device", "gpu"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "invalid choice: 'gpu'" in bad.stderr
