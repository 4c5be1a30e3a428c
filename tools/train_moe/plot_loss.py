"""Plot the training loss log (train CE, held-out CE, aux loss) to a PNG and print a text table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_log(path: Path) -> list[dict]:
    """Read the JSON-lines loss log written by train.py."""
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def text_table(rows: list[dict], every: int) -> str:
    """Markdown table of the log every ``every`` steps, at held-out evaluations and at the end."""
    out = [
        "| step | tokens | train CE (this batch) | train CE (mean of 10 logged steps) | held-out CE "
        "| aux loss | lr | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows):
        if not (r["step"] % every == 0 or r["step"] == 1 or "heldout_ce" in r or i == len(rows) - 1):
            continue
        window = [x["ce"] for x in rows[max(0, i - 9) : i + 1]]
        held = f"{r['heldout_ce']:.3f}" if "heldout_ce" in r else ""
        out.append(
            f"| {r['step']} | {r['tokens']} | {r['ce']:.3f} | {sum(window) / len(window):.3f} | {held} | "
            f"{r['aux']:.4f} | {r['lr']:.2e} | {r['elapsed_s']:.0f} |"
        )
    return "\n".join(out)


def plot(rows: list[dict], png: Path) -> None:
    """Train CE (raw and 10-point moving average) and held-out CE against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    ce = [r["ce"] for r in rows]
    k = 10
    ma = [sum(ce[max(0, i - k + 1) : i + 1]) / len(ce[max(0, i - k + 1) : i + 1]) for i in range(len(ce))]
    held = [(r["step"], r["heldout_ce"]) for r in rows if "heldout_ce" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, ce, color="#9bb", lw=0.8, label="train CE (every 5th step, one batch)")
    ax.plot(steps, ma, color="#077", lw=1.6, label="train CE, mean of 10 logged steps (50 steps)")
    if held:
        ax.plot(
            [h[0] for h in held],
            [h[1] for h in held],
            "o-",
            color="#c50",
            label="held-out CE (first 16 held-out windows)",
        )
    ax.set_xlabel("step (2048 tokens each)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Colibri MoE (Mixtral, 8 experts top-2) on the Python stdlib")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--log", default=str(HERE / "out" / "loss_log.jsonl"))
    ap.add_argument("--png", default=str(HERE.parent.parent / "docs" / "model_card_loss.png"))
    ap.add_argument("--every", type=int, default=50)
    args = ap.parse_args()
    rows = load_log(Path(args.log))
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    plot(rows, Path(args.png))
    print(text_table(rows, args.every))


if __name__ == "__main__":
    main()
