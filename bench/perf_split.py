"""Where a process's CPU went while a block ran, by shared object (``perf record -p``), in groups a
transport row can be read by: the kernel (TCP, copies to user space), gRPC's C core (HTTP/2 framing and
BoringSSL, which grpcio links in statically and strips: the two cannot be told apart by symbol), OpenSSL
(Python's ``ssl``: the raw TLS reference), Python (interpreter, event loop, our reassembly), libc (memcpy
of the copies) and xxhash. Needs root and ``perf``; without them the split is empty.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile

GROUPS = (
    ("kernel", ("[kernel", "[vdso")),
    ("grpc_core_http2_and_tls", ("cygrpc",)),
    ("openssl_tls", ("libcrypto", "libssl")),
    ("python", ("libpython", "python3", "_asyncio", "loop.cpython", "_ssl.cpython", "_socket")),
    ("libc_memcpy", ("libc.so", "libc-")),
    ("xxhash", ("_xxhash",)),
)
SAMPLE_HZ = 499


def group_of(dso: str) -> str:
    return next((g for g, keys in GROUPS if any(k in dso for k in keys)), "other")


def shares(report: str) -> dict[str, float]:
    """Share of samples per group from ``perf report --sort dso --stdio -q`` text."""
    out: dict[str, float] = {}
    for line in report.splitlines():
        pct, sep, dso = line.strip().partition("%")
        try:
            share = float(pct) / 100
        except ValueError:
            continue
        if sep:
            out[group_of(dso.strip())] = out.get(group_of(dso.strip()), 0.0) + share
    return out


@contextlib.contextmanager
def profile(pid: int, out: dict):
    """Sample ``pid`` (every thread) while the block runs; ``out`` then holds each group's share of them."""
    if shutil.which("perf") is None:
        yield
        return
    fd, data = tempfile.mkstemp(prefix="wdl-perf-", suffix=".data")
    os.close(fd)
    rec = subprocess.Popen(["perf", "record", "-q", "-F", str(SAMPLE_HZ), "-p", str(pid), "-o", data],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        rec.send_signal(signal.SIGINT)
        try:
            rec.wait(30)
        except subprocess.TimeoutExpired:
            rec.kill()
            rec.wait()
        try:
            rep = subprocess.run(["perf", "report", "-i", data, "--sort", "dso", "--stdio", "-q"],
                                 capture_output=True, text=True, timeout=180)
            out.update(shares(rep.stdout))
        finally:
            os.unlink(data)
