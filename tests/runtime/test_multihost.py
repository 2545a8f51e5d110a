"""A learner as a JAX multi-controller job: P local processes over gloo train like one process."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from wan_diloco.config import ConfigError, from_mapping
from wan_diloco.runtime import multihost as mh
from wan_diloco.runtime.launch_cluster import free_port

STEPS = 10

# One learner process. argv: process_id num_processes port out_dir. num_processes 0: today's learner
# (no jax.distributed, train.local_mesh, the whole global batch from the host) as the reference.
_WORKER = textwrap.dedent("""
    import hashlib, json, sys, time
    pid, n, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    from wan_diloco.runtime import multihost as mh
    if n:
        mh.initialize(mh.MultihostConfig(f"127.0.0.1:{port}", n, pid, init_timeout_s=60))
    import jax, numpy as np
    from wan_diloco import data as d, train as tr, tree
    import dataclasses
    from wan_diloco.model import preset
    cfg = dataclasses.replace(preset("micro"), seq_len=16)
    tc = tr.TrainConfig(lr=1e-2, warmup_steps=2, total_steps=100)
    toks = d.load_corpus(d.DataConfig(max_bytes=200_000)).train
    mesh = mh.global_mesh() if n else tr.local_mesh()
    feed = (lambda b: mh.global_batch(mh.local_rows(b, pid, n), mesh)) if n else (lambda b: b)
    state = tr.init_state(cfg, tc, jax.random.key(0))
    step = tr.make_train_step(cfg, tc, mesh)
    losses = []
    for _, b in zip(range(%d), d.batches(toks, 8, 16, seed=1)):
        state, m = step(state, feed(b.tokens))
        losses.append(float(mh.to_host(m["loss"])))
    held = [feed(b) for b in d.eval_batches(toks, 8, 16, 2)]
    flat = mh.to_host(tree.flatten(state.params))
    h = hashlib.sha256()
    for name in sorted(flat):
        h.update(name.encode()); h.update(np.ascontiguousarray(flat[name], "<f4").tobytes())
    np.savez(f"{out}/params-{n}-{pid}.npz", **flat)
    # Each process offers its own value; all must come back with the leader's.
    told = mh.from_leader({"x": np.full((3,), 10.0 + pid, np.float32)})["x"].tolist() if n else None
    print(json.dumps({"losses": losses, "eval": tr.make_eval_fn(cfg, mesh)(state.params, held),
                      "digest": h.hexdigest(), "leader": mh.is_leader(), "told": told,
                      "devices": len(mesh.devices.flat), "local": len(mesh.local_devices),
                      "step": int(mh.to_host(state.step))}))
""" % STEPS)


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def run_all(jobs: list[tuple[list[str], dict]], out: Path, timeout_s: float,
            kill_on_failure: bool = True) -> list[tuple[int, str, str]]:
    """Run the (argv, env) processes together; (rc, stdout, stderr) each. All are reaped whatever
    happens, and (``kill_on_failure``) killed once one fails: a process whose peer died would wait in a
    collective for good."""
    procs, deadline = [], time.monotonic() + timeout_s
    try:
        for i, (argv, env) in enumerate(jobs):
            # Files, not pipes: one process blocked on a full pipe must not stall its peers' collectives.
            with open(out / f"{i}.out", "w") as o, open(out / f"{i}.err", "w") as e:
                procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=o, stderr=e))
        while time.monotonic() < deadline:
            rcs = [p.poll() for p in procs]
            if None not in rcs or (kill_on_failure and any(rc not in (None, 0) for rc in rcs)):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return [(p.returncode, (out / f"{i}.out").read_text(), (out / f"{i}.err").read_text())
            for i, p in enumerate(procs)]


@pytest.mark.slow  # 3 JAX processes: 35-110 s on 2 shared cores; `pytest -m slow` runs it
@pytest.mark.parametrize("devices_per_process", [1, 2])
def test_two_process_learner_trains_like_one_process(tmp_path, devices_per_process):
    port = str(free_port())
    worker = ["-c", _WORKER]
    env = _env(devices_per_process)
    # The reference (one process, one device, the whole batch) runs alongside the pair.
    got = run_all([(worker + ["0", "2", port, str(tmp_path)], env), (worker + ["1", "2", port, str(tmp_path)], env),
                   (worker + ["0", "0", "0", str(tmp_path)], _env(1))], tmp_path, timeout_s=240)
    for i, (rc, _, err) in enumerate(got):
        assert rc == 0, f"process {i} ended with {rc}: {err[-3000:]}"
    p0, p1, one = [json.loads(o.strip().splitlines()[-1]) for _, o, _ in got]
    assert p0["devices"] == p1["devices"] == 2 * devices_per_process and p0["local"] == devices_per_process
    assert one["devices"] == 1 and one["step"] == p0["step"] == STEPS
    assert (p0["leader"], p1["leader"]) == (True, False)
    assert p0["told"] == p1["told"] == [10.0] * 3
    # The two processes hold one replicated model: the same bits, step for step.
    assert p0["losses"] == p1["losses"] and p0["digest"] == p1["digest"] and p0["eval"] == p1["eval"]
    # Against one process on the whole batch only the order of the sums differs (each device
    # averages its rows, then the gradient is all-reduced across processes), so float tolerance.
    np.testing.assert_allclose(p0["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(p0["eval"], one["eval"], rtol=1e-5)
    assert one["losses"][-1] < one["losses"][0]
    with np.load(tmp_path / "params-2-0.npz", allow_pickle=False) as a, \
            np.load(tmp_path / "params-0-0.npz", allow_pickle=False) as b:
        assert sorted(a.files) == sorted(b.files)
        for name in a.files:
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)


_LONE = textwrap.dedent("""
    import sys, time
    from wan_diloco.runtime import multihost as mh
    print(time.time(), flush=True)
    mh.initialize(mh.MultihostConfig(sys.argv[3], int(sys.argv[2]), int(sys.argv[1]), init_timeout_s=3))
    print("joined")
