#!/usr/bin/env python
"""Loopback throughput of the gRPC transport between two processes, vs raw asyncio TCP.

Every receiver runs in its own subprocess (started once, torn down at exit); this
process is the sender. Configurations are measured in interleaved rounds, so a
burst of load from other work on the machine hits all of them alike.
``ratio_vs_tcp`` is the median rate of a row over the median rate of raw asyncio
TCP in the same run (medians: one quiet moment must not decide a ratio);
``cpu_s_per_gib`` is the CPU time both processes spent per GiB moved, which
depends far less on other load. Writes bench/results/transport.json (+ .png).

    PYTHONPATH=$PWD python bench/transport.py [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import platform
import resource
import statistics
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from wan_diloco.transport import (  # noqa: E402
    Ack, Frame, SyncerClient, TlsConfig, TransportConfig, TransportServer, run, tune_for_link,
)
from wan_diloco.transport.dev_certs import make_dev_certs  # noqa: E402
from wan_diloco.runtime.launch_cluster import free_port  # noqa: E402
from wan_diloco.transport.loop import have_uvloop  # noqa: E402
from wan_diloco.transport.security import channel_credentials, server_credentials  # noqa: E402

from int4_codec import load_codec  # noqa: E402  (bench/int4_codec.py)

TOKEN = "bench-token-not-secret"
MiB = 1 << 20
MESSAGE_SIZES = (256 << 10, 1 * MiB, 4 * MiB)  # gRPC message sizes compared (``chunk_bytes``)


# ---- receivers (run in a child process) ---------------------------------------

class CountingHandler:
    """Counts fragments; with ``decode`` set, decodes each payload like a syncer would."""

    def __init__(self, decode=None):
        self.decode = decode

    async def on_metadata(self, msg):
        return None

    async def on_fragment(self, frame):
        values = frame.meta.get("values", 0)
        if self.decode is not None and values:  # warm-up uploads carry no values
            await asyncio.to_thread(self.decode, frame.payload, values)
        return Ack("bench", global_step=frame.meta.get("index", 0))

    def subscribe(self, msg):
        raise NotImplementedError

    async def bulk(self, request):
        raise NotImplementedError


class _Sink(asyncio.BufferedProtocol):
    """Raw TCP receiver: an 8-byte length, then that many bytes read with recv_into
    into one reusable buffer; replies with the count (TLS cannot half-close)."""

    def __init__(self):
        self.buf, self.n, self.expected = bytearray(4 * MiB), 0, None

    def connection_made(self, transport):
        self.transport = transport

    def get_buffer(self, sizehint):
        return self.buf

    def buffer_updated(self, nbytes):
        if self.expected is None:  # the sender writes the prefix alone, so it arrives first
            self.expected = int.from_bytes(self.buf[:8], "little") + 8
        self.n += nbytes
        if self.n >= self.expected:
            self.transport.write((self.n - 8).to_bytes(8, "little"))


def server_ssl_context(tls_dir: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(f"{tls_dir}/server.pem", f"{tls_dir}/server.key")
    return ctx


def transport_config(spec: dict) -> TransportConfig:
    base = TransportConfig(channels=spec["channels"], max_inflight_uploads=max(8, spec["streams"]))
    if spec["settings"] == "tuned":
        tuned = tune_for_link(spec["rate_gbit_s"], spec["rtt_s"])
        base = dataclasses.replace(tuned, channels=spec["channels"], max_inflight_uploads=base.max_inflight_uploads)
    if spec.get("unstriped"):  # every fragment on one stream (the transport before striping)
        base = dataclasses.replace(base, stripe_min_bytes=0)
    if spec.get("direct_port"):  # direct stripes (transport/direct.py): both sides name the receiver's port
        base = dataclasses.replace(base, direct_port=spec["direct_port"])
    if spec.get("stripe_min_bytes"):
        base = dataclasses.replace(base, stripe_min_bytes=spec["stripe_min_bytes"])
    if spec.get("chunk_bytes"):  # the gRPC message size (a receiver takes messages up to its own)
        base = dataclasses.replace(base, chunk_bytes=spec["chunk_bytes"])
    if spec.get("tls_dir"):
        d = spec["tls_dir"]
        side = spec.get("side", "client")
        tls = (TlsConfig(cert_file=f"{d}/server.pem", key_file=f"{d}/server.key") if side == "server"
               else TlsConfig(ca_file=f"{d}/ca.pem"))
        base = dataclasses.replace(base, tls=tls)
    return base


async def serve(spec: dict) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # The parent closes our stdin to stop us (also if it dies).
    threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)), daemon=True).start()
    if spec["kind"] == "tcp":
        ctx = server_ssl_context(spec["tls_dir"]) if spec.get("tls_dir") else None
        server = await loop.create_server(_Sink, "127.0.0.1", 0, ssl=ctx)
        port = server.sockets[0].getsockname()[1]
        print(json.dumps({"port": port}), flush=True)
        async with server:
            await stop.wait()
        return
    if spec["kind"] == "floor":
        await serve_floor(spec, stop)
        return
    decode = load_codec()[2] if spec.get("decode") else None
    if spec.get("direct"):
        spec = {**spec, "direct_port": free_port()}
    config = transport_config({**spec, "side": "server"})
    server = TransportServer(CountingHandler(decode), TOKEN, config, "127.0.0.1:0")
    port = await server.start()
    print(json.dumps({"port": port, "direct_port": spec.get("direct_port", 0)}), flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop(0)


async def serve_floor(spec: dict, stop: asyncio.Event) -> None:
    """gRPC's own floor: a bare grpc.aio server whose one method reads every message and drops it (no
    framing, reassembly, checksum or handler of ours), with the transport's server options and TLS."""
    async def sink(requests, context):
        n = 0
        async for chunk in requests:
            n += len(chunk)
        return n.to_bytes(8, "little")

    config = transport_config({**spec, "side": "server"})
    server = grpc.aio.server(options=config.server_options())
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "floor", {"Sink": grpc.stream_unary_rpc_method_handler(sink)}),))
    if config.tls is not None:
        port = server.add_secure_port("127.0.0.1:0", server_credentials(config.tls))
    else:
        port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop(0)


