"""The chaos report: uptime, goodput, recovery times and costs, from a ``RunRecord``."""
from __future__ import annotations

import math
import statistics

from wan_diloco.runtime.chaos.record import RunRecord
from wan_diloco.runtime.chaos.recovery import (  # noqa: F401  (re-exported: the report's names stay importable here)
    FAULT_CHECKS, WINDOW_SLACK_S, disk_full_check, fault_checks, fresh_restart_check, recovered_s,
)
from wan_diloco.runtime.chaos.schedule import learner_index, learner_name


def merge_times(record: RunRecord) -> list[float]:
    """When the syncer was seen merging: progress events whose versions grew since the previous one of the
    same syncer process (the first of a resumed syncer is compared with the snapshot it resumed)."""
    times, last = [], {}
    for e in record.events_of("syncer"):
        kind, pid = e.get("event"), e.get("pid")
        if kind == "listening":
            last[pid] = sum((e.get("resumed") or {}).get("versions") or [0])
        elif kind == "progress" and "versions" in e:
            total = sum(e["versions"])
            if total > last.get(pid, 0):
                times.append(e["t"])
            last[pid] = total
    return sorted(times)


def training_end(record: RunRecord) -> float:
    """When training was over: the first learner's ``finishing`` (the final sync is not training), else the
    syncer's final event, else the end of the record."""
    for kind, source in (("finishing", None), ("final", "syncer")):
        times = [e["t"] for e in record.events_of(source, kind)]
        if times:
            return min(times)
    return record.t_end


def merge_uptime(times: list[float], end: float, min_window_s: float = 3.0) -> tuple[float, float]:
    """(uptime, window) over [first merge, ``end``]: the share of it not inside a gap between merges (or
    from the last merge to ``end``) longer than the window, max(``min_window_s``, 3 x the median gap);
    0 with fewer than two merges."""
    times = [t for t in times if t <= end]
    if len(times) < 2 or end <= times[0]:
        return 0.0, min_window_s
    gaps = [b - a for a, b in zip(times, times[1:])]
    window = max(min_window_s, 3 * statistics.median(gaps))
    down = sum(g for g in gaps + [end - times[-1]] if g > window)
    return 1.0 - down / (end - times[0]), window


