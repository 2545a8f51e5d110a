"""The link probe over the production transport (TLS, HTTP/2) across an emulated WAN link.

Needs root and `ip netns` (skipped otherwise, like test_emulator.py). The
server runs in the syncer's region, the probing client in the other one.
"""
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from wan_diloco.regions.emulator import Emulator, unavailable_reason
from wan_diloco.regions.topology import regions_from_mapping
from wan_diloco.transport.dev_certs import make_dev_certs


pytestmark = pytest.mark.netns
if (reason := unavailable_reason()) is not None:
    pytestmark = [pytest.mark.netns, pytest.mark.skip(reason=reason)]

PEER = str(Path(__file__).resolve().parents[2] / "bench" / "wan_peer.py")
RATE_GBIT_S, RTT_MS = 0.4, 60.0


def test_probe_measures_the_emulated_link(tmp_path):
    # The run's default probe length (0.2 s, so ten round trips here): the start-up probes must
    # grow past the fresh connection's ramp on their own (0.2 s probes used to read 0.13-0.23 of 0.4).
    # The round trip is exact to 10%. The rate is not, on this machine: one 0.6 s transfer of Python
    # gRPC through the Python forwarder reads 0.30-0.40 of 0.4 Gbit/s idle (iperf3 0.40 on the same link
    # a second later) and 0.29 in one CI run on two loaded cores. So the rate must be past the ramp
    # (0.6 of the link, which every ramp-bound reading missed) and never above the link.
    topo = regions_from_mapping({"names": ["hub", "far"], "link": {"rate_gbit_s": RATE_GBIT_S, "rtt_ms": RTT_MS}})
    with Emulator(topo, prefix="wdlp") as emu:
        host = emu.address_of("hub")
        make_dev_certs(tmp_path, hosts=(host,))
        srv = emu.popen("hub", [sys.executable, PEER, "server", "--host", host, "--tls", str(tmp_path)],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            port = json.loads(srv.stdout.readline())["ready"]
            res = emu.exec("far", [sys.executable, PEER, "probe", "--target", f"{host}:{port}",
                                   "--tls", str(tmp_path), "--samples", "5"], timeout=120)
        finally:
            srv.stdin.close()
            srv.wait(10)
    samples = json.loads(res.stdout.strip().splitlines()[-1])["samples"][-5:]
    rtt_ms = min(s["rtt_ms"] for s in samples)
    rate = statistics.median(s["rate_gbit_s"] for s in samples)
    assert rtt_ms == pytest.approx(RTT_MS, rel=0.10), samples
    assert 0.6 * RATE_GBIT_S <= rate <= 1.1 * RATE_GBIT_S, samples
