"""Terminal output for long runs: a rich progress bar and a summary table."""
from __future__ import annotations

import contextlib
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

console = Console(stderr=True)  # progress goes to stderr, results to stdout
out = Console()
CU_MEANING = "CU = compute utilization: the share of wall time the chips compute rather than wait on the network"


@contextlib.contextmanager
def progress_bar(description: str) -> Iterator:
    """Yields ``update(fraction, point)``; ``point`` may carry step, and eval_loss with the eval_step it was
    taken at (shown with it: the loss moves only at eval points, the step with every step)."""
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=console,
    ) as bar:
        task = bar.add_task(description, total=1.0, info="")

        def update(fraction: float, point: dict) -> None:
            info = f"step {point.get('step', '?')}"
            if "eval_loss" in point:
                info += f"  eval loss {point['eval_loss']:.3f} (step {point.get('eval_step', '?')})"
            bar.update(task, completed=fraction, info=info)

        yield update


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def summary_table(result) -> None:
    """One run's headline figures."""
    t = Table(title=f"{result.config['simulate']['baseline']} run", show_header=False)
    rows = [
        ("eval loss", f"{result.initial_eval_loss:.4f} -> {result.final_eval_loss:.4f}"),
        ("tokens", f"{result.tokens:,}"),
        ("global steps", f"{result.global_steps}"),
        ("goodput", f"{result.goodput:.1%}"),
        ("uptime", f"{result.uptime:.1%}"),
        ("fragment syncs", " ".join(map(str, result.fragment_syncs))),
        ("bytes over the WAN", human_bytes(result.bytes_sent)),
        ("virtual time", f"{result.virtual_time_s:.1f} s"),
        ("wall time", f"{result.wall_s:.1f} s"),
    ]
    if result.mean_quorum:
        rows.append(("mean quorum / grace", f"{result.mean_quorum:.2f} / {result.mean_grace_s * 1000:.0f} ms"))
        rows.append(("late Δs carried / dropped", f"{result.late_carried} / {result.late_dropped}"))
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)


def save_figure(fig, ax, path) -> None:
    """Grid, legend, tight layout, write a PNG (creating its folder), free the figure."""
    import matplotlib.pyplot as plt
    from pathlib import Path

    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
