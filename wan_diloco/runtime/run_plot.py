"""The picture of a finished networked run: each learner's training loss and the global model's eval
loss against the global step (``RUN_DIR/loss.png``, written by ``launch`` and ``train``)."""
from __future__ import annotations

from pathlib import Path


def plot_run(losses: dict[int, list[tuple[int, float]]], evals: list[dict], starts: list[float],
             finals: list[tuple[int, float]], path: str | Path, title: str = "") -> None:
    """``losses``: learner -> (step, training loss) points; ``evals``: {step, eval_loss} of the global model
    (``run.eval_every``); ``starts``/``finals``: eval losses at the start and (step, loss) at the end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, points in sorted(losses.items()):
        if points:
            ax.plot(*zip(*points), linewidth=0.8, alpha=0.6, label=f"learner {m} (training loss)")
    curve = [(0, sum(starts) / len(starts))] if starts else []
    curve += [(e["step"], e["eval_loss"]) for e in evals]
    if finals:
        curve.append((max(s for s, _ in finals), sum(loss for _, loss in finals) / len(finals)))
    if curve:
        ax.plot(*zip(*curve), color="black", marker="o", linewidth=1.8, label="global model (held-out eval loss)")
    ax.set_xlabel("global step")
    ax.set_ylabel("loss (nats per byte-token)")
    ax.set_title(title or "networked run")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
