"""`wan-diloco goodput`: chaos simulation of goodput and uptime under chip failures."""
from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path

from rich.console import Console
from rich.table import Table

from wan_diloco.cli.args import count
from wan_diloco.config import require
from wan_diloco.planning.goodput import SYSTEMS, GoodputConfig, simulate
from wan_diloco.tape import save_tape, scale_tape

PLOT_LEARNERS = (1, 2, 4, 8, 16)
DEFAULT_LEARNERS = 4  # the default run's (wan-diloco train): decoupled at M = 1 would be elastic-dp again
_HELP = {
    "chips": "chips allocated to the run",
    "mtbf_chip_years": "mean time between failures of one chip, years",
    "learners": "learners M of decoupled",
    "quorum": "K: uptime counts time with at least K learners training",
    "slice_chips": "chips a failure takes down (its slice)",
    "repair_scale_h": "repair time: exponentiated Weibull scale, hours",
    "repair_shape": "repair time: Weibull shape k",
    "repair_exponent": "repair time: exponentiation alpha",
    "downscale_s": "elastic pause to drop a failed slice, s",
    "upscale_s": "elastic pause to re-add a repaired slice, s",
    "restart_s": "dp: restart from checkpoint on spare capacity, s",
    "checkpoint_interval_s": "dp: seconds of training between checkpoints",
    "speed_cv": "coefficient of variation of slice step times",
    "days": "simulated days",
    "seed": "random seed",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(GoodputConfig)
    for f in dataclasses.fields(GoodputConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "system":
            p.add_argument(flag, choices=SYSTEMS, help=f"one system (default: {', '.join(SYSTEMS)} side by side)")
        elif f.name == "learners":
            p.add_argument(flag, type=count, help=f"{_HELP[f.name]} (default {DEFAULT_LEARNERS})")
        else:
            typ = count if hints[f.name] is int else hints[f.name]
            p.add_argument(flag, type=typ, default=f.default, help=f"{_HELP[f.name]} (default {f.default:g})")
    p.add_argument("--json", type=Path, metavar="PATH", help="write goodput, uptime and the settings as JSON")
    p.add_argument("--tape", type=Path, metavar="PATH", help="write each learner's outages as a failure tape")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply tape times by this, e.g. 1/336 maps two weeks onto one hour (default 1)")
    p.add_argument("--plot", type=Path, metavar="PNG", help="plot goodput against chips for M = 1, 2, 4, 8, 16")


def configs_from_args(args: argparse.Namespace) -> list[GoodputConfig]:
    """The scenario of each system asked for: ``--system``, else all of them side by side (``--learners``
    and ``--quorum`` are decoupled's then; the others run one learner)."""
    systems = (args.system,) if args.system else SYSTEMS
    out = []
    for system in systems:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(GoodputConfig)}
        values["system"] = system
        if system == "decoupled":
            values["learners"] = DEFAULT_LEARNERS if args.learners is None else args.learners
        elif args.system is None:  # side by side: --learners and --quorum were decoupled's
            values["learners"], values["quorum"] = 1, 1
        elif args.learners is None:
            values["learners"] = 1
        cfg = GoodputConfig(**values)
        cfg.validate()
        out.append(cfg)
    return out


def _who(cfg: GoodputConfig) -> str:
    return f"decoupled, M={cfg.learners}, K={cfg.quorum}" if cfg.system == "decoupled" else cfg.system


def run(args: argparse.Namespace) -> int:
    cfgs = configs_from_args(args)
    require(args.time_scale > 0, "time_scale", f"must be > 0, got {args.time_scale}")
    require(args.tape is not None or args.time_scale == 1, "time_scale", "only applies with --tape")
    results = [simulate(cfg) for cfg in cfgs]
    cfg = cfgs[-1]  # decoupled when comparing (SYSTEMS ends with it): its learners' outages make the tape
    title = f": {_who(cfg)}" if len(cfgs) == 1 else ""
    table = Table(title=f"{cfg.chips:.3g} chips ({cfg.n_slices} slices of {cfg.slice_chips}), "
                        f"MTBF {cfg.mtbf_chip_years:g} chip-years, {cfg.days:g} days{title}")
    table.add_column("measure")
    for c in cfgs:
        table.add_column("value" if len(cfgs) == 1 else _who(c), justify="right")
    rows = [("goodput", lambda r: f"{r.goodput:.3f}"), ("uptime", lambda r: f"{r.uptime:.3f}"),
            ("failures (hitting a healthy slice)", lambda r: f"{r.failures} ({r.effective_failures})"),
            ("chips under repair", lambda r: f"{r.down_chip_fraction:.3f}"),
            ("time paused or restarting (per learner)", lambda r: f"{r.paused_fraction:.3f}")]
    dp = next((r for c, r in zip(cfgs, results) if c.system == "dp"), None)
    if dp is not None:
        rows.append(("work redone after restarts", lambda r: f"{r.lost_work_fraction:.4f}" if r is dp else "-"))
    for name, cell in rows:
        table.add_row(name, *(cell(r) for r in results))
    Console().print(table)
    if args.json:
        one = [{**r.summary(), "config": dataclasses.asdict(c)} for c, r in zip(cfgs, results)]
        _write(args.json, json.dumps(one[0] if args.system else {"systems": one}, indent=2) + "\n")
    if args.tape:
        save_tape(args.tape, scale_tape(results[-1].outages, args.time_scale))
        Console().print(f"tape ({_who(cfg)}): {len(results[-1].outages)} outages -> {args.tape}"
                        + (f" (times x {args.time_scale:g})" if args.time_scale != 1 else ""), highlight=False)
    if args.plot:
        plot_goodput_vs_chips(cfg, args.plot)
        Console().print(f"plot: {args.plot}", highlight=False)
    return 0


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def plot_chip_range(cfg: GoodputConfig) -> tuple[float, float]:
    """Chips on the plot's axis: three decades up to ``cfg.chips`` (at least one slice to four)."""
    low = max(float(cfg.slice_chips), cfg.chips / 1000)
    return low, max(float(cfg.chips), 4 * low)


def plot_goodput_vs_chips(cfg: GoodputConfig, path: Path, points: int = 7) -> None:
    """PNG of goodput against chips: decoupled with M = 1, 2, 4, 8, 16 (M = 1 is elastic-dp), and dp."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    chips = np.geomspace(*plot_chip_range(cfg), points)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    base = dataclasses.replace(cfg, quorum=1)
    for m in PLOT_LEARNERS:
        fits = [float(c) for c in chips if c >= m * cfg.slice_chips]  # every learner needs a slice at least
        if not fits:
            continue
        g = [simulate(dataclasses.replace(base, system="decoupled", learners=m, chips=c)).goodput for c in fits]
        ax.plot(fits, g, marker="o", label=f"decoupled M={m}" + (" (= elastic-dp)" if m == 1 else ""))
    g = [simulate(dataclasses.replace(base, system="dp", learners=1, chips=float(c))).goodput for c in chips]
    ax.plot(chips, g, marker="x", linestyle="--", color="gray", label="dp (no elasticity)")
    ax.set_xscale("log")
    ax.set_ylim(0, 1)
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput")
    ax.set_title(f"MTBF {cfg.mtbf_chip_years:g} chip-years, slices of {cfg.slice_chips}, {cfg.days:g} days")
    from wan_diloco.cli.report import save_figure

    save_figure(fig, ax, path)
