"""Expert streaming under a memory budget, through the C API (ctypes) on tiny MoE GGUF files.

The contract: whatever the budget, policy or predictor, the logits and the greedy tokens are
bit-identical to the unbudgeted run (the store changes when bytes arrive, never the math); the
store really streams (fewer slots than experts, misses and bytes read counted); a budget below
the minimum working set is refused with the number that works; a decode step still makes no
heap allocation.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from engine_reference import make_tiny_model
from native_engine import LIB, Engine

from colibri_backend import _native as N
from colibri_backend.errors import BudgetError

N_CTX, N_BATCH, THREADS = 96, 16, 2
PROMPT_LEN, N_GEN = 37, 12  # the prompt spans three chunks of N_BATCH, so prefill runs in waves


class Run(Engine):
    """One model + context with a budget; evaluates a prompt and a greedy continuation."""

    def __init__(self, path: Path, budget: int, policy: int = N.POLICY_LFU, prefetch: int = 3) -> None:
        self._open(path, N.ContextParamsC(THREADS, N_CTX, N_BATCH, budget, policy, prefetch))

    def greedy(self, prompt: list[int], n_new: int) -> tuple[np.ndarray, list[int], np.ndarray]:
        prompt_logits = self.eval(prompt, True)
        last = prompt_logits[-1]
        ids: list[int] = []
        steps = []
        for _ in range(n_new):
            ids.append(int(np.argmax(last)))
            last = self.eval([ids[-1]], False)[0]
            steps.append(last)
        return prompt_logits, ids, np.stack(steps)


MODELS = {
    "mixtral_q8": dict(
        arch="mixtral",
        wtype="Q8_0",
        n_expert=16,
        n_expert_used=2,
        n_embd=128,
        n_layer=4,
        n_ff_exp=256,
        head_dim=32,
    ),
    "qwen2moe_shared": dict(
        arch="qwen2moe",
        wtype="Q4_0",
        n_expert=16,
        n_expert_used=3,
        n_embd=128,
        n_layer=3,
        n_ff_exp=512,
        n_ff_shexp=128,
        head_dim=32,
    ),
    "qwen3moe_f32": dict(
        arch="qwen3moe",
        wtype="F32",
        n_expert=8,
        n_expert_used=2,
        n_embd=64,
        n_layer=3,
        n_ff_exp=256,
        norm=True,
    ),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    spec = dict(MODELS[request.param])
    path = tmp_path_factory.mktemp("moe") / f"{request.param}.gguf"
    arch = spec.pop("arch")
    make_tiny_model(path, arch, seed=5, **spec)
    prompt = np.random.default_rng(3).integers(0, 301, PROMPT_LEN).tolist()
    ref = Run(path, 0)
    try:
        out = ref.greedy(prompt, N_GEN)
        assert ref.stats().expert_slots == 0  # no budget: no store
    finally:
        ref.close()
    return path, {"prompt": prompt, "ref": out}


def _budget(path: Path, fraction: float) -> int:
    """fraction of the file, or the minimum working set where the tiny model's fixed overheads (model
    tables, scratch, KV) put that above a quarter of its 5 MB: the budget still streams its experts."""
    probe = Run(path, 1 << 40)
    try:
        min_budget = probe.plan().min_budget
    finally:
        probe.close()
    return max(int(os.path.getsize(path) * fraction), min_budget)


def _assert_identical(got: tuple, ref: tuple) -> None:
    assert got[1] == ref[1], "greedy ids differ"
    assert np.array_equal(got[0], ref[0]), "prompt logits differ"
    assert np.array_equal(got[2], ref[2]), "decode logits differ"


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_bit_identical_at_budget_fractions(moe: tuple[Path, dict], fraction: float) -> None:
    path, ref = moe
    budget = _budget(path, fraction)
    run = Run(path, budget)
    try:
        plan = run.plan()
        got = run.greedy(ref["prompt"], N_GEN)
        s = run.stats()
    finally:
        run.close()
    _assert_identical(got, ref["ref"])
    assert plan.fits == 1 and plan.total_bytes <= budget
    assert s.memory_budget == budget and s.planned_bytes == plan.total_bytes
    if not plan.all_resident:
        assert 0 < plan.n_expert_slots < plan.n_expert_total
        assert s.expert_slots == plan.n_expert_slots
        assert s.expert_misses > 0 and s.expert_bytes_read > 0
        assert s.expert_calls == s.expert_hits + s.expert_misses
    if fraction <= 0.5:
        assert not plan.all_resident, "half the file must not hold every expert plus the rest"


@pytest.mark.parametrize(
    "policy,prefetch",
    [(N.POLICY_LFU, 0), (N.POLICY_LRU, 0), (N.POLICY_LRU, 3), (N.POLICY_LFU, 1), (N.POLICY_LFU, 2)],
)
def test_policies_and_predictors_do_not_change_output(
    moe: tuple[Path, dict], policy: int, prefetch: int
) -> None:
    path, ref = moe
    run = Run(path, int(os.path.getsize(path) * 0.3), policy, prefetch)
    try:
        got = run.greedy(ref["prompt"], N_GEN)
        s = run.stats()
    finally:
        run.close()
    _assert_identical(got, ref["ref"])
    if prefetch == 0:
        assert s.prefetch_issued == 0 and s.lookahead_predicted == 0 and s.temporal_predicted == 0
    if prefetch & 1:
        # every decode step predicts layers 1.. from the layer before: k experts each
        assert s.lookahead_predicted > 0 and s.lookahead_correct <= s.lookahead_predicted
    if prefetch & 2:
        assert s.temporal_predicted > 0 and s.temporal_correct <= s.temporal_actual


def test_minimum_budget_is_exact_and_below_is_refused(moe: tuple[Path, dict]) -> None:
    path, ref = moe
    probe = Run(path, 1 << 40)
    try:
        min_budget = probe.plan().min_budget
    finally:
        probe.close()
    with pytest.raises(BudgetError) as err:
        Run(path, min_budget - 1)
    assert str(min_budget) in str(err.value)
    run = Run(path, min_budget)  # the number the error names works, with top-k slots
    try:
        plan = run.plan()
        assert plan.n_expert_slots == plan.min_expert_slots == run.info.n_expert_used
        got = run.greedy(ref["prompt"], N_GEN)
    finally:
        run.close()
    _assert_identical(got, ref["ref"])


def test_counters_add_up_and_decode_allocates_nothing(moe: tuple[Path, dict]) -> None:
    path, ref = moe
    run = Run(path, _budget(path, 0.25))
    try:
        run.eval(ref["prompt"], False)
        LIB.colibri_reset_stats(run.ctx)
        for t in ref["ref"][1][:6]:
            run.eval([t], False)
            assert run.stats().allocs_last_eval == 0
        s = run.stats()
        per = run.expert_stats()
        k, n_layer = run.info.n_expert_used, run.info.n_layer
        assert s.expert_calls == 6 * n_layer * k  # one call per chosen expert per layer per token
        assert s.expert_calls == sum(e.calls for e in per)
        assert s.expert_hits == sum(e.hits for e in per)
        assert s.expert_bytes_read == sum(e.bytes_read for e in per)
        assert s.prefetch_used + s.prefetch_wasted <= s.prefetch_issued + s.expert_slots
        assert sum(e.resident for e in per) <= s.expert_slots
        assert s.expert_slots == run.plan().n_expert_slots
    finally:
        run.close()


def test_plan_without_loading_matches_context(moe: tuple[Path, dict]) -> None:
    path, _ = moe
    budget = int(os.path.getsize(path) * 0.5)
    params = N.ContextParamsC(THREADS, N_CTX, N_BATCH, budget, 0, 3)
    plan = N.MemoryPlanC()
    LIB.check(LIB.colibri_plan(os.fsencode(path), ctypes.byref(params), ctypes.byref(plan)))
    run = Run(path, budget)
    try:
        assert bytes(run.plan()) == bytes(plan)
    finally:
        run.close()
    parts = (
        plan.metadata_bytes
        + plan.resident_weight_bytes
        + plan.model_table_bytes
        + plan.kv_bytes
        + plan.scratch_bytes
        + plan.context_bytes
        + plan.store_table_bytes
        + plan.expert_bytes
    )
    assert parts == plan.total_bytes


def test_plan_command(moe: tuple[Path, dict]) -> None:
    path, _ = moe
    env = dict(os.environ)
    env["COLIBRI_LIB"] = str(LIB.path)
    cmd = [sys.executable, "-m", "colibri_backend.cli", "plan", str(path), "--context", str(N_CTX)]
    ok = subprocess.run(cmd + ["--memory-budget", "1G"], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    assert "KV cache" in ok.stdout and "-> fits" in ok.stdout
    bad = subprocess.run(cmd + ["--memory-budget", "1K"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2
    assert "does NOT fit" in bad.stdout and "--memory-budget" in bad.stderr


_RSS_CHILD = r"""
import ctypes, sys
import numpy as np
from colibri_backend import _native as N
LIB = N.load_library()
def vm(name):
    for line in open("/proc/self/status"):
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
path, budget = sys.argv[1], int(sys.argv[2])
toks = np.random.default_rng(0).integers(0, 301, 48).astype(np.int32)
out = np.zeros(301, np.float32)
before = vm("VmRSS")
m, c = ctypes.c_void_p(), ctypes.c_void_p()
LIB.check(LIB.colibri_model_open(path.encode(), ctypes.byref(m)))
p = N.ContextParamsC(2, 64, 16, budget, 0, 3)
LIB.check(LIB.colibri_context_new(m, ctypes.byref(p), ctypes.byref(c)))
LIB.check(LIB.colibri_eval(c, N.i32_ptr(toks), len(toks), N.f32_ptr(out), 0))
for _ in range(8):
    t = np.asarray([int(np.argmax(out))], np.int32)
    LIB.check(LIB.colibri_eval(c, N.i32_ptr(t), 1, N.f32_ptr(out), 0))
plan = N.MemoryPlanC()
LIB.check(LIB.colibri_get_memory_plan(c, ctypes.byref(plan)))
print(vm("VmHWM") - before, plan.total_bytes, plan.n_expert_slots, plan.n_expert_total)
"""


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_peak_rss_within_ten_percent_of_plan(tmp_path: Path, fraction: float) -> None:
    """A fresh process: peak RSS growth from just before the model opens to the end of a prompt and
    eight decode steps stays within 10% of the ledger's total (the experts dominate: ~100 MB file)."""
    path = tmp_path / "mid.gguf"
    make_tiny_model(
        path,
        "mixtral",
        wtype="F32",
        n_expert=8,
        n_expert_used=2,
        n_embd=256,
        n_layer=4,
        n_ff_exp=1024,
        head_dim=32,
        n_head=8,
        n_head_kv=4,
    )
    budget = int(os.path.getsize(path) * fraction)
    env = dict(os.environ, COLIBRI_LIB=str(LIB.path))
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(path), str(budget)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    growth, planned, slots, total = (int(v) for v in proc.stdout.split())
    assert 0 < slots < total
    assert planned <= budget
    assert abs(growth - planned) <= 0.10 * planned, f"peak RSS growth {growth} vs plan {planned}"
