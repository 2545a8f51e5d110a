"""The picture of a finished networked run: each learner's training loss and the global model's eval
loss against the global step, and below it each learner's throughput (tokens/s) against wall time
(``RUN_DIR/loss.png``, written by ``launch``)."""
from __future__ import annotations

from pathlib import Path

from wan_diloco.spec import RunSpec


def rates(points: list[tuple[float, int]]) -> list[tuple[float, float]]:
    """(wall time, tokens trained so far) readings -> (time, tokens/s) between consecutive readings; a
    restart (the count going back) starts over."""
    out = []
    for (t0, n0), (t1, n1) in zip(points, points[1:]):
        if t1 > t0 and n1 >= n0:
            out.append((t1, (n1 - n0) / (t1 - t0)))
    return out


def plot_labels(spec: RunSpec) -> dict[str, str]:
    """``title`` and ``ylabel`` of ``spec``'s picture: the model's own name (a user's module, not the preset
    its defaults came from), and the loss's unit: bytes only when text is read as bytes (no tokenizer;
    .bin and .npy corpora hold token ids already, see wan_diloco.data)."""
    where, _, factory = spec.model.module.rpartition(":")  # spec has made a file's path absolute: keep its name
    name = f"{Path(where).name}:{factory}" if spec.model.module else spec.preset
    corpora = {spec.data.corpus, *(c for _, c in spec.data.regions)}
    as_bytes = not spec.data.tokenizer and not any(Path(c).suffix.lower() in (".bin", ".npy") for c in corpora)
    return {"title": f"{spec.run.learners} learners, {spec.run.steps} steps ({name})",
            "ylabel": f"loss (nats per {'byte' if as_bytes else 'token'})"}


def plot_run(losses: dict[int, list[tuple[int, float]]], evals: list[dict], starts: list[float],
             finals: list[tuple[int, float]], path: str | Path, title: str = "",
             tokens: dict[int, list[tuple[float, int]]] | None = None, ylabel: str = "loss (nats per token)") -> None:
    """``losses``: learner -> (step, training loss) points; ``evals``: {step, eval_loss} of the global model
    (``run.eval_every_steps``); ``starts``/``finals``: eval losses at the start and (step, loss) at the end;
    ``tokens``: learner -> (wall time, tokens trained) readings, drawn as throughput below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    throughput = {m: rates(p) for m, p in (tokens or {}).items()}
    if any(throughput.values()):
        fig, (ax, tax) = plt.subplots(2, 1, figsize=(7, 7), height_ratios=(3, 2))
        t0 = min(p[0][0] for p in throughput.values() if p)
        for m, points in sorted(throughput.items()):
            if points:
                tax.plot([t - t0 for t, _ in points], [r for _, r in points], linewidth=0.8, label=f"learner {m}")
        tax.set_xlabel("wall time (s)")
        tax.set_ylabel("tokens/s")
        tax.grid(True, alpha=0.3)
        tax.legend(fontsize=8)
    else:
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
    ax.set_ylabel(ylabel)
    ax.set_title(title or "networked run")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
