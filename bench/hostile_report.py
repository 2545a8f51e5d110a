"""The hostile-peer benchmark's verdict (#23): what /metrics and /status say, and the checks of
``bench.hostile``'s two runs against the attacker's rows (see that module for what each check means)."""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path

HONEST = (0, 1)
LOSS_TOLERANCE = 0.02


# ---- reading the syncer ---------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text -> {sample name: [(labels, value)]}."""
    out: dict[str, list] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.setdefault(m.group(1), []).append((dict(_LABEL.findall(m.group(2) or "")), value))
    return out


def refusals(text: str) -> dict:
    """What /metrics counts as refused: ``refused_total`` by field when the syncer has it, the
    transport's errors by (rpc, code) always, and identity refusals where counted."""
    samples = parse_metrics(text)
    by_field = None
    for name in ("wan_diloco_refused_total", "refused_total"):
        if name in samples:
            by_field = {labels.get("field", ""): int(v) for labels, v in samples[name]}
            break
    errors = {f"{lab.get('rpc')}/{lab.get('code')}": int(v)
              for lab, v in samples.get("wan_diloco_transport_errors_total", [])}
    identity = next((int(sum(v for _, v in samples[n])) for n in
                     ("wan_diloco_identity_refused_total", "identity_refused_total") if n in samples), None)
    return {"refused_total": by_field, "transport_errors": errors, "identity_refused_total": identity}


_QUARANTINED = re.compile(r"learner (\d+) (?:is )?quarantined")


def quarantined_of(status: dict) -> set[int]:
    """Learners /status shows quarantined: their state, or an event saying so."""
    out = {int(m) for m, info in (status.get("learners") or {}).items()
           if isinstance(info, dict) and info.get("state") == "quarantined"}
    for e in status.get("events") or []:
        for m in _QUARANTINED.findall(str(e.get("what", ""))):
            out.add(int(m))
    return out


# ---- the report -----------------------------------------------------------------------------------

def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill
    return rows


def run_right(run: dict, tokens_per_step: int, sync_every: int = 8) -> tuple[bool, bool, dict]:
    """(finished, digests equal, {honest learner: how its state was touched}) of one run: the syncer's
    final sync happened and every honest process exited 0; each honest learner's final digests are the
    syncer's; neither ends at, nor was seen by the syncer at, a step beyond what the honest learners
    trained (tokens / tokens per step) plus one sync period ``sync_every``."""
    finals, syncer = run["finals"], run["syncer_final"] or {}
    exits = run["exit_codes"]
    finished = bool(run["syncer_final"]) and all(exits.get(f"learner-{m}") == 0 for m in HONEST) and not run["errors"]
    digests_equal = bool(syncer.get("digests")) and len(finals) == len(HONEST) and all(
        f.get("digests") == syncer["digests"] and not f.get("digest_mismatch") for f in finals.values())
    touched = {}
    trained = {m: finals[f"learner-{m}"].get("tokens", 0) // tokens_per_step for m in HONEST
               if f"learner-{m}" in finals}
    # A learner's step may jump to the global step (a faster peer's), never past what some honest learner
    # trained plus one sync period: beyond that, a step nobody trained moved it (issue case 1).
    bound = max(trained.values(), default=0) + sync_every
    for m in HONEST:
        f = finals.get(f"learner-{m}")
        view = run["max_view_step"].get(str(m), 0)
        if f is None:
            touched[m] = "no final event"
        elif f.get("steps", 0) > bound:
            touched[m] = (f"ended at step {f.get('steps')}, but the honest learners trained at most "
                          f"{bound - sync_every} steps ({f.get('tokens')} tokens here): its step was moved")
        elif view > bound:
            touched[m] = (f"the syncer saw learner {m} at step {view}; the honest learners trained at most "
                          f"{bound - sync_every}: a message in its name that it did not send")
    return finished, digests_equal, touched


def final_eval_loss(run: dict) -> float | None:
    losses = [f["final_eval_loss"] for f in run["finals"].values() if f.get("final_eval_loss") is not None]
    return sum(losses) / len(losses) if losses else None


