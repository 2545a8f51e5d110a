"""Process entry points of a learner: one process (``run_learner``) or one of a multi-process learner
(``run_multihost``). Exit statuses: ``runtime.exits``."""
from __future__ import annotations

import signal
import sys

from wan_diloco.assemble import Assembly
from wan_diloco.runtime import exits
from wan_diloco.runtime import lockstep as lk
from wan_diloco.runtime import multihost as mh
from wan_diloco.runtime.events import emit
from wan_diloco.runtime.learner import Learner
from wan_diloco.spec import RunSpec

# A multi-process learner's leader tells its followers it lives at least this often while it waits on
# the network (they wait in the next header broadcast; a follower that died is noticed then too).
HEARTBEAT_S = 5.0


def run_learner(cfg: RunSpec, learner: int, target: str, token: str, resume: bool = False,
                parts: Assembly | None = None, lockstep: lk.Lockstep | None = None) -> int:
    """Process entry point; the exit status is one of ``runtime.exits``'s table (0 after a completed final
    sync whose model equals the syncer's).

    With ``lockstep`` this is the leader of a multi-process learner: its followers are told to exit
    with the same status at the end, and a follower that died ends it with
    ``multihost.EXIT_JOB_BROKEN``."""
    lrn = Learner(cfg, learner, target, token, parts=parts, resume=resume, lockstep=lockstep)

    def stop_cleanly() -> None:
        # Until the first compile is done there is nothing to finish or write: a signal's default
        # action ends the process at once (a Python handler would wait for the compile, seconds).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: lrn.stop.set())

    lrn.on_compiled = stop_cleanly
    if lockstep is None:
        return _run_to_end(lrn, learner, target)
    lockstep.start_heartbeat(HEARTBEAT_S)
    code = exits.EXIT_BUG  # what the followers are told if the leader fails otherwise (its traceback follows)
    try:
        code = _run_to_end(lrn, learner, target)
        return code
    except lk.JobBroken as e:
        emit({"event": "error", "role": "learner", "learner": learner,
              "error": f"the learner's job broke, another of its processes died or left: {e}"})
        lk.broken(lockstep.name, str(e))
        raise  # not reached: broken() ends the process
    finally:
        try:
            lockstep.stop(code)
        except lk.JobBroken as e:
            lk.broken(lockstep.name, str(e))


def _run_to_end(lrn: Learner, learner: int, target: str) -> int:
    try:
        result = lrn.run()
    except exits.STOPS as e:  # not a bug: one line
        why = exits.stop_line(e, learner, target)
        emit({"event": "error", "role": "learner", "learner": learner, "error": why})
        print(f"learner-{learner}: stopping: {why}", file=sys.stderr)
        return exits.EXIT_SYNCER
    emit(result)
    if result.get("digest_mismatch"):
        print(f"learner-{learner}: final fragments {result['digest_mismatch']} differ from the syncer's", file=sys.stderr)
    return exits.exit_code(result)


def run_multihost(cfg: RunSpec, learner: int, target: str, token: str, mcfg: mh.MultihostConfig,
                  resume: bool = False) -> int:
    """Process entry point of one process of a multi-process learner, once ``multihost.initialize`` has
    joined the job: process 0 leads (``run_learner``), the others follow (``run_follower``)."""
    mesh = mh.global_mesh()
    parts = Assembly(cfg, learner, mesh=mesh)
    who = f"learner-{learner}" + (f".p{mcfg.process_id}" if mcfg.process_id else "")
    lockstep = lk.Lockstep(mesh, parts.state0, (cfg.run.batch_size, cfg.model.seq_len + 1), mcfg.process_id,
                           mcfg.num_processes, name=f"{who} (process {mcfg.process_id} of {mcfg.num_processes})")
    try:
        lockstep.handshake()
    except lk.JobBroken as e:
        lk.broken(lockstep.name, str(e))
    if mcfg.leader:
        return run_learner(cfg, learner, target, token, resume=resume, parts=parts, lockstep=lockstep)
    return lk.run_follower(parts, lockstep)
