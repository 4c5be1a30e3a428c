"""Evaluate a Colibri MoE checkpoint on the held-out split of the standard-library corpus.

Computes, with torch on CPU:
  * held-out perplexity (non-overlapping windows of ``--context`` + 1 tokens; each window predicts
    its last ``--context`` tokens from the ones before, inside the window only);
  * a unigram baseline perplexity on exactly the same predicted tokens, with token frequencies
    counted on the train split and add-one (Laplace) smoothing over the whole vocabulary;
  * sample completions of Python prompts, greedy and sampled (temperature 0.8, top-k/top-p off,
    ``torch.manual_seed(0)`` before each prompt); prompts are preceded by ``<|endoftext|>`` as every
    training document is;
  * routing statistics per layer on the held-out windows:
      - expert load: share of the top-k assignments per expert, its entropy (nats) and that entropy
        divided by log(E) (1.0 = perfectly balanced);
      - temporal reuse: for consecutive tokens t, t+1 in a window, the share of token t+1's experts
        that token t also used (``reuse_prev``), the share of pairs with any common expert
        (``any_prev``), and the share of token t's experts used by any of the previous 8 tokens
        (``reuse_last8``, tokens with a full 8-token history only); each beside a baseline with the
        token order shuffled within the window (same marginals, no temporal correlation);
      - cross-layer lookahead: layer l+1's router applied to layer l's output. Exactly: h_l is the
        residual stream leaving decoder layer l (the embedding output for l = -1); the predicted
        logits are ``W_router[l+1] @ post_attention_layernorm[l+1](h_l)`` (the norm layer l+1 applies
        right before its own router, skipping layer l+1's attention). Reported: recall of the true
        top-2 of layer l+1 within the predicted top-2 and within the predicted top-4 (random
        guessing: 2/E and 4/E). The same with layer l+2's norm and router on h_l ("2-ahead"). For
        scale, the recall of a static predictor (always the layer's 2 or 4 most used experts).
        In the tables a row is the *target* layer: row i is predicted from layer i-1's (i-2's) output.

Writes ``analysis.json`` and ``analysis.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

# On a shared, oversubscribed machine OpenMP's default spin-waiting makes each step several times
# slower (one thread spins while its partner is descheduled); passive waiting avoids that.
# It must be set before torch (and its OpenMP runtime) is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from prepare import DEFAULT_STDLIB, EOT_ID, is_heldout, list_corpus, read_text  # noqa: E402
from transformers import MixtralForCausalLM, PreTrainedTokenizerFast  # noqa: E402

HERE = Path(__file__).resolve().parent
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "    def __init__(self"]


def corpus_split_tokens(
    tok: PreTrainedTokenizerFast, stdlib: Path, heldout_percent: int
) -> tuple[np.ndarray, np.ndarray]:
    """Re-derive the (train, held-out) token streams exactly as prepare.py builds them."""
    files = list_corpus(stdlib)
    streams: dict[bool, list[int]] = {True: [], False: []}
    backend = tok.backend_tokenizer
    for held in (False, True):
        names = [f for f in files if is_heldout(f, heldout_percent) == held]
        for enc in backend.encode_batch([read_text(stdlib / f) for f in names], add_special_tokens=False):
            streams[held].append(EOT_ID)
            streams[held].extend(enc.ids)
    return np.asarray(streams[False], dtype=np.int64), np.asarray(streams[True], dtype=np.int64)


class RoutingRecorder:
    """Forward hooks that keep each layer's output and each router's logits for one forward pass."""

    def __init__(self, model: MixtralForCausalLM) -> None:
        self.layer_out: dict[int, torch.Tensor] = {}
        self.router_logits: dict[int, torch.Tensor] = {}
        self.embed: torch.Tensor | None = None
        self.handles = [model.model.embed_tokens.register_forward_hook(self._embed_hook)]
        for i, layer in enumerate(model.model.layers):
            self.handles.append(layer.register_forward_hook(self._make_layer_hook(i)))
            self.handles.append(layer.mlp.gate.register_forward_hook(self._make_router_hook(i)))

    def _embed_hook(self, mod: torch.nn.Module, inp: object, out: torch.Tensor) -> None:
        self.embed = out.detach()

    def _make_layer_hook(self, i: int):  # noqa: ANN202
        def hook(mod: torch.nn.Module, inp: object, out: object) -> None:
            self.layer_out[i] = (out[0] if isinstance(out, tuple) else out).detach()

        return hook

    def _make_router_hook(self, i: int):  # noqa: ANN202
        def hook(mod: torch.nn.Module, inp: object, out: tuple) -> None:
            self.router_logits[i] = out[0].detach()

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def topk_sets(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean [..., E] mask of the top-k experts per row."""
    idx = logits.topk(k, dim=-1).indices
    return torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, idx, True)