def analyze(hostile: dict, clean: dict | None, rows: list[dict], tokens_per_step: int,
            requested: int | None = None) -> dict:
    """The report's figures and checks from the two runs and the attacker's rows (``requested``: how many
    it was to send; all of them must have been answered before the syncer's final sync)."""
    refused_rows = [r for r in rows if r["verdict"] == "refused"]
    client_codes = Counter(f"{r['rpc'].replace('SlowUpload', 'Upload')}/{r['code']}" for r in refused_rows
                           if r["code"] not in ("DEADLINE_EXCEEDED", "CANCELLED", "UNAVAILABLE"))
    seen = refusals(hostile["metrics_after_attack"] or hostile["metrics"] or "")
    undercounted = {k: {"attacker_saw": n, "metrics": seen["transport_errors"].get(k, 0)}
                    for k, n in client_codes.items() if seen["transport_errors"].get(k, 0) < n}
    if rows and hostile["metrics_after_attack"] is None:  # the syncer was gone before the attack ended
        undercounted["not_judged"] = "/metrics was not read after the attacker's last answer"
    by_field = seen["refused_total"]
    source = "/metrics refused_total{field}"
    if by_field is None:
        by_field = dict(Counter(r["field"] for r in refused_rows))
        source = "attacker rows (no refused_total on /metrics)"
    if seen["refused_total"] is not None:  # core refusals by field; every refused row is at least one count
        core = sum(seen["refused_total"].values()) + (seen["identity_refused_total"] or 0)
        if core + sum(seen["transport_errors"].values()) < len(refused_rows):
            undercounted["refused_total"] = {"attacker_saw": len(refused_rows), "metrics": core}

    finished, digests_equal, touched = run_right(hostile, tokens_per_step)
    finals = hostile["finals"]
    loss, clean_loss = final_eval_loss(hostile), (final_eval_loss(clean) if clean else None)
    ratio = loss / clean_loss if loss is not None and clean_loss else None
    verdicts = Counter(r["verdict"] for r in rows)
    final_t = (hostile["syncer_final"] or {}).get("t")
    late = [r for r in rows if final_t is not None and r.get("t", 0) > final_t]  # no final sync: ``finished`` says so
    checks = {
        "attack_in_training": (requested is None or len(rows) == requested) and not late,
        "finished": finished,
        "digests_equal": digests_equal,
        "loss_within_2pct": ratio is not None and abs(ratio - 1) <= LOSS_TOLERANCE,
        "refusals_counted": not undercounted,
        "nothing_taken_past_limit": verdicts.get("taken_past_limit", 0) == 0,
        "no_impersonation_taken": verdicts.get("impersonation_taken", 0) == 0,
        "honest_not_quarantined": not set(hostile["quarantined"]) & set(HONEST),
        "honest_state_untouched": not touched,
    }
    if clean is not None:  # the reference itself must be a right run, or the ratio means nothing
        checks["clean_run_right"] = run_right(clean, tokens_per_step) == (True, True, {})
    taken_bad = Counter((r["field"], r["value"], r["verdict"]) for r in rows
                        if r["verdict"] in ("taken_past_limit", "impersonation_taken"))
    return {
        "messages": len(rows), "refused_by_field": dict(sorted(by_field.items())), "refused_by_field_source": source,
        "quarantined": hostile["quarantined"], "final_eval_loss": _round(loss), "clean_eval_loss": _round(clean_loss),
        "loss_ratio": _round(ratio), "digests_equal": digests_equal, "ok": all(checks.values()), "checks": checks,
        "verdicts": dict(verdicts), "by_rpc": dict(Counter(r["rpc"] for r in rows)),
        "by_code": dict(Counter(r["code"] for r in rows)),
        "taken_that_should_be_refused": [{"field": f, "value": v, "verdict": k, "count": n}
                                         for (f, v, k), n in taken_bad.most_common(40)],
        "late_messages": len(late), "undercounted": undercounted,
        "honest_state_touched": {str(k): v for k, v in touched.items()},
        "metrics": refusals(hostile["metrics_after_attack"] or hostile["metrics"] or ""),
        "rejected": (hostile["status"] or {}).get("rejected"),
        "status_refused": (hostile["status"] or {}).get("refused"),  # {field: count}, where the syncer has it
        "learner_states": {m: info.get("state") for m, info in ((hostile["status"] or {}).get("learners") or {}).items()
                           if isinstance(info, dict)},
        # Refusals the syncer charged to each learner, where /status shows them (a per-learner count).
        "refused_by_learner": {m: info.get("refused") for m, info in ((hostile["status"] or {}).get("learners")
                                                                       or {}).items()
                               if isinstance(info, dict) and info.get("refused") is not None},
        "exit_codes": hostile["exit_codes"], "attack_exit": hostile["attack_exit"], "errors": hostile["errors"],
        "learners": {n: {k: f.get(k) for k in ("steps", "tokens", "final_eval_loss", "digest_mismatch")}
                     for n, f in finals.items()},
        "wall_s": {"hostile": hostile["wall_s"], "clean": clean["wall_s"] if clean else None},
    }


def _round(x, digits: int = 5):
    return None if x is None or not math.isfinite(x) else round(float(x), digits)
