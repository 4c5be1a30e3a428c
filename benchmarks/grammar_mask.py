"""Cost per token of grammar-constrained sampling (structured output), on SmolLM2-135M-Instruct.

Three figures, each the median over the tokens of constrained generations:
  * mask: llguidance computing the allowed-token bitmask for the next step, plus consuming the token;
  * sample: the native sampler with the mask applied (colibri_sampler_set_allowed + sample) against the
    same sampler without one, on the model's real logits;
  * end to end: wall time per token (after the first) of a json_schema-constrained generation against
    an unconstrained one of the same prompt.

    python benchmarks/grammar_mask.py [--model PATH] [--tokens 48] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import colibri_backend
from colibri_backend.adapters.sampling import SamplingParams
from colibri_backend.engine import _NativeSampler
from colibri_backend.grammar import Grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a fictional person as JSON.",
    "Invent a chess player and give their details as JSON.",
    "Give me a JSON record of a baker who lives in Lyon.",
    "Make up a retired sailor and describe them in JSON.",
    "Describe a young programmer as a JSON object.",
]


def _us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    path = args.model or str(colibri_backend.resolve_model("smollm2").gguf)
    model = engine = colibri_backend.load(path, threads=2, context_length=512)
    grammar = Grammar.from_json_schema(model, SCHEMA)
    greedy = SamplingParams(temperature=0)

    mask_s: list[float] = []
    free_s: list[float] = []
    masked_s: list[float] = []
    e2e: dict[str, list[float]] = {"constrained": [], "free": []}
    outputs = []
    for prompt in PROMPTS[: args.runs]:
        text = model.render_chat([{"role": "user", "content": prompt}])
        ids = model.tokenize(text, add_special_tokens=False)
        # end to end: the same prompt, constrained and not, decode seconds per generated token
        for kind in ("constrained", "free"):
            c = grammar.constraint() if kind == "constrained" else None
            n = 0
            text = ""
            t_first = t_last = 0.0
            for ev in model.generate_tokens(ids, max_tokens=args.tokens, sampling=greedy, constraint=c):
                t_last = time.perf_counter()
                t_first = t_first or t_last
                n += 1
                text += ev.text
            if n > 1:  # wall time per token after the first: forward pass, mask and sampling
                e2e[kind].append((t_last - t_first) / (n - 1))
            if kind == "constrained":
                outputs.append(text)
        # the pieces, replayed over the constrained output's tokens with the real logits
        toks = model.tokenize(outputs[-1], add_special_tokens=False)
        c = grammar.constraint()
        with _NativeSampler(
            engine._lib, SamplingParams(temperature=0.8, seed=1), engine.info.n_vocab, ids
        ) as sampler:
            seq = list(ids)
            for t in toks:
                logits = np.ascontiguousarray(engine.next_logits(seq), dtype=np.float32)
                t0 = time.perf_counter()
                mask = c.fill()
                c.consume(t)
                mask_s.append(time.perf_counter() - t0)
                sampler.allow(None)
                t0 = time.perf_counter()
                sampler.sample(logits)
                free_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                sampler.allow(mask)
                sampler.sample(logits)
                masked_s.append(time.perf_counter() - t0)
                seq.append(t)
    result = {
        "model": path,
        "n_vocab": engine.info.n_vocab,
        "tokens_measured": len(mask_s),
        "mask_compute_and_consume_us": round(_us(mask_s), 1),
        "sample_free_us": round(_us(free_s), 1),
        "sample_masked_us": round(_us(masked_s), 1),
        "decode_ms_per_token_free": round(statistics.median(e2e["free"]) * 1e3, 2),
        "decode_ms_per_token_constrained": round(statistics.median(e2e["constrained"]) * 1e3, 2),
        "outputs": outputs,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
