"""User-space delay/jitter/loss for kernels without ``netem``: a TUN packet forwarder.

Run by :class:`wan_diloco.regions.emulator.Emulator` inside the router
namespace as its own process (``python -m wan_diloco.regions.forwarder``), so
it can be killed on its own and dies with the emulator (parent-death signal).
The router's policy routing sends every packet arriving from a region into
the TUN device; this process reads it, holds it for the one-way delay of the
links it crosses (source region's link + destination region's link), maybe
drops it, and writes it back into the TUN, where the kernel routes it on to
the destination's veth (and that veth's htb shaper). Each endpoint's own
kernel TCP therefore sees the configured RTT.

Addresses follow the emulator's layout: every region owns a /30 in its own /24
(10.77.<i>.0/30), so the first three address bytes name the region.
"""
from __future__ import annotations

import argparse
import fcntl
import heapq
import os
import random
import struct
import sys
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MAX_PACKET = 65536 + 64


def open_tun(name: str) -> int:
    """Attach to the existing (persistent) TUN device ``name``; returns its fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    ifr = struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI)
    fcntl.ioctl(fd, TUNSETIFF, ifr)
    return fd


def parse_link(spec: str) -> tuple[bytes, tuple[float, float, float]]:
    """``10.77.3=delay_s,jitter_s,loss_fraction`` -> (b'\\x0a\\x4d\\x03', (delay, jitter, loss))."""
    key, _, vals = spec.partition("=")
    octets = bytes(int(x) for x in key.split("."))
    if len(octets) != 3:
        raise ValueError(f"--link {spec!r}: key must be the first three address bytes, e.g. 10.77.3")
    delay, jitter, loss = (float(v) for v in vals.split(","))
    return octets, (delay, jitter, loss)


class Forwarder:
    """Delays, jitters and drops IPv4 packets between a TUN fd's read and write sides."""

    def __init__(self, fd: int, links: dict[bytes, tuple[float, float, float]], seed: int = 0):
        self.fd = fd
        self.links = links
        self.rng = random.Random(seed)
        self.heap: list[tuple[float, int, bytes]] = []
        self.cond = threading.Condition()
        self.last_release: dict[tuple[bytes, bytes], float] = {}
        self.seq = 0
        self.slack = 0.0  # running estimate of how late a timed wait wakes, seconds
        self.stats = {"in": 0, "out": 0, "dropped": 0}

    def schedule(self, pkt: bytes, now: float) -> None:
        """Queue one packet read from the TUN, or drop it."""
        if len(pkt) < 20 or pkt[0] >> 4 != 4:
            return  # only IPv4 is routed here; IPv6 noise (router solicitations) is dropped
        src, dst = pkt[12:15], pkt[16:19]
        delay = 0.0
        for key in (src, dst):
            link = self.links.get(key)
            if link is None:
                continue  # the syncer's region: no WAN link of its own
            d, j, loss = link
            if loss and self.rng.random() < loss:
                self.stats["dropped"] += 1
                return
            delay += d + (self.rng.uniform(-j, j) if j else 0.0)
        # Keep each direction in order even with jitter: TCP treats reordering as
        # loss, and a WAN path rarely reorders within one flow. (Under dense
        # traffic this pushes delays towards delay + jitter, unlike netem,
        # which reorders.)
        direction = (src, dst)
        release = max(now + delay, self.last_release.get(direction, 0.0))
        self.last_release[direction] = release
        with self.cond:
            self.seq += 1
            heapq.heappush(self.heap, (release, self.seq, pkt))
            if self.heap[0][1] == self.seq:
                self.cond.notify()

    def read_loop(self) -> None:
        """Read packets forever (blocking reads release the GIL)."""
        while True:
            pkt = os.read(self.fd, MAX_PACKET)
            self.stats["in"] += 1
            self.schedule(pkt, time.monotonic())

    def write_loop(self) -> None:
        """Write each packet back into the TUN at its release time."""
        while True:
            with self.cond:
                while not self.heap:
                    self.cond.wait()
                release = self.heap[0][0]
                now = time.monotonic()
                wait = release - now
                # Timed waits wake late (a few hundred us on some machines), which
                # would add to every RTT; so aim early by the lateness seen so far.
                if wait > self.slack:
                    target = wait - self.slack
                    if not self.cond.wait(target):  # timed out, rather than notified
                        late = time.monotonic() - now - target
                        self.slack = 0.9 * self.slack + 0.1 * min(max(late, 0.0), 0.005)
                    continue  # an earlier packet may have arrived meanwhile
                _, _, pkt = heapq.heappop(self.heap)
            try:
                os.write(self.fd, pkt)
                self.stats["out"] += 1
            except OSError:
                self.stats["dropped"] += 1  # e.g. no route: the kernel would drop it too


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tun", required=True, help="persistent TUN device to attach to")
    p.add_argument("--tag", required=True, help="emulator prefix; lets teardown find this process")
    p.add_argument("--link", action="append", default=[], help="A.B.C=delay_s,jitter_s,loss_fraction")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    links = dict(parse_link(s) for s in args.link)
    fwd = Forwarder(open_tun(args.tun), links, seed=args.seed)
    threading.Thread(target=fwd.read_loop, daemon=True, name="tun-read").start()
    print("ready", flush=True)  # the emulator waits for this line
    fwd.write_loop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
