"""The Python API (docs/api.md): what ``wan-diloco simulate``, ``launch`` and ``plan`` run, as functions that
take a :class:`RunSpec` and return data. The CLI commands print what these return.

Every function takes a ``RunSpec``, a TOML file's path or a TOML-shaped dict; a bad one is a ConfigError
naming the key, raised before anything runs.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from wan_diloco import model as model_lib
from wan_diloco import sim, tree
from wan_diloco.checkpoint import load_params, read_params
from wan_diloco.config import require
from wan_diloco.fragments import make_fragments
from wan_diloco.planning.plan import LinkEstimate, ModelFacts, Plan, links_from_metrics, plan_run
from wan_diloco.planning.shards import DEFAULT_SHARD_MERGE_GB_S, shard_merge_rate, shard_warning, shards_needed
from wan_diloco.runtime import launch as launch_lib
from wan_diloco.sim import SimResult
from wan_diloco.spec import RunSpec, dumps
from wan_diloco.tape import Fault, load_tape

__all__ = ["PlanResult", "RunResult", "RunSpec", "SimResult", "as_spec", "launch", "load_params", "plan",
           "read_params", "simulate"]

TIMED_STEPS = 5  # plan: steps timed here when no step time is given (after one that compiles)


def as_spec(spec: RunSpec | str | Path | Mapping[str, Any]) -> RunSpec:
    """``spec`` itself, the spec in a TOML file's path, or the spec of a TOML-shaped dict."""
    if isinstance(spec, RunSpec):
        return spec
    if isinstance(spec, (str, Path)):
        return RunSpec.load(spec)
    require(isinstance(spec, Mapping), "spec",
            f"must be a RunSpec, a TOML file's path or a dict of tables, got {type(spec).__name__}")
    return RunSpec.from_dict(spec)


# ---- simulate ------------------------------------------------------------------------------------

def simulate(spec: RunSpec | str | Path | Mapping[str, Any], failures: str | Path | Iterable[Fault] = (),
             progress: Callable[[float, dict], None] | None = None) -> SimResult:
    """The run on a virtual clock in this process (``wan-diloco simulate``): M learners training real models,
    links and step times from ``[simulate]``, the baseline ``simulate.baseline``. ``failures``: a failure tape
    (its path, or ``tape.Outage``/``tape.SyncerOutage`` items); ``progress(share_done, latest_eval_point)``
    is called as it goes. Deterministic for a seed; the result's ``params`` are the final global parameters."""
    spec = as_spec(spec)
    tape = load_tape(failures) if isinstance(failures, (str, Path)) else list(failures)
    return sim.run(spec, tape, progress=progress)


# ---- launch --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunResult:
    """How a launched run ended. ``summary`` is everything ``wan-diloco launch --json`` writes; the fields
    are its most used entries. ``learners``: each learner's final report (id -> its ``final`` event in
    metrics.jsonl: steps, tokens, final_eval_loss, bytes_sent, digests, ...), for learners that sent one."""

    exit_code: int  # 0: a success; 1: failed or short of its budget; 130: stopped (resume with launch --resume)
    error: str | None  # why it is not a success (also why it stopped)
    run_dir: Path | None  # metrics.jsonl, config.toml, the processes' logs, loss.png
    params_path: Path | None  # the final global parameters (load_params reads them)
    initial_eval_loss: float | None
    final_eval_loss: float | None  # mean over the learners that finished
    learners: Mapping[int, dict] = dataclasses.field(repr=False)
    summary: Mapping[str, Any] = dataclasses.field(repr=False)

    @property
    def ok(self) -> bool:
        """The run reached its step budget with every final fragment equal to the syncer's."""
        return self.exit_code == 0


def launch(spec: RunSpec | str | Path | Mapping[str, Any], run_dir: str | Path | None = None,
           watch: Callable[[launch_lib.RunState], None] | None = None, emulate: bool = False) -> RunResult:
    """A whole run on this machine (``wan-diloco launch``): a syncer and ``run.learners`` learners, each in its
    own process, until the run ends; returns how it ended. ``run_dir``: where its files go (default
    ``run.run_dir/<time>``); ``watch(state)`` sees every update (``runtime.launch.RunState``: each process's
    latest state); ``emulate``: each process in its region's network namespace of an emulated WAN (root).
    Call it from the main thread: Ctrl-C stops the run after a last snapshot (exit code 130)."""
    spec = as_spec(spec)
    seen: list[launch_lib.RunState] = []

    def on_update(state: launch_lib.RunState) -> None:
        if not seen:
            seen.append(state)  # one object, updated in place
        if watch is not None:
            watch(state)

    code, summary = launch_lib.launch(spec, dumps(spec), None if run_dir is None else str(run_dir),
                                      watch=on_update, emulate=emulate)
    # The summary's means count a learner that never started or finished as nothing: no loss, not 0.
    finals = launch_lib.trained_finals(seen[0]) if seen else {}
    started = launch_lib.first_starts(seen[0]) if seen else {}
    ended = "budget_steps" in summary  # a run that got as far as its figures (not a start-up failure)
    return RunResult(
        exit_code=code, error=summary.get("error") or summary.get("stopped"),
        run_dir=Path(summary["run_dir"]) if summary.get("run_dir") else None,
        params_path=Path(summary["params_path"]) if summary.get("params_path") else None,
        initial_eval_loss=summary["initial_eval_loss"] if ended and started else None,
        final_eval_loss=summary["final_eval_loss"] if ended and finals else None,
        learners={m: dict(f) for m, f in sorted(finals.items())}, summary=summary)