""")


def test_a_process_whose_peers_never_come_up_says_so_within_the_timeout(tmp_path):
    """Process 0 waits for a peer that never starts; process 1 for a coordinator that never starts."""
    alone = ["-c", _LONE]
    got = run_all([(alone + ["0", "2", f"127.0.0.1:{free_port()}"], _env(1)),
                   (alone + ["1", "2", f"127.0.0.1:{free_port()}"], _env(1))], tmp_path, timeout_s=60,
                  kill_on_failure=False)
    (rc0, out0, err0), (rc1, out1, err1) = got
    assert (rc0, rc1) == (mh.EXIT_PEERS_MISSING, mh.EXIT_PEERS_MISSING), (err0[-2000:], err1[-2000:])
    assert "joined" not in out0 + out1
    # The line came within the timeout (3 s) and well before JAX's own deadline (SIGABRT and a C++ stack
    # trace, JAX_DEADLINE_MARGIN_S later); measured from initialize, not from starting Python.
    for i, out in enumerate((out0, out1)):
        said_after = (tmp_path / f"{i}.err").stat().st_mtime - float(out.split()[0])
        assert 2.9 <= said_after < 3 + mh.JAX_DEADLINE_MARGIN_S, said_after  # mtimes are coarse
    assert "learner process 0 of 2: the coordinator is up at 127.0.0.1:" in err0
    assert "not all 2 processes joined within 3 s: is process 1 running" in err0
    assert "(multihost.init_timeout_s)" in err0
    assert "learner process 1 of 2: nothing accepts connections at the coordinator 127.0.0.1:" in err1
    assert "Check failure" not in err0 + err1


def test_timeout_message_when_the_coordinator_is_up():
    cfg = mh.MultihostConfig("10.0.0.1:1234", 4, 2, init_timeout_s=7.5)
    msg = mh.join_timeout_message(cfg, coordinator_listening=True)
    assert msg.startswith("learner process 2 of 4: the coordinator 10.0.0.1:1234 (process 0) is reachable")
    assert "within 7.5 s" in msg and "num_processes = 4" in msg
    leader = mh.join_timeout_message(dataclasses.replace(cfg, process_id=0), None)
    assert "are processes 1..3 running" in leader


@pytest.mark.parametrize("bad,field,says", [
    ({"coordinator": "nohost"}, "coordinator", "expected host:port"),
    ({"coordinator": "127.0.0.1:0"}, "coordinator", "fixed port"),
    ({"coordinator": "127.0.0.1:70000"}, "coordinator", "outside the valid range"),
    ({"num_processes": 0}, "num_processes", ">= 1"),
    ({"process_id": 2}, "process_id", "must be in 0..1"),
    ({"process_id": -1}, "process_id", "must be in 0..1"),
    ({"local_device_ids": []}, "local_device_ids", "non-empty"),
    ({"local_device_ids": [0, 0]}, "local_device_ids", "twice"),
    ({"local_device_ids": [-1]}, "local_device_ids", ">= 0"),
    ({"init_timeout_s": 0}, "init_timeout_s", "positive"),
    ({"heartbeat_timeout_s": 0}, "heartbeat_timeout_s", ">= 1"),
    ({"spare": 1}, "spare", "unknown field"),
])
def test_config_validation(bad, field, says):
    base = {"coordinator": "127.0.0.1:4321", "num_processes": 2, "process_id": 1}
    with pytest.raises(ConfigError, match=f"^{field}: .*{says}"):
        from_mapping(mh.MultihostConfig, {**base, **bad})


def test_config_accepts_a_good_one():
    cfg = from_mapping(mh.MultihostConfig, {"coordinator": "[::1]:4321", "num_processes": 3, "process_id": 0,
                                            "local_device_ids": [0, 1], "init_timeout_s": 20})
    assert cfg.leader and cfg.local_device_ids == (0, 1) and cfg.init_timeout_s == 20.0


def test_local_rows_split_the_global_batch_in_process_order():
    batch = np.arange(8 * 3).reshape(8, 3)
    parts = [mh.local_rows(batch, i, 4) for i in range(4)]
    np.testing.assert_array_equal(np.concatenate(parts), batch)
    assert all(p.shape == (2, 3) for p in parts)
    with pytest.raises(ConfigError, match="batch_size: 8 rows do not split evenly over the learner's 3 processes"):
        mh.local_rows(batch, 0, 3)


def test_single_process_helpers():
    """Without jax.distributed the helpers are those of a one-process learner."""
    import jax

    mesh = mh.global_mesh()
    assert mh.is_leader() and list(mesh.devices.flat) == sorted(jax.devices(), key=lambda d: d.id)
    rows = np.arange(len(jax.devices()) * 2 * 5, dtype=np.int32).reshape(-1, 5)
    g = mh.global_batch(rows, mesh)
    assert g.shape == rows.shape
    np.testing.assert_array_equal(mh.to_host({"g": g})["g"], rows)
    np.testing.assert_array_equal(mh.from_leader({"x": rows})["x"], rows)
    with pytest.raises(ConfigError, match="batch: tokens must have shape"):
        mh.global_batch(np.zeros(4, np.int32), mesh)


# ---- the learner runtime with several processes ------------------------------------------------

def _lockstep_config(tmp_path: Path, hosts: int, **changes: str) -> Path:
    """One learner, made deterministic so that two runs compare step by step: blocking with tau = 0 (each
    fragment's update is merged right after the step that sent it, not whenever it arrives), fp32 outer
    gradients, 18 steps (the last fragment, sent at step 16, is merged before the end), a step event each step."""
    from .conftest import micro_config

    path = micro_config(tmp_path, learners=1, steps=18, tau=0, extra="[codec]\nbits = 32\n")
    text = path.read_text().replace("[learner]\n", f"[learner]\nhosts = {hosts}\nblocking = true\n")
    text = text.replace("report_every_s = 0.2", "report_every_s = 0.001\neval_every_steps = 6")
    for old, new in changes.items():
        text = text.replace(old, new)
    path.write_text(text)
    return path


def _learner_events(run_dir: Path, kind: str) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [e for e in map(json.loads, f) if e.get("event") == kind and e["source"] == "learner-0"]


@pytest.mark.slow  # two launched runs, 4 JAX processes in all: 80-110 s on 2 shared cores
def test_a_two_process_learner_trains_like_one_process_through_launch(tmp_path):
    """The issue's acceptance test, through the real runtime: `launch` with learner.hosts = 2 (a leader
    talking to the syncer, a follower in lockstep) against hosts = 1 on the same config and batches."""
    from wan_diloco import load_params
    from wan_diloco import spec as rt
    from wan_diloco.runtime.launch import launch

    runs = {}
    for hosts in (2, 1):
        d = tmp_path / f"hosts{hosts}"
        d.mkdir()
        path = _lockstep_config(d, hosts)
        code, summary = launch(rt.load(path), path.read_text(), str(d / "run"))
        assert code == 0, summary
        assert summary["bit_identical"] and summary["learners_finished"] == 1 and not summary["failed_learners"]
        runs[hosts] = (d / "run", summary)
    (two, s2), (_, s1) = runs[2], runs[1]
    assert sorted(p.name for p in two.glob("learner-*.log")) == ["learner-0.log", "learner-0.p1.log"]
    assert "following the leader" in (two / "learner-0.p1.log").read_text()
    losses = {h: {e["step"]: e["loss"] for e in _learner_events(d, "step")} for h, (d, _) in runs.items()}
    assert sorted(losses[2]) == sorted(losses[1]) == list(range(1, 19))
    np.testing.assert_allclose([losses[2][s] for s in range(1, 19)], [losses[1][s] for s in range(1, 19)], rtol=1e-5)
    assert losses[1][18] < losses[1][1]
    # The global model's eval points (Θ broadcast to the follower, evaluated by both) and the final eval.
    assert [e["step"] for e in s2["eval_curve"]] == [e["step"] for e in s1["eval_curve"]] == [6, 12, 18]
    np.testing.assert_allclose([e["eval_loss"] for e in s2["eval_curve"]],
                               [e["eval_loss"] for e in s1["eval_curve"]], rtol=1e-5)
    np.testing.assert_allclose([s2["initial_eval_loss"], s2["final_eval_loss"]],
                               [s1["initial_eval_loss"], s1["final_eval_loss"]], rtol=1e-5)
    a = load_params(s2["params_path"])
    b = load_params(s1["params_path"])
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-4, atol=1e-5, err_msg=name)


def _learner_argv(config: Path, process_id: int, coordinator: str, syncer: str) -> list[str]:
    return ["-m", "wan_diloco.cli", "learner", "--config", str(config), "--id", "0", "--syncer", syncer,
            "--process-id", str(process_id), "--num-processes", "2", "--coordinator", coordinator, "--no-table"]


@pytest.mark.parametrize("dies", ["follower", pytest.param("leader", marks=pytest.mark.slow)])  # 25-45 s each
def test_when_one_process_of_a_learner_dies_the_other_exits_saying_so(tmp_path, dies):
    """No syncer listens: the leader keeps trying to reach it, its follower waits in the next header.
    Whichever dies (SIGKILL), the other's next collective fails: one line, exit status 6, in seconds
    (the leader's heartbeat header every 5 s is that collective for the leader)."""
    config = _lockstep_config(tmp_path, 2, **{"retry_budget_s = 15.0": "retry_budget_s = 300.0"})
    coordinator, syncer = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = _env(1)
    procs = []
    try:
        for i in range(2):
            with open(tmp_path / f"{i}.err", "w") as e:
                procs.append(subprocess.Popen([sys.executable, *_learner_argv(config, i, coordinator, syncer)],
                                              env=env, stdout=subprocess.DEVNULL, stderr=e))
        deadline = time.monotonic() + 90
        while "following the leader" not in (tmp_path / "1.err").read_text():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [(tmp_path / f"{i}.err").read_text()[-2000:] for i in range(2)]
            time.sleep(0.2)
        victim, survivor = (1, 0) if dies == "follower" else (0, 1)
        procs[victim].kill()
        procs[victim].wait()
        t0 = time.monotonic()
        rc = procs[survivor].wait(timeout=45)
        took_s = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    err = (tmp_path / f"{survivor}.err").read_text()
    assert rc == mh.EXIT_JOB_BROKEN, err[-3000:]
    who = "learner-0 (process 0 of 2)" if survivor == 0 else "learner-0.p1 (process 1 of 2)"
    assert f"{who}: stopping: the learner's job broke, another of its processes died or left" in err
    assert took_s < 20, took_s
    assert "Traceback" not in err and "Check failure" not in err


def test_launch_names_a_learners_processes():
    from wan_diloco.runtime.launch import learner_of, learner_process, process_name

    assert learner_process("learner-3") == (3, 0) and learner_process("learner-3.p2") == (3, 2)
    assert learner_of("learner-3.p2") == 3 and process_name(3, 0) == "learner-3" and process_name(3, 1) == "learner-3.p1"
    for bad in ("learner-3.p0", "learner-03", "learner-3.p", "learner-3.p01", "syncer"):
        with pytest.raises(ValueError, match="is not a learner's name"):
            learner_process(bad)


def test_the_run_state_hears_a_learner_through_its_leader():
    from wan_diloco import spec as rt
    from wan_diloco.runtime.launch import RunState

    mon = RunState(rt.from_document({"run": {"learners": 1}, "learner": {"hosts": 2}}))
    mon.fold("learner-0", {"event": "start", "eval_loss": 5.0})
    mon.fold("learner-0.p1", {"event": "exit"})  # a follower's end says nothing about the learner
    assert mon.learners[0]["status"] == "training"
    mon.fold("learner-0", {"event": "exit"})
    assert mon.learners[0]["status"] == "exited"
