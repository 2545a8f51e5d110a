"""A learner that cannot work with its syncer says why in one line and exits 3 (#14): nobody listening
(within seconds, naming the address and the cause, then giving up after transport.retry_budget_s),
and a token the syncer refuses."""
import os
import socket
import subprocess
import sys
import time

import pytest

from wan_diloco import spec as rt
from wan_diloco.runtime.launch import Cluster

from .conftest import micro_config


def learner(config, target, env=None, timeout_s=120):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "wan_diloco.cli", "learner", "--config", str(config), "--id", "0",
                           "--syncer", target], capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **(env or {})})
    return proc.returncode, proc.stderr.strip().splitlines(), time.monotonic() - t0


def test_nobody_listening_is_said_at_once_and_the_learner_gives_up_after_its_retry_budget(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    path = micro_config(tmp_path, learners=2, extra="")
    path.write_text(path.read_text().replace("retry_budget_s = 15.0", "retry_budget_s = 3.0"))
    code, err, took_s = learner(path, f"127.0.0.1:{port}")
    assert code == 3, err
    assert err[0].startswith(f"learner-0: cannot reach the syncer at 127.0.0.1:{port}: connection refused"), err
    assert err[-1].startswith(f"learner-0: stopping: cannot reach the syncer at 127.0.0.1:{port}: connection refused")
    assert "gave up after 3 s (transport.retry_budget_s)" in err[-1] and not any("Traceback" in ln for ln in err), err
    assert took_s < 30  # seconds, not a call deadline (82 s before)


@pytest.mark.slow  # ~25 s (a real syncer); the transport's UNAUTHENTICATED is tested by default in test_tls.py
def test_a_token_the_syncer_refuses_is_named_as_the_reason(tmp_path):
    path = micro_config(tmp_path, learners=2)
    cfg = rt.load(path)
    with Cluster(cfg, path, tmp_path / "run") as cluster:
        cluster.start_syncer()
        wrong = tmp_path / "wrong.toml"
        wrong.write_text(path.read_text().replace('token = "', 'token = "not-the-'))
        code, err, _ = learner(wrong, cluster.syncer_target)
    assert code == 3 and not any("Traceback" in ln for ln in err), err
    assert err[-1].startswith(f"learner-0: stopping: the syncer at {cluster.syncer_target} refused this learner's token "
                             "(UNAUTHENTICATED)"), err
