"""What a launched run reports: ``RunState`` folds every child's events into the latest state of each
process (the live table reads it); ``summarize`` turns it into the run's figures once it is over, and
``verdict`` says what makes a run that ended not a success."""
from __future__ import annotations

from wan_diloco.runtime.launch_names import is_syncer, learner_process, shard_of
from wan_diloco.spec import RunSpec


class RunState:
    """Latest state of every process of a run, folded from their events."""

    def __init__(self, cfg: RunSpec):
        self.cfg = cfg
        self.learners: dict[int, dict] = {m: {"region": cfg.region(m), "status": "starting", "tau": cfg.learner.tau}
                                          for m in range(cfg.run.learners)}
        self.syncer: dict = {}
        self.syncer_final: dict | None = None
        self.shard_finals: dict[int, dict] = {}  # syncer shards 1..: their final reports
        self.shards: dict[int, dict] = {}  # syncer shards 1..: what they last reported (as ``syncer`` for shard 0)
        self.finals: dict[int, dict] = {}
        self.starts: dict[int, dict] = {}
        self.evals: list[dict] = []  # the global model's eval points (run.eval_every_steps), in step order
        self.losses: dict[int, list[tuple[int, float]]] = {m: [] for m in range(cfg.run.learners)}
        self.tokens: dict[int, list[tuple[float, int]]] = {m: [] for m in range(cfg.run.learners)}  # (t, tokens)
        self.barrier: dict = {}  # the start barrier as last heard: need, joined, waiting_for, started

    def fold(self, name: str, e: dict) -> None:
        kind = e.get("event")
        if is_syncer(name):
            if name != "syncer":
                if kind == "final":
                    self.shard_finals[shard_of(name)] = e
                if kind in ("progress", "final", "listening"):
                    self.shards.setdefault(shard_of(name), {}).update(e)
                return
            if kind == "final":
                self.syncer_final = e
            if kind in ("progress", "final", "listening"):
                self.syncer.update(e)
            if kind == "barrier":
                self.barrier = {k: e.get(k) for k in ("need", "joined", "waiting_for", "started")}
            return
        m, process = learner_process(name)
        if process:  # a follower of a learner of several processes: the leader speaks for the learner
            return
        row = self.learners[m]
        if kind == "barrier":
            if not self.barrier.get("started"):
                self.barrier = {k: e.get(k) for k in ("need", "joined", "waiting_for", "started")}
            row["status"] = "starting" if e.get("started") else (
                "waiting for " + ", ".join(f"learner-{w}" for w in e.get("waiting_for") or ()) or "waiting to start")
        elif kind == "start":
            self.starts.setdefault(m, e)
            row["status"] = "training"
        elif kind == "step":
            row.update(e)
            self.losses[m].append((e["step"], e["loss"]))
            if "t" in e:
                self.tokens[m].append((e["t"], e["tokens"]))
        elif kind == "eval":
            self.evals.append({k: e[k] for k in ("step", "eval_loss", "tokens")})
            self.evals.sort(key=lambda x: x["step"])
        elif kind == "finishing":
            row["status"] = "final sync"
        elif kind == "link":
            row["link"] = {k: e[k] for k in ("rtt_ms", "rate_gbit_s")}
        elif kind == "replan":
            row["tau"] = e["tau_new"]
        elif kind == "final":
            self.finals[m] = e
            row.update(status="done", step=e["steps"], loss=e["last_loss"], tokens=e["tokens"],
                       bytes_sent=e["bytes_sent"])
        elif kind == "exit" and row.get("status") != "done":
            row["status"] = "exited"


def trained_finals(mon: RunState) -> dict[int, dict]:
    """The final reports of learners that trained (tokens > 0): one "recovered" at the end with nothing
    trained did not do any of the run's work and is no finished learner."""
    return {m: f for m, f in mon.finals.items() if f.get("tokens", 0) > 0}


def first_starts(mon: RunState) -> dict[int, dict]:
    """The start reports of the run's first start (the lowest step any learner started at): a learner that
    joined later evaluated a model others had trained already, which is no initial loss."""
    if not mon.starts:
        return {}
    first = min(e.get("step", 0) for e in mon.starts.values())
    return {m: e for m, e in mon.starts.items() if e.get("step", 0) == first}


