"""`wan-diloco bandwidth`: Gbit/s between datacenters needed per compute-utilization target."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from wan_diloco.cli.args import count
from wan_diloco.cli.report import CU_MEANING
from wan_diloco.config import ConfigError, replace, require
from wan_diloco.planning.bandwidth import (
    DEFAULT_CU_TARGETS,
    PRESETS,
    BandwidthConfig,
    cu_at_rate,
    parse_methods,
    required_rates,
    schedule_for,
    step_time_from_flops,
)
from wan_diloco.planning.recommend import BITS_OPTIONS, STREAMING_METHODS, recommend
from wan_diloco.planning.timeline import compute_utilization

SHOWN_RECOMMENDATIONS = 8
DEFAULT_PRESET = "1b"


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=sorted(PRESETS), help="params, layers and step time of a paper model")
    m.add_argument("--params", type=float, help="parameter count, e.g. 1e9")
    m.add_argument("--layers", type=count, help="transformer layers")
    m.add_argument("--step-time", type=float, metavar="S", help="seconds per training step")
    m.add_argument("--tokens-per-step", type=float, help="tokens per step per datacenter (step time from FLOPs)")
    m.add_argument("--mfu", type=float, default=0.4, help="model FLOP utilization (default 0.4)")
    m.add_argument("--peak-tflops", type=float, help="peak TFLOP/s of one datacenter's chips together")
    s = p.add_argument_group("sync")
    s.add_argument("--datacenters", type=count, default=2, help="sites joined by identical links (default 2)")
    s.add_argument("--method", default="all", help="'all' (default), 'paper' (the paper's five columns) or a "
                   "comma list of: data_parallel, diloco, streaming, streaming_overlap, streaming_overlap_4bit, decoupled")
    s.add_argument("--sync-every", type=count, default=100, metavar="H", help="inner steps per outer sync (default 100)")
    s.add_argument("--fragments", type=count, metavar="P", help="fragments (default: one per 3 layers)")
    s.add_argument("--tau", type=count, default=1, help="overlap steps for overlapped methods (default 1)")
    s.add_argument("--bits", type=count, default=16, choices=BITS_OPTIONS, help="outer-gradient bits (default 16)")
    s.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip time between datacenters (default 0)")
    o = p.add_argument_group("question and output")
    o.add_argument("--target-cu", default=",".join(map(str, DEFAULT_CU_TARGETS)), help="comma list of CU targets")
    o.add_argument("--bandwidth-gbit", type=float, help="also report the CU each method reaches at this rate")
    o.add_argument("--link-gbit", type=float, help="recommend H, P, tau and bits reaching --target-cu on this link")
    o.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    o.add_argument("--plot", type=Path, metavar="PNG", help="plot CU against bandwidth per method")


def config_from_args(args: argparse.Namespace) -> BandwidthConfig:
    """The model and sync settings named on the command line."""
    model_flags = (args.preset, args.params, args.layers, args.step_time, args.tokens_per_step, args.peak_tflops)
    if all(v is None for v in model_flags):  # a bare `wan-diloco bandwidth` answers for the paper's 1B model
        args.preset = DEFAULT_PRESET
        Console().print(f"no model given: --preset {DEFAULT_PRESET} (Streaming DiLoCo's 1B model); "
                        "--preset or --params, --layers and --step-time choose another", highlight=False)
    params, layers, step_time = PRESETS[args.preset] if args.preset else (None, None, None)
    params = args.params if args.params is not None else params
    layers = args.layers if args.layers is not None else layers
    require(params is not None, "params", "give --params or --preset")
    require(layers is not None, "layers", "give --layers or --preset")
    if args.step_time is not None:
        step_time = args.step_time
    elif args.tokens_per_step is not None or args.peak_tflops is not None:
        require(args.tokens_per_step is not None and args.peak_tflops is not None, "step_time",
                "computing it from FLOPs needs both --tokens-per-step and --peak-tflops")
        step_time = step_time_from_flops(params, args.tokens_per_step, args.mfu, args.peak_tflops)
    require(step_time is not None, "step_time", "give --step-time, --preset, or --tokens-per-step with --peak-tflops")
    cfg = BandwidthConfig(params=params, layers=layers, step_time_s=step_time, datacenters=args.datacenters,
                          sync_every=args.sync_every, fragments=args.fragments, tau=args.tau, bits=args.bits,
                          rtt_s=args.rtt_ms / 1e3)
    cfg.validate()
    return cfg


def parse_targets(spec: str) -> tuple[float, ...]:
    try:
        targets = tuple(float(x) for x in spec.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"target_cu: expected a comma list of numbers, got {spec!r}") from None
    require(bool(targets), "target_cu", "no target given")
    for cu in targets:
        require(0 < cu < 1, "target_cu", f"each target must be in (0, 1), got {cu}")
    return targets


def _gbit(x: float) -> str:
    return "unreachable" if math.isinf(x) else f"{x:.3g}"


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    targets = parse_targets(args.target_cu)
    methods = parse_methods(args.method)
    console = Console()
    given = "given: " if args.link_gbit is not None else ""  # recommend mode prints its pick below these
    console.print(f"[bold]{given}{cfg.params:.3g} params, {cfg.layers} layers, step {cfg.step_time_s:.3g} s[/], "
                  f"{cfg.datacenters} datacenters, H={cfg.sync_every}, P={cfg.n_fragments}, tau={cfg.tau}, "
                  f"{cfg.bits}-bit outer gradients, RTT {cfg.rtt_s * 1e3:.0f} ms")
    console.print(CU_MEANING, highlight=False)
    if args.link_gbit is not None:
        return _run_recommend(args, cfg, targets, methods, console)
    rates = required_rates(cfg, methods, targets)
    table = Table(title="Gbit/s between datacenters needed to reach each compute utilization")
    table.add_column("method", no_wrap=True)
    for cu in targets:
        table.add_column(f"CU {cu:g}", justify="right")
    at_rate = cu_at_rate(cfg, methods, args.bandwidth_gbit) if args.bandwidth_gbit is not None else None
    if at_rate is not None:
        table.add_column(f"CU at {args.bandwidth_gbit:g} Gbit/s", justify="right")
    for m in methods:
        extra = [f"{at_rate[m]:.3f}"] if at_rate is not None else []
        table.add_row(m, *[_gbit(r) for r in rates[m]], *extra)
    console.print(table)
    if args.json:
        out = {"cu_targets": list(targets),
               "methods": {m: [None if math.isinf(r) else float(f"{r:.4g}") for r in rates[m]] for m in methods}}
        if at_rate is not None:
            out["cu_at_bandwidth"] = {"bandwidth_gbit": args.bandwidth_gbit, "cu": at_rate}
        _write_json(args.json, out)
    if args.plot:
        plot_cu_curves(cfg, methods, rates, args.plot)
        console.print(f"plot: {args.plot}", highlight=False)
    return 0


PUBLISHED_MAX_H = 100  # the largest H of published runs at data-parallel quality (Streaming DiLoCo, H = 100)


def quality_note(r) -> str:
    """What the published runs say of a setting's model quality (τ <= 5 and 4-bit outer gradients are
    within them; H is the one knob that goes past them)."""
    if r.sync_every <= PUBLISHED_MAX_H:
        return "as data parallel in published runs"
    return f"H beyond published runs (<= {PUBLISHED_MAX_H}): expect some loss"


def _run_recommend(args, cfg, targets, methods, console) -> int:
    require(len(targets) == 1, "target_cu", "recommendations need exactly one --target-cu")
    require(args.bandwidth_gbit is None, "bandwidth_gbit", "use --link-gbit alone in recommendation mode")
    method = methods[0] if args.method != "all" else "decoupled"
    require(len(methods) == 1 or args.method == "all", "method", "recommendations take one method")
    require(method in STREAMING_METHODS, "method", f"recommendations cover {', '.join(STREAMING_METHODS)}")
    found, reached = recommend(cfg, args.link_gbit, targets[0], method)
    pick = found[0]
    setting = f"H = {pick.sync_every}, P = {pick.fragments}, tau = {pick.tau}, {pick.bits}-bit"
    if reached:
        console.print(f"[bold green]recommended: {setting}[/]: CU {pick.cu:.3f} on {args.link_gbit:g} Gbit/s; of the "
                      f"settings that reach CU {targets[0]:g}, it syncs most often, then with the least overlap, then "
                      f"with the most bits (in that order they cost model quality). Model quality: "
                      f"{quality_note(pick)}.")
    else:
        console.print(f"[bold red]no setting reaches CU {targets[0]:g} on {args.link_gbit:g} Gbit/s[/]; the closest is "
                      f"{setting} at CU {pick.cu:.3f}: a faster link, a longer step or a lower target.")
    verdict = "reach" if reached else "[red]do not reach[/] (best CU shown)"
    table = Table(title=f"{method} on {args.link_gbit:g} Gbit/s: settings that {verdict} CU {targets[0]:g}")
    for col in ("", "H", "P", "tau", "bits", "CU"):
        table.add_column(col, justify="right")
    table.add_column("model quality")
    for i, r in enumerate(found[:SHOWN_RECOMMENDATIONS]):
        table.add_row("pick" if i == 0 and reached else "", str(r.sync_every), str(r.fragments), str(r.tau),
                      str(r.bits), f"{r.cu:.3f}", quality_note(r))
    console.print(table)
    if args.json:
        _write_json(args.json, {"method": method, "link_gbit": args.link_gbit, "target_cu": targets[0],
                                "reached": reached, "pick": pick.__dict__ if reached else None,
                                "recommendations": [{**r.__dict__, "quality": quality_note(r)}
                                                    for r in found[:SHOWN_RECOMMENDATIONS]]})
    if args.plot:
        picked = replace(cfg, sync_every=pick.sync_every, fragments=pick.fragments, tau=pick.tau, bits=pick.bits)
        plot_recommendation(cfg, picked, method, args.link_gbit, targets[0], args.plot)
        console.print(f"plot: {args.plot}", highlight=False)
    return 0 if reached else 1


def plot_recommendation(cfg: BandwidthConfig, picked: BandwidthConfig, method: str, link_gbit: float,
                        target_cu: float, path: Path, points: int = 60) -> None:
    """PNG of CU against link rate for the settings given and for the pick, with the link and the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.geomspace(link_gbit / 100, link_gbit * 100, points)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c, label in ((cfg, f"as given: H {cfg.sync_every}, P {cfg.n_fragments}, tau {cfg.tau}, {cfg.bits}-bit"),
                     (picked, f"pick: H {picked.sync_every}, P {picked.n_fragments}, tau {picked.tau}, {picked.bits}-bit")):
        sched = schedule_for(c, method)
        ax.plot(grid, [compute_utilization(sched, g) for g in grid], label=label)
    ax.axvline(link_gbit, color="gray", linestyle=":", label=f"link {link_gbit:g} Gbit/s")
    ax.axhline(target_cu, color="gray", linestyle="--", label=f"target CU {target_cu:g}")
    ax.set_xscale("log")
    ax.set_xlabel("bandwidth between datacenters (Gbit/s)")
    ax.set_ylabel("compute utilization")
    ax.set_title(f"{method}: {cfg.params:.3g} params, {cfg.layers} layers, step {cfg.step_time_s:.3g} s")
    from wan_diloco.cli.report import save_figure

    save_figure(fig, ax, path)


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def plot_cu_curves(cfg: BandwidthConfig, methods, rates: dict[str, list[float]], path: Path, points: int = 60) -> None:
    """PNG of CU against link rate (log scale), one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    finite = [r for rs in rates.values() for r in rs if math.isfinite(r)] or [1.0]
    grid = np.geomspace(min(finite) / 4, max(finite) * 4, points)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in methods:
        sched = schedule_for(cfg, m)
        ax.plot(grid, [compute_utilization(sched, g) for g in grid], label=m)
    ax.set_xscale("log")
    ax.set_xlabel("bandwidth between datacenters (Gbit/s)")
    ax.set_ylabel("compute utilization")
    ax.set_title(f"{cfg.params:.3g} params, {cfg.layers} layers, step {cfg.step_time_s:.3g} s")
    from wan_diloco.cli.report import save_figure

    save_figure(fig, ax, path)