def temporal_counts(mask: torch.Tensor, k: int, window: int) -> dict[str, float]:
    """Sums for the reuse statistics; ``mask`` is [B, T, E] (bool) of the experts each token used."""
    m = mask.float()
    inter = (m[:, 1:] * m[:, :-1]).sum(-1)  # [B, T-1]
    hist = torch.zeros_like(m[:, window:])
    for d in range(1, window + 1):
        hist = torch.maximum(hist, m[:, window - d : m.size(1) - d])
    in_hist = (m[:, window:] * hist).sum(-1)
    return {
        "reuse_prev": float(inter.sum()) / k,
        "any_prev": float((inter > 0).sum()),
        "pairs": float(inter.numel()),
        "reuse_last8": float(in_hist.sum()) / k,
        "hist_tokens": float(in_hist.numel()),
    }


def analyze(args: argparse.Namespace) -> dict:
    """Run all measurements; returns the JSON-serialisable result."""
    torch.set_num_threads(args.threads)
    ck = Path(args.checkpoint)
    tok = PreTrainedTokenizerFast.from_pretrained(str(ck))
    model = MixtralForCausalLM.from_pretrained(str(ck), torch_dtype=torch.float32)
    model.eval()
    cfg = model.config
    E, K, L, V = cfg.num_local_experts, cfg.num_experts_per_tok, cfg.num_hidden_layers, cfg.vocab_size
    train_ids, held_ids = corpus_split_tokens(tok, Path(args.stdlib), args.heldout_percent)

    C = args.context
    n_win = (held_ids.size - 1) // C
    if args.max_windows:
        n_win = min(n_win, args.max_windows)
    wins = torch.from_numpy(np.stack([held_ids[i * C : i * C + C + 1] for i in range(n_win)]))

    counts = np.bincount(train_ids, minlength=V).astype(np.float64)
    uni_logp = np.log((counts + 1.0) / (counts.sum() + V))

    nll_sum = 0.0
    uni_sum = 0.0
    n_tok = 0
    usage = torch.zeros(L, E, dtype=torch.float64)
    temporal = [
        dict.fromkeys(("reuse_prev", "any_prev", "pairs", "reuse_last8", "hist_tokens"), 0.0)
        for _ in range(L)
    ]
    shuffled = [
        dict.fromkeys(("reuse_prev", "any_prev", "pairs", "reuse_last8", "hist_tokens"), 0.0)
        for _ in range(L)
    ]
    # (source layer, target layer): source -1 is the embedding output; distances 1 and 2
    pairs = [(dst - d, dst) for dst in range(L) for d in (1, 2) if dst - d >= -1]
    look = {pr: {"hit2": 0.0, "hit4": 0.0, "n": 0.0} for pr in pairs}
    gen = torch.Generator().manual_seed(0)
    rec = RoutingRecorder(model)
    t0 = time.time()
    with torch.no_grad():
        for b in range(0, n_win, args.batch_size):
            x = wins[b : b + args.batch_size]
            inp, tgt = x[:, :-1], x[:, 1:]
            out = model(input_ids=inp, use_cache=False)
            logp = torch.log_softmax(out.logits.float(), dim=-1)
            nll_sum += float(-logp.gather(-1, tgt[..., None]).sum())
            uni_sum += float(-uni_logp[tgt.numpy()].sum())
            n_tok += tgt.numel()
            B, T = inp.shape
            perm = torch.randperm(T, generator=gen)
            true_masks = []
            for i in range(L):
                lg = rec.router_logits[i].reshape(B, T, E)
                mask = topk_sets(lg, K)
                true_masks.append(mask)
                usage[i] += mask.reshape(-1, E).sum(0).double()
                for key, v in temporal_counts(mask, K, 8).items():
                    temporal[i][key] += v
                for key, v in temporal_counts(mask[:, perm], K, 8).items():
                    shuffled[i][key] += v
            for src, dst in pairs:
                h = rec.embed if src < 0 else rec.layer_out[src]
                target = model.model.layers[dst]
                pred = target.mlp.gate(target.post_attention_layernorm(h))[0].reshape(B, T, E)
                truth = true_masks[dst]
                look[(src, dst)]["hit2"] += float((topk_sets(pred, 2) & truth).sum()) / K
                look[(src, dst)]["hit4"] += float((topk_sets(pred, 4) & truth).sum()) / K
                look[(src, dst)]["n"] += B * T
    rec.remove()
    eval_s = time.time() - t0

    layers = []
    for i in range(L):
        p = (usage[i] / usage[i].sum()).numpy()
        ent = float(-(p * np.log(np.where(p > 0, p, 1.0))).sum())
        t, s = temporal[i], shuffled[i]
        row = {
            "layer": i,
            "expert_share": [round(float(v), 4) for v in p],
            "entropy_nats": round(ent, 4),
            "entropy_norm": round(ent / math.log(E), 4),
            "max_over_min_load": round(float(p.max() / max(p.min(), 1e-12)), 3),
            "reuse_prev": round(t["reuse_prev"] / t["pairs"], 4),
            "reuse_prev_shuffled": round(s["reuse_prev"] / s["pairs"], 4),
            "any_prev": round(t["any_prev"] / t["pairs"], 4),
            "any_prev_shuffled": round(s["any_prev"] / s["pairs"], 4),
            "reuse_last8": round(t["reuse_last8"] / t["hist_tokens"], 4),
            "reuse_last8_shuffled": round(s["reuse_last8"] / s["hist_tokens"], 4),
            # a static predictor: always this layer's 2 (4) most used experts on this text
            "static_recall_top2": round(float(np.sort(p)[::-1][:2].sum()), 4),
            "static_recall_top4": round(float(np.sort(p)[::-1][:4].sum()), 4),
        }
        # this layer's experts predicted from the residual stream 1 (and 2) layers earlier
        for d, name in ((1, "lookahead"), (2, "lookahead2")):
            if (i - d, i) in look:
                lk = look[(i - d, i)]
                row[f"{name}_source"] = "embedding" if i - d < 0 else f"layer {i - d} output"
                row[f"{name}_recall_top2"] = round(lk["hit2"] / lk["n"], 4)
                row[f"{name}_recall_top4"] = round(lk["hit4"] / lk["n"], 4)
        layers.append(row)

    samples = []
    for prompt in PROMPTS:
        ids = torch.tensor([[EOT_ID] + tok(prompt, add_special_tokens=False)["input_ids"]])
        g = model.generate(
            ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=EOT_ID, eos_token_id=EOT_ID
        )
        torch.manual_seed(0)
        s = model.generate(
            ids,
            max_new_tokens=args.new_tokens,
            do_sample=True,
            temperature=0.8,
            top_k=0,
            top_p=1.0,
            pad_token_id=EOT_ID,
            eos_token_id=EOT_ID,
        )
        samples.append(
            {
                "prompt": prompt,
                "greedy": tok.decode(g[0, ids.size(1) :], skip_special_tokens=False),
                "sampled_t0.8_seed0": tok.decode(s[0, ids.size(1) :], skip_special_tokens=False),
            }
        )

    n_params = sum(p.numel() for p in model.parameters())
    return {
        "checkpoint": str(ck),
        "config": {
            "layers": L,
            "hidden": cfg.hidden_size,
            "heads": cfg.num_attention_heads,
            "kv_heads": cfg.num_key_value_heads,
            "experts": E,
            "top_k": K,
            "expert_intermediate": cfg.intermediate_size,
            "vocab": V,
            "context": cfg.max_position_embeddings,
            "params": n_params,
        },
        "heldout": {
            "windows": n_win,
            "context": C,
            "predicted_tokens": n_tok,
            "mean_nll": round(nll_sum / n_tok, 5),
            "ppl": round(math.exp(nll_sum / n_tok), 3),
            "unigram_mean_nll": round(uni_sum / n_tok, 5),
            "unigram_ppl": round(math.exp(uni_sum / n_tok), 3),
            "train_tokens_for_unigram": int(train_ids.size),
            "eval_seconds": round(eval_s, 1),
        },
        "random_baselines": {"lookahead_recall_top2": 2 / E, "lookahead_recall_top4": 4 / E},
        "routing": layers,
        "samples": samples,
    }


