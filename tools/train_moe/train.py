"""Train Colibri's small Mixtral-architecture MoE on the CPython standard library (CPU, torch).

Seeded and resumable: the batch of step ``s`` is drawn from ``numpy.random.default_rng([seed, s])``,
so a run resumed from a checkpoint sees exactly the batches an uninterrupted run would have seen.
The learning rate follows a warm-up / stable / decay schedule: linear warm-up over ``--warmup``
steps, constant peak, then a linear decay to 10% of the peak over the last ``--decay-fraction`` of
the run. With a wall-clock ``--deadline`` the run's length in steps is not known in advance on a
shared machine, so the decay start is chosen once, while training, from the measured step time
(the step at which the remaining time would hold ``--decay-fraction`` of all steps). That choice
(``decay_start``, ``decay_steps``) is stored in the state and the loss log; passing both back as
``--decay-start-step`` / ``--decay-steps`` replays the identical schedule without a deadline. The
deadline also stops the run (saving everything) if the decay has not finished by then.

Writes under ``--out``:
  state/state.pt        resumable training state (model, optimizer, step), rewritten atomically
  loss_log.jsonl        one JSON line per logged step (train CE, aux loss, lr, tokens, wall time)
  checkpoint/           final Hugging Face checkpoint (save_pretrained, safetensors F32 + tokenizer)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import time
from datetime import datetime, timezone
from pathlib import Path

# On a shared, oversubscribed machine OpenMP's default spin-waiting makes each step several times
# slower (one thread spins while its partner is descheduled); passive waiting avoids that.
# It must be set before torch (and its OpenMP runtime) is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import MixtralConfig, MixtralForCausalLM  # noqa: E402

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


def lr_at(step: int, args: argparse.Namespace, decay_start: int | None, decay_steps: int) -> float:
    """Warm-up, constant peak, then linear decay to 10% of the peak; a function of the step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if decay_start is None or step < decay_start:
        return args.lr
    frac = min(1.0, (step - decay_start) / max(1, decay_steps))
    return args.lr * (1.0 - 0.9 * frac)