def summarize(mon: RunState, wall_s: float) -> dict:
    """The run's figures once it is over (what `launch` prints and writes as JSON)."""
    cfg, finals = mon.cfg, list(trained_finals(mon).values())
    starts = list(first_starts(mon).values())
    sf = joined_final(mon.syncer_final or {}, mon.shard_finals)
    params = int(mon.syncer.get("params", 0))
    M = cfg.run.learners
    dp_bytes = cfg.run.steps * 2 * (M - 1) / M * params * 4 * M
    sent = int(sf.get("bytes_in", 0)) + int(sf.get("bytes_out", 0))
    raw = sum(f["raw_bytes"] for f in finals)
    payload = sum(f["payload_bytes"] for f in finals)
    digests = sf.get("digests")
    lags = [f["merge_lag_steps"] for f in finals if f.get("merge_lag_steps") is not None]
    return {
        "learners_finished": len(finals), "learners": M,
        # The syncer's view: also learners restarted by hand outside this launcher, whose events it never saw.
        "final_learners": sf.get("final_learners", []),
        "initial_eval_loss": sum(s["eval_loss"] for s in starts) / max(1, len(starts)),
        "final_eval_loss": sum(f["final_eval_loss"] for f in finals) / max(1, len(finals)),
        "tokens": sum(f["tokens"] for f in finals), "global_steps": sf.get("global_step", 0),
        "goodput": sum(f["compute_s"] for f in finals) / max(1e-9, sum(f["train_s"] for f in finals)),
        "fragment_syncs": sf.get("fragment_syncs", []), "mean_quorum": sf.get("mean_quorum", 0.0),
        "late_carried": sf.get("late_carried", 0),
        "bytes_sent": sent, "dp_bytes": dp_bytes, "compression_ratio": raw / payload if payload else 1.0,
        "bit_identical": bool(digests) and all(f["digests"] == digests for f in finals),
        "params": params, "wall_s": wall_s,
        # Steps a learner trained between sending a fragment and merging the answer (mean over learners).
        "merge_lag_steps": sum(lags) / len(lags) if lags else None,
        "run_id": sf.get("run_id"), "params_path": sf.get("params_path"),
        "snapshots": sf.get("snapshots_complete", 0), "syncer_epoch": sf.get("epoch"),
        "eval_curve": mon.evals,
        # Each learner's own work: a learner that trained nothing shows 0 here, whatever its final report says.
        "per_learner": {str(m): {"steps": int(mon.finals.get(m, row).get("steps", row.get("step", 0)) or 0),
                                 "tokens": int(mon.finals.get(m, row).get("tokens", 0) or 0),
                                 "finished": m in trained_finals(mon), "status": row.get("status")}
                        for m, row in mon.learners.items()},
        # How far the run got: the syncer's step, or a learner's that finished its final sync (its last
        # steps reach the syncer only in the final uploads).
        "budget_steps": cfg.run.steps,
        "resumed": mon.syncer.get("resumed"),
        "steps_reached": max([int(sf.get("global_step", 0))] + [int(f["steps"]) for f in finals]),
    }


def verdict(summary: dict) -> list[str]:
    """What makes a run that ended not a success, one line each (empty: it is one): the global step budget not
    reached, no learner that trained, learners whose final fragments differ from the syncer's."""
    problems = []
    budget, reached = summary.get("budget_steps", 0), summary.get("steps_reached", 0)
    if reached < budget:
        problems.append(f"the run stopped at global step {reached} of its {budget}-step budget")
    if not summary.get("learners_finished"):
        problems.append("no learner trained to the end of the run")
    elif not summary.get("bit_identical"):
        problems.append("the learners' final fragments differ from the syncer's (final digests: see the learners' "
                        "final events in metrics.jsonl)")
    return problems


def joined_final(first: dict, others: dict[int, dict]) -> dict:
    """Shard 0's final report with the other shards' fragments and byte counts folded in."""
    if not others or not first:
        return first
    out = dict(first)
    digests, syncs = list(first.get("digests") or []), list(first.get("fragment_syncs") or [])
    for e in others.values():
        for p, d in enumerate(e.get("digests") or []):
            if d is not None and p < len(digests):
                digests[p] = d
        for p, n in enumerate(e.get("fragment_syncs") or []):
            if p < len(syncs):
                syncs[p] += n  # a shard counts only its own fragments' merges
        for key in ("bytes_in", "bytes_out"):
            out[key] = out.get(key, 0) + e.get(key, 0)
    out["digests"], out["fragment_syncs"] = digests, syncs
    return out
