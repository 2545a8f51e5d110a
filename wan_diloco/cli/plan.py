"""`wan-diloco plan`: choose H, P, τ, bits, grace window and fragment order for a run from its links.

Reads the run's TOML; the model's size and fragment sizes come from the model
config alone (shapes only: nothing is trained and no corpus is read). Links
come from ``[regions]``, or from a run's ``metrics.jsonl`` (``--measured``).
The step time is ``--step-time``, else measured here on random tokens. The
planner is :func:`wan_diloco.planning.plan.plan_run`; see docs/planning.md.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from wan_diloco import model as model_lib
from wan_diloco import spec as spec_lib
from wan_diloco import tree
from wan_diloco.cli.args import count
from wan_diloco.cli.report import CU_MEANING
from wan_diloco.config import require
from wan_diloco.fragments import make_fragments
from wan_diloco.planning.plan import DEFAULT_MAX_TAU, LinkEstimate, ModelFacts, Plan, links_from_metrics, plan_run
from wan_diloco.planning.shards import shard_warning, shards_needed
from wan_diloco.spec import RunSpec

TIMED_STEPS = 5


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


def model_facts(spec: RunSpec) -> ModelFacts:
    """Parameter count, layers and the configured fragmenter's fragment sizes, from shapes alone."""
    shapes = tree.flatten(model_lib.abstract_params(spec.model))
    sizes = {n: math.prod(a.shape) for n, a in shapes.items()}
    frags = make_fragments(spec.run.fragmenter, sizes, spec.learner.num_fragments, model_lib.layer_index)
    layers = spec.model.n_layers if not spec.model.module else \
        max(1, len({i for n in sizes if (i := model_lib.layer_index(n)) is not None}))
    return ModelFacts(params=sum(sizes.values()), layers=layers,
                      fragment_params=tuple(sum(sizes[n] for n in f) for f in frags))


def measure_step_time(spec: RunSpec, steps: int = TIMED_STEPS) -> float:
    """Seconds per step of one learner of ``spec`` alone on this machine (random tokens, after compiling).

    A run's ``min_step_s`` pacing is a floor: learners never step faster.
    """
    import jax
    import numpy as np

    from wan_diloco import train as train_lib

    mesh = train_lib.local_mesh()
    step = train_lib.make_train_step(spec.model, spec.train, mesh)
    state = train_lib.init_state(spec.model, spec.train, jax.random.PRNGKey(spec.run.seed))
    rng = np.random.default_rng(spec.run.seed)
    tokens = rng.integers(0, spec.model.vocab_size, (spec.run.batch_size, spec.model.seq_len + 1), dtype=np.int32)
    state, metrics = step(state, tokens)  # compiles
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, tokens)
    jax.block_until_ready(metrics)
    return max((time.perf_counter() - t0) / steps, spec.run.min_step_s)


def links_of(spec: RunSpec, measured: Path | None) -> tuple[dict[str, LinkEstimate], dict[str, str], list[str]]:
    """(links, where each came from, notes): every WAN region's link, measured ones replacing the config's."""
    regions = spec.regions
    links = {r: LinkEstimate(regions.link_of(r).rate_gbit_s, regions.link_of(r).rtt_ms / 1e3) for r in regions.remote}
    source = {r: "config" for r in links}
    notes: list[str] = []
    if measured is None:
        return links, source, notes
    require(measured.is_file(), "measured", f"{measured}: not found")
    with open(measured) as f:
        found = links_from_metrics(f, source=str(measured))
    require(bool(found), "measured", f"{measured}: no link events (\"event\": \"link\")")
    for r, est in found.items():
        if r == regions.syncer_region:
            notes.append(f"{r}: measured link ignored, it is the syncer's region (LAN)")
            continue
        require(r in links, "measured", f"{measured}: region {r!r} is not a WAN region of the config "
                f"(WAN regions: {', '.join(links) or 'none'})")
        links[r], source[r] = est, "measured"
    return links, source, notes


