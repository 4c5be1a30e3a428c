"""The benchmark scripts work (they are scripts, not timed tests: nothing here checks a speed).

* make_bench_models: the shapes give the advertised parameter counts; a shrunken bench-A / bench-B
  checkpoint loads in transformers with no missing or unexpected weights, converts with our converter and
  gives transformers' logits in Colibri; the rebuilt SmolLM2 tokenizer matches Colibri's own.
* _worker.py / bench.py: a real run on a tiny model reports complete, consistent JSON.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench  # noqa: E402
import make_bench_models as mbm  # noqa: E402

import colibri_backend  # noqa: E402
from colibri_backend.convert import convert  # noqa: E402


def smollm2() -> Path:
    return Path(colibri_backend.resolve_model("smollm2").gguf)


def tiny(name: str) -> mbm.BenchSpec:
    base = mbm.SPECS[name]
    return dataclasses.replace(
        base,
        name=f"tiny-{name}",
        n_layer=2,
        hidden=64,
        n_head=4,
        n_head_kv=2,
        head_dim=16,
        n_ff_exp=32,
        n_expert=max(base.n_expert // 2, 4),
        n_expert_used=min(base.n_expert_used, 4),
        # DeepSeek's latent attention and leading dense layer, shrunk alike (None for the others)
        mla=(32, 8, 16, 16) if base.mla else None,
        dense_lead=(1, 48) if base.dense_lead else None,
    )


def test_full_size_parameter_counts() -> None:
    assert round(mbm.param_count(mbm.SPECS["bench-a"]) / 1e9, 3) == 1.250
    assert round(mbm.param_count(mbm.SPECS["bench-b"]) / 1e9, 3) == 1.754
    assert round(mbm.param_count(mbm.SPECS["bench-gptoss"]) / 1e9, 3) == 1.352
    assert round(mbm.param_count(mbm.SPECS["bench-qwen35"]) / 1e9, 3) == 1.853
    assert round(mbm.param_count(mbm.SPECS["bench-deepseek2"]) / 1e9, 3) == 1.794


def test_gptoss_experts_are_written_as_mxfp4() -> None:
    """bench-gptoss ships its experts as the Hub does: uint8 blocks of 16 bytes and E8M0 scales per 32."""
    spec = tiny("bench-gptoss")
    names = {t.name: t for t in mbm.layer_tensors(spec, 0)}
    gu = names["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert gu.shape == (spec.n_expert, 2 * spec.n_ff_exp, spec.hidden // 32, 16)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    blocks, scales = (
        mbm.tensor_values(spec, gu),
        mbm.tensor_values(spec, names["model.layers.0.mlp.experts.down_proj_scales"]),
    )
    assert blocks.dtype == np.uint8 and len(np.unique(blocks)) > 200  # both nibbles spread over all codes
    assert scales.dtype == np.uint8 and set(np.unique(scales)) <= {
        mbm.MXFP4_SCALE_E8M0 - 1,
        mbm.MXFP4_SCALE_E8M0,
        mbm.MXFP4_SCALE_E8M0 + 1,
    }
    assert mbm.hf_config(spec, 1, 2)["quantization_config"]["quant_method"] == "mxfp4"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("bench_models")
    out = {}
    for name in ("bench-a", "bench-b", "bench-gptoss", "bench-deepseek2"):
        spec = tiny(name)
        ckpt = root / spec.name / "hf"
        mbm.write_checkpoint(spec, ckpt, smollm2(), log=lambda *a: None)
        gguf = convert(ckpt, root / f"{spec.name}.f32.gguf", out_type="f32", progress=False)
        out[name] = (ckpt, gguf)
    return out


@pytest.mark.parametrize("name", ["bench-a", "bench-b", "bench-gptoss", "bench-deepseek2"])
def test_checkpoint_loads_in_transformers_and_matches_colibri(tiny_models, name: str) -> None:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    ckpt, gguf = tiny_models[name]
    extra = {}
    if name == "bench-gptoss":  # experts in the Hub's MXFP4 form: transformers dequantizes them on CPU
        from gguf import GGMLQuantizationType, GGUFReader
        from transformers import Mxfp4Config

        types = {t.name: t.tensor_type for t in GGUFReader(str(gguf)).tensors}
        assert types["blk.0.ffn_gate_exps.weight"] == GGMLQuantizationType.MXFP4  # repacked, not requantized
        assert types["blk.0.ffn_down_exps.weight"] == GGMLQuantizationType.MXFP4
        extra["quantization_config"] = Mxfp4Config(dequantize=True)
    model, info = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, output_loading_info=True, **extra
    )
    assert not any(info.values()), info
    classes = {
        "bench-a": "MixtralForCausalLM",
        "bench-b": "Qwen3MoeForCausalLM",
        "bench-gptoss": "GptOssForCausalLM",
        "bench-deepseek2": "DeepseekV2ForCausalLM",
    }
    assert type(model).__name__ == classes[name]
    ids = bench.prompt_ids(gguf, 24)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
    with colibri_backend.load(gguf, threads=2) as m:
        got = m.logits(ids)
    assert np.max(np.abs(got - ref)) <= 1e-3 * np.max(np.abs(ref))
    assert mbm.checkpoint_is_current(tiny(name), ckpt)
    assert not mbm.checkpoint_is_current(dataclasses.replace(tiny(name), seed=1), ckpt)


def test_rebuilt_tokenizer_matches_colibri() -> None:
    from tokenizers import Tokenizer

    from colibri_backend.adapters.tokenizer import Tokenizer as ColibriTokenizer

    ours = Tokenizer.from_str(json.dumps(mbm.tokenizer_json(mbm.tokenizer_from_gguf(smollm2()))))
    theirs = ColibriTokenizer.from_gguf(smollm2())
    texts = (
        bench.PROMPT_TEXT,
        "Numbers 12345 and  two  spaces\n\tindent",
        "<|im_start|>user\nhi<|im_end|>",
        "café naïve — ünïcödé 🙂",
        "def f(x):\n    return x**2  # square",
    )
    for text in texts:
        expected = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False).ids == expected


def test_worker_and_runner_on_a_tiny_model(tiny_models, tmp_path: Path) -> None:
    _, gguf = tiny_models["bench-b"]
    prompt = bench.prompt_ids(gguf, 16)
    ban = bench.banned_ids(gguf)
    assert ban == [0, 2]  # SmolLM2's <|endoftext|> and <|im_end|> (EOS)
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "_worker.py"),
            "--engine",
            "colibri",
            "--model",
            str(gguf),
            "--prompt-ids",
            ",".join(map(str, prompt)),
            "--max-tokens",
            "12",
            "--temperature",
            "0.8",
            "--seed",
            "5",
            "--ban-ids",
            ",".join(map(str, ban)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    line = [x for x in proc.stdout.splitlines() if x.startswith("COLIBRI_BENCH_RESULT ")][-1]
    r = json.loads(line.split(" ", 1)[1])
    assert r["ok"] and r["n_prompt"] == 16 and r["n_generated"] == 12
    assert not set(r["generated_ids"]) & set(ban)
    assert r["ttft_s"] > 0 and r["decode_tps"] > 0 and r["prefill_tps"] == pytest.approx(16 / r["ttft_s"])
    assert r["peak_rss_bytes"] >= r["rss_after_load_bytes"] > 0
    assert r["engine_stats"]["allocs_last_eval"] == 0
    # the counters once the prompt is in (the decode steps' own figures are the difference)
    first = r["engine_stats_at_first_token"]
    assert first["n_prompt_tokens"] == 16 and first["n_decode_tokens"] == 0
    assert r["engine_stats"]["n_decode_tokens"] == 11

    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "bench.py"),
            "--model",
            str(gguf),
            "--engines",
            "colibri",
            "--runs",
            "2",
            "--sampling",
            "both",
            "--prompt-tokens",
            "16",
            "--max-tokens",
            "8",
            "--json",
            str(out),
            "--markdown",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert len(data["runs"]) == 4 and all(r["ok"] for r in data["runs"])
    assert [(r["sampling"], r["round"]) for r in data["runs"]] == [
        ("greedy", 0),
        ("greedy", 1),
        ("sampled", 0),
        ("sampled", 1),
    ]
    # Greedy runs in fresh processes give the same tokens; so do sampled runs with the same seed.
    assert data["runs"][0]["generated_ids"] == data["runs"][1]["generated_ids"]
    assert data["runs"][2]["generated_ids"] == data["runs"][3]["generated_ids"]
    row = data["summary"][0]["engines"]["colibri"]
    assert row["runs_ok"] == 4 and row["decode_tps_greedy"] > 0 and row["decode_tps_sampled"] > 0
    assert "| tiny-bench-b.f32.gguf | Colibri | 4 |" in proc.stdout


def test_parse_size() -> None:
    assert bench.parse_size("1034M") == 1034 << 20
    assert bench.parse_size("1.5G") == int(1.5 * (1 << 30))
    assert bench.parse_size("250MB") == 250_000_000
    assert bench.parse_size("4096") == 4096
    for bad in ("lots", "12XB", "-1G", ""):
        with pytest.raises(Exception, match="cannot parse"):
            bench.parse_size(bad)


def _cached_pages(path: Path) -> int:
    """Pages of `path` in the page cache (mincore over a read-only mapping)."""
    import ctypes
    import mmap
    import os

    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        n = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = ctypes.create_string_buffer(n)
        assert libc.mincore(addr, size, vec) == 0
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw)


def _fs_type(path: Path) -> str:
    """The file system type of the mount holding `path` (/proc/mounts: the longest mount point above it)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mnt, fstype = line.split()[:3]
        if str(path).startswith(mnt.rstrip("/") + "/") and len(mnt) > len(best):
            best, kind = mnt, fstype
    return kind


