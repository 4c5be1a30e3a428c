"""Write a released checkpoint with its weights rounded to BF16 (round to nearest even).

The F32 working checkpoint of colibri-moe v2 is 85 MB; the repository keeps its BF16 copy (43 MB).
Every file of the checkpoint directory but the weights is copied as it is, except config.json, whose
`dtype` is set to bfloat16 so that loaders know what they read.

    python tools/train_moe/to_bf16.py ~/.cache/colibri/train-v2/checkpoint tools/train_moe/release
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def convert(src: Path, dst: Path) -> None:
    """Copy checkpoint `src` to `dst` with model.safetensors in BF16."""
    if not (src / "config.json").is_file() or not (src / "model.safetensors").is_file():
        raise SystemExit(f"{src}: not a checkpoint (needs config.json and model.safetensors)")
    dst.mkdir(parents=True, exist_ok=True)
    for old in dst.iterdir():
        if old.is_file():
            old.unlink()
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copyfile(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = load_file(src / "model.safetensors")
    # sorted names: the file's layout depends only on the weights, not on the order they were saved in
    save_file(
        {k: tensors[k].to(torch.bfloat16).contiguous() for k in sorted(tensors)},
        dst / "model.safetensors",
        metadata={"format": "pt"},
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, help="checkpoint directory with an F32 model.safetensors")
    p.add_argument("dst", type=Path, help="output directory (its files are replaced)")
    a = p.parse_args()
    convert(a.src, a.dst)


if __name__ == "__main__":
    main()
