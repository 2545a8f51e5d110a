"""The sender's TCP counters read from ``ss -tin`` (bench/tcp_info.py), on a real loopback connection."""
import shutil
import socket
import subprocess
import threading
import time

import pytest

from bench.tcp_info import parse_ss, sampled

SS_LINE = ("ESTAB 0      3012218 10.77.0.2:35808 10.77.0.1:443\n"
           "\t cubic wscale:10,10 rto:304 rtt:100.4/0.2 mss:1448 cwnd:4000 ssthresh:3000 bytes_sent:834662256 "
           "bytes_retrans:2896 bytes_acked:833614529 send 30470836689bps pacing_rate 51862517448bps busy:308ms "
           "rwnd_limited:44ms(14.3%) sndbuf_limited:12ms(3.9%) retrans:0/2 rcv_space:65495 minrtt:100.1\n")


def test_each_connection_gets_its_addresses_and_counters_in_ms():
    (conn,) = parse_ss(SS_LINE)
    assert conn == {"local": "10.77.0.2:35808", "peer": "10.77.0.1:443", "mss": 1448, "cwnd": 4000,
                    "ssthresh": 3000, "bytes_sent": 834662256, "bytes_retrans": 2896, "busy": 308.0, "rwnd_limited": 44.0, "sndbuf_limited": 12.0,
                    "retrans_segs": 2, "minrtt": 100.1}
    assert parse_ss("") == [] and parse_ss("\t cwnd:10\n") == []  # an info line without its connection


class Here:
    """The emulator's ``exec``, run in this namespace."""

    def exec(self, region, argv, check=True, timeout=None):
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(shutil.which("ss") is None, reason="iproute2's ss is not installed")
def test_samples_keep_the_last_counters_of_a_connection_that_sent():
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    got = []

    def sink():
        c, _ = srv.accept()
        with c:
            while c.recv(1 << 20):
                pass

    reader = threading.Thread(target=sink, daemon=True)
    reader.start()
    try:
        with socket.create_connection(("127.0.0.1", port)) as client, sampled(Here(), "far", "127.0.0.1", got,
                                                                              every_s=0.05):
            sent, until = 0, time.monotonic() + 0.5  # several samples' worth
            while time.monotonic() < until:
                client.sendall(b"x" * (1 << 20))
                sent += 1 << 20
    finally:
        srv.close()
        reader.join(5)
    mine = [c for c in got if c["peer"] == f"127.0.0.1:{port}"]
    (conn,) = mine  # bytes_sent counts retransmitted bytes again
    assert 0 < conn["bytes_sent"] - conn.get("bytes_retrans", 0) <= sent and conn["cwnd"] > 0
