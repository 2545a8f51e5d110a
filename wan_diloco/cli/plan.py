"""`wan-diloco plan`: choose H, P, τ, bits, grace window and fragment order for a run from its links.

Reads the run's TOML; the model's size and fragment sizes come from the model
config alone (shapes only: nothing is trained and no corpus is read). Links
come from ``[regions]``, or from a run's ``metrics.jsonl`` (``--measured``).
The step time is ``--step-time``, else measured here on random tokens. What it
computes is :func:`wan_diloco.api.plan` (the planner: ``planning.plan.plan_run``); see docs/planning.md.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from wan_diloco import api
from wan_diloco import spec as spec_lib
from wan_diloco.api import apply_plan
from wan_diloco.cli.args import count
from wan_diloco.planning.plan import DEFAULT_MAX_TAU, ModelFacts, Plan
from wan_diloco.cli.report import CU_MEANING
from wan_diloco.spec import RunSpec

__all__ = ["add_arguments", "apply_plan", "make_plan", "print_plan", "run"]  # apply_plan: for `launch --plan`


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, metavar="F", help="run TOML (default: the embedded examples/local.toml)")
    p.add_argument("--step-time", type=float, metavar="S",
                   help="seconds per learner step (default: time a few steps of the model here)")
    p.add_argument("--measured", type=Path, metavar="PATH",
                   help="a run's metrics.jsonl: its latest link measurement per region replaces the config's link")
    p.add_argument("--target-cu", type=float, help="compute-utilization target (default: [plan] target_cu, 0.95)")
    p.add_argument("--margin", type=float,
                   help="share of each link's rate and of each step kept in reserve (default: [plan] margin, 0.1)")
    p.add_argument("--max-tau", type=count,
                   help=f"largest overlap tau considered (default: [plan] max_tau, {DEFAULT_MAX_TAU})")
    p.add_argument("--json", type=Path, metavar="OUT", help="write the plan and its inputs as JSON")


def make_plan(spec: RunSpec, console: Console, step_time: float | None = None, measured: Path | None = None,
              target_cu: float | None = None, margin: float | None = None,
              max_tau: int | None = None) -> tuple[Plan, ModelFacts, dict[str, str], str, list[str]]:
    """(plan, model facts, where each link came from, where the step time came from, notes) for ``spec``
    (:func:`wan_diloco.api.plan`, which says here when it times the step)."""
    r = api.plan(spec, step_time, measured, target_cu, margin, max_tau, say=console.print)
    return r.plan, r.facts, dict(r.link_source), r.step_time_from, list(r.notes)


def run(args: argparse.Namespace) -> int:
    spec = spec_lib.load(args.config)
    console = Console()
    result = api.plan(spec, args.step_time, args.measured, args.target_cu, args.margin, args.max_tau,
                      say=console.print)
    print_plan(console, spec, result.plan, result.facts, dict(result.link_source), result.step_time_from,
               list(result.notes))
    console.print(f"  syncer shard merge rate {result.shard_merge_gb_s:.3g} GB/s: {result.shard_merge_from}",
                  highlight=False, markup=False)
    if result.shard_warning:
        console.print(f"[yellow]warning:[/] {result.shard_warning}", highlight=False)
    if args.json:
        out = result.to_dict(config=str(args.config) if args.config else "(embedded default)")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if result.reached else 1


def print_plan(console: Console, spec: RunSpec, plan: Plan, facts: ModelFacts, source: dict[str, str],
               step_from: str, notes: list[str]) -> None:
    console.print(f"[bold]{spec.preset}[/]: {facts.params / 1e6:.3g}M params, {facts.layers} layers, "
                  f"{spec.run.fragmenter} fragments; step {plan.step_time_s:.4g} s ({step_from}); "
                  f"{spec.run.learners} learners, syncer in {spec.regions.syncer_region}")
    cfg = spec.learner
    settings = Table(title="Plan (same model as wan-diloco bandwidth, method decoupled)")
    for col in ("setting", "planned", "config now"):
        settings.add_column(col, justify="right" if col != "setting" else "left")
    per_region = ", ".join(f"{r} {t if t is not None else '-'}" for r, t in plan.tau_by_region.items())
    grace_now = "none" if spec.syncer.max_grace_s is None else f"{spec.syncer.max_grace_s:g}"
    for row in (("H  learner.sync_every", plan.sync_every, cfg.sync_every),
                ("P  learner.num_fragments", plan.fragments, cfg.num_fragments),
                ("tau  learner.tau", f"{plan.tau}  ({per_region})", cfg.tau),
                ("bits  codec.bits", plan.bits, spec.codec.bits),
                ("grace cap, s  syncer.max_grace_s", f"{plan.max_grace_s:.3g}", grace_now),
                ("fragment order (slot -> fragment)  learner.fragment_order", " ".join(map(str, plan.fragment_order)),
                 " ".join(map(str, cfg.fragment_order)) or "index order"),
                ("largest fragment on the wire, MB", f"{plan.fragment_bytes / 1e6:.3g}", "")):
        settings.add_row(*map(str, row))
    console.print(settings)
    links = Table(title=f"Links: Gbit/s each way, demand <= rate x {1 - plan.margin:g}; tau: the smallest the "
                        f"link allows")
    for col in ("region", "learners", "from", "rate", "RTT ms", "demand", "tau", "CU"):
        links.add_column(col, justify="left" if col in ("region", "from") else "right")
    for r, link in plan.links.items():
        demand = plan.demand_gbit_s_by_region[r]
        over = "[red]" if demand > link.rate_gbit_s * (1 - plan.margin) else ""
        tau = plan.tau_by_region[r]
        links.add_row(r, str(plan.learners_per_region[r]), source.get(r, "?"), f"{link.rate_gbit_s:.3g}",
                      f"{link.rtt_s * 1e3:.0f}", f"{over}{demand:.3g}", "-" if tau is None else str(tau),
                      f"{min(plan.cu_by_region[r], 1.0):.3f}")
    console.print(CU_MEANING, highlight=False)
    console.print(links)
    verdict = "[green]reached[/]" if plan.reached else "[red]not reached[/]"
    console.print(f"predicted CU {min(plan.cu_predicted, 1.0):.3f} (bottleneck {plan.bottleneck}) vs target "
                  f"{plan.target_cu:g}: {verdict}")
    for line in plan.why:
        console.print(f"  [red]why:[/] {line}", highlight=False)
    for line in [*notes, *plan.notes]:
        console.print(f"  note: {line}", highlight=False)
    # The order is set only when it is not index order (the default, a run's behaviour without the key).
    order = ("" if plan.fragment_order == tuple(range(plan.fragments))
             else f", fragment_order = [{', '.join(map(str, plan.fragment_order))}]")
    console.print("TOML: "
                  f"[learner] sync_every = {plan.sync_every}, num_fragments = {plan.fragments}, tau = {plan.tau}"
                  f"{order}; [codec] bits = {plan.bits}; [syncer] max_grace_s = {plan.max_grace_s:.3g}",
                  highlight=False, markup=False)