def _union_s(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``spans`` clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def alive_uptime(record: RunRecord) -> float:
    """1 - (time the syncer was down or no learner was training) / wall time from t0 to ``training_end``.
    A learner trains from its ``start`` event until it exits; the syncer is up from ``listening`` until
    it exits."""
    end = training_end(record)
    up: dict[str, list] = {"syncer": [], "learners": []}
    for p in record.procs:
        ready = next((e["t"] for e in record.events if e.get("pid") == p["pid"]
                      and e.get("event") in ("listening", "start")), None)
        if ready is not None:
            up["syncer" if p["name"] == "syncer" else "learners"].append((ready, p["exit_t"] or record.t_end))
    wall = max(1e-9, end - record.t0)
    syncer_up = _union_s(up["syncer"], record.t0, end)
    # Up = syncer up and some learner training: |S ∩ L| = |S| + |L| - |S ∪ L|.
    learners_up = _union_s(up["learners"], record.t0, end)
    both = syncer_up + learners_up - _union_s(up["syncer"] + up["learners"], record.t0, end)
    return both / wall


def step_time_s(record: RunRecord) -> float | None:
    """Median seconds per step between consecutive step events of one learner process."""
    rates, last = [], {}
    for e in record.events:
        if e.get("event") != "step" or learner_index(e["source"]) is None:
            continue
        prev = last.get(e["pid"])
        if prev is not None and e["step"] > prev["step"] and e["t"] > prev["t"]:
            rates.append((e["t"] - prev["t"]) / (e["step"] - prev["step"]))
        last[e["pid"]] = e
    return statistics.median(rates) if rates else None


def goodput(record: RunRecord) -> float:
    """Σ compute seconds of every learner process / Σ over learner slots of the wall time it was supposed
    to train (its first process's ``start`` to its last process's ``finishing``, or the end)."""
    compute, supposed = 0.0, 0.0
    for m in range(record.learners):
        gens, first_start, end = record.generations(learner_name(m)), None, None
        for p in gens:
            mine = [e for e in record.events if e.get("pid") == p["pid"]]
            start = next((e["t"] for e in mine if e.get("event") == "start"), None)
            final = next((e for e in mine if e.get("event") == "final"), None)
            steps = [e["t"] for e in mine if e.get("event") == "step"]
            if start is not None and first_start is None:
                first_start = start
            if final is not None:
                compute += final["compute_s"]
            elif start is not None and steps:
                compute += steps[-1] - start  # a killed process: trained from its start to its last report
            finishing = next((e["t"] for e in mine if e.get("event") == "finishing"), None)
            end = finishing or p["exit_t"] or end
        if first_start is not None:
            supposed += max(0.0, (end or record.t_end) - first_start)
    return compute / supposed if supposed else 0.0


def recovery_bytes(record: RunRecord) -> int:
    """Bytes received for recovery: a restarted learner's ``bytes_received`` at its ``start`` event (the
    bulk fetch of every fragment at its join, plus its first link probe), and for a learner rejoining a
    resumed syncer, its ``bytes_received`` growth from the last step event before its ``rejoin`` to the
    first after it (the bulk fetch, plus the updates of that interval: an upper bound)."""
    total = 0
    for m in range(record.learners):
        for p in record.generations(learner_name(m))[1:]:
            start = record.first(lambda e: e.get("pid") == p["pid"] and e.get("event") == "start")
            total += int(start.get("bytes_received", 0)) if start else 0
    for rj in record.events_of(kind="rejoin"):
        mine = [e for e in record.events if e.get("pid") == rj["pid"] and e.get("event") in ("step", "start")]
        before = [e for e in mine if e["t"] <= rj["t"] and "bytes_received" in e]
        after = next((e for e in mine if e["t"] > rj["t"] and "bytes_received" in e), None)
        if after is not None:
            total += int(after["bytes_received"]) - (int(before[-1]["bytes_received"]) if before else 0)
    return total


def rolled_back_steps(record: RunRecord) -> int:
    """Σ over syncer resumes and the learner processes training then: the learner's step when it took up the
    snapshot (its ``rejoin``; or its last step report, if it was killed before it rejoined) minus the
    snapshot's global step. What it trained since the snapshot (merged or not) is replaced by the snapshot.
    A learner that joined the resumed syncer directly (restarted during the outage) lost nothing there."""
    resumes = [e for e in record.events_of("syncer", "listening") if e.get("resumed")]
    starts = sorted(e["t"] for e in record.events_of("syncer", "listening"))
    lost = 0
    for res in resumes:
        t, snap_step = res["t"], int(res["resumed"].get("global_step", 0))
        until = next((x for x in starts if x > t), math.inf)  # the next syncer process, if any
        for p in record.procs:
            if p["name"] == "syncer" or p["spawn_t"] > t or (p["exit_t"] or math.inf) <= t:
                continue
            step = _step_at_resume(record, p, t, until)
            lost += max(0, step - snap_step) if step is not None else 0
    return lost


def _step_at_resume(record: RunRecord, proc: dict, t: float, until: float) -> int | None:
    mine = [e for e in record.events if e.get("pid") == proc["pid"]]
    rejoin = next((e for e in mine if e.get("event") == "rejoin" and t <= e["t"] < until), None)
    if rejoin is not None:
        return int(rejoin.get("step", 0))
    trained_before = any(e.get("event") == "step" and e["t"] <= t for e in mine)
    if trained_before and (proc["exit_t"] or math.inf) < until:  # killed before it rejoined
        steps = [e["step"] for e in mine if e.get("event") == "step" and e["t"] <= proc["exit_t"]]
        return int(steps[-1])
    return None  # joined the resumed syncer directly (or never trained): nothing of it was rolled back


def tokens_trained(record: RunRecord, until_t: float = math.inf) -> int:
    """Tokens every learner process trained on (by wall time ``until_t``): its last report (step or
    final) minus its first step report, plus that first step (``tokens_per_step``). A learner's own
    counter restarts with each process, or at a snapshot's count, so the final events alone undercount
    a run with restarts."""
    total = 0
    for p in record.procs:
        reports = [e for e in record.events if e.get("pid") == p["pid"] and e.get("event") in ("step", "final")
                   and "tokens" in e and e["t"] <= until_t]
        if reports and reports[0]["event"] == "step":
            total += int(reports[-1]["tokens"]) - int(reports[0]["tokens"]) + record.tokens_per_step
    return total


def eval_curve(record: RunRecord) -> list[tuple[int, float]]:
    """(tokens the run had trained, eval loss of the global model) at each ``eval`` event (``run.eval_every_steps``),
    and at the end; empty without eval events."""
    evals = record.events_of(kind="eval")
    if not evals:
        return []
    points = [(tokens_trained(record, e["t"]), float(e["eval_loss"])) for e in evals]
    final = final_eval_loss(record)
    if final is not None:
        points.append((tokens_trained(record), final))
    return sorted(points)


def loss_at_tokens(curve: list[tuple[int, float]], tokens: int) -> float | None:
    """The eval loss a run had when it had trained ``tokens`` (linear between the two points around it;
    past the last point, the last one's)."""
    if not curve:
        return None
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= tokens <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return curve[-1][1] if tokens > curve[-1][0] else curve[0][1]


def learner_down_s(record: RunRecord, faults: list[dict]) -> float:
    """Σ per learner of the union of [fault, recovery] of its kills and stops (never recovered: to the end)."""
    spans: dict[str, list] = {}
    for f in faults:
        if f.get("skipped") or f["kind"] not in ("kill_learner", "stop_learner"):
            continue
        r = f.get("recovered_s")
        spans.setdefault(f["target"], []).append((f["fired_t"], f["fired_t"] + r if r is not None else record.t_end))
    return sum(_union_s(s, record.t0, record.t_end) for s in spans.values())


def _learner_finals(record: RunRecord) -> list[dict]:
    """The final event of each learner slot's last process (the one that finished the run)."""
    out = []
    for m in range(record.learners):
        gens = record.generations(learner_name(m))
        final = record.first(lambda e: gens and e.get("pid") == gens[-1]["pid"] and e.get("event") == "final")
        if final is not None:
            out.append(final)
    return out


def final_eval_loss(record: RunRecord) -> float | None:
    finals = _learner_finals(record)
    return sum(f["final_eval_loss"] for f in finals) / len(finals) if finals else None


def finished(record: RunRecord) -> bool:
    """The run ended as a run should: no error, the syncer's final sync done, every learner slot final."""
    return (record.error is None and bool(record.events_of("syncer", "final"))
            and len(_learner_finals(record)) == record.learners)


def snapshot_interval_s(record: RunRecord) -> float | None:
    times = sorted(e["t"] for e in record.events_of("syncer", "snapshot"))
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)