@contextlib.contextmanager
def receiver(spec: dict):
    """A receiver subprocess for ``spec``; yields (port, pid, what it printed); always torn down."""
    proc = subprocess.Popen([sys.executable, __file__, "--serve", json.dumps(spec)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"receiver {spec} exited with {proc.wait()}")
        info = json.loads(line)
        yield info["port"], proc.pid, info
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- senders (this process) ---------------------------------------------------

@functools.lru_cache(maxsize=4)
def random_bytes(n: int) -> bytes:
    """Made once: generating them inside a measurement would be charged to the sender's CPU."""
    return os.urandom(n)


async def send_tcp(port: int, total_bytes: int, tls_dir: str | None) -> float:
    ctx = None
    if tls_dir:
        ctx = ssl.create_default_context(cafile=f"{tls_dir}/ca.pem")
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    buf = random_bytes(4 * MiB)
    n_chunks = total_bytes // len(buf)
    writer.write((n_chunks * len(buf)).to_bytes(8, "little"))
    await writer.drain()
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    for _ in range(n_chunks):
        writer.write(buf)
        await writer.drain()
    got = int.from_bytes(await reader.readexactly(8), "little")
    dt = time.perf_counter() - t0
    writer.close()
    assert got == n_chunks * len(buf), (got, total_bytes)
    return dt


async def send_fragments(port: int, spec: dict, total_bytes: int, fragment_bytes: int) -> tuple[float, int]:
    """Upload ``total_bytes`` as fragments over ``streams`` concurrent uploads."""
    config = transport_config(spec)
    payload = random_bytes(fragment_bytes)
    n_fragments = max(1, total_bytes // fragment_bytes)
    async with SyncerClient(f"127.0.0.1:{port}", TOKEN, config) as client:
        warm = Frame("bench", 0, {}, b"w")
        await asyncio.gather(*(client.upload_fragment(warm) for _ in range(config.channels)))
        todo = iter(range(n_fragments))

        async def worker():
            for i in todo:
                meta = {"index": i, "clock": {"bench": i}}  # about the size of a real upload's meta
                await client.upload_fragment(Frame("bench", i, meta, payload))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(spec["streams"])))
        return time.perf_counter() - t0, n_fragments * fragment_bytes


