"""Build the corpus split, train the byte-level BPE tokenizer and tokenize both splits.

Corpus: the CPython 3.11 standard library sources (``Lib/**/*.py``), excluding ``site-packages``
and test directories (``test``, ``tests``, ``idle_test``, and ``lib2to3/tests``), which are large,
repetitive and full of generated data. Files are split by file (never by line): a file goes to the
held-out split when the first 8 bytes of SHA-256 of its relative POSIX path, as an integer, modulo
100 is below ``--heldout-percent``.

Outputs under ``--out`` (default ``out/``):
  data/train.u16, data/heldout.u16   token ids (uint16, documents joined by ``<|endoftext|>``)
  data/manifest.json                 the file lists of each split, byte and token counts
  tokenizer/                         tokenizer.json + tokenizer_config.json (HF format)
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DEFAULT_STDLIB = "/root/.pyenv/versions/3.11.7/lib/python3.11"
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOT_ID = 0
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def list_corpus(root: Path) -> list[str]:
    """Return the sorted relative paths of the corpus files under ``root``."""
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel_path: str, heldout_percent: int) -> bool:
    """Deterministic by-file split: SHA-256 of the relative path, modulo 100."""
    h = int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big")
    return h % 100 < heldout_percent


def read_text(path: Path) -> str:
    """Read a source file as UTF-8, replacing undecodable bytes."""
    return path.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style pre-tokenization, no prefix space)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id("<|endoftext|>") == EOT_ID
    return tok


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Save tokenizer.json and tokenizer_config.json (with a ChatML-style chat template)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token=None,
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    make_portable_tokenizer_config(out_dir)


def make_portable_tokenizer_config(out_dir: Path) -> None:
    """Make tokenizer_config.json readable by transformers 4.x, llama.cpp's converter and jinja2 users.

    transformers 5 writes ``tokenizer_class: TokenizersBackend`` and keeps the chat template only in
    ``chat_template.jinja``; older readers expect ``PreTrainedTokenizerFast``, the template inside
    tokenizer_config.json and ``additional_special_tokens``.
    """
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["additional_special_tokens"] = ["<|im_start|>", "<|im_end|>"]
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def encode_docs(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Encode documents; each document is preceded by ``<|endoftext|>``."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.append(EOT_ID)
        ids.extend(enc.ids)
    arr = np.asarray(ids, dtype=np.uint16)
    return arr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stdlib", default=DEFAULT_STDLIB)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out"))
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--heldout-percent", type=int, default=5)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()

    root = Path(args.stdlib)
    out = Path(args.out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    files = list_corpus(root)
    train_files = [f for f in files if not is_heldout(f, args.heldout_percent)]
    held_files = [f for f in files if is_heldout(f, args.heldout_percent)]
    train_texts = [read_text(root / f) for f in train_files]
    held_texts = [read_text(root / f) for f in held_files]

    tok = train_tokenizer(train_texts, args.vocab_size)  # trained on the train split only
    save_hf_tokenizer(tok, out / "tokenizer", args.context)

    train_ids = encode_docs(tok, train_texts)
    held_ids = encode_docs(tok, held_texts)
    train_ids.tofile(out / "data" / "train.u16")
    held_ids.tofile(out / "data" / "heldout.u16")
    manifest = {
        "stdlib_root": str(root),
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "heldout_rule": f"int(sha256(relpath)[:8 bytes], big-endian) % 100 < {args.heldout_percent}",
        "vocab_size": tok.get_vocab_size(),
        "train": {
            "files": len(train_files),
            "bytes": sum(len(t.encode()) for t in train_texts),
            "tokens": int(train_ids.size),
        },
        "heldout": {
            "files": len(held_files),
            "bytes": sum(len(t.encode()) for t in held_texts),
            "tokens": int(held_ids.size),
        },
        "train_files": train_files,
        "heldout_files": held_files,
    }
    (out / "data" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(json.dumps({k: v for k, v in manifest.items() if not k.endswith("_files")}, indent=1))


if __name__ == "__main__":
    main()