def test_evict_model_drops_the_file_and_its_sidecars_only(tmp_path: Path) -> None:
    """--cold-start evict (the capped runs' default) makes the model and its sidecars cold and leaves
    another file's pages cached."""
    if _fs_type(tmp_path.resolve()) in ("tmpfs", "ramfs"):
        pytest.skip("tmpfs pages cannot be evicted")
    import mmap

    model, side, other = tmp_path / "m.gguf", tmp_path / "m.gguf.lowbit", tmp_path / "other.bin"
    for f in (model, side, other):
        f.write_bytes(np.random.default_rng(0).bytes(1 << 20))
        f.read_bytes()
    assert _cached_pages(other) == (1 << 20) // mmap.PAGESIZE
    bench.evict_model(model)
    assert _cached_pages(model) == 0
    assert _cached_pages(side) == 0
    assert _cached_pages(other) == (1 << 20) // mmap.PAGESIZE


def test_ab_lib_prefill_on_a_tiny_model(tiny_models, capsys: pytest.CaptureFixture[str]) -> None:
    """The same library on both sides: equal logits (exit 0) and one timing line per round and side."""
    import ab_lib_prefill

    from colibri_backend._native import find_library

    _, gguf = tiny_models["bench-deepseek2"]
    lib = str(find_library())
    argv = [
        "--old",
        lib,
        "--new",
        lib,
        "--model",
        str(gguf),
        "--tokens",
        "20",
        "--reps",
        "2",
        "--rounds",
        "2",
    ]
    assert ab_lib_prefill.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("fastest") == 5 and "logits bit-identical: True" in out
    assert ab_lib_prefill.main([*argv, "--decode", "3"]) == 0  # per decode step, its logits compared
    out = capsys.readouterr().out
    assert "decode step after 20 tokens" in out and "logits bit-identical: True" in out
    with pytest.raises(SystemExit):
        ab_lib_prefill.main([*argv[:3], "/nonexistent/libcolibri.so", *argv[4:]])


