"""An emulated WAN on this machine: one network namespace per region, joined by a router.

Layout (``prefix`` defaults to ``wdl``)::

    <prefix>-<region>  (one per region)     eth0 10.77.<i>.2/30, default via 10.77.<i>.1
           | veth
    <prefix>--router                          v<i> 10.77.<i>.1/30 for every region i
                                              htb (+ bfifo or netem) on each v<i> egress
                                              backend "tun": <prefix>tun + forwarder process

Every address is private to these namespaces; nothing is configured in the
host's namespace, so deleting the namespaces removes every device as well.
The one host-wide setting touched: a namespace may only pick a TCP congestion
control on the host's allowed list, so ``[regions] congestion_control``
(cubic, the usual Linux default) is added there while the emulator is up and
the list restored on teardown.
Rate is shaped with htb on the router: traffic towards a remote region on its
own veth, traffic from it towards the syncer's region in a per-source class
on the syncer region's veth. Delay, jitter and loss come from ``tc netem``
when the kernel has it (tried, not guessed), else from the user-space TUN
forwarder in :mod:`wan_diloco.regions.forwarder`.

Traffic between two remote regions (learners never send any) crosses both
links with the TUN forwarder, but only the destination's link with netem.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Literal, Sequence

from wan_diloco.regions.namespaces import (  # noqa: F401  (re-exported: the emulator's public names)
    FORWARDER_MODULE, EmulatorError, die_with_parent, forwarder_pids, kill_pids, list_namespaces, router_name,
    run_checked, teardown_leftovers, unavailable_reason,
)
from wan_diloco.regions.topology import LinkConfig, RegionsConfig

log = logging.getLogger(__name__)

SUBNET = "10.77"  # 10.77.<i>.0/30 per region, only ever inside our namespaces
MTU = 65000  # large frames cut per-packet cost, so Python can carry Gbit/s
MIN_MTU = 1500
PACKETS_PER_S = 2000  # the MTU is chosen so the fastest link needs at most this many packets a second


def mtu_for(topology: RegionsConfig) -> int:
    """MTU of the emulated links: as small as real (1500) unless the forwarder's packet rate needs larger.

    Large frames let a Python forwarder carry Gbit/s, but on a slow link one
    65000-byte frame takes long to serialize (0.75 s at 0.7 Mbit/s), which no
    real WAN does; so slow topologies get ordinary frames."""
    fastest = max((topology.link_of(r).rate_gbit_s for r in topology.remote), default=1.0)
    return int(min(MTU, max(MIN_MTU, fastest * 1e9 / 8 / PACKETS_PER_S)))
CC_AVAILABLE = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
CC_ALLOWED = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
ROUTER_TABLE = "100"
CLASSIFY_PRIO = 1  # u32 filters that pick a region's class
ROUTER_RULE_PRIO = "1000"  # ip rules that steer into the TUN; cut() blackholes at 2i+1, 2i+2 (< 1000)

Backend = Literal["auto", "netem", "tun"]


class Emulator:
    """Context manager that builds the emulated WAN for ``topology`` and removes it on exit.

    ``backend``: "auto" tries netem and falls back to the TUN forwarder; "netem"
    or "tun" force one. After entering, :attr:`backend` says which one runs.
    Teardown happens on normal exit, on exceptions, and on SIGINT/SIGTERM
    (handlers are installed while inside and restored afterwards).
    """

    def __init__(self, topology: RegionsConfig, prefix: str = "wdl", backend: Backend = "auto"):
        if not prefix.replace("-", "").isalnum() or len(prefix) > 8 or prefix.endswith("-"):
            raise EmulatorError(f"prefix {prefix!r}: must be 1-8 letters/digits/'-' (device names are short)")
        self.topology = topology
        self.prefix = prefix
        self.requested_backend = backend
        self.backend: str | None = None
        self.router = router_name(prefix)
        self.index = {name: i + 1 for i, name in enumerate(topology.names)}
        self.tun = f"{prefix}tun"
        self.mtu = mtu_for(topology)
        self._procs: list[subprocess.Popen] = []
        self._forwarder: subprocess.Popen | None = None
        self._old_handlers: dict[int, object] = {}
        self._up = False
        self._allowed_cc: tuple[str, str] | None = None  # (host's allowed list before, what we wrote)

    # ---- public helpers -------------------------------------------------
    def namespace(self, region: str) -> str:
        """Network namespace of ``region``."""
        if region not in self.index:
            raise KeyError(f"unknown region {region!r}; regions are {list(self.index)}")
        return f"{self.prefix}-{region}"

    def address_of(self, region: str) -> str:
        """IPv4 address of ``region``'s namespace (reachable from every other region)."""
        self.namespace(region)
        return f"{SUBNET}.{self.index[region]}.2"

    def netns_argv(self, region: str) -> list[str]:
        """Prefix that runs a command inside ``region``'s namespace (for callers that start their own)."""
        return ["ip", "netns", "exec", self.namespace(region)]

    def exec(self, region: str, argv: Sequence[str], check: bool = True, timeout: float | None = None,
             ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``region``'s namespace and wait; returns the completed process."""
        res = subprocess.run(["ip", "netns", "exec", self.namespace(region), *argv],
                             capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise EmulatorError(f"in {region}: `{' '.join(argv)}` failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def popen(self, region: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``region``'s namespace; it is killed on teardown if still running."""
        kwargs.setdefault("preexec_fn", die_with_parent)
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(region), *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def describe(self) -> list[str]:
        """One line per region: namespace, address, link (for printing)."""
        cc = self.topology.congestion_control or "the host's"
        lines = [f"backend {self.backend}, router namespace {self.router}, TCP congestion control {cc}"]
        for name in self.topology.names:
            if name == self.topology.syncer_region:
                link = "syncer's region"
            else:
                lk = self.topology.link_of(name)
                link = (f"{lk.rate_gbit_s:g} Gbit/s, rtt {lk.rtt_ms:g} ms, jitter {lk.jitter_ms:g} ms, "
                        f"loss {lk.loss_pct:g} %")
            lines.append(f"{name:<16} {self.namespace(name):<24} {self.address_of(name):<14} {link}")
        return lines

    # ---- lifecycle ------------------------------------------------------
    def __enter__(self) -> "Emulator":
        if os.geteuid() != 0:
            raise EmulatorError("the WAN emulator needs root (network namespaces, tc); run as root or under sudo")
        if shutil.which("ip") is None or shutil.which("tc") is None:
            raise EmulatorError("the WAN emulator needs iproute2 (`ip` and `tc`) on PATH")
        if list_namespaces(self.prefix):
            raise EmulatorError(f"namespaces with prefix {self.prefix!r} exist already "
                                f"(another run, or a crashed one: `wan-diloco wan down`)")
        self._install_handlers()
        try:
            self._up = True
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Tear everything down (idempotent)."""
        try:
            if self._up:
                procs = [p for p in self._procs if p.poll() is None]
                if self._forwarder is not None and self._forwarder.poll() is None:
                    procs.append(self._forwarder)
                kill_pids([p.pid for p in procs])
                for p in procs:
                    try:
                        p.wait(timeout=2)
                    except subprocess.TimeoutExpired:
                        pass
                teardown_leftovers(self.prefix)
                self._restore_allowed_cc()
                self._up = False
        finally:
            self._restore_handlers()

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread

        def on_signal(signum, frame):
            # Unwind through __exit__ (which tears down) instead of dying in place.
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, on_signal)

    def _restore_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    # ---- building -------------------------------------------------------
    def _ns(self, ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return run_checked(["ip", "netns", "exec", ns, *argv], check=check)

    def _allow_cc(self, cc: str) -> None:
        """Let namespaces select ``cc``: a namespace other than the host's may only pick a congestion
        control on the host's allowed list, so add it there for the emulator's lifetime."""
        available = CC_AVAILABLE.read_text().split() if CC_AVAILABLE.exists() else []
        if cc not in available:
            raise EmulatorError(f"regions.congestion_control: {cc!r} is not available in this kernel "
                                f"(available: {' '.join(available) or 'unknown'}); set it to one of those or \"\"")
        before = CC_ALLOWED.read_text().strip()
        if cc in before.split():
            return
        wrote = f"{before} {cc}".strip()
        CC_ALLOWED.write_text(wrote)
        self._allowed_cc = (before, CC_ALLOWED.read_text().strip())

    def _restore_allowed_cc(self) -> None:
        if self._allowed_cc is None:
            return
        before, wrote = self._allowed_cc
        self._allowed_cc = None
        try:
            if CC_ALLOWED.read_text().strip() == wrote:  # unless someone changed it since
                CC_ALLOWED.write_text(before)
        except OSError as e:
            log.warning("could not restore %s to %r: %s", CC_ALLOWED, before, e)

    def _build(self) -> None:
        topo = self.topology
        cc = topo.congestion_control
        if cc:
            self._allow_cc(cc)
        run_checked(["ip", "netns", "add", self.router])
        r = self.router
        for k, v in (("net.ipv4.ip_forward", "1"), ("net.ipv4.conf.all.rp_filter", "0"),
                     ("net.ipv4.conf.default.rp_filter", "0"), ("net.ipv6.conf.all.disable_ipv6", "1"),
                     ("net.ipv6.conf.default.disable_ipv6", "1")):
            self._ns(r, "sysctl", "-qw", f"{k}={v}")
        run_checked(["ip", "-n", r, "link", "set", "lo", "up"])
        for name in topo.names:
            i, ns = self.index[name], self.namespace(name)
            run_checked(["ip", "netns", "add", ns])
            # Slow start after idle off: what a host tuned for long fat links runs with
            # (docs/operations.md), so a sync after a quiet spell starts at full window.
            mem = f"4096 {min(131072, topo.tcp_buffer_max_bytes)} {topo.tcp_buffer_max_bytes}"
            for k, v in (("net.ipv4.tcp_rmem", mem), ("net.ipv4.tcp_wmem", mem),
                         ("net.ipv4.tcp_slow_start_after_idle", "0"),
                         *((("net.ipv4.tcp_congestion_control", cc),) if cc else ()),
                         ("net.ipv6.conf.all.disable_ipv6", "1"), ("net.ipv6.conf.default.disable_ipv6", "1")):
                self._ns(ns, "sysctl", "-qw", f"{k}={v}")
            # Created straight inside the two namespaces: nothing ever exists in the host's.
            run_checked(["ip", "-n", r, "link", "add", f"v{i}", "mtu", str(self.mtu), "type", "veth",
                  "peer", "name", "eth0", "netns", ns])
            run_checked(["ip", "-n", ns, "link", "set", "eth0", "mtu", str(self.mtu)])
            run_checked(["ip", "-n", r, "addr", "add", f"{SUBNET}.{i}.1/30", "dev", f"v{i}"])
            run_checked(["ip", "-n", ns, "addr", "add", f"{SUBNET}.{i}.2/30", "dev", "eth0"])
            for dev_ns, dev in ((r, f"v{i}"), (ns, "eth0"), (ns, "lo")):
                run_checked(["ip", "-n", dev_ns, "link", "set", dev, "up"])
            run_checked(["ip", "-n", ns, "route", "add", "default", "via", f"{SUBNET}.{i}.1"])
            self._ns(r, "sysctl", "-qw", f"net.ipv4.conf.v{i}.rp_filter=0")
        want = self.requested_backend
        if want in ("auto", "netem") and self._shape(netem=True):
            self.backend = "netem"
        elif want == "netem":
            raise EmulatorError("backend 'netem' requested, but this kernel has no netem qdisc")
        else:
            self._shape(netem=False)
            self._start_tun()
            self.backend = "tun"

    def _shape(self, netem: bool) -> bool:
        """htb on the router's egress; leaves are netem (if ``netem``) or bfifo. False: no netem here."""
        topo, r = self.topology, self.router
        syncer_dev = f"v{self.index[topo.syncer_region]}"
        for name in topo.names:
            run_checked(["tc", "-n", r, "qdisc", "del", "dev", f"v{self.index[name]}", "root"], check=False)
        # Syncer's side: one class per remote region, picked by source address;
        # everything else (e.g. the syncer region's own loopback-like traffic) is unshaped.
        run_checked(["tc", "-n", r, "qdisc", "add", "dev", syncer_dev, "root", "handle", "1:", "htb", "default", "1"])
        run_checked(["tc", "-n", r, "class", "add", "dev", syncer_dev, "parent", "1:", "classid", "1:1",
              "htb", "rate", "100gbit", "quantum", "200000"])
        for name in topo.remote:
            i, link = self.index[name], topo.link_of(name)
            dev = f"v{i}"
            # Towards the region: its own veth.
            run_checked(["tc", "-n", r, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
            self._leaf(dev, "1:10", "10:", link, netem)
            # From the region towards the syncer's region: a class on the syncer's veth.
            cls = f"1:{10 + i:x}"
            ok = self._leaf(syncer_dev, cls, f"{10 + i:x}:", link, netem)
            run_checked(["tc", "-n", r, "filter", "add", "dev", syncer_dev, "parent", "1:", "protocol", "ip",
                  "prio", str(CLASSIFY_PRIO), "u32", "match", "ip", "src", f"{SUBNET}.{i}.0/30", "flowid", cls])
            if not ok:
                return False
        return True

    def _leaf(self, dev: str, classid: str, handle: str, link: LinkConfig, netem: bool, verb: str = "add") -> bool:
        r = self.router
        rate = f"{link.rate_gbit_s * 1000:g}mbit"
        rate_bytes_s = link.rate_gbit_s * 1e9 / 8
        # Burst and quantum must cover a frame, or htb stalls on big MTUs; beyond
        # that, a burst of 2 ms at line rate (no more: a slow link must stay slow).
        burst = max(4 * self.mtu, int(rate_bytes_s * 0.002))
        run_checked(["tc", "-n", r, "class", verb, "dev", dev, "parent", "1:", "classid", classid, "htb",
              "rate", rate, "ceil", rate, "burst", str(burst), "cburst", str(burst),
              "quantum", str(max(self.mtu + 536, 1600))])
        # Queue one bandwidth-delay product (at least a few frames): enough to
        # keep the link busy, little enough that a bulk flow does not add much RTT.
        bdp = max(int(rate_bytes_s * max(link.rtt_ms, 1) / 1000), 8 * self.mtu)
        if netem:
            argv = ["tc", "-n", r, "qdisc", verb, "dev", dev, "parent", classid, "handle", handle, "netem",
                    "limit", str(max(bdp // 1500, 1000)), "delay", f"{link.one_way_s * 1000:g}ms"]
            if link.jitter_ms:
                argv += [f"{link.jitter_ms:g}ms"]
            if link.loss_pct:
                argv += ["loss", f"{link.loss_pct:g}%"]
            res = run_checked(argv, check=False)
            if res.returncode != 0:
                if "unknown" in res.stderr.lower() or "no such file" in res.stderr.lower():
                    return False
                raise EmulatorError(f"`{' '.join(argv)}` failed: {res.stderr.strip()}")
            return True
        run_checked(["tc", "-n", r, "qdisc", verb, "dev", dev, "parent", classid, "handle", handle,
              "bfifo", "limit", str(bdp)])
        return True

    # ---- changing links while a run uses them ------------------------------
    def set_rate(self, region: str, rate_gbit_s: float) -> None:
        """Shape ``region``'s link (both directions) to ``rate_gbit_s`` from now on (delay and loss kept)."""
        link = dataclasses.replace(self.topology.link_of(region), rate_gbit_s=rate_gbit_s)
        link.validate()
        i, syncer_dev = self.index[region], f"v{self.index[self.topology.syncer_region]}"
        netem = self.backend == "netem"
        self._leaf(f"v{i}", "1:10", "10:", link, netem, verb="change")
        self._leaf(syncer_dev, f"1:{10 + i:x}", f"{10 + i:x}:", link, netem, verb="change")

    def cut(self, region: str, down: bool = True) -> None:
        """Drop every packet to and from ``region`` at the router (``down=False`` restores it), as a
        failed WAN link does: the endpoints' TCP sees silence, not a reset."""
        i, r = self.index[region], self.router
        verb = "add" if down else "del"
        # Policy rules ahead of everything else the router does (TUN steering sits at ROUTER_RULE_PRIO).
        for prio, direction in ((2 * i + 1, "from"), (2 * i + 2, "to")):
            run_checked(["ip", "-n", r, "rule", verb, direction, f"{SUBNET}.{i}.0/30", "blackhole", "priority", str(prio)],
                 check=down)

    def _start_tun(self) -> None:
        r, topo = self.router, self.topology
        run_checked(["ip", "-n", r, "tuntap", "add", "dev", self.tun, "mode", "tun"])
        run_checked(["ip", "-n", r, "link", "set", self.tun, "mtu", str(self.mtu), "up"])
        self._ns(r, "sysctl", "-qw", f"net.ipv4.conf.{self.tun}.rp_filter=0")
        # Everything arriving from a region goes through the TUN; what the
        # forwarder writes back arrives on the TUN and takes the main table.
        run_checked(["ip", "-n", r, "route", "add", "default", "dev", self.tun, "table", ROUTER_TABLE])
        for name in topo.names:
            run_checked(["ip", "-n", r, "rule", "add", "iif", f"v{self.index[name]}", "lookup", ROUTER_TABLE,
                  "priority", ROUTER_RULE_PRIO])
        argv = [sys.executable, "-m", FORWARDER_MODULE, "--tun", self.tun, "--tag", self.prefix]
        for name in topo.remote:
            link = topo.link_of(name)
            argv += ["--link", f"{SUBNET}.{self.index[name]}={link.one_way_s!r},"
                               f"{link.jitter_ms / 1000!r},{link.loss_pct / 100!r}"]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                          env.get("PYTHONPATH", "")]))
        self._forwarder = subprocess.Popen(["ip", "netns", "exec", r, *argv], stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True, env=env,
                                           preexec_fn=die_with_parent)
        line = self._forwarder.stdout.readline()
        if line.strip() != "ready":
            err = self._forwarder.stderr.read() if self._forwarder.poll() is not None else ""
            raise EmulatorError(f"TUN forwarder did not start: {line.strip()} {err.strip()}")

    @property
    def forwarder_pid(self) -> int | None:
        """Pid of the TUN forwarder process (None with netem)."""
        return self._forwarder.pid if self._forwarder is not None else None
