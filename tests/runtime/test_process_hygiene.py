"""Processes and names (#13): children die with a killed launcher, a syncer that cannot listen says so in
one line, and a learner has exactly one name on the wire."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest

from wan_diloco import spec as rt
from wan_diloco.clock import VectorClock
from wan_diloco.core import Metadata
from wan_diloco.runtime import serde
from wan_diloco.runtime.launch import THREAD_ENV, RunState
from wan_diloco.transport import SyncerClient, TransportError, TransportMetrics, TransportServer, run

from .conftest import TOKEN, micro_config

# What the launcher runs: a Cluster with a learner behind an exec wrapper (as ``ip netns exec NS cmd``
# is: it execs the command in place, same pid) and a syncer; it prints each child's pid
# the moment it exists, then "ready" once the syncer listens, and waits to be killed.
LAUNCHER = textwrap.dedent("""
    import json, sys, time
    from wan_diloco import spec
    from wan_diloco.runtime.launch import Cluster

    config, run_dir = sys.argv[1], sys.argv[2]
    EXEC = "import os, sys; i = sys.argv.index('--'); os.execvp(sys.argv[i + 1], sys.argv[i + 1:])"
    wrap = lambda name: [sys.executable, "-c", EXEC, "--"] if name == "wrapped" else []
    cluster = Cluster(spec.load(config), config, run_dir, wrap=wrap)
    # The wrapped child is a learner whose syncer never answers: it stays quiet (no stdout to break)
    # and would retry for retry_budget_s (120 s here) if nothing stopped it.
    children = {"wrapped": ["learner", "--config", config, "--id", "0", "--syncer", "127.0.0.1:9"],
                "syncer": ["syncer", "--config", config]}
    for name, args in children.items():
        child = cluster._spawn(name, args)
        print(json.dumps({name: child.proc.pid}), flush=True)
    while True:
        name, event = cluster.events.get(timeout=300)
        if event.get("event") in ("listening", "exit"):
            print(json.dumps({"ready": name, **event}), flush=True)
            time.sleep(600)
