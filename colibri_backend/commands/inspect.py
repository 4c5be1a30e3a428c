"""`colibri inspect FILE`: what a GGUF holds, without loading the engine.

Architecture, dimensions, tensor types and bytes by category (attention, experts, shared
experts, dense FFN, norms, router, embeddings, output). Plain `key: value` lines, or --json.
Pure Python over the gguf package.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

CATEGORIES = (
    "attention",
    "experts",
    "shared_experts",
    "dense_ffn",
    "norms",
    "router",
    "embeddings",
    "output",
    "other",
)

_BLOCK = re.compile(r"^blk\.\d+\.(.+)$")


def categorize(name: str) -> str:
    """The category of a tensor by its llama.cpp name."""
    if name.startswith("token_embd") or name.startswith("position_embd"):
        return "embeddings"
    if name.startswith("output_norm"):
        return "norms"
    if name.startswith("output"):
        return "output"
    m = _BLOCK.match(name)
    if not m:
        return "other"
    local = m.group(1).split(".")[0]
    if "norm" in local:
        return "norms"
    if local.startswith("attn_"):
        return "attention"
    if local.endswith("_shexp"):
        return "shared_experts"  # includes ffn_gate_inp_shexp, the shared expert's sigmoid gate
    if local == "ffn_gate_inp":
        return "router"
    if local.endswith("_exps") or local == "exp_probs_b":
        return "experts"
    if local in ("ffn_gate", "ffn_up", "ffn_down"):
        return "dense_ffn"
    return "other"


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        value = value.tolist()
    return value


def inspect_gguf(path: str | Path) -> dict[str, Any]:
    """A dict describing the file (what `colibri inspect --json` prints)."""
    from gguf import GGUFReader  # only this command needs it at import time

    from colibri_backend.engine import check_model_file
    from colibri_backend.errors import ModelFormatError
    from colibri_backend.models import resolve_model

    given = Path(path).expanduser()
    if given.is_dir() and (given / "config.json").is_file():
        raise FileNotFoundError(
            f"{given} is a Hugging Face checkpoint directory; `colibri inspect` reads GGUF files "
            f"(`colibri convert {given}` writes one)"
        )
    path = resolve_model(given).gguf  # the messages `colibri run` gives for a missing file or a directory
    check_model_file(path)  # the engine's own parser, which checks every size and offset against the file
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError/IndexError/etc. on corrupt input
        raise ModelFormatError("COLIBRI_E_FORMAT", f"{path} is not a readable GGUF file: {exc}") from exc

    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key not in ("tokenizer.ggml.model", "tokenizer.ggml.pre"):
            continue
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = _plain(field.contents())
        except Exception:
            continue
    arch = str(meta.get("general.architecture", "unknown"))
    dims = {k[len(arch) + 1 :]: v for k, v in meta.items() if k.startswith(arch + ".")}
    tok_field = reader.fields.get("tokenizer.ggml.tokens")
    if "vocab_size" not in dims and tok_field is not None:
        dims["vocab_size"] = len(tok_field.data)

    by_type: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "elements": 0})
    by_cat: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    n_params = 0
    tensor_bytes = 0
    for t in reader.tensors:
        tname = t.tensor_type.name
        nbytes = int(t.n_bytes)
        nel = int(t.n_elements)
        by_type[tname]["tensors"] += 1
        by_type[tname]["bytes"] += nbytes
        by_type[tname]["elements"] += nel
        by_cat[categorize(t.name)] += nbytes
        n_params += nel
        tensor_bytes += nbytes
    names = {t.name for t in reader.tensors}
    version_field = reader.fields.get("GGUF.version")
    return {
        "file": str(path),
        "file_bytes": path.stat().st_size,
        "gguf_version": int(version_field.contents()) if version_field is not None else None,
        "architecture": arch,
        "name": meta.get("general.name"),
        "tokenizer": {"model": meta.get("tokenizer.ggml.model"), "pre": meta.get("tokenizer.ggml.pre")},
        "has_chat_template": "tokenizer.chat_template" in meta,
        "n_tensors": len(reader.tensors),
        "n_params": n_params,
        "tensor_bytes": tensor_bytes,
        # No output.weight: the output projection reuses the token embedding.
        "tied_output": "output.weight" not in names,
        "dimensions": dims,
        "tensor_types": dict(sorted(by_type.items())),
        "bytes_by_category": by_cat,
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"file: {r['file']}",
        f"file_bytes: {r['file_bytes']} ({_mib(r['file_bytes'])})",
        f"gguf_version: {r['gguf_version']}",
        f"architecture: {r['architecture']}",
        f"name: {r['name']}",
        f"tokenizer: {r['tokenizer']['model']} (pre={r['tokenizer']['pre']})",
        f"chat_template: {'yes' if r['has_chat_template'] else 'no'}",
        f"tensors: {r['n_tensors']}",
        f"parameters: {r['n_params']} ({r['n_params'] / 1e6:.1f} M)",
        f"tensor_bytes: {r['tensor_bytes']} ({_mib(r['tensor_bytes'])})",
        f"tied_output: {'yes' if r['tied_output'] else 'no'}",
    ]
    for k, v in sorted(r["dimensions"].items()):
        if isinstance(v, list) and len(v) > 8:
            v = f"[{len(v)} values]"
        lines.append(f"dim.{k}: {v}")
    for tname, d in r["tensor_types"].items():
        lines.append(f"type.{tname}: {d['tensors']} tensors, {d['bytes']} bytes ({_mib(d['bytes'])})")
    total = max(r["tensor_bytes"], 1)
    for cat, nbytes in r["bytes_by_category"].items():
        if nbytes or cat != "other":
            lines.append(f"bytes.{cat}: {nbytes} ({_mib(nbytes)}, {100 * nbytes / total:.1f}%)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = inspect_gguf(args.file)
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="show a GGUF file's architecture, dimensions, tensor types and bytes by category",
        description="Show what a GGUF file holds: architecture, dimensions, tensor types, and bytes by "
        "category (attention, experts, shared experts, dense FFN, norms, router, embeddings, output).",
    )
    p.add_argument("file", help="a .gguf file")
    p.add_argument("--json", action="store_true", help="print JSON instead of key: value lines")
    p.set_defaults(func=run)
