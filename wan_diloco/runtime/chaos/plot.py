"""The chaos timeline PNG: processes alive, faults, steps of the chaos and fault-free runs."""
from __future__ import annotations

from pathlib import Path

from wan_diloco.runtime.chaos.record import RunRecord
from wan_diloco.runtime.chaos.schedule import learner_name


FAULT_COLORS = {"kill_learner": "tab:red", "stop_learner": "tab:orange", "kill_syncer": "tab:purple",
                "cut_link": "tab:blue", "disk_full": "tab:brown", "restart_syncer_fresh": "tab:pink"}


def plot_timeline(record: RunRecord, path: str | Path, baseline: RunRecord | None = None, title: str = "") -> None:
    """PNG: one row per process name (each process started: starting light, up green), fault markers (X at
    the fault, a bar until it was undone), and below it the global step over time (syncer progress; the
    fault-free run dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["syncer"] + [learner_name(m) for m in range(record.learners)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 2.2 + 0.45 * len(names) + 2.5), sharex=True,
                                      gridspec_kw={"height_ratios": [len(names) * 0.6 + 0.8, 2.5]})
    _process_rows(top, record, names)
    _fault_marks(top, bottom, record)
    _step_lines(bottom, record, "with faults", "tab:green", "-")
    if baseline is not None:
        _step_lines(bottom, baseline, "fault-free", "gray", "--")
    bottom.set_xlabel("seconds since every learner started training (t_s = 0 of the faults)")
    bottom.set_ylabel("global step")
    bottom.grid(True, alpha=0.3)
    bottom.legend(loc="upper left", fontsize=8)
    top.set_title(title or "chaos run: processes, faults and the global step")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _process_rows(ax, record: RunRecord, names: list[str]) -> None:
    for row, name in enumerate(names):
        for p in record.generations(name):
            ready = record.first(lambda e: e.get("pid") == p["pid"] and e.get("event") in ("listening", "start"))
            end = p["exit_t"] or record.t_end
            t_ready = ready["t"] if ready else end
            # A start refused on purpose (restart_syncer_fresh) in its own colour: it never came up.
            ax.broken_barh([(p["spawn_t"] - record.t0, t_ready - p["spawn_t"])], (row - 0.3, 0.6),
                           facecolors="lightcoral" if p.get("refused") else "lightsteelblue")
            ax.broken_barh([(t_ready - record.t0, max(0.0, end - t_ready))], (row - 0.3, 0.6), facecolors="tab:green")
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(-0.7, len(names) - 0.3)
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    from matplotlib.patches import Patch

    handles = [Patch(color="lightsteelblue", label="starting (import, compile, join)"), Patch(color="tab:green", label="up")]
    handles += [Patch(color=c, label=k) for k, c in FAULT_COLORS.items()
                if any(f["kind"] == k and not f.get("skipped") for f in record.faults)]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.04), ncol=4, fontsize=8, frameon=False)


def _fault_marks(top, bottom, record: RunRecord) -> None:
    rows = {"syncer": 0, **{learner_name(m): m + 1 for m in range(record.learners)}}
    for f in record.faults:
        if f.get("skipped"):
            continue
        x, color = f["fired_t"] - record.t0, FAULT_COLORS[f["kind"]]
        end = (f.get("undone_t") or f["fired_t"]) - record.t0
        row = rows.get(f["target"], 0)
        top.plot([x], [row], marker="X", color=color, markersize=10, markeredgecolor="black")
        top.hlines(row + 0.38, x, end, colors=color, linewidth=3)
        for ax in (top, bottom):
            ax.axvline(x, color=color, linestyle=":", alpha=0.7)


def _step_lines(ax, record: RunRecord, label: str, color: str, style: str) -> None:
    pids = []
    for e in record.events_of("syncer", "progress"):
        if e["pid"] not in pids:
            pids.append(e["pid"])
    for i, pid in enumerate(pids):
        pts = [(e["t"] - record.t0, e.get("global_step", 0)) for e in record.events_of("syncer", "progress") if e["pid"] == pid]
        ax.plot(*zip(*pts), color=color, linestyle=style, label=label if i == 0 else None)


