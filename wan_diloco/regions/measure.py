"""Measure the emulated WAN: RTT by a TCP echo, throughput by a timed raw-TCP bulk transfer.

Both ends run as subprocesses (``python -m wan_diloco.regions.measure ...``)
inside region namespaces, started by :class:`~wan_diloco.regions.emulator.Emulator`,
so every byte stays inside the emulated network. Each tool prints one JSON line.
``iperf3`` is used only if installed (a test-time tool, never a dependency).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ECHO_PORT = 7707
BULK_PORT = 7708
CHUNK = 4 << 20


@dataclass(frozen=True)
class Throughput:
    """Result of a bulk transfer, measured at the receiver."""

    gbit_s: float  # after the warm-up (slow start excluded)
    total_gbit_s: float  # whole transfer, first byte to last
    bytes: int
    seconds: float


# ---- the processes ----------------------------------------------------------
def _listen(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(1)
    print(json.dumps({"ready": port}), flush=True)
    return s


def echo_server(port: int) -> None:
    """Echo one connection's bytes back until it closes."""
    with _listen(port) as srv:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)


def echo_client(host: str, port: int, count: int) -> dict:
    """Round trips of a 32-byte message; the first (handshake-adjacent) one is discarded."""
    with socket.create_connection((host, port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg, rtts = b"x" * 32, []
        for _ in range(count + 1):
            t0 = time.perf_counter()
            s.sendall(msg)
            got = 0
            while got < len(msg):
                chunk = s.recv(len(msg) - got)
                if not chunk:
                    raise ConnectionError("echo server closed early")
                got += len(chunk)
            rtts.append(time.perf_counter() - t0)
        srtt_ms = kernel_srtt_ms(s)
    rtts = rtts[1:]
    return {"rtt_ms_median": statistics.median(rtts) * 1e3, "rtt_ms_min": min(rtts) * 1e3,
            "rtt_ms_max": max(rtts) * 1e3, "count": len(rtts), "kernel_srtt_ms": srtt_ms}


def kernel_srtt_ms(sock: socket.socket) -> float:
    """The kernel's smoothed RTT of a connected TCP socket (``tcpi_rtt`` from TCP_INFO), in ms.

    This is what the endpoint's own congestion control sees, free of the
    Python echo's scheduling overhead.
    """
    # struct tcp_info: 8 one-byte fields, then u32s; tcpi_rtt (microseconds) is the 16th u32.
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return struct.unpack_from("I", info, 8 + 15 * 4)[0] / 1000.0


def sink(port: int, warmup_s: float) -> dict:
    """Receive one connection until EOF; rate over the part after ``warmup_s``."""
    buf = bytearray(CHUNK)
    with _listen(port) as srv:
        conn, _ = srv.accept()
        with conn:
            total, first, mark_t, mark_b = 0, None, None, 0
            while n := conn.recv_into(buf):
                now = time.perf_counter()
                if first is None:
                    first = now
                total += n
                if mark_t is None and now - first >= warmup_s:
                    mark_t, mark_b = now, total
                last = now
    if first is None:
        return {"bytes": 0, "seconds": 0.0, "gbit_s": 0.0, "total_gbit_s": 0.0}
    dur = max(last - first, 1e-9)
    steady = (total - mark_b) * 8 / max(last - mark_t, 1e-9) / 1e9 if mark_t and last > mark_t else 0.0
    return {"bytes": total, "seconds": dur, "gbit_s": steady, "total_gbit_s": total * 8 / dur / 1e9}


def source(host: str, port: int, seconds: float) -> dict:
    """Send as fast as TCP allows for ``seconds``, then close."""
    data = bytes(CHUNK)
    sent = 0
    with socket.create_connection((host, port), timeout=30) as s:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            s.sendall(data)
            sent += len(data)
        s.shutdown(socket.SHUT_WR)
    return {"sent": sent}


# ---- driving them through an emulator ---------------------------------------
def _module_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "wan_diloco.regions.measure", *args]


def _await_ready(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()
    if "ready" not in line:
        raise RuntimeError(f"measurement server did not start: {line!r} {proc.stderr.read() if proc.poll() else ''}")


def _env() -> dict:
    # The subprocesses import this module by name; make sure they find this checkout.
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
    return env


def rtt(emu, server_region: str, client_region: str, count: int = 20, port: int = ECHO_PORT) -> dict:
    """TCP echo RTT from ``client_region`` to ``server_region``: median/min/max in ms."""
    srv = emu.popen(server_region, _module_argv("echo-server", "--port", str(port)),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        _await_ready(srv)
        res = emu.exec(client_region, _module_argv("echo-client", "--host", emu.address_of(server_region),
                                                   "--port", str(port), "--count", str(count)), timeout=60)
        return json.loads(res.stdout.strip().splitlines()[-1])
    finally:
        srv.kill()
        srv.wait()


def throughput(emu, server_region: str, client_region: str, seconds: float = 4.0, warmup_s: float = 1.0,
               port: int = BULK_PORT) -> Throughput:
    """Bulk TCP from ``client_region`` to ``server_region``, measured at the receiver."""
    srv = emu.popen(server_region, _module_argv("sink", "--port", str(port), "--warmup", str(warmup_s)),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        _await_ready(srv)
        emu.exec(client_region, _module_argv("source", "--host", emu.address_of(server_region),
                                             "--port", str(port), "--seconds", str(seconds)),
                 timeout=seconds + 60)
        out, err = srv.communicate(timeout=60)
        r = json.loads(out.strip().splitlines()[-1])
        return Throughput(gbit_s=r["gbit_s"], total_gbit_s=r["total_gbit_s"], bytes=r["bytes"], seconds=r["seconds"])
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()


def iperf3(emu, server_region: str, client_region: str, seconds: float = 4.0, omit_s: int = 1) -> float | None:
    """Gbit/s by iperf3 (receiver side, the first ``omit_s`` of slow start left out), or None
    when iperf3 is not installed."""
    got = iperf3_run(emu, server_region, client_region, seconds, omit_s)
    return None if got is None else got["gbit_s"]


def iperf3_run(emu, server_region: str, client_region: str, seconds: float = 4.0, omit_s: int = 1) -> dict | None:
    """iperf3's rate (as ``iperf3``) and its sender's and receiver's CPU seconds per GiB received
    (iperf3's own ``cpu_utilization_percent``: user + system over the test), or None without iperf3."""
    if shutil.which("iperf3") is None:
        return None
    srv = emu.popen(server_region, ["iperf3", "-s", "-1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        res = emu.exec(client_region, ["iperf3", "-J", "-c", emu.address_of(server_region), "-t", str(seconds),
                                           "-O", str(omit_s)],
                       timeout=seconds + 60)
        end = json.loads(res.stdout)["end"]
        got, cpu = end["sum_received"], end["cpu_utilization_percent"]
        gib = max(got["bytes"], 1) / (1 << 30)
        return {"gbit_s": got["bits_per_second"] / 1e9,
                "sender_cpu_s_per_gib": cpu["host_total"] / 100 * got["seconds"] / gib,
                "receiver_cpu_s_per_gib": cpu["remote_total"] / 100 * got["seconds"] / gib}
    finally:
        if srv.poll() is None:
            srv.kill()
        srv.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("echo-server", "sink"):
        s = sub.add_parser(name)
        s.add_argument("--port", type=int, required=True)
        if name == "sink":
            s.add_argument("--warmup", type=float, default=1.0)
    for name in ("echo-client", "source"):
        s = sub.add_parser(name)
        s.add_argument("--host", required=True)
        s.add_argument("--port", type=int, required=True)
        if name == "echo-client":
            s.add_argument("--count", type=int, default=20)
        else:
            s.add_argument("--seconds", type=float, default=4.0)
    a = p.parse_args(argv)
    if a.cmd == "echo-server":
        echo_server(a.port)
    elif a.cmd == "sink":
        print(json.dumps(sink(a.port, a.warmup)), flush=True)
    elif a.cmd == "echo-client":
        print(json.dumps(echo_client(a.host, a.port, a.count)), flush=True)
    else:
        print(json.dumps(source(a.host, a.port, a.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