def learners_per_region(spec: RunSpec) -> dict[str, int]:
    counts = collections.Counter(spec.region(m) for m in range(spec.run.learners))
    return {r: counts[r] for r in spec.regions.names if counts[r]}


def make_plan(spec: RunSpec, console: Console, step_time: float | None = None, measured: Path | None = None,
              target_cu: float | None = None, margin: float | None = None,
              max_tau: int | None = None) -> tuple[Plan, ModelFacts, dict[str, str], str, list[str]]:
    """(plan, model facts, where each link came from, where the step time came from, notes) for ``spec``;
    ``None`` arguments take the file's ``[plan]`` values, the step time is timed here."""
    target_cu = spec.plan.target_cu if target_cu is None else target_cu
    margin = spec.plan.margin if margin is None else margin
    max_tau = spec.plan.max_tau if max_tau is None else max_tau
    require(step_time is None or (math.isfinite(step_time) and step_time > 0), "step_time",
            f"must be > 0, got {step_time}")
    require(bool(spec.regions.remote), "regions",
            f"every region is the syncer's ({spec.regions.syncer_region}): no WAN link to plan for")
    links, source, notes = links_of(spec, measured)
    facts = model_facts(spec)
    if step_time is not None:
        step_s, step_from = step_time, "given"
    else:
        console.print(f"timing {TIMED_STEPS} steps of the model here (batch {spec.run.batch_size}) ...")
        step_s, step_from = measure_step_time(spec), f"measured here: one learner alone, {TIMED_STEPS} steps"
    plan = plan_run(facts, links, step_s, learners_per_region(spec), target_cu=target_cu, margin=margin,
                    max_tau=max_tau, grace_safety=spec.syncer.grace_safety)
    return plan, facts, source, step_from, notes


def apply_plan(spec: RunSpec, plan: Plan) -> RunSpec:
    """``spec`` with the plan's H, P, τ, fragment order (``learner.fragment_order``; left empty when it
    is index order, the default), bits and grace cap."""
    order = [] if plan.fragment_order == tuple(range(plan.fragments)) else list(plan.fragment_order)
    return spec.with_changes(learner={"sync_every": plan.sync_every, "num_fragments": plan.fragments,
                                      "tau": plan.tau, "fragment_order": order},
                             codec={"bits": plan.bits}, syncer={"max_grace_s": round(plan.max_grace_s, 6)})


def run(args: argparse.Namespace) -> int:
    spec = spec_lib.load(args.config)
    console = Console()
    plan, facts, source, step_from, notes = make_plan(spec, console, args.step_time, args.measured,
                                                      args.target_cu, args.margin, args.max_tau)
    print_plan(console, spec, plan, facts, source, step_from, notes)
    need = shards_needed(facts.params, spec.run.learners, plan.sync_every, plan.step_time_s, spec.plan.shard_merge_gb_s)
    warning = shard_warning(facts.params, spec.run.learners, plan.sync_every, plan.step_time_s,
                            spec.plan.shard_merge_gb_s, spec.syncer.shards)
    if warning:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    if args.json:
        out = {**plan.to_dict(), "syncer_shards_needed": need, "syncer_shards": spec.syncer.shards,
               "shard_warning": warning, "inputs": {
            "config": str(args.config) if args.config else "(embedded default)", "preset": spec.preset,
            "fragmenter": spec.run.fragmenter, "fragment_params_configured": list(facts.fragment_params or ()),
            "step_time_s": plan.step_time_s, "step_time_from": step_from, "link_source": source,
            "measured": str(args.measured) if args.measured else None, "target_cu": plan.target_cu,
            "margin": plan.margin, "max_tau": spec.plan.max_tau if args.max_tau is None else args.max_tau,
            "shard_merge_gb_s": spec.plan.shard_merge_gb_s,
            "notes": notes}}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0 if plan.reached else 1


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
