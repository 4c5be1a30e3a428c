"""Per-tensor digests (MODEL.digests): `colibri verify`, the opt-in load check, the streamed-expert
check, and the all-resident expert copy's check (docs/robustness.md).

One byte is flipped in a resident tensor and in one expert that the prompt routes to; the
digests were written from the intact file. The model is Colibri's bundled MoE (6 layers x 32
experts, top-4, 22 MiB Q8_0)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import colibri_backend
from colibri_backend import cli
from colibri_backend.digests import sidecar_path, verify_file, write_digests
from colibri_backend.errors import ModelFormatError
from colibri_backend.models import bundled_model_path

PROMPT = "def fibonacci(n):"
RESIDENT = "blk.2.attn_q.weight"
EXPERTS = "blk.1.ffn_up_exps.weight"


def _tensor_range(path: Path, name: str) -> tuple[int, int]:
    import gguf

    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return int(t.data_offset), int(t.n_bytes)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.fixture(scope="module")
def routed_expert() -> int:
    """An expert of layer 1 that the prompt's first token routes to."""
    with colibri_backend.load(bundled_model_path("colibri-moe"), threads=1, memory_budget=0) as m:
        ids = m.route(m.tokenize(PROMPT))
    return int(ids[0, 1, 0])


@pytest.fixture
def model(tmp_path: Path) -> Path:
    dst = tmp_path / "moe.gguf"
    shutil.copyfile(bundled_model_path("colibri-moe"), dst)
    assert cli.main(["verify", "--write", str(dst)]) == 0
    assert sidecar_path(dst).is_file()
    return dst


def _flip_expert(path: Path, expert: int) -> None:
    off, nbytes = _tensor_range(path, EXPERTS)
    per = nbytes // 32  # 32 experts stacked
    _flip(path, off + expert * per + per // 2)


def test_intact_file_verifies(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert verify_file(model) == []
    assert cli.main(["verify", str(model)]) == 0
    assert "every tensor matches" in capsys.readouterr().out


def test_verify_names_the_flipped_tensor_and_expert(model: Path, routed_expert: int, capsys) -> None:
    off, nbytes = _tensor_range(model, RESIDENT)
    _flip(model, off + nbytes // 3)
    _flip_expert(model, routed_expert)
    # in tensor-table order (the bundled file lists a layer's FFN before the next layer's attention)
    assert sorted(verify_file(model)) == sorted([RESIDENT, f"{EXPERTS} expert {routed_expert}"])
    capsys.readouterr()
    assert cli.main(["verify", str(model)]) == 1
    out = capsys.readouterr()
    assert sorted(out.out.splitlines()) == sorted([RESIDENT, f"{EXPERTS} expert {routed_expert}"])
    assert "2 tensor(s) do not match" in out.err


def test_load_check_refuses_a_flipped_resident_tensor(model: Path) -> None:
    off, nbytes = _tensor_range(model, RESIDENT)
    _flip(model, off + 7)
    with pytest.raises(ModelFormatError, match=RESIDENT):
        colibri_backend.load(model, threads=1, expert_slots=4, verify=True)
    # opt-in: without verify the file loads (and would compute with the flipped byte)
    colibri_backend.load(model, threads=1, expert_slots=4).close()


def test_streamed_expert_check_fails_that_eval(model: Path, routed_expert: int) -> None:
    _flip_expert(model, routed_expert)
    with colibri_backend.load(model, threads=1, expert_slots=4, verify=True) as m:  # resident part is intact
        with pytest.raises(ModelFormatError, match=rf"expert {routed_expert} of layer 1 .*digest"):
            m.generate(PROMPT, max_tokens=4)


def test_all_resident_context_checks_every_expert(model: Path, routed_expert: int) -> None:
    _flip_expert(model, routed_expert)
    with pytest.raises(
        ModelFormatError, match=rf"expert {routed_expert} of {EXPERTS} does not match its digest"
    ):
        colibri_backend.load(model, threads=1, memory_budget=0)


def test_no_sidecar_no_check_and_verify_says_so(tmp_path: Path, capsys) -> None:
    dst = tmp_path / "plain.gguf"
    shutil.copyfile(bundled_model_path("colibri-moe"), dst)
    colibri_backend.load(dst, threads=1, memory_budget=0).close()
    assert cli.main(["verify", str(dst)]) == 1
    assert "has no digests" in capsys.readouterr().err
    with pytest.raises(colibri_backend.errors.ColibriError, match="no digests"):
        colibri_backend.load(dst, threads=1, verify=True)


def test_bad_or_foreign_sidecar_is_refused_at_load(model: Path, tmp_path: Path) -> None:
    side = sidecar_path(model)
    raw = bytearray(side.read_bytes())
    raw[60] ^= 1  # a digest value: the checksum no longer matches
    side.write_bytes(bytes(raw))
    with pytest.raises(ModelFormatError, match="checksum mismatch"):
        colibri_backend.load(model, threads=1, expert_slots=4)
    # a valid sidecar of another file (same size and tensors, one metadata byte changed) names the problem
    other = tmp_path / "other.gguf"
    raw_model = bytearray(model.read_bytes())
    key = raw_model.find(b"general.name")
    value = key + len(b"general.name") + 4 + 8  # after the key: u32 type, u64 length, then the string
    raw_model[value] ^= 0x20
    other.write_bytes(bytes(raw_model))
    write_digests(other)
    shutil.copyfile(sidecar_path(other), side)
    with pytest.raises(ModelFormatError, match="made from another file"):
        colibri_backend.load(model, threads=1, expert_slots=4)