def test_batch_steps_on_a_tiny_model(tiny_models, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/batch_steps.py: batched tokens equal those decoded alone (exit 0), one row per count."""
    import batch_steps

    _, gguf = tiny_models["bench-a"]
    out = tmp_path / "steps.json"
    argv = ["--model", str(gguf), "--seqs", "1,3", "--steps", "3", "--prompt-words", "8", "--threads", "2"]
    chunks = ["--chunks", "1,4,16", "--repeats", "2"]
    assert batch_steps.main([*argv, "--context-length", "128", *chunks, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [c["tokens"] for c in report["chunks"]] == [1, 4, 16]
    for c in report["chunks"]:
        assert c["wall_range"][0] <= c["wall_ms_per_token"] <= c["wall_range"][1]
        assert c["cpu_ms_per_token"] > 0
    with pytest.raises(SystemExit):  # a chunk larger than the context
        batch_steps.main([*argv, "--context-length", "128", "--chunks", "129"])
    rows = report["rows"]
    assert [r["seqs"] for r in rows] == [1, 3] and all(r["identical"] for r in rows)
    assert all(r["engine_cpu_ms_per_step"] > 0 for r in rows)
    assert (
        rows[0]["experts_per_layer_step"] == 2.0 <= rows[1]["experts_per_layer_step"] <= 4.0
    )  # 4 experts, top-2
    assert "same" in capsys.readouterr().out


def test_scheduler_overhead_script(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/scheduler_overhead.py: three sequences through the scheduler with a stand-in engine;
    every decode token came through a step (a script, not a timed test)."""
    import scheduler_overhead

    assert scheduler_overhead.main(["--seqs", "3", "--steps", "20", "--step-ms", "1"]) == 0
    fields = capsys.readouterr().out.split()
    steps = int(fields[fields.index("steps") + 1])
    assert 21 <= steps <= 3 * 21  # a prompt and 20 decodes each, shared by the steps or not
    with pytest.raises(SystemExit):
        scheduler_overhead.main(["--seqs", "0"])


def test_capped_report_counts_decode_steps_alone() -> None:
    """capped_sweep.py's decode figures are the counters' growth after the first token, not the run's
    totals over prompt + decoded tokens (the prompt's chunked reads would dilute what a token costs)."""
    import capped_sweep

    first = {
        "n_decode_tokens": 0,
        "expert_calls": 100,
        "expert_hits": 10,
        "expert_bytes_read": 1000 << 20,
        "decode_seconds": 0.0,
        "expert_stall_decode_seconds": 0.0,
    }
    end = {
        "n_decode_tokens": 10,
        "expert_calls": 420,
        "expert_hits": 26,
        "expert_bytes_read": 3700 << 20,
        "decode_seconds": 2.0,
        "expert_stall_decode_seconds": 1.5,
    }
    d = capped_sweep.decode_figures({"engine_stats_at_first_token": first, "engine_stats": end})
    assert d == {
        "hit": pytest.approx(5.0),
        "mib_per_token": pytest.approx(270.0),
        "read_mb_s": pytest.approx((2700 << 20) / 2.0 / 1e6),
        "stall": pytest.approx(75.0),
    }
    assert capped_sweep.decode_figures({"engine_stats": end}) is None


def test_capped_sweep_caps_of_another_file(tmp_path: Path, monkeypatch, capsys) -> None:
    """--cap-of FILE: the caps are shares of FILE's size, not the model's; the result files name the basis
    and the report labels the cells with it and the cap in MiB."""
    import capped_sweep

    model, other = tmp_path / "small.gguf", tmp_path / "big-q8_0.gguf"
    model.write_bytes(b"\0" * (3 << 20))
    other.write_bytes(b"\0" * (8 << 20))
    calls: list[tuple[list[str], dict]] = []

    def fake_run(cmd: list[str], env: dict, text: bool, timeout: float) -> subprocess.CompletedProcess:
        calls.append((cmd, env))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(capped_sweep.subprocess, "run", fake_run)
    argv = ["capped", "--model", str(model), "--fractions", "0.5,0.25", "--engines", "colibri"]
    argv += ["--overhead-mib", "1", "--out-dir", str(tmp_path)]
    assert capped_sweep.main([*argv, "--cap-of", str(other)]) == 0
    caps = [int(c[c.index("--memory-cap") + 1]) for c, _ in calls]
    assert caps == [4 << 20, 2 << 20]  # of the other file's 8 MiB, not the model's 3
    assert [int(e["COLIBRI_MEMORY_BUDGET"]) for _, e in calls] == [3 << 20, 1 << 20]
    outs = [Path(c[c.index("--json") + 1]).name for c, _ in calls]
    assert outs == ["capped_0.50_of-big-q8_0.json", "capped_0.25_of-big-q8_0.json"]
    calls.clear()
    assert capped_sweep.main(argv) == 0  # without it, shares of the model's own size
    assert [int(c[c.index("--memory-cap") + 1]) for c, _ in calls] == [
        int(0.5 * (3 << 20)),
        int(0.25 * (3 << 20)),
    ]
    assert Path(calls[0][0][calls[0][0].index("--json") + 1]).name == "capped_0.50.json"

    assert capped_sweep.parse_label("capped_0.25_of-big-q8_0_pf-none") == ("0.25", "big-q8_0", "none")
    assert capped_sweep.parse_label("capped_0.60") == ("0.60", "", "default")
    assert capped_sweep.parse_label("capped_none") == ("none", "", "default")

    def run(engine: str, tps: float) -> dict:
        return {"ok": True, "engine": engine, "sampling": "sampled", "decode_tps": tps}

    report = tmp_path / "report"
    report.mkdir()
    for name, cap, runs in (
        ("capped_0.25_of-big-q8_0.json", 2 << 20, [run("llama_cpp", 1.0), run("llama_cpp", 2.0)]),
        ("capped_0.50.json", 6 << 20, [run("llama_cpp", 4.0)]),
    ):
        (report / name).write_text(json.dumps({"protocol": {"memory_cap_bytes": cap}, "runs": runs}))
    capsys.readouterr()
    assert capped_sweep.main(["report", str(report)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")][1:]
    assert [ln.split(" | ")[0] for ln in lines] == ["| 50% (6 MiB)", "| 25% of big-q8_0 (2 MiB)"]
    assert lines[1].split(" | ")[4] == "1.50"  # the llama.cpp median of the two runs


def test_capped_report_over_rounds_lists_every_run_and_the_predictors(tmp_path: Path, capsys) -> None:
    """`capped_sweep.py report R1 R2`: the rounds' runs of a cell in one row, the median over them, each run's
    tok/s in round order, each predictor that guessed with its median precision / recall, MiB wasted."""
    import capped_sweep

    def run(tps: float, hashed_correct: int, wasted_mib: int) -> dict:
        stats = {
            "n_prompt_tokens": 8,
            "n_decode_tokens": 8,
            "expert_calls": 64,
            "expert_hits": 32,
            "expert_bytes_read": 64 << 20,
            "memory_plan": {"total_bytes": 100 << 20},
            "prefetch_wasted_bytes": wasted_mib << 20,
            "hashed_predicted": 40,
            "hashed_correct": hashed_correct,
            "hashed_actual": 40,
            "temporal_predicted": 0,
        }
        return {
            "ok": True,
            "engine": "colibri",
            "sampling": "greedy",
            "decode_tps": tps,
            "engine_stats": stats,
            "peak_rss_bytes": 90 << 20,
        }

    for rnd, r in (("r1", run(10.0, 20, 30)), ("r2", run(12.0, 30, 50))):
        d = tmp_path / rnd
        d.mkdir()
        doc = {"protocol": {"memory_cap_bytes": 200 << 20}, "runs": [r]}
        (d / "capped_0.40_pf-hashed.json").write_text(json.dumps(doc))
    capsys.readouterr()
    assert capped_sweep.main(["report", str(tmp_path / "r1"), str(tmp_path / "r2")]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")]
    assert len(lines) == 2  # the header and one row for the two rounds' runs
    cells = [c.strip() for c in lines[1].strip("|").split(" | ")]
    assert cells[:4] == ["40% (200 MiB)", "hashed", "greedy", "11.00"]
    assert cells[-3:] == ["10.0, 12.0", "H 62% / 62%", "40"]


def test_sampler_cost_reports_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/sampler_cost.py: a row per sampling setting, each with a positive time (a fresh process)."""
    import sampler_cost

    assert sampler_cost.main(["--vocab", "300", "--calls", "5", "--rounds", "1"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")][1:]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == list(sampler_cost.SETTINGS)
    assert all(float(r.split(" | ")[1].split(" ")[0]) > 0 for r in rows)


def test_cap_bounds_on_a_tiny_model(tiny_models, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/cap_bounds.py: an expert's bytes from the file, Belady's optimum on the decode steps'
    routing of a run (the rows of its prompt + generated ids but the last), and the speeds the disk allows."""
    import cap_bounds

    from colibri_backend.optimum import belady
    from colibri_backend.trace import record_trace

    _, gguf = tiny_models["bench-a"]
    spec = tiny("bench-a")
    assert cap_bounds.expert_bytes(str(gguf)) == [3 * spec.hidden * spec.n_ff_exp * 4] * spec.n_layer  # f32
    prompt, generated = list(range(40, 60)), [7, 300, 9, 41, 8, 12, 500, 3, 77, 31, 2000, 5]
    model = colibri_backend.load(str(gguf), threads=2, context_length=128)
    full = record_trace(model, token_ids=prompt + generated).ids
    model.close()
    opt = belady(full[len(prompt) : len(prompt) + len(generated) - 1], spec.n_expert, 3)

    def stats(n: int, read: int) -> dict:
        return {"n_decode_tokens": n, "expert_bytes_read": read, "expert_slots": 3}

    def run(engine: str, tps: float, capped: bool) -> dict:
        r = {"ok": True, "engine": engine, "model": str(gguf), "decode_tps": tps, "generated_ids": generated}
        if capped and engine == "colibri":
            r |= {"engine_stats_at_first_token": stats(0, 0), "engine_stats": stats(11, 11 << 20)}
        return r

    protocol = {"prompt_ids": {str(gguf): prompt}}
    for name, runs in (
        ("capped_none.json", [run("colibri", 10.0, False)]),
        ("capped_0.25_of-big_pf-none.json", [run("colibri", 4.0, True), run("llama_cpp", 0.5, True)]),
    ):
        (tmp_path / name).write_text(json.dumps({"protocol": protocol, "runs": runs}))
    out = tmp_path / "bounds.json"
    assert cap_bounds.main([str(tmp_path), "--disk-gbs", "0.001", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["cap"] == "0.25 of big" and row["prefetch"] == "none" and row["slots"] == 3
    assert row["opt_hit"] == pytest.approx(opt.hit_rate_preloaded)
    mib = opt.misses_preloaded * 3 * spec.hidden * spec.n_ff_exp * 4 / 2**20 / (len(generated) - 1)
    assert row["opt_mib_per_token"] == pytest.approx(mib)
    assert row["run_mib_per_token"] == pytest.approx(1.0) and row["llama_tps"] == 0.5
    io_s = mib * 2**20 / 1e6
    assert row["best_overlap_tps"] == pytest.approx(1 / max(0.1, io_s))
    assert row["best_serial_tps"] == pytest.approx(1 / (0.1 + io_s))
    assert "| 0.25 of big | none | 3 | 4.00 |" in capsys.readouterr().out


def _fake_runner(path: Path, rate: float, fail: bool = False) -> str:
    """An executable that answers as colibri-run --warmup does: its report lines on stderr (the untimed
    warmup's first, at a tenth of the rate; the timed prompt at `rate`), or an error and exit 1."""
    body = (
        "sys.stderr.write('error: cannot open model\\n'); sys.exit(1)"
        if fail
        else (
            "sys.stderr.write('colibri-run: warmup prompt: 5 tokens in 1.0 s "
            f"({rate / 10} tok/s), not counted\\n"
            f"  prompt: 5 tokens in 0.1 s ({rate} tok/s)\\n"
            f"generated: 128 tokens, time to first token 0.02 s, decode {rate} tok/s\\n')"
        )
    )
    path.write_text(f"#!{sys.executable}\nimport sys\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_ab_decode_alternates_builds_and_reports_ratios(tmp_path: Path) -> None:
    import ab_decode

    base, new = _fake_runner(tmp_path / "base", 40.0), _fake_runner(tmp_path / "new", 50.0)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    out = tmp_path / "ab.json"
    assert (
        ab_decode.main(
            [
                "--build",
                f"base={base}",
                "--build",
                f"new={new}",
                "--model",
                str(model),
                "--rounds",
                "3",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert [len(report["runs"]["m.gguf"][b]) for b in ("base", "new")] == [3, 3]
    by_build = {row["build"]: row for row in report["summary"]}
    assert by_build["base"]["ratio"] == 1.0
    assert by_build["new"]["median"] == 50.0
    assert by_build["new"]["ratio"] == pytest.approx(1.25)
    # the timed prompt's line, not the warmup's (which comes first, after "colibri-run: ")
    assert by_build["new"]["prefill_median"] == 50.0
    assert by_build["new"]["prefill_ratio"] == pytest.approx(1.25)


def test_ab_decode_names_a_failing_build(tmp_path: Path) -> None:
    import ab_decode

    bad = _fake_runner(tmp_path / "bad", 0.0, fail=True)
    with pytest.raises(RuntimeError, match="cannot open model"):
        ab_decode.main(["--build", f"bad={bad}", "--model", str(tmp_path / "m.gguf"), "--rounds", "1"])


def test_llama_cpp_keeps_its_repack_buffers_unless_built_with_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import _worker

    built = "CPU : AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | AMX_BF16 = 1 | REPACK = 1 |"
    readme_build = "CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | REPACK = 1 |"
    assert _worker.built_with_amx(built)
    assert not _worker.built_with_amx(readme_build)
    assert not _worker.built_with_amx("CPU : AMX_INT8 = 0 |")
    for cpu_amx, info, expected in ((True, built, False), (True, readme_build, True), (False, built, True)):
        monkeypatch.setattr(_worker, "cpu_has_amx", lambda cpu_amx=cpu_amx: cpu_amx)
        fake = types.SimpleNamespace(llama_print_system_info=lambda info=info: info.encode())
        assert _worker.extra_bufts_default(fake) is expected, (cpu_amx, info)
