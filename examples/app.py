"""A small app that does not know which engine runs it.

It asks a model a few questions through the backend-neutral API. Which model and which engine is
configuration: examples/colibri.toml (or $COLIBRI_CONFIG), overridden by $COLIBRI_BACKEND:

    python examples/app.py                             # backend from colibri.toml ("colibri")
    COLIBRI_BACKEND=llama_cpp python examples/app.py   # same code on llama.cpp
    COLIBRI_BACKEND=transformers COLIBRI_MODEL=/path/to/hf_checkpoint python examples/app.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from colibri_backend.registry import open_model

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU does.",
]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config", default=os.environ.get("COLIBRI_CONFIG") or str(Path(__file__).with_name("colibri.toml"))
    )
    parser.add_argument("--model", default=None, help="alias from the config (default: its default model)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()

    t0 = time.perf_counter()
    with open_model(args.model, config=args.config) as model:
        print(
            f"# model {model.name!r} on backend {model.backend!r} "
            f"(loaded in {time.perf_counter() - t0:.1f} s, context {model.context_length})"
        )
        for q in QUESTIONS:
            t = time.perf_counter()
            answer = model.chat([{"role": "user", "content": q}], max_tokens=args.max_tokens, temperature=0)
            print(f"\n## {q}\n{answer}")
            print(f"({time.perf_counter() - t:.2f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