def analyze(record: RunRecord, baseline: RunRecord | None = None, min_window_s: float = 3.0) -> dict:
    """The chaos report of a run (and its fault-free twin, if run). Definitions:

    - ``faults[].recovered_s``: seconds from the fault until the run has it behind it, None if never:
      a killed learner: until a restarted process of it logs a ``step``; a stopped learner: until it
      logs a ``step`` after SIGCONT; the syncer: until a syncer started after the kill has resumed
      and merged (a ``progress`` event with versions above its snapshot's, or its final event);
      a cut link: until every learner behind it received a newer version after the link came back.
    - ``uptime``: share of the training span (first merge to the first learner's ``finishing``,
      ``training_end``) during which the syncer was merging: time not inside a gap between merges
      (``merge_times``: progress events whose versions grew) longer than max(3 s, 3 x the median gap)
      (``merge_uptime``). ``notes.uptime_alive`` is the other definition: 1 - (syncer down or no
      learner training) / wall from t0 to the end of training (``alive_uptime``).
    - ``goodput``: Σ learner compute seconds / Σ wall seconds the learner slots were supposed to train,
      as in ``launch.summarize``; a killed process counts its start-to-last-step time as compute, the
      time until its restart is stepping again is lost. Rolled-back work is not subtracted (see lost_s).
    - ``recovery_bytes``: ``recovery_bytes`` (restart joins + rejoins after a syncer resume).
    - ``final_eval_loss``: mean final eval loss of the learners' last processes; ``fault_free_eval_loss``
      the fault-free run's (same config and step budget) eval loss at the tokens the faulty run trained
      (it trains fewer, ``notes.tokens``, ``tokens_trained``), read off its eval curve (``eval_curve``,
      ``loss_at_tokens``: needs ``run.eval_every_steps``; without one, its final loss at equal steps,
      ``notes.compared_at``); ``loss_ratio`` the first over the second.
    - ``syncer_resumes``: syncer processes started with a resumed snapshot.
    - ``snapshot_interval_s``: mean time between the syncer's complete-snapshot events.
    - ``lost_s``: learner-seconds of training lost: each learner's time from a kill or stop until it
      stepped again, plus rolled-back steps (``rolled_back_steps``) x the median step time.
    """
    faults = [{**f, "recovered_s": recovered_s(record, f)} for f in record.faults]
    up, window = merge_uptime(merge_times(record), training_end(record), min_window_s)
    step_s = step_time_s(record)
    rolled = rolled_back_steps(record)
    lost = learner_down_s(record, faults) + rolled * (step_s or 0.0)
    loss = final_eval_loss(record)
    tokens = lambda r: tokens_trained(r) if r is not None else None  # noqa: E731
    base_steps = final_eval_loss(baseline) if baseline is not None else None
    # At equal tokens (the faulty run trained fewer), read off the fault-free run's eval curve when it has one.
    base_tokens = loss_at_tokens(eval_curve(baseline), tokens_trained(record)) if baseline is not None else None
    base = base_tokens if base_tokens is not None else base_steps
    report = {
        "faults": [{"t_s": round(f["t_s"], 3), "kind": f["kind"], "target": f["target"],
                    "recovered_s": f["recovered_s"], **fault_checks(record, f)} for f in faults],
        "uptime": _round(up), "goodput": _round(goodput(record)), "recovery_bytes": recovery_bytes(record),
        "final_eval_loss": _round(loss, 5), "fault_free_eval_loss": _round(base, 5),
        "loss_ratio": _round(loss / base, 5) if loss is not None and base else None,
        "syncer_resumes": sum(1 for e in record.events_of("syncer", "listening") if e.get("resumed")),
        "snapshot_interval_s": _round(snapshot_interval_s(record), 3), "lost_s": _round(lost, 3),
        "notes": {
            "finished": finished(record), "error": record.error,
            "baseline_finished": finished(baseline) if baseline is not None else None,
            "wall_s": round(record.t_end - record.t0, 3),
            "baseline_wall_s": round(baseline.t_end - baseline.t0, 3) if baseline is not None else None,
            "uptime_alive": _round(alive_uptime(record)), "uptime_window_s": round(window, 3),
            "step_s": _round(step_s), "rolled_back_steps": rolled,
            "tokens": tokens(record), "baseline_tokens": tokens(baseline),
            "compared_at": "equal tokens" if base_tokens is not None else "equal steps (no eval curve)",
            "fault_free_eval_loss_equal_steps": _round(base_steps, 5),
            "loss_ratio_equal_steps": _round(loss / base_steps, 5) if loss is not None and base_steps else None,
            "skipped": [f"{f['kind']} {f['target']} at {f['t_s']} s: {f['skipped']}" for f in faults if f["skipped"]],
            "actual_fault_t_s": [round(f["fired_t"] - record.t0, 3) for f in faults],
            "run_dir": record.run_dir,
        },
    }
    report["notes"]["targets"] = targets(report, faults)
    return report



def targets(report: dict, faults: list[dict], min_uptime: float = 0.9, max_loss_gap: float = 0.02) -> dict:
    """The issue's targets, measured: the run finished, every applied fault recovered (for disk_full and
    restart_syncer_fresh: its ``check`` passed too), uptime, loss gap."""
    ratio = report.get("loss_ratio")
    checked = [f for f in report["faults"] if "check" in f]
    return {
        "finished": bool(report["notes"]["finished"]),
        "every_fault_recovered": all(f["recovered_s"] is not None for f in faults if not f.get("skipped"))
        and all(f["check"]["ok"] for f in checked),
        f"uptime>={min_uptime}": report["uptime"] is not None and report["uptime"] >= min_uptime,
        f"loss_within_{max_loss_gap:.0%}": ratio is not None and abs(ratio - 1.0) <= max_loss_gap,
    }