# ---- plan ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PlanResult:
    """What ``wan-diloco plan`` computes: ``plan`` (H, P, τ, bits, grace cap, fragment order and the predicted
    compute utilization, CU: the share of time the learners compute rather than wait on their links),
    ``spec`` (the input with those settings applied: what ``launch --plan`` runs) and the inputs."""

    plan: Plan
    spec: RunSpec
    facts: ModelFacts  # parameter count, layers, the configured fragmenter's fragment sizes
    link_source: Mapping[str, str]  # region -> "config" or "measured"
    step_time_from: str  # "given", or how it was measured here
    notes: tuple[str, ...]  # about the links (a measured link that was ignored, and why)
    syncer_shards_needed: int  # at shard_merge_gb_s per shard
    shard_warning: str | None  # set when the run has fewer syncer.shards than it needs
    measured: str | None  # the metrics.jsonl whose links replaced the config's
    max_tau: int
    shard_merge_gb_s: float = DEFAULT_SHARD_MERGE_GB_S  # one shard: plan.shard_merge_gb_s, else measured, else default
    shard_merge_from: str = "plan.shard_merge_gb_s"  # which of those (``planning.shards.shard_merge_rate``)

    @property
    def reached(self) -> bool:
        """The predicted CU reaches the target."""
        return self.plan.reached

    def to_dict(self, config: str = "(a RunSpec)") -> dict[str, Any]:
        """JSON-ready: what ``wan-diloco plan --json`` writes; ``config`` names where the spec came from."""
        spec, plan = self.spec, self.plan
        return {**plan.to_dict(), "syncer_shards_needed": self.syncer_shards_needed,
                "syncer_shards": spec.syncer.shards, "shard_warning": self.shard_warning, "inputs": {
                    "config": config, "preset": spec.preset, "fragmenter": spec.run.fragmenter,
                    "fragment_params_configured": list(self.facts.fragment_params or ()),
                    "step_time_s": plan.step_time_s, "step_time_from": self.step_time_from,
                    "link_source": dict(self.link_source), "measured": self.measured, "target_cu": plan.target_cu,
                    "margin": plan.margin, "max_tau": self.max_tau, "shard_merge_gb_s": self.shard_merge_gb_s,
                    "shard_merge_from": self.shard_merge_from,
                    "notes": list(self.notes)}}


def plan(spec: RunSpec | str | Path | Mapping[str, Any], step_time_s: float | None = None,
         measured: str | Path | None = None, target_cu: float | None = None, margin: float | None = None,
         max_tau: int | None = None, say: Callable[[str], None] | None = None) -> PlanResult:
    """H, P, τ, bits, grace cap and fragment order for ``spec`` from its links (``wan-diloco plan``).

    ``step_time_s``: seconds per learner step, else timed here (a few steps of the model; ``say`` hears that
    it is). ``measured``: a run's metrics.jsonl whose latest link measurements replace ``[regions]``'s.
    ``None`` arguments take the spec's ``[plan]`` values. Nothing is trained and no corpus is read."""
    spec = as_spec(spec)
    target_cu = spec.plan.target_cu if target_cu is None else target_cu
    margin = spec.plan.margin if margin is None else margin
    max_tau = spec.plan.max_tau if max_tau is None else max_tau
    require(step_time_s is None or (math.isfinite(step_time_s) and step_time_s > 0), "step_time",
            f"must be > 0, got {step_time_s}")
    require(bool(spec.regions.remote), "regions",
            f"every region is the syncer's ({spec.regions.syncer_region}): no WAN link to plan for")
    measured = None if measured is None else Path(measured)
    links, source, notes = links_of(spec, measured)
    facts = model_facts(spec)
    if step_time_s is not None:
        step_s, step_from = step_time_s, "given"
    else:
        if say is not None:
            say(f"timing {TIMED_STEPS} steps of the model here (batch {spec.run.batch_size}) ...")
        step_s, step_from = measure_step_time(spec), f"measured here: one learner alone, {TIMED_STEPS} steps"
    result = plan_run(facts, links, step_s, learners_per_region(spec), target_cu=target_cu, margin=margin,
                      max_tau=max_tau, grace_safety=spec.syncer.grace_safety)
    rate, rate_from = shard_merge_rate(spec.plan.shard_merge_gb_s, spec.run.learners)
    return PlanResult(
        plan=result, spec=apply_plan(spec, result), facts=facts, link_source=source, step_time_from=step_from,
        notes=tuple(notes), measured=None if measured is None else str(measured), max_tau=max_tau,
        shard_merge_gb_s=rate, shard_merge_from=rate_from,
        syncer_shards_needed=shards_needed(facts.params, spec.run.learners, result.sync_every,
                                           result.step_time_s, rate),
        shard_warning=shard_warning(facts.params, spec.run.learners, result.sync_every, result.step_time_s, rate,
                                    spec.syncer.shards, rate_from))


def apply_plan(spec: RunSpec, plan: Plan) -> RunSpec:
    """``spec`` with the plan's H, P, τ, fragment order (``learner.fragment_order``; left empty when it
    is index order, the default), bits and grace cap."""
    order = [] if plan.fragment_order == tuple(range(plan.fragments)) else list(plan.fragment_order)
    return spec.with_changes(learner={"sync_every": plan.sync_every, "num_fragments": plan.fragments,
                                      "tau": plan.tau, "fragment_order": order},
                             codec={"bits": plan.bits}, syncer={"max_grace_s": round(plan.max_grace_s, 6)})


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
    """How many learners each region holds (regions without learners left out)."""
    counts = collections.Counter(spec.region(m) for m in range(spec.run.learners))
    return {r: counts[r] for r in spec.regions.names if counts[r]}