async def send_floor(port: int, spec: dict, total_bytes: int) -> tuple[float, int]:
    """``total_bytes`` in ``chunk_bytes`` messages on one gRPC call per channel to ``serve_floor``."""
    config = transport_config(spec)
    chunk = random_bytes(config.chunk_bytes)
    per_call = total_bytes // config.channels // len(chunk)
    creds = channel_credentials(config.tls) if config.tls is not None else None
    target = f"127.0.0.1:{port}"
    channels = [grpc.aio.secure_channel(target, creds, options=config.client_options()) if creds else
                grpc.aio.insecure_channel(target, options=config.client_options()) for _ in range(config.channels)]
    try:
        calls = [c.stream_unary("/floor/Sink") for c in channels]
        await asyncio.gather(*(call(iter([chunk])) for call in calls))  # connections up
        t0 = time.perf_counter()
        got = await asyncio.gather(*(call(itertools.repeat(chunk, per_call)) for call in calls))
        dt = time.perf_counter() - t0
    finally:
        await asyncio.gather(*(c.close() for c in channels))
    assert sum(int.from_bytes(g, "little") for g in got) == per_call * len(chunk) * len(channels)
    return dt, per_call * len(chunk) * len(channels)


async def send_int4(port: int, spec: dict, total_wire_bytes: int, values: int) -> tuple[float, int]:
    """Encode float32 fragments to int4, upload, receiver decodes; wire bytes / time."""
    _, encode, _ = load_codec()
    config = transport_config(spec)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(values, dtype=np.float32) for _ in range(spec["streams"])]
    per_fragment = len(encode(grads[0]))
    n_fragments = max(spec["streams"], total_wire_bytes // per_fragment)
    sent = 0
    async with SyncerClient(f"127.0.0.1:{port}", TOKEN, config) as client:
        warm = Frame("bench", 0, {}, b"w")
        await asyncio.gather(*(client.upload_fragment(warm) for _ in range(config.channels)))
        todo = iter(range(n_fragments))

        async def worker(grad):
            nonlocal sent
            for i in todo:
                wire = await asyncio.to_thread(encode, grad)
                await client.upload_fragment(Frame("bench", i, {"index": i, "values": values}, wire))
                sent += len(wire)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(g) for g in grads))
        return time.perf_counter() - t0, sent


def codec_rates(values: int) -> dict:
    name, encode, decode = load_codec()
    x = np.random.default_rng(1).standard_normal(values, dtype=np.float32)
    best_e = best_d = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        wire = encode(x)
        t1 = time.perf_counter()
        y = decode(wire, values)
        t2 = time.perf_counter()
        best_e, best_d = min(best_e, t1 - t0), min(best_d, t2 - t1)
    err = float(np.abs(np.asarray(y) - x).max() / np.abs(x).max())
    n = len(wire)
    return {"codec": name, "wire_bytes_per_value": n / values, "max_rel_error": err,
            "encode_wire_gbit_s": n * 8 / best_e / 1e9, "decode_wire_gbit_s": n * 8 / best_d / 1e9}


# ---- the run -------------------------------------------------------------------

def cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system, all threads) used so far by (this process: the sender, ``pid``: the receiver)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return me.ru_utime + me.ru_stime, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    colors = {"tcp": "#888888", "grpc": "#3b75af", "int4": "#c0504d", "floor": "#9bbbd9", "direct": "#4f9d69"}
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.4))
    y = range(len(rows))
    for i, r in enumerate(rows):
        ax.barh(i, r["gbit_s"], color=colors[r["kind"]], hatch="//" if r["tls"] else None, edgecolor="white")
        ax.text(r["gbit_s"], i, f" {r['gbit_s']:.1f}  ({r['ratio_vs_tcp']:.2f}x tcp)", va="center", fontsize=8)
    ax.set_yticks(list(y), [r["name"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("Gbit/s, loopback, two processes (median of rounds; hatched = TLS)")
    ax.set_title(f"transport throughput (int4 codec: {report['codec']}; load avg {report['machine']['loadavg_1m_at_end']})",
                 fontsize=9)
    ax.set_xlim(0, max(r["gbit_s"] for r in rows) * 1.35)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def grpc_rows(channels_many: int) -> list[dict]:
    rows = []
    for settings in ("default", "tuned"):
        rows += [
            {"name": f"grpc 1 stream, {settings}", "streams": 1, "channels": 1, "settings": settings},
            {"name": f"grpc 8 streams, {settings}", "streams": 8, "channels": 1, "settings": settings},
            {"name": f"grpc 8 streams x {channels_many} channels, {settings}", "streams": 8,
             "channels": channels_many, "settings": settings},
        ]
    # One fragment at a time over several connections: what striping is for (a learner with one upload).
    rows += [
        {"name": f"grpc 1 stream x {channels_many} channels, tuned, unstriped", "streams": 1,
         "channels": channels_many, "settings": "tuned", "unstriped": True},
        {"name": f"grpc 1 stream x {channels_many} channels, tuned, striped", "streams": 1,
         "channels": channels_many, "settings": "tuned"},
    ]
    rows += [
        {"name": "grpc+tls 1 stream, tuned", "streams": 1, "channels": 1, "settings": "tuned", "tls": True},
        {"name": f"grpc+tls 8 streams x {channels_many} channels, tuned", "streams": 8,
         "channels": channels_many, "settings": "tuned", "tls": True},
    ]
    # The gRPC message size (``chunk_bytes``) against the default's, one striped upload at a time over TLS.
    default = TransportConfig().chunk_bytes
    rows += [{"name": f"grpc+tls 1 stream x {channels_many} channels, tuned, {size >> 10} KiB messages"
              + (" (default)" if size == default else ""), "streams": 1, "channels": channels_many,
              "settings": "tuned", "tls": True, "chunk_bytes": size} for size in MESSAGE_SIZES]
    return rows


async def measure(row: dict, port: int, args, tls_dir: str) -> tuple[float, int]:
    spec = {**{k: v for k, v in row.items() if k != "port"}, "rate_gbit_s": args.rate_gbit_s, "rtt_s": args.rtt_s,
            "tls_dir": tls_dir if row.get("tls") else None}
    if row["kind"] == "tcp":
        dt = await send_tcp(port, args.total_bytes, spec["tls_dir"])
        return dt, args.total_bytes // (4 * MiB) * 4 * MiB
    if row["kind"] == "int4":
        return await send_int4(port, spec, args.total_bytes // 2, args.int4_values)
    if row["kind"] == "floor":
        return await send_floor(port, spec, args.total_bytes)
    return await send_fragments(port, spec, args.total_bytes, args.fragment_bytes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller transfers, fewer rounds (< 1 min)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--total-mib", type=int, default=None, help="bytes per measurement")
    p.add_argument("--fragment-mib", type=int, default=32)
    p.add_argument("--channels", type=int, default=4, help="channels for the multi-channel rows")
    p.add_argument("--rate-gbit-s", type=float, default=5.0, help="link that tune_for_link tunes for")
    p.add_argument("--rtt-s", type=float, default=0.05)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "transport.json"))
    p.add_argument("--serve", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        run(serve(json.loads(args.serve)))
        return 0
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.total_bytes = (args.total_mib or (256 if args.quick else 1024)) * MiB
    args.fragment_bytes = min(args.fragment_mib * MiB, args.total_bytes)
    args.int4_values = 8 * MiB if args.quick else 16 * MiB

    c = args.channels
    rows = ([{"name": "raw asyncio tcp", "kind": "tcp"}, {"name": "raw asyncio tcp+tls", "kind": "tcp", "tls": True}]
            + [{**r, "kind": "grpc"} for r in grpc_rows(c)]
            # gRPC with nothing of ours on the receiving side, and our stripes without gRPC (direct.py)
            + [{"name": f"grpc{t} floor: {c} calls dropping every message, tuned", "kind": "floor", "channels": c,
                "streams": 1, "settings": "tuned", "tls": bool(t)} for t in ("", "+tls")]
            + [{"name": f"direct{t} stripes, 1 stream x {c} channels, tuned", "kind": "direct", "streams": 1,
                "channels": c, "settings": "tuned", "tls": bool(t), "direct": True} for t in ("", "+tls")]
            + [{"name": f"int4 end to end, 4 streams x {c} channels, tuned", "kind": "int4",
                "streams": 4, "channels": c, "settings": "tuned", "decode": True},
               {"name": f"int4 end to end, direct stripes, 4 streams x {c} channels, tuned", "kind": "int4",
                "streams": 4, "channels": c, "settings": "tuned", "decode": True, "direct": True,
                "stripe_min_bytes": 2 * MiB}])
    results = {r["name"]: [] for r in rows}
    cpu = {r["name"]: [] for r in rows}  # per round: (sender, receiver) CPU s per GiB
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="wd-bench-") as tmp, contextlib.ExitStack() as stack:
        make_dev_certs(tmp)
        ports = {}
        for r in rows:  # one receiver per distinct server setup, started once
            key = (r["kind"], r.get("settings"), bool(r.get("tls")), bool(r.get("decode")), bool(r.get("direct")))
            if key not in ports:
                kind = r["kind"] if r["kind"] in ("tcp", "floor") else "grpc"
                spec = {"kind": kind, "settings": r.get("settings", "default"), "direct": bool(r.get("direct")),
                        "tls_dir": tmp if r.get("tls") else None, "decode": r.get("decode", False),
                        "channels": 1, "streams": 1, "rate_gbit_s": args.rate_gbit_s, "rtt_s": args.rtt_s,
                        "chunk_bytes": max(MESSAGE_SIZES)}  # takes every row's messages
                ports[key] = stack.enter_context(receiver(spec))
            r["port"] = ports[key]
            r["direct_port"] = ports[key][2].get("direct_port", 0)
        t_start = time.perf_counter()
        for rnd in range(args.rounds):
            for r in rows:
                port, pid, _ = r["port"]
                s0, r0 = cpu_s(pid)
                dt, nbytes = run(measure(r, port, args, tmp))
                s1, r1 = cpu_s(pid)
                gib = nbytes / (1 << 30)
                cpu[r["name"]].append(((s1 - s0) / gib, (r1 - r0) / gib))
                results[r["name"]].append(nbytes * 8 / dt / 1e9)
                print(f"round {rnd + 1}/{args.rounds}  {r['name']:<52} {results[r['name']][-1]:6.1f} Gbit/s  "
                      f"CPU s/GiB sender {cpu[r['name']][-1][0]:.2f} receiver {cpu[r['name']][-1][1]:.2f}", flush=True)
                # Written as each row finishes: a run cut short (or still going) has its rows so far.
                out.write_text(json.dumps(summarize(rows, results, cpu, args, time.perf_counter() - t_start),
                                          indent=2) + "\n")
        elapsed = time.perf_counter() - t_start

    report = summarize(rows, results, cpu, args, elapsed, codec_rates(args.int4_values))
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(json.dumps(report["targets"], indent=2))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def summarize(rows: list[dict], results: dict, cpu: dict, args, elapsed: float, codec: dict | None = None) -> dict:
    """The report of the rounds so far (``partial`` until ``codec``, measured last, is given).

    CPU per GiB is the best round's (it depends little on other load; the rate does); the ratios
    are against raw TCP (and, for TLS rows, raw TLS over TCP) measured in the same run."""
    done = [r for r in rows if results[r["name"]]]

    def best_cpu(name: str) -> tuple[float, float]:
        return min(cpu[name], key=sum)

    tcp = statistics.median(results["raw asyncio tcp"])
    tcp_best = max(results["raw asyncio tcp"])
    tcp_cpu = best_cpu("raw asyncio tcp")
    tls_cpu = best_cpu("raw asyncio tcp+tls") if results["raw asyncio tcp+tls"] else None
    out_rows = []
    for r in done:
        rates, (send, recv) = results[r["name"]], best_cpu(r["name"])
        row = {
            "name": r["name"], "kind": r["kind"], "tls": bool(r.get("tls")), "settings": r.get("settings"),
            "streams": r.get("streams", 1), "channels": r.get("channels", 1), "striped": striped(r, args),
            "gbit_s": round(statistics.median(rates), 2), "gbit_s_best": round(max(rates), 2),
            "gbit_s_rounds": [round(x, 2) for x in rates],
            "ratio_vs_tcp": round(statistics.median(rates) / tcp, 3),
            "ratio_vs_tcp_best": round(max(rates) / tcp_best, 3),
            "cpu_s_per_gib": round(send + recv, 3),
            "sender_cpu_s_per_gib": round(send, 3), "receiver_cpu_s_per_gib": round(recv, 3),
            "cpu_vs_tcp": round((send + recv) / sum(tcp_cpu), 2),
            "sender_cpu_vs_tcp": round(send / tcp_cpu[0], 2), "receiver_cpu_vs_tcp": round(recv / tcp_cpu[1], 2),
        }
        if r.get("tls") and tls_cpu is not None:
            row["cpu_vs_tls_tcp"] = round((send + recv) / sum(tls_cpu), 2)
            row["receiver_cpu_vs_tls_tcp"] = round(recv / tls_cpu[1], 2)
        out_rows.append(row)
    tuned = tune_for_link(args.rate_gbit_s, args.rtt_s)
    report = {
        "benchmark": "transport",
        "quick": args.quick,
        "partial": codec is None,
        "what": "loopback, sender and receiver in separate processes; gbit_s = median of interleaved rounds; "
                "ratio_vs_tcp = median / median of raw asyncio TCP (recv_into) in the same run; cpu_s_per_gib = "
                "CPU seconds of both processes per GiB (best round), split into sender_ and receiver_; *_vs_tcp and "
                "*_vs_tls_tcp: the same over raw TCP's (raw TLS over TCP's) in the same run",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "grpcio": grpc.__version__, "uvloop": have_uvloop(),
                    "loadavg_1m_at_end": round(os.getloadavg()[0], 2)},
        "bytes_per_measurement": args.total_bytes, "fragment_bytes": args.fragment_bytes, "rounds": args.rounds,
        "elapsed_s": round(elapsed, 1),
        "tuned_for": {"rate_gbit_s": args.rate_gbit_s, "rtt_s": args.rtt_s,
                      "settings": {k: getattr(tuned, k) for k in
                                   ("chunk_bytes", "lookahead_bytes", "max_frame_bytes", "read_chunk_bytes",
                                    "bdp_probe")}},
        "default_settings": {k: getattr(TransportConfig(), k) for k in
                             ("chunk_bytes", "lookahead_bytes", "max_frame_bytes", "read_chunk_bytes", "bdp_probe",
                              "stripe_min_bytes")},
        "tcp_gbit_s": round(tcp, 2),
        "tcp_cpu_s_per_gib": round(sum(tcp_cpu), 3),
        "rows": out_rows,
    }
    if codec is None:
        return report
    grpc_clear = [r for r in out_rows if r["kind"] == "grpc" and not r["tls"]]
    grpc_tls = [r for r in out_rows if r["kind"] == "grpc" and r["tls"]]
    best_clear = max(grpc_clear, key=lambda r: r["ratio_vs_tcp"])
    cheapest_clear = min(grpc_clear, key=lambda r: r["cpu_vs_tcp"])
    best_tls = max(grpc_tls, key=lambda r: r["ratio_vs_tcp"])
    int4_row, int4_direct = (next(r for r in out_rows if r["kind"] == "int4" and ("direct" in r["name"]) == d)
                             for d in (False, True))
    floor = {r["tls"]: r for r in out_rows if r["kind"] == "floor"}
    direct = {r["tls"]: r for r in out_rows if r["kind"] == "direct"}
    by_name = {r["name"]: r for r in out_rows}
    pair = [by_name[f"grpc 1 stream x {args.channels} channels, tuned, {k}"] for k in ("unstriped", "striped")]
    sizes = {r["name"]: r for r in out_rows if "KiB messages" in r["name"]}
    default = next(r for n, r in sizes.items() if n.endswith("(default)"))
    report.update({
        "codec": codec["codec"],
        "codec_alone": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in codec.items()},
        "striping": {"rows": [pair[0]["name"], pair[1]["name"]],
                     "striped_over_unstriped_gbit_s": round(pair[1]["gbit_s"] / pair[0]["gbit_s"], 3),
                     "striped_over_unstriped_cpu": round(pair[1]["cpu_s_per_gib"] / pair[0]["cpu_s_per_gib"], 3)},
        "message_sizes": {  # per row: its CPU per GiB over the default message size's, same run
            n: {"gbit_s": r["gbit_s"], "sender_cpu_vs_default": round(r["sender_cpu_s_per_gib"] /
                                                                      default["sender_cpu_s_per_gib"], 3),
                "receiver_cpu_vs_default": round(r["receiver_cpu_s_per_gib"] / default["receiver_cpu_s_per_gib"], 3)}
            for n, r in sizes.items()},
        "targets": {
            "best_cleartext_ratio": {"target": 0.5, "row": best_clear["name"],
                                     "measured": best_clear["ratio_vs_tcp"],
                                     "met": best_clear["ratio_vs_tcp"] >= 0.5},
            "best_cleartext_cpu_vs_tcp": {"target": 2.0, "row": cheapest_clear["name"],
                                          "measured": cheapest_clear["cpu_vs_tcp"],
                                          "met": cheapest_clear["cpu_vs_tcp"] <= 2.0},
            "tls_ratio": {"target": 0.3, "row": best_tls["name"], "measured": best_tls["ratio_vs_tcp"],
                          "met": best_tls["ratio_vs_tcp"] >= 0.3},
            "tls_receiver_cpu_vs_tls_tcp": {"target": 1.5, "row": best_tls["name"],
                                            "measured": best_tls.get("receiver_cpu_vs_tls_tcp"),
                                            "met": best_tls.get("receiver_cpu_vs_tls_tcp", 99) <= 1.5},
            "int4_end_to_end_gbit_s": {"target": 3.0, "row": int4_row["name"], "measured": int4_row["gbit_s"],
                                       "met": int4_row["gbit_s"] >= 3.0, "codec": codec["codec"]},
            "direct_cleartext_ratio": {"target": 0.5, "row": direct[False]["name"],
                                       "measured": direct[False]["ratio_vs_tcp"],
                                       "met": direct[False]["ratio_vs_tcp"] >= 0.5},
            "direct_cleartext_cpu_vs_tcp": {"target": 2.0, "row": direct[False]["name"],
                                            "measured": direct[False]["cpu_vs_tcp"],
                                            "met": direct[False]["cpu_vs_tcp"] <= 2.0},
            "direct_tls_receiver_cpu_vs_tls_tcp": {"target": 1.5, "row": direct[True]["name"],
                                                   "measured": direct[True].get("receiver_cpu_vs_tls_tcp"),
                                                   "met": direct[True].get("receiver_cpu_vs_tls_tcp", 99) <= 1.5},
            "int4_end_to_end_direct_gbit_s": {"target": 3.0, "row": int4_direct["name"],
                                              "measured": int4_direct["gbit_s"], "met": int4_direct["gbit_s"] >= 3.0},
        },
        # What gRPC costs with nothing of ours on the receiving side: if its receiver is above the targets,
        # no change of ours to the gRPC path can meet them.
        "grpc_floor": {"cleartext_receiver_cpu_vs_tcp": floor[False]["receiver_cpu_vs_tcp"],
                       "tls_receiver_cpu_vs_tls_tcp": floor[True].get("receiver_cpu_vs_tls_tcp"),
                       "cleartext_ratio_vs_tcp": floor[False]["ratio_vs_tcp"]},
    })
    return report


def striped(row: dict, args) -> bool:
    """Whether this row's fragments travel striped (the client's own rule, ``upload_fragment``)."""
    if row["kind"] == "tcp" or row.get("unstriped"):
        return False
    size = args.fragment_bytes if row["kind"] in ("grpc", "direct") else 0  # int4 fragments: a few MiB
    return row.get("channels", 1) > 1 and size >= 2 * TransportConfig().stripe_min_bytes


if __name__ == "__main__":
    sys.exit(main())
