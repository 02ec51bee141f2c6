"""Draw a run's curves into one PNG: loss and validation loss, gradient norm, learning rate, tokens/s."""

from __future__ import annotations

from pathlib import Path

from ultratron.atomic import atomic_path
from ultratron.errors import UserError
from ultratron.training.metrics import read_metrics


def draw_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = [r for r in records if "loss" in r]
    if not train:
        raise UserError(f"{run_dir}: no training steps in metrics.jsonl (is this a run directory?)")
    val = [r for r in records if "val_loss" in r]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in train]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    ax = axes[0][0]
    ax.plot(steps, [r["loss"] for r in train], label="train loss", lw=1)
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax.set(title="loss (nats/token)", xlabel="step")
    ax.legend()
    panels = [(axes[0][1], "grad_norm", "gradient norm (before clipping)"),
              (axes[1][0], "lr", "learning rate"),
              (axes[1][1], "tokens_per_sec", "tokens / s")]
    for ax, key, title in panels:
        ax.plot(steps, [r.get(key, float("nan")) for r in train], lw=1)
        ax.set(title=title, xlabel="step")
    fig.suptitle(f"ultratron run: {run_dir}")
    out = Path(out) if out else run_dir / "report.png"
    with atomic_path(out, keep_suffix=True) as tmp:  # savefig takes the format from the extension
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return out