def to_markdown(res: dict) -> str:
    """Markdown tables of the result."""
    h = res["heldout"]
    lines = [
        f"Held-out: {h['predicted_tokens']} predicted tokens ({h['windows']} windows of {h['context']}).",
        "",
        "| model | mean NLL (nats/token) | perplexity |",
        "|---|---|---|",
        f"| Colibri MoE | {h['mean_nll']:.4f} | {h['ppl']:.2f} |",
        f"| unigram (train counts, add-one) | {h['unigram_mean_nll']:.4f} | {h['unigram_ppl']:.2f} |",
        "",
        "| layer | load entropy / log E | max/min load | reuse prev (shuffled) | any expert shared with "
        "prev (shuffled) | reuse last 8 (shuffled) | 1-ahead recall@2 | 1-ahead recall@4 "
        "| 2-ahead recall@2 / @4 | static top-2 / top-4 recall |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["routing"]:
        emb = " (from embedding)" if r["lookahead_source"] == "embedding" else ""
        la2 = f"{r['lookahead_recall_top2']:.3f}{emb}"
        la4 = f"{r['lookahead_recall_top4']:.3f}{emb}"
        if "lookahead2_source" in r:
            emb2 = " (from embedding)" if r["lookahead2_source"] == "embedding" else ""
            two = f"{r['lookahead2_recall_top2']:.3f} / {r['lookahead2_recall_top4']:.3f}{emb2}"
        else:
            two = "–"
        lines.append(
            f"| {r['layer']} | {r['entropy_norm']:.3f} | {r['max_over_min_load']:.2f} | "
            f"{r['reuse_prev']:.3f} ({r['reuse_prev_shuffled']:.3f}) | {r['any_prev']:.3f} "
            f"({r['any_prev_shuffled']:.3f}) | {r['reuse_last8']:.3f} ({r['reuse_last8_shuffled']:.3f}) | "
            f"{la2} | {la4} | {two} | {r['static_recall_top2']:.3f} / {r['static_recall_top4']:.3f} |"
        )
    rb = res["random_baselines"]
    lines += [
        "",
        f"Random-guess lookahead recall: top-2 {rb['lookahead_recall_top2']:.3f}, "
        f"top-4 {rb['lookahead_recall_top4']:.3f}.",
        "",
    ]
    for s in res["samples"]:
        lines += [
            f"**Prompt** `{s['prompt']!r}`",
            "",
            "greedy:",
            "```python",
            s["prompt"] + s["greedy"],
            "```",
            "sampled (T=0.8, seed 0):",
            "```python",
            s["prompt"] + s["sampled_t0.8_seed0"],
            "```",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(HERE / "release"))
    ap.add_argument("--stdlib", default=DEFAULT_STDLIB)
    ap.add_argument("--heldout-percent", type=int, default=5)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--max-windows", type=int, default=0, help="0 = all held-out windows")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "out" / "analysis"))
    args = ap.parse_args()
    res = analyze(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "analysis.json").write_text(json.dumps(res, indent=1))
    md = to_markdown(res)
    (out / "analysis.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