def get_batch(data: np.ndarray, step: int, args: argparse.Namespace) -> torch.Tensor:
    """Random windows of context+1 tokens; a pure function of (seed, step)."""
    rng = np.random.default_rng([args.seed, step])
    starts = rng.integers(0, data.size - args.context - 1, size=args.batch_size)
    rows = np.stack([data[s : s + args.context + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)


def per_layer_balance_loss(
    router_logits: tuple[torch.Tensor, ...], n_experts: int, top_k: int
) -> torch.Tensor:
    """Switch-style load-balancing loss computed per layer, then averaged over layers.

    transformers' ``load_balancing_loss_func`` concatenates the router logits of all layers before
    counting, so expert e of one layer and expert e of another share one count: every layer can keep
    a hot expert as long as the hot indices differ between layers. Per layer, each layer is balanced.
    Equals ``top_k`` when perfectly balanced, like transformers' value.
    """
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)  # [N, E]
        top = probs.topk(top_k, dim=-1).indices
        frac = torch.nn.functional.one_hot(top, n_experts).float().mean(0)  # [K, E]
        losses.append(n_experts * (frac * probs.mean(0)[None]).sum())
    return torch.stack(losses).mean()


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


def save_state(
    path: Path,
    model: MixtralForCausalLM,
    opt: torch.optim.Optimizer,
    step: int,
    args: argparse.Namespace,
    schedule: dict,
    train_s: float,
) -> None:
    """Write the resumable state atomically (tmp file then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "step": step,
            "schedule": schedule,
            "train_s": train_s,
            "args": vars(args),
        },
        tmp,
    )
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
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--aux-coef", type=float, default=0.02)
    ap.add_argument(
        "--aux-per-layer",
        action="store_true",
        help="balance experts per layer (not used for the released model, whose loss pooled layers)",
    )
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--max-steps", type=int, default=100000, help="hard cap on steps")
    ap.add_argument("--decay-fraction", type=float, default=0.25)
    ap.add_argument("--decay-start-step", type=int, default=None, help="replay a recorded schedule")
    ap.add_argument("--decay-steps", type=int, default=None, help="replay a recorded schedule")
    ap.add_argument("--deadline", default=None, help="UTC wall-clock stop, e.g. 2026-11-29T14:40:00")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--save-every-s", type=float, default=600.0)
    ap.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        help="save the resumable state and exit at this step (tests resumption)",
    )
    ap.add_argument("--no-resume", action="store_true")
    ap.add_argument("--no-final", action="store_true", help="skip the final save_pretrained (timing runs)")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if (args.decay_start_step is None) != (args.decay_steps is None):
        raise SystemExit("--decay-start-step and --decay-steps go together")
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
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    state_path = out / "state" / "state.pt"
    log_path = out / "loss_log.jsonl"
    step = 0
    train_s_base = 0.0
    schedule: dict = {"decay_start": args.decay_start_step, "decay_steps": args.decay_steps}
    if schedule["decay_start"] is None and deadline is None:
        schedule["decay_start"] = int(args.max_steps * (1.0 - args.decay_fraction))
        schedule["decay_steps"] = args.max_steps - schedule["decay_start"]
    if state_path.exists() and not args.no_resume:
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step = int(st["step"])
        train_s_base = float(st.get("train_s", 0.0))
        if st.get("schedule", {}).get("decay_start") is not None:
            schedule = st["schedule"]
        # keep only log lines the saved state has seen
        if log_path.exists():
            kept = [ln for ln in log_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
            log_path.write_text("".join(ln + "\n" for ln in kept))
        print(f"resumed at step {step}", flush=True)
    elif log_path.exists():
        log_path.unlink()

    print(
        f"params {n_params:,} train tokens {train.size:,} held-out {held.size:,} "
        f"tokens/step {args.batch_size * args.context}",
        flush=True,
    )
    t0 = time.time()
    last_save = t0
    stopped_by_deadline = False
    step_time: float | None = None
    term = {"flag": False}

    def on_term(signum: int, frame: object) -> None:  # save a resumable state and exit cleanly
        term["flag"] = True

    signal.signal(signal.SIGTERM, on_term)
    with log_path.open("a") as log:
        while step < args.max_steps:
            if deadline is not None and time.time() >= deadline:
                stopped_by_deadline = True
                break
            if term["flag"] or (args.stop_at_step is not None and step >= args.stop_at_step):
                save_state(state_path, model, opt, step, args, schedule, train_s_base + time.time() - t0)
                print(f"interrupted: state saved at step {step}", flush=True)
                return
            if schedule["decay_start"] is None and step_time is not None and step >= args.warmup:
                remaining = max(1, int((deadline - time.time()) / step_time))
                if remaining <= args.decay_fraction / (1.0 - args.decay_fraction) * step:
                    schedule = {"decay_start": step, "decay_steps": remaining}
                    print(f"decay starts at step {step} over {remaining} steps", flush=True)
                    save_state(state_path, model, opt, step, args, schedule, train_s_base + time.time() - t0)
            if (
                schedule["decay_start"] is not None
                and step >= schedule["decay_start"] + schedule["decay_steps"]
            ):
                break
            lr = lr_at(step, args, schedule["decay_start"], schedule["decay_steps"] or 0)
            t_step = time.time()
            for g in opt.param_groups:
                g["lr"] = lr
            batch = get_batch(train, step, args)
            out_m = model(input_ids=batch[:, :-1], use_cache=False, output_router_logits=True)
            logits = out_m.logits
            ce = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)).float(), batch[:, 1:].reshape(-1)
            )
            if args.aux_per_layer:
                aux = per_layer_balance_loss(out_m.router_logits, args.experts, args.top_k)
            else:  # transformers' loss: all layers' router logits pooled before balancing
                aux = out_m.aux_loss
            loss = ce + args.aux_coef * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            dt = time.time() - t_step
            step_time = dt if step_time is None else 0.9 * step_time + 0.1 * dt
            if step % args.log_every == 0 or step == 1:
                rec = {
                    "step": step,
                    "ce": round(ce.item(), 5),
                    "aux": round(aux.item(), 5),
                    "lr": lr,
                    "gnorm": round(gnorm.item(), 4),
                    "tokens": step * args.batch_size * args.context,
                    "elapsed_s": round(train_s_base + time.time() - t0, 1),
                    "step_s": round(step_time, 2),
                    "decay_start": schedule["decay_start"],
                }
                if step % args.eval_every == 0:
                    rec["heldout_ce"] = round(eval_loss(model, held, args.context, args.eval_windows), 5)
                log.write(json.dumps(rec) + "\n")
                log.flush()
                print(json.dumps(rec), flush=True)
            if time.time() - last_save >= args.save_every_s:
                save_state(state_path, model, opt, step, args, schedule, train_s_base + time.time() - t0)
                last_save = time.time()
    save_state(state_path, model, opt, step, args, schedule, train_s_base + time.time() - t0)
    print(
        f"stopped at step {step} ({'deadline' if stopped_by_deadline else 'schedule end / max steps'}) "
        f"after {time.time() - t0:.0f}s",
        flush=True,
    )
    if not args.no_final:
        model.eval()
        save_final(out, model)
        (out / "checkpoint" / "training_summary.json").write_text(
            json.dumps(
                {
                    "steps": step,
                    "stopped_by": "deadline" if stopped_by_deadline else "schedule end / max_steps",
                    "schedule": schedule,
                    "tokens": step * args.batch_size * args.context,
                    "params": n_params,
                    "train_seconds": round(train_s_base + time.time() - t0, 1),
                    "args": vars(args),
                },
                indent=1,
            )
        )
        print("saved", out / "checkpoint", flush=True)


if __name__ == "__main__":
    main()
