"""When the run had each fault behind it (``recovered_s``), and the checks of the faults that must do more
than recover (``FAULT_CHECKS``: disk_full, restart_syncer_fresh); ``report.analyze`` puts both in the report."""
from __future__ import annotations

from wan_diloco.runtime.chaos.record import RunRecord
from wan_diloco.runtime.chaos.schedule import learner_index


def _is_learner(source: str) -> bool:
    return learner_index(source) is not None


def _versions(e: dict | None) -> int:
    return sum(e.get("versions") or []) if e else 0


def recovered_s(record: RunRecord, fault: dict) -> float | None:
    """Seconds from a fault until the run had it behind it (see ``analyze``); None if never."""
    if fault.get("skipped"):
        return None
    t, kind, target = fault["fired_t"], fault["kind"], fault["target"]
    if kind == "kill_learner":
        back = record.first(lambda e: e["source"] == target and e.get("event") == "step" and e["t"] > t
                      and e.get("pid") != fault.get("pid"))
    elif kind == "stop_learner":
        cont = fault.get("undone_t") or t
        back = record.first(lambda e: e["source"] == target and e.get("event") == "step" and e["t"] > cont)
    elif kind == "kill_syncer":
        back = _syncer_back(record, fault)
    elif kind == "restart_syncer_fresh":
        back = _syncer_back(record, fault) if fresh_restart_check(record, fault)["ok"] else None
    elif kind == "disk_full":
        back = _written_again(record, fault)
    else:
        back = _link_back(record, fault)
    return round(back["t"] - t, 3) if back else None


def _syncer_back(record: RunRecord, fault: dict) -> dict | None:
    """The first merge of a syncer started after the kill (its versions above the resumed snapshot's)."""
    listening = record.first(lambda e: e["source"] == "syncer" and e.get("event") == "listening"
                       and e["t"] > fault["fired_t"] and e.get("pid") != fault.get("pid"))
    if listening is None:
        return None
    base = sum((listening.get("resumed") or {}).get("versions") or [0])
    return record.first(lambda e: e.get("pid") == listening["pid"] and e["t"] >= listening["t"] and (
        (e.get("event") == "progress" and _versions(e) > base) or e.get("event") == "final"))


def _space_back_t(record: RunRecord, fault: dict) -> float:
    return fault.get("undone_t") or record.t_end


def _written_again(record: RunRecord, fault: dict) -> dict | None:
    """disk_full: the first complete snapshot after space returned, else a final event of the syncer that
    wrote the final parameters after it (a run that ended before the next snapshot)."""
    back_t = _space_back_t(record, fault)
    return record.first(lambda e: e["source"] == "syncer" and e["t"] > back_t and (
        e.get("event") == "snapshot" or (e.get("event") == "final" and _params_written(e))))


def _params_written(final: dict) -> bool:
    return bool(final.get("params_path")) and final.get("params_error") is None


# Seconds after the space returned that a write failure still counts for the window: a write that began
# (and found the disk full) just before is reported just after.
WINDOW_SLACK_S = 1.0


def disk_full_check(record: RunRecord, fault: dict) -> dict:
    """What a disk_full window did: the syncer's failed writes seen in it (``warning`` events carrying
    ``storage``), whether its storage status (``progress`` events carry /status["storage"]) was not ok
    meanwhile and ok again after (seconds after the space returned), when a snapshot completed after it,
    and whether the run's final parameters were written (the last syncer final event). ``ok``: all of it."""
    t, back_t = fault["fired_t"], _space_back_t(record, fault)
    syncer = record.events_of("syncer")
    failures = [e for e in syncer if e.get("event") == "warning" and "storage" in e
                and t <= e["t"] <= back_t + WINDOW_SLACK_S]
    storage = [(e["t"], (e.get("storage") or {}).get("ok")) for e in syncer if e.get("event") == "progress"
               and isinstance(e.get("storage"), dict)]
    not_ok = any(ok is False for ts, ok in storage if t <= ts <= back_t + WINDOW_SLACK_S)
    ok_again = next((ts for ts, ok in storage if ts > back_t and ok is True), None)
    snap = next((e for e in syncer if e.get("event") == "snapshot" and e["t"] > back_t), None)
    finals = [e for e in syncer if e.get("event") == "final"]
    written = bool(finals) and _params_written(finals[-1])
    after = lambda x: None if x is None else round(x - back_t, 3)  # noqa: E731
    return {"write_failures": len(failures), "storage_not_ok_seen": not_ok,
            "storage_ok_again_s": after(ok_again), "snapshot_after_s": after(snap["t"] if snap else None),
            "final_params_written": written,
            "ok": bool(failures) and not_ok and ok_again is not None and snap is not None and written}


def fresh_restart_check(record: RunRecord, fault: dict) -> dict:
    """What a restart_syncer_fresh did: the start without --resume (its exit code and line, as the driver
    saw them: refused is exit code 2 with ``refusing to start``), and the epoch of the syncer killed and of
    the one the --resume start brought up (its ``listening``), which must be one more. ``ok``: both."""
    refusal = fault.get("refusal") or {}
    code, line = refusal.get("exit_code"), refusal.get("line") or ""
    refused = code == 2 and "refusing to start" in line
    before = record.first(lambda e: e.get("pid") == fault.get("pid") and e.get("event") == "listening")
    after = record.first(lambda e: e["source"] == "syncer" and e.get("event") == "listening"
                         and e["t"] > fault["fired_t"] and e.get("pid") not in (fault.get("pid"), refusal.get("pid")))
    epoch_before = before.get("epoch") if before else None
    epoch_after = after.get("epoch") if after else None
    resumed = bool(after and after.get("resumed")) and epoch_before is not None and epoch_after == epoch_before + 1
    return {"refused": refused, "refusal_exit_code": code, "refusal_line": line or None,
            "epoch_before": epoch_before, "epoch_after": epoch_after,
            "resumed_snapshot": ((after or {}).get("resumed") or {}).get("snapshot"),
            "resumed_at_next_epoch": resumed, "ok": refused and resumed}


FAULT_CHECKS = {"disk_full": disk_full_check, "restart_syncer_fresh": fresh_restart_check}


def _link_back(record: RunRecord, fault: dict) -> dict | None:
    """cut_link: the last of the affected learners (those in the cut region; every learner when none is,
    as for the syncer's region) to receive a newer version after the link was restored."""
    t, restored = fault["fired_t"], fault.get("undone_t") or fault["fired_t"]
    regions = {e["source"]: e.get("region") for e in record.events_of(kind="start") if _is_learner(e["source"])}
    region = regions.get(fault["target"], fault["target"])  # learner-N: its region
    names = sorted(n for n, r in regions.items() if r == region) or sorted(regions)
    backs = []
    for name in names:
        before = [e for e in record.events_of(name, "step") if e["t"] <= t]
        seen = _versions(before[-1]) if before else 0
        back = record.first(lambda e: e["source"] == name and e.get("event") == "step" and e["t"] > restored
                      and _versions(e) > seen)
        if back is None:
            return None
        backs.append(back)
    return max(backs, key=lambda e: e["t"]) if backs else None


def fault_checks(record: RunRecord, fault: dict) -> dict:
    """A fault kind's own checks (``FAULT_CHECKS``) as ``check``; nothing for the other kinds or a skipped one."""
    check = FAULT_CHECKS.get(fault["kind"])
    return {"check": check(record, fault)} if check is not None and not fault.get("skipped") else {}
