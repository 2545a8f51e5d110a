"""A TLS setting the learner and the syncer disagree on cannot heal by waiting (#23, item 13): the learner
says which in one line and exits 3 at once, instead of retrying for transport.retry_budget_s."""
import asyncio
import dataclasses
import os
import subprocess
import sys
import threading
import time

from wan_diloco.transport import TransportConfig, TransportServer, run
from wan_diloco.transport.dev_certs import make_dev_certs

from .conftest import TOKEN, micro_config


class TlsSyncer(threading.Thread):
    """A TLS-only gRPC server on loopback, on its own thread and event loop."""

    def __init__(self, tls):
        super().__init__(daemon=True)
        self.tls, self.port, self.ready, self.done = tls, None, threading.Event(), threading.Event()

    def run(self):
        async def serve():
            server = TransportServer(object(), TOKEN, TransportConfig(tls=self.tls), "127.0.0.1:0")
            self.port = await server.start()
            self.ready.set()
            try:
                while not self.done.is_set():
                    await asyncio.sleep(0.1)
            finally:
                await server.stop(0)
        run(serve())


def test_a_cleartext_learner_at_a_tls_syncer_stops_at_once_naming_the_cause(tmp_path):
    syncer = TlsSyncer(make_dev_certs(tmp_path / "tls")["server"])
    syncer.start()
    try:
        assert syncer.ready.wait(30)
        path = micro_config(tmp_path, learners=2)
        path.write_text(path.read_text().replace("retry_budget_s = 15.0", "retry_budget_s = 150.0"))
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "wan_diloco.cli", "learner", "--config", str(path), "--id", "0",
                               "--syncer", f"127.0.0.1:{syncer.port}"], capture_output=True, text=True,
                              timeout=240, env=dict(os.environ))
        took_s = time.monotonic() - t0
    finally:
        syncer.done.set()
        syncer.join(10)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 3, proc.stderr
    assert err[-1].startswith(f"learner-0: stopping: cannot reach the syncer at 127.0.0.1:{syncer.port}: the syncer "
                              "expects TLS but this learner has no [transport.tls]"), err
    assert "not retried" in err[-1] and not any("Traceback" in ln for ln in err), err
    assert took_s < 120  # the start-up of one process, not the 150 s retry budget
