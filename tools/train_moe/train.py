"""Train Colibri's small Mixtral-architecture MoE on the CPython standard library (CPU, torch).

Seeded and resumable: the batch of step ``s`` is drawn from ``numpy.random.default_rng([seed, s])``,
so a run resumed from a checkpoint sees exactly the batches an uninterrupted run would have seen.
The learning-rate schedule (linear warm-up, cosine decay to 10%) depends on the step only; the
wall-clock ``--deadline`` is a safety stop that ends the run early (saving everything) if reached.

Writes under ``--out``:
  state/state.pt        resumable training state (model, optimizer, step), rewritten atomically
  loss_log.jsonl        one JSON line per logged step (train CE, aux loss, lr, tokens, wall time)
  checkpoint/           final Hugging Face checkpoint (save_pretrained, safetensors F32 + tokenizer)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from transformers import MixtralConfig, MixtralForCausalLM

HERE = Path(__file__).resolve().parent


def build_config(args: argparse.Namespace, vocab_size: int) -> MixtralConfig:
    """The model configuration from the command-line sizes."""
    return MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        hidden_act="silu",
        max_position_embeddings=args.context,
        initializer_range=0.02,
        rms_norm_eps=1e-5,
        use_cache=True,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        sliding_window=None,
        attention_dropout=0.0,
        num_experts_per_tok=args.top_k,
        num_local_experts=args.experts,
        output_router_logits=True,
        router_aux_loss_coef=args.aux_coef,
        router_jitter_noise=0.0,
    )


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up then cosine decay to 10% of the peak, by step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def get_batch(data: np.ndarray, step: int, args: argparse.Namespace) -> torch.Tensor:
    """Random windows of context+1 tokens; a pure function of (seed, step)."""
    rng = np.random.default_rng([args.seed, step])
    starts = rng.integers(0, data.size - args.context - 1, size=args.batch_size)
    rows = np.stack([data[s : s + args.context + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)


@torch.no_grad()
def eval_loss(model: MixtralForCausalLM, data: np.ndarray, context: int, n_windows: int) -> float:
    """Mean CE over the first ``n_windows`` non-overlapping held-out windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(n_windows):
        s = i * context
        if s + context + 1 > data.size:
            break
        x = torch.from_numpy(data[s : s + context + 1].astype(np.int64))[None]
        out = model(input_ids=x[:, :-1], use_cache=False, output_router_logits=False)
        logp = torch.log_softmax(out.logits.float(), dim=-1)
        nll = -logp.gather(-1, x[:, 1:, None]).squeeze(-1)
        total += float(nll.sum())
        count += nll.numel()
    model.train()
    return total / max(1, count)


def save_state(path: Path, model: MixtralForCausalLM, opt: torch.optim.Optimizer, step: int,
               args: argparse.Namespace) -> None:
    """Write the resumable state atomically (tmp file then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                "args": vars(args)}, tmp)
    os.replace(tmp, path)


def save_final(out: Path, model: MixtralForCausalLM) -> None:
    """save_pretrained (safetensors, F32) plus the tokenizer files into out/checkpoint/."""
    ck = out / "checkpoint"
    if ck.exists():
        shutil.rmtree(ck)
    model.save_pretrained(str(ck), safe_serialization=True)
    for f in (out / "tokenizer").iterdir():
        shutil.copy2(f, ck / f.name)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE / "out"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--aux-coef", type=float, default=0.02)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--deadline", default=None, help="UTC wall-clock stop, e.g. 2026-11-29T14:40:00")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--save-every-s", type=float, default=600.0)
    ap.add_argument("--no-resume", action="store_true")
    ap.add_argument("--no-final", action="store_true", help="skip the final save_pretrained (timing runs)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    deadline = None
    if args.deadline:
        deadline = datetime.fromisoformat(args.deadline).replace(tzinfo=timezone.utc).timestamp()

    train = np.fromfile(out / "data" / "train.u16", dtype=np.uint16)
    held = np.fromfile(out / "data" / "heldout.u16", dtype=np.uint16)
    vocab = json.loads((out / "data" / "manifest.json").read_text())["vocab_size"]

    torch.manual_seed(args.seed)
    config = build_config(args, vocab)
    model = MixtralForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    state_path = out / "state" / "state.pt"
    log_path = out / "loss_log.jsonl"
    step = 0
    if state_path.exists() and not args.no_resume:
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step = int(st["step"])
        # keep only log lines the saved state has seen
        if log_path.exists():
            kept = [ln for ln in log_path.read_text().splitlines() if ln and json.loads(ln)["step"] < step]
            log_path.write_text("".join(ln + "\n" for ln in kept))
        print(f"resumed at step {step}", flush=True)
    elif log_path.exists():
        log_path.unlink()

    print(f"params {n_params:,} train tokens {train.size:,} held-out {held.size:,} "
          f"tokens/step {args.batch_size * args.context}", flush=True)
    t0 = time.time()
    last_save = t0
    stopped_by_deadline = False
    with log_path.open("a") as log:
        while step < args.max_steps:
            if deadline is not None and time.time() >= deadline:
                stopped_by_deadline = True
                break
            lr = lr_at(step, args)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = get_batch(train, step, args)
            out_m = model(input_ids=batch[:, :-1], use_cache=False, output_router_logits=True)
            logits = out_m.logits
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                                   batch[:, 1:].reshape(-1))
            aux = out_m.aux_loss
            loss = ce + args.aux_coef * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % args.log_every == 0 or step == 1:
                rec = {"step": step, "ce": round(float(ce), 5), "aux": round(float(aux), 5),
                       "lr": lr, "gnorm": round(float(gnorm), 4),
                       "tokens": step * args.batch_size * args.context,
                       "elapsed_s": round(time.time() - t0, 1)}
                if step % args.eval_every == 0:
                    rec["heldout_ce"] = round(eval_loss(model, held, args.context, args.eval_windows), 5)
                log.write(json.dumps(rec) + "\n")
                log.flush()
                print(json.dumps(rec), flush=True)
            if time.time() - last_save >= args.save_every_s:
                save_state(state_path, model, opt, step, args)
                last_save = time.time()
    save_state(state_path, model, opt, step, args)
    print(f"stopped at step {step} ({'deadline' if stopped_by_deadline else 'max steps'}) "
          f"after {time.time() - t0:.0f}s", flush=True)
    if not args.no_final:
        model.eval()
        save_final(out, model)
        (out / "checkpoint" / "training_summary.json").write_text(json.dumps(
            {"steps": step, "stopped_by": "deadline" if stopped_by_deadline else "max_steps",
             "tokens": step * args.batch_size * args.context, "params": n_params,
             "args": vars(args)}, indent=1))
        print("saved", out / "checkpoint", flush=True)


if __name__ == "__main__":
    main()
