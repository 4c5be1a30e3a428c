"""Greedy chat on two backends, token by token; explains the first divergence, if any.

    python examples/compare_backends.py                       # colibri vs llama_cpp on SmolLM2
    python examples/compare_backends.py --model /path/model.gguf --backends colibri transformers

At a divergence it prints both engines' two best candidates there, from the logits of the same
computation that generated the token (llama.cpp's logits depend on how the prompt was batched, so
they are recomputed along the generation's own path: one batch for the prompt, then one token at a
time).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from colibri_backend.backends import StepModel
from colibri_backend.config import ModelConfig
from colibri_backend.registry import load_model

sys.path.insert(0, str(Path(__file__).parent))
from app import QUESTIONS  # noqa: E402  (the example app's questions)


def next_logits(model, prompt: list[int], generated: list[int]) -> np.ndarray:
    """The logits the model sampled token len(generated) from."""
    if isinstance(model, StepModel):  # replay the generation path: batched prompt, then one by one
        row = model._prefill(prompt)
        for t in generated:
            row = model._decode(t)
        return row
    return model.logits(prompt + generated)[-1]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--backends", nargs=2, default=["colibri", "llama_cpp"])
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    a_name, b_name = args.backends
    a = load_model(ModelConfig(alias="a", path=args.model, backend=a_name, threads=2, context_length=1024))
    b = load_model(ModelConfig(alias="b", path=args.model, backend=b_name, threads=2, context_length=1024))
    for q in QUESTIONS:
        msgs = [{"role": "user", "content": q}]
        prompt = a.tokenize(a.render_chat(msgs), add_special_tokens=False)
        if prompt != b.tokenize(b.render_chat(msgs), add_special_tokens=False):
            print(f"{q!r}: the backends tokenize the chat prompt differently")
            continue
        ta = [e.token_id for e in a.generate_tokens(prompt, max_tokens=args.max_tokens)]
        tb = [e.token_id for e in b.generate_tokens(prompt, max_tokens=args.max_tokens)]
        if ta == tb:
            print(f"{q!r}: identical ({len(ta)} tokens)")
            continue
        k = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
        ra, rb = next_logits(a, prompt, ta[:k]), next_logits(b, prompt, tb[:k])

        def top2(row: np.ndarray) -> str:
            return ", ".join(f"{a.token_text(int(t))!r} {row[t]:.3f}" for t in np.argsort(-row)[:2])

        print(
            f"{q!r}: first divergence at generated token {k}, after {a.detokenize(ta[:k])!r}\n"
            f"    {a_name}: {top2(ra)}\n    {b_name}: {top2(rb)}"
        )
    a.close()
    b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