""")


def _exited(pidfd: int, timeout_s: float) -> bool:
    """A pidfd turns readable when its process has exited (zombie or reaped), whoever its parent is."""
    return bool(select.select([pidfd], [], [], max(0.0, timeout_s))[0])


def _lines(proc: subprocess.Popen, deadline: float):
    while True:
        ready = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]
        line = proc.stdout.readline() if ready else b""
        if not line:
            raise AssertionError(f"the launcher said nothing more (exit code {proc.poll()}); "
                                 "see launcher.log in the test's tmp_path")
        yield json.loads(line)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_children_do_not_outlive_a_launcher_killed_with_sigkill(tmp_path):
    config = micro_config(tmp_path, learners=2, extra=f'\n[checkpoint]\ndir = "{tmp_path / "ckpt"}"\n')
    config.write_text(config.read_text().replace("retry_budget_s = 15.0", "retry_budget_s = 120.0"))
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    with open(tmp_path / "launcher.log", "wb") as log:
        launcher = subprocess.Popen([sys.executable, str(script), str(config), str(tmp_path / "run")],
                                    stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    pidfds: dict[str, int] = {}  # by pidfd, not pid: safe to signal however late, even after reuse of the pid
    try:
        for event in _lines(launcher, time.monotonic() + 240):
            if "ready" in event:
                break
            (name, pid), = event.items()
            pidfds[name] = os.pidfd_open(pid)  # the launcher has not reaped it: still this process
        assert event == {**event, "ready": "syncer", "event": "listening"}, event
        assert not any(_exited(fd, 0) for fd in pidfds.values()), "a child died before the launcher"
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 10
        left = [name for name, fd in pidfds.items() if not _exited(fd, deadline - time.monotonic())]
        assert not left, f"{left} still running 10 s after the launcher was SIGKILLed"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        for fd in pidfds.values():
            if not _exited(fd, 0):
                signal.pidfd_send_signal(fd, signal.SIGKILL)  # what the kernel should have done
            os.close(fd)
        launcher.stdout.close()


# ---- `wan-diloco syncer` on a port it cannot have ----------------------------------------------

def _syncer_cli(tmp_path: Path, port: str) -> subprocess.CompletedProcess:
    config = micro_config(tmp_path, learners=2, extra=f'\n[checkpoint]\ndir = "{tmp_path / "ckpt"}"\n')
    config.write_text(config.read_text().replace("retry_budget_s = 15.0", "retry_budget_s = 120.0"))
    env = {**os.environ, **THREAD_ENV, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "wan_diloco.cli", "syncer", "--config", str(config), "--port", port],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)


def test_syncer_on_a_port_in_use_says_so_in_one_line_and_exits_2(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = _syncer_cli(tmp_path, str(port))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    # Ours, and at most gRPC's own log line before it; no traceback.
    assert 1 <= len(lines) <= 2 and "Traceback" not in done.stderr, done.stderr
    assert lines[-1] == f"wan-diloco syncer: cannot listen on 127.0.0.1:{port}: address already in use", done.stderr
    assert '"listening"' not in done.stdout


def test_syncer_port_out_of_range_is_one_line_naming_the_range_and_exits_2(tmp_path):
    done = _syncer_cli(tmp_path, "99999")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "99999" in done.stderr and "0..65535" in done.stderr, done.stderr


# ---- one name per learner ----------------------------------------------------------------------

# Reported in #13 as taken for learners 0 and 1: a leading zero, an Arabic-Indic and a fullwidth digit.
OTHER_SPELLINGS = ["learner-00", "learner-01", "learner-\u0660", "learner-\u0661", "learner-\uff10", "learner-\uff11",
                   "learner-\u00b9", "learner-1 ", "Learner-1"]


def test_the_syncer_takes_no_other_spelling_of_a_learner_and_revives_no_dead_one(tmp_path):
    """Metadata, Upload and Subscribe under every other spelling are INVALID_ARGUMENT; they neither revive
    a lost learner nor take over a live one's stream, and the canonical names keep working."""
    from wan_diloco.runtime.syncer import SyncerService

    cfg = rt.load(micro_config(tmp_path, learners=2))
    service = SyncerService(cfg, TransportMetrics())

    def metadata(sender: str, step: int = 1):
        m = int(sender.rpartition("-")[2]) if sender in ("learner-0", "learner-1") else 0
        frame = serde.to_frame(Metadata(learner=m, step=step, c_steps=(step, step), c_tokens=(128, 128),
                                        clock=VectorClock({f"learner-{m}": step}), region="region-a"))
        return dataclasses.replace(frame, sender=sender)

    async def first_frame(client, sender):
        async for frame in client.subscribe(sender, "region-a"):
            return frame

    def state():
        return ({m: dataclasses.asdict(info) for m, info in service.core.learners.items()}, dict(service.streams),
                dict(service.regions), service.core.global_step)

    async def main():
        server = TransportServer(service, TOKEN, cfg.transport, "127.0.0.1:0")
        await server.start()
        try:
            async with SyncerClient(server.target, TOKEN, cfg.transport) as a, \
                    SyncerClient(server.target, TOKEN, cfg.transport) as b:
                await a.send_metadata(metadata("learner-1"))
                service._act(service.core.on_peer_lost(service.now(), 1))  # learner 1 died
                stream0 = a.subscribe("learner-0", "region-a")  # learner 0 is live, subscribed
                assert serde.control_from_frame(await asyncio.wait_for(stream0.__anext__(), 30)) is not None
                before, rejected = state(), service.rejected
                for sender in OTHER_SPELLINGS:
                    upload = dataclasses.replace(metadata(sender, step=2), fragment=0, payload=b"x" * 64)
                    for call in (b.send_metadata(metadata(sender, step=2)), b.upload_fragment(upload),
                                 first_frame(b, sender)):
                        with pytest.raises(TransportError) as err:
                            await asyncio.wait_for(call, 30)
                        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, (sender, err.value)
                        assert "is not a learner of this run" in err.value.details, (sender, err.value)
                assert state() == before and service.rejected == rejected + 3 * len(OTHER_SPELLINGS)
                assert service.core.learners[1].alive is False and service.core.alive() == [0]
                assert service.streams == {0: 1}  # learner 0's stream was neither taken over nor ended
                # The real names still work: learner 1 comes back under its own.
                await b.send_metadata(metadata("learner-1", step=3))
                assert service.core.learners[1].alive is True
                await stream0.aclose()
        finally:
            await server.stop(0)

    run(asyncio.wait_for(main(), 120))


@pytest.mark.parametrize("name", ["learner-00", "learner-\u0661", "learner-\uff10"])
def test_run_state_takes_only_its_own_learner_names(tmp_path, name):
    state = RunState(rt.load(micro_config(tmp_path, learners=2)))
    before = json.dumps(state.learners, sort_keys=True)
    try:
        state.fold(name, {"event": "start", "step": 0})
    except (ValueError, KeyError) as e:
        assert name in str(e) or repr(name) in str(e), e
        return
    changed = json.dumps(state.learners, sort_keys=True) != before
    raise AssertionError(f"fold took {name!r} for a learner{' and changed its row' if changed else ''}")


def test_the_summary_counts_learners_the_launcher_did_not_start(tmp_path):
    """A learner restarted by hand (outside the launcher) is in the syncer's final sync; the summary says so."""
    from wan_diloco.runtime.launch import summarize

    state = RunState(rt.load(micro_config(tmp_path, learners=3)))
    state.fold("syncer", {"event": "final", "final_learners": [0, 1, 2], "digests": ["d"], "global_step": 40})
    for m in (0, 1):
        state.fold(f"learner-{m}", {"event": "final", "steps": 40, "last_loss": 2.0, "tokens": 100, "bytes_sent": 1,
                                    "raw_bytes": 4, "payload_bytes": 1, "final_eval_loss": 2.0, "compute_s": 1.0,
                                    "train_s": 1.0, "digests": ["d"]})
    summary = summarize(state, 10.0)
    assert summary["learners_finished"] == 2 and summary["final_learners"] == [0, 1, 2]
