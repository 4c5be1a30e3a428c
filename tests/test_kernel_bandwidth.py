"""benchmarks/kernel_bandwidth.py --compare: the bytes of weights a decoded token reads, from a GGUF's
tensor sizes, and each engine's share of the read bandwidth. Timings are benchmarks, not tests."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import kernel_bandwidth as kb  # noqa: E402


def _moe_gguf(path: Path, tied: bool) -> dict[str, int]:
    """A two-layer MoE file of f32 tensors (4 experts, top-2); returns each tensor's bytes."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    shapes = {"token_embd.weight": (50, 16)}  # numpy order: n_vocab rows of n_embd
    if not tied:
        shapes["output.weight"] = (50, 16)
    for layer in range(2):
        shapes[f"blk.{layer}.attn_q.weight"] = (16, 16)
        shapes[f"blk.{layer}.ffn_norm.weight"] = (16,)
        shapes[f"blk.{layer}.ffn_gate_inp.weight"] = (4, 16)
        shapes[f"blk.{layer}.ffn_up_exps.weight"] = (4, 24, 16)
        shapes[f"blk.{layer}.ffn_down_exps.weight"] = (4, 16, 24)
    for name, shape in shapes.items():
        w.add_tensor(name, np.ones(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {name: 4 * int(np.prod(shape)) for name, shape in shapes.items()}


@pytest.mark.parametrize("tied", [False, True])
def test_decode_bytes_counts_top_k_experts_and_one_embedding_row(tmp_path: Path, tied: bool) -> None:
    sizes = _moe_gguf(tmp_path / "m.gguf", tied)
    got = kb.decode_bytes(tmp_path / "m.gguf")
    experts = sum(b for n, b in sizes.items() if "_exps." in n)
    embd = sizes["token_embd.weight"]
    rest = sum(b for n, b in sizes.items() if "_exps." not in n and n != "token_embd.weight")
    want = rest + experts * 2 // 4 + (embd if tied else embd // 50)
    assert (got["experts"], got["top_k"]) == (4, 2)
    assert got["bytes"] == want and got["by_type"] == {"F32": want}


def test_roofline_share_is_bytes_times_tok_s_over_bandwidth(tmp_path: Path) -> None:
    _moe_gguf(tmp_path / "m.gguf", tied=False)
    per_token = kb.decode_bytes(tmp_path / "m.gguf")["bytes"]
    doc = {
        "runs": [{"model": "m", "path": str(tmp_path / "m.gguf")}],
        "summary": [
            {
                "model": "m",
                "mode": "cold",
                "engines": {"llama_bench": {"decode_tps": 1e6}, "colibri_run": {"decode_tps": None}},
            }
        ],
    }
    (cell,) = kb.roofline([doc], read_gb_s=20.0)
    assert cell["bytes_per_token"] == per_token and cell["mode"] == "cold"
    assert cell["llama_bench"]["gb_s"] == pytest.approx(per_token * 1e6 * 1e-9)
    assert cell["llama_bench"]["share"] == pytest.approx(per_token * 1e-3 / 20.0)
    assert cell["colibri_run"]["share"] is None  # no successful run, no share


def test_bench_bandwidth_line_is_parsed() -> None:
    line = (
        "read 2048 MiB chunk 2816 KiB thr=2 pages=thp median 25.3 GB/s best 26.2 GB/s per CPU-s 27.2 GB/s"
        " (1 passes x 15 reps, sink 0)"
    )
    m = kb.READ_LINE.search(line)
    assert m is not None
    assert (m["mib"], m["chunk"], m["thr"], m["pages"], m["gbs"], m["cpu"]) == (
        "2048",
        "2816",
        "2",
        "thp",
        "25.3",
        "27.2",
    )
