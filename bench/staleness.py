"""Delay sweep: final eval loss against merge lag, for the outer step as published and each staleness option.

Every row is one simulated Decoupled DiLoCo run (bench/quality.py's runs: same deployment, same equal-token
budget, NF4 outer gradients with error feedback) whose link round trip is set to ``lag`` steps (τ = ``lag``
too, capped below H, so the grace window expects it): a fragment's global update comes back ``lag`` steps
after its Δ left, and past H steps a learner's next Δ of that fragment is based on a version the syncer
has moved past (staleness ≥ 1). Options (docs/method.md, "Staleness-aware outer steps", "Eager updates"):
``nesterov`` (today's outer step), ``scale`` and ``gate`` (``syncer.outer.staleness``), ``eager``
(``learner.eager``). Writes bench/results/staleness.json row by row (bench/quality.py's writer; a rerun
keeps the rows it does not redo) and bench/results/staleness.png.

    python bench/staleness.py --quick --jobs 2             # fewer tokens and lags: minutes per row on 2 cores
    python bench/staleness.py --quick --seeds 1 2 --lags 16 --learners 8
    python bench/staleness.py                              # 2M tokens, lags 0..16: hours; for a bigger machine
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from quality import DECOUPLED, STEP_TIME_S, _one, deployment, deployment_settings, kept_rows, write_rows  # noqa: E402
from wan_diloco import model, spec as spec_lib  # noqa: E402
from wan_diloco.fragments import tau_bounds  # noqa: E402

OPTIONS = {"nesterov": {}, "scale": {"staleness": "scale"}, "gate": {"staleness": "gate"}, "eager": {"eager": True}}
LAGS, QUICK_LAGS = (0, 2, 4, 6, 8, 10, 12, 14, 16), (0, 8, 16)
SYNC_EVERY, FRAGMENTS = 8, 4
# The quality rows' wire: NF4 with error feedback (bench/quality.py "decoupled_int4_ef").
WIRE = dict(bits=4, error_feedback=True)


def name_of(option: str, learners: int, lag: int, seed: int) -> str:
    return f"{option}_m{learners}_lag{lag}_s{seed}"


def row_overrides(option: str, learners: int, lag: int, seed: int) -> dict:
    """One row's settings (``spec.SHORT_NAMES``) over the deployment: the lag as the link's round trip."""
    _, tau_max = tau_bounds(SYNC_EVERY, FRAGMENTS)
    return dict(DECOUPLED, **WIRE, **OPTIONS[option], learners=learners, sync_every=SYNC_EVERY, fragments=FRAGMENTS,
                tau=min(lag, tau_max), rtt_s=lag * STEP_TIME_S, seed=seed)


def plot(rows: dict[str, dict], path: Path, what: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted({r["sweep"]["learners"] for r in rows.values()})
    fig, axes = plt.subplots(1, len(ms), figsize=(6 * len(ms), 4.5), squeeze=False)
    for ax, m in zip(axes[0], ms):
        for i, option in enumerate(OPTIONS):
            pts = [r for r in rows.values() if r["sweep"]["learners"] == m and r["sweep"]["option"] == option]
            if not pts:
                continue
            lags = sorted({r["sweep"]["lag"] for r in pts})
            mean = [sum(r["final_eval_loss"] for r in pts if r["sweep"]["lag"] == g)
                    / sum(1 for r in pts if r["sweep"]["lag"] == g) for g in lags]
            color = plt.cm.tab10.colors[i]
            # gate often equals nesterov to the bit (no stale Δ opposed the momentum): drawn dashed on top
            ax.plot(lags, mean, marker="o", color=color, label=option, linestyle="--" if option == "gate" else "-",
                    linewidth=3 if option == "nesterov" else 1.5)
            ax.scatter([r["sweep"]["lag"] for r in pts], [r["final_eval_loss"] for r in pts], color=color, s=8, alpha=0.5)
        ax.set_title(f"M = {m}, NF4 + error feedback, {what}")
        ax.set_xlabel("merge lag (link round trip, steps)")
        ax.set_ylabel("final eval loss (line: mean over seeds, dots: each seed)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def describe(header: dict) -> str:
    return f"{header['tokens']:.3g} tokens" + (" (quick)" if header.get("quick") else "")


def table(rows: dict[str, dict]) -> str:
    lines = ["| M | lag | seed | " + " | ".join(OPTIONS) + " |", "|---|---|---|" + "---|" * len(OPTIONS)]
    keys = sorted({(r["sweep"]["learners"], r["sweep"]["lag"], r["sweep"]["seed"]) for r in rows.values()})
    for m, lag, seed in keys:
        cells = [rows.get(name_of(o, m, lag, seed), {}).get("final_eval_loss") for o in OPTIONS]
        lines.append(f"| {m} | {lag} | {seed} | " + " | ".join("" if c is None else f"{c:.4f}" for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"1.5e5 tokens and lags {QUICK_LAGS} (the numbers say quick)")
    ap.add_argument("--tokens", type=float, default=None, help="token budget per run (default 2e6, quick 1.5e5)")
    ap.add_argument("--lags", type=int, nargs="*", help=f"merge lags in steps (default {LAGS}; quick {QUICK_LAGS})")
    ap.add_argument("--learners", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--options", nargs="*", default=list(OPTIONS), choices=list(OPTIONS))
    ap.add_argument("--seeds", type=int, nargs="*", default=[0])
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--eval-batches", type=int, default=None, help="eval set size in batches (default 8); smoke tests")
    ap.add_argument("--out", default=str(ROOT / "results" / "staleness.json"))
    ap.add_argument("--fresh", action="store_true", help="start a new --out instead of keeping its other rows")
    ap.add_argument("--replot", action="store_true", help="redraw the PNG and table from --out without running")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.replot:
        doc = json.loads(out.read_text())
        rows = doc["runs"]
        plot(rows, out.with_suffix(".png"), describe(doc))
        print(table(rows))
        return 0
    lags = args.lags or (QUICK_LAGS if args.quick else LAGS)
    if any(not 0 <= g <= 64 for g in lags):
        ap.error(f"--lags: steps in [0, 64], got {lags}")
    tokens = int(args.tokens or (1.5e5 if args.quick else 2e6))
    dep = deployment("tiny")
    steps = tokens // (model.preset("tiny").seq_len * 4)  # of an M = 4 row; the curve is not what this compares
    common = dict(preset="tiny", tokens=tokens, batch_size=1, eval_every=max(1, steps // 8),
                  **deployment_settings(dep))
    if args.eval_batches is not None:
        common["eval_batches"] = args.eval_batches
    todo = {name_of(o, m, g, s): (o, m, g, s) for s in args.seeds for m in args.learners for g in lags
            for o in args.options}
    eval_batches = spec_lib.RunConfig().eval_batches if args.eval_batches is None else args.eval_batches
    # Seeds differ per row (in its name), so the header names none; the rest must match to add rows to a file.
    header = json.loads(json.dumps({
        "preset": "tiny", "tokens": tokens, "batch_size": 1, "quick": args.quick, "seed": "per row",
        "sync_every": SYNC_EVERY, "eval_batches": eval_batches, "deployment": dep, "holdout": "eval", "wire": WIRE,
        "lag": "link round trip = lag steps (rtt_s = lag x step_time_s), tau = min(lag, H - 1)"}))
    try:  # a bad setting or an incompatible --out stops here, before any run or write
        for o, m, g, s in todo.values():
            spec_lib.from_short(**{**common, **row_overrides(o, m, g, s)})
        rows = {} if args.fresh else kept_rows(out, header, list(todo))
    except ValueError as e:
        ap.error(str(e))
    order = sorted(rows.keys() | todo.keys())
    write_rows(out, header, rows, order)
    jobs = [(name, row_overrides(*key), common) for name, key in todo.items()]
    with mp.get_context("spawn").Pool(args.jobs) if args.jobs > 1 else contextlib.nullcontext() as pool:
        for name, r in pool.imap_unordered(_one, jobs) if pool else map(_one, jobs):
            o, m, g, s = todo[name]
            rows[name] = dict(r, sweep={"option": o, "learners": m, "lag": g, "seed": s})
            write_rows(out, header, rows, order)
    plot(rows, out.with_suffix(".png"), describe(header))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
