#!/usr/bin/env python
"""The production transport between two emulated regions: a server, a link probe, a timed upload.

Started inside region namespaces by bench/wan.py and tests/regions (one JSON
line on stdout each), so every byte crosses the emulated link with the same
TLS, channels and HTTP/2 settings a run uses.

    wan_peer.py server --host H --tls DIR [--tuned RATE,RTT]      prints {"ready": port}, serves until stdin closes
    wan_peer.py probe  --target H:P --tls DIR --samples N           prints the link samples
    wan_peer.py upload --target H:P --tls DIR --mib M --fragments F [--rounds R] [--tuned RATE,RTT] [--auto-channels]
                       [--unstriped] [--direct-port P]
    wan_peer.py tls-sink --host H --tls DIR       raw TLS over TCP: prints {"ready": port}, then one connection's
                                                  {"bytes", "cpu_s", "wall_s"} (the receiver's reference)
    wan_peer.py tls-send --target H:P --tls DIR --mib M                        prints {"gbit_s", "cpu_s", "bytes"}
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import ssl
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wan_diloco.transport import (  # noqa: E402
    Ack, Frame, ProbePolicy, SyncerClient, TlsConfig, TransportConfig, TransportServer, channels_for_link,
    host_socket_buffer_bytes, run, tune_for_link,
)

TOKEN = "wan-bench-token-not-secret"


class Sink:
    """Acknowledges every upload; nothing else (probes are served by the transport itself)."""

    async def on_metadata(self, frame):
        return None

    async def on_fragment(self, frame):
        return Ack(sender="sink", global_step=0)

    def subscribe(self, msg):
        raise NotImplementedError

    async def bulk(self, request):
        raise NotImplementedError


def config(args) -> TransportConfig:
    d = Path(args.tls)
    tls = TlsConfig(cert_file=str(d / "server.pem"), key_file=str(d / "server.key"), ca_file=str(d / "ca.pem"))
    base = TransportConfig(tls=tls, max_message_bytes=1 << 30, call_timeout_s=120.0)
    if args.tuned:
        rate, rtt_ms = (float(x) for x in args.tuned.split(","))
        # For this host's TCP buffers (the emulator's [regions] tcp_buffer_max_bytes in its namespaces).
        base = tune_for_link(rate, rtt_ms / 1e3, base, socket_buffer_bytes=host_socket_buffer_bytes())
    if args.unstriped:  # every fragment on one HTTP/2 stream (the transport before striping)
        base = dataclasses.replace(base, stripe_min_bytes=0)
    if args.direct_port:  # striped uploads over plain TLS connections to this port (transport/direct.py)
        base = dataclasses.replace(base, direct_port=args.direct_port)
    return dataclasses.replace(base, channels=args.channels) if args.channels else base


async def serve(args) -> None:
    server = TransportServer(Sink(), TOKEN, config(args), f"{args.host}:0")
    await server.start()
    print(json.dumps({"ready": server.port}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await server.stop(0)


async def probe(args) -> None:
    """Probes as a learner makes them (``ProbePolicy``): grown at start until settled, then ``--samples`` counted."""
    pol, out, report = ProbePolicy(probe_seconds=args.probe_seconds, duty=0.5, every_s=0), [], {}
    async with SyncerClient(args.target, TOKEN, config(args)) as client:
        while len(out) < args.samples:
            nbytes, max_s = pol.request()
            s = await client.probe("learner-0", nbytes, report, max_s=max_s)
            report = s.to_event()
            if pol.take(s):
                out.append(report)
    print(json.dumps({"samples": out}), flush=True)


async def widen_from_probes(client: SyncerClient) -> float:
    """What a learner does with ``transport.auto_channels``: probe, open the connections the measured link
    needs (``channels_for_link``), probe again, until no more are needed. Returns the last rate measured."""
    pol, buf = ProbePolicy(duty=0.5, every_s=0), host_socket_buffer_bytes()
    while True:
        nbytes, max_s = pol.request()
        s = await client.probe("learner-0", nbytes, max_s=max_s)
        if not pol.take(s):
            continue
        want = channels_for_link(s.rate_gbit_s, s.rtt_s, buf, client.channels)
        if want <= client.channels:
            return s.rate_gbit_s
        await client.widen(want)
        pol.restart()


async def upload(args) -> None:
    """``--rounds`` timed rounds of ``--fragments`` concurrent uploads on one client: the first on
    connections only just opened (cold: TCP and HTTP/2 windows still growing), the rest warm, as
    a run's connections are after its first fragments."""
    cfg = config(args)
    payload = bytes(args.mib << 20)
    rounds, probed = [], None
    async with SyncerClient(args.target, TOKEN, cfg) as client:
        await client.upload_fragment(Frame("learner-0", 0, {}, payload[: 1 << 20]))  # connections up
        if args.auto_channels:
            probed = await widen_from_probes(client)
        cpu0, wall0 = time.process_time(), time.monotonic()
        for _ in range(args.rounds):
            t0 = time.monotonic()
            await asyncio.gather(*(client.upload_fragment(Frame("learner-0", i, {}, payload))
                                   for i in range(args.fragments)))
            rounds.append(args.fragments * len(payload) * 8 / (time.monotonic() - t0) / 1e9)
        client_cpu_s = time.process_time() - cpu0
        client_cores = client_cpu_s / (time.monotonic() - wall0)
        channels = client.channels
    warm = sorted(rounds[1:]) or rounds
    print(json.dumps({"gbit_s": warm[len(warm) // 2], "cold_gbit_s": rounds[0], "rounds_gbit_s": rounds,
                      "client_cores": client_cores, "probed_gbit_s": probed,
                      "client_cpu_s_per_gib": client_cpu_s / (args.rounds * args.fragments * len(payload) / (1 << 30)),
                      "socket_buffer_bytes": host_socket_buffer_bytes(),
                      "bytes_per_round": args.fragments * len(payload), "channels": channels,
                      "chunk_bytes": cfg.chunk_bytes, "lookahead_bytes": cfg.lookahead_bytes}), flush=True)


async def tls_sink(args) -> None:
    """One raw TLS connection's bytes into one reused buffer (``bench/transport.py``'s receiver), and the
    CPU seconds that took this process: what TLS over TCP costs a receiver without gRPC."""
    from bench.transport import _Sink, server_ssl_context
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    class Timed(_Sink):
        def connection_made(self, transport):  # after the handshake
            super().connection_made(transport)
            self.cpu0, self.t0 = time.process_time(), time.monotonic()

        def buffer_updated(self, nbytes):
            super().buffer_updated(nbytes)
            if self.expected is not None and self.n >= self.expected and not done.done():
                done.set_result({"bytes": self.n - 8, "cpu_s": time.process_time() - self.cpu0,
                                 "wall_s": time.monotonic() - self.t0})

    server = await loop.create_server(Timed, args.host, 0, ssl=server_ssl_context(args.tls))
    print(json.dumps({"ready": server.sockets[0].getsockname()[1]}), flush=True)
    print(json.dumps(await done), flush=True)
    server.close()


async def tls_send(args) -> None:
    """``--mib`` MiB over one raw TLS connection, in 4 MiB writes; the rate until the receiver's count is back."""
    host, port = args.target.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port), ssl=ssl.create_default_context(
        cafile=str(Path(args.tls) / "ca.pem")))
    buf, n = bytes(4 << 20), max(1, args.mib // 4)
    writer.write((n * len(buf)).to_bytes(8, "little"))
    cpu0, t0 = time.process_time(), time.monotonic()
    for _ in range(n):
        writer.write(buf)
        await writer.drain()
    got = int.from_bytes(await reader.readexactly(8), "little")
    dt, cpu = time.monotonic() - t0, time.process_time() - cpu0
    writer.close()
    print(json.dumps({"gbit_s": got * 8 / dt / 1e9, "cpu_s": cpu, "bytes": got}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("server", "probe", "upload", "tls-sink", "tls-send"))
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--target")
    p.add_argument("--tls", required=True)
    p.add_argument("--tuned", help="RATE_GBIT_S,RTT_MS: transport.tune_for_link settings instead of defaults")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--probe-seconds", type=float, default=0.2)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--channels", type=int, default=0, help="HTTP/2 connections (default: the settings')")
    p.add_argument("--auto-channels", action="store_true",
                   help="upload: first widen the connections from link probes, as a learner does")
    p.add_argument("--rounds", type=int, default=1, help="upload: timed rounds on the same connections")
    p.add_argument("--unstriped", action="store_true", help="upload: never stripe a fragment over connections")
    p.add_argument("--direct-port", type=int, default=0, help="direct stripes on this port (both sides)")
    args = p.parse_args()
    run({"server": serve, "probe": probe, "upload": upload, "tls-sink": tls_sink, "tls-send": tls_send}[args.mode](args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
