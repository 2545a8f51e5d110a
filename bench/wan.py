#!/usr/bin/env python
"""Emulated-WAN benchmark: real processes, real training, links scaled from a large run.

A syncer (region ``hub``) and M = 4 learners, each in its own region
(``r1``..``r4``) of the emulated WAN (``wan_diloco.regions.Emulator``: one
network namespace per region, htb rate shaping, netem or the TUN forwarder
for delay). Every method runs on the same links with the tiny preset:

- ``dp``: data parallel as a parameter-server exchange every step: each
  learner sends its whole model (16 bits) to the syncer and waits for the
  average (H = 1, P = 1, τ = 0, K = M, outer lr 1 without momentum).
- ``diloco``: H steps, then the whole model, blocking (P = 1, τ = 0, K = M).
- ``streaming``: P fragments at staggered offsets, each awaited τ = 2 steps after it is sent (K = M).
- ``decoupled``: P fragments, τ = 2 steps of overlap, quorum K = 1 + grace,
  at 16, 8 and 4 bits.

Scaling: the links are set so that (bytes a method moves per step) / (link
rate) and RTT / step time equal those of a stated large run (10B parameters,
1 s steps, 2 Gbit/s, 80 ms): rate = 2 Gbit/s x (tiny params / 1e10) x (1 s /
tiny step), RTT = 80 ms x (tiny step / 1 s). The tiny step is padded to a
fixed ``STEP_S`` (``run.min_step_s``) so every run computes at the same pace.

Links are fast while learners join (fetching the model is not what is
measured) and during the final sync, and shaped while they train.
Compute utilization (CU) of a learner = busy time / wall time of its
training loop; ``cu_ratio`` divides by the same method's CU on loopback
(no network) in the same benchmark run. ``cu_predicted`` is the bandwidth
calculator (``planning.bandwidth.schedule_for(..., via_hub=True)``) for the
same settings, step time and link.

``merge_lag_steps`` is what a learner that does not wait pays instead: steps
trained between sending a fragment and merging the answer, beside
``merge_lag_predicted`` (``planning.round_trip_s`` over the step time).

Also measured: the emulator itself (RTT, and iperf3 through 1, 2 and 5 Gbit/s
links) and the production transport's upload rate through emulated links of
1, 2 and 5 Gbit/s at 50 and 100 ms, on hosts with TCP buffers tuned for long
fat links (256 MB) and with Linux's default (4 MiB): default settings,
``transport.tune_for_link`` for the known link, and connections widened from
link probes as learners do (``auto``). Each is ``TRANSPORT_ROUNDS`` rounds of
4 concurrent uploads of about a second of link each; the first round is on
fresh connections (``cold_gbit_s``), the row's figure is the median of the rest
(``--rounds`` for more). Each row also has the sending kernel's view of its
connections (``sender_tcp``: congestion window, retransmitted bytes) and the
packets the emulated link dropped meanwhile (``link_drops``).

    python -m bench.wan --quick     # ~6 min: dp and decoupled int4 + transport at 1 Gbit/s
    python -m bench.wan             # every method, every bit width, every transport link, the link events
    python -m bench.wan --transport-only   # rerun the transport rows into an existing wan.json
    python -m bench.wan --transport-only --case 2,50,4 --fragments 1   # one link, into transport_wan.json
    python -m bench.wan --transport-only --case 5,100,256,tuned --rounds 12 --case-out F   # warm connections
Needs root (network namespaces). Writes bench/results/wan.json (+ wan.png).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from wan_diloco import spec as spec_lib  # noqa: E402
from wan_diloco.planning import LinkEstimate, ModelFacts, plan_run, round_trip_s  # noqa: E402
from wan_diloco.planning.bandwidth import BandwidthConfig, schedule_for  # noqa: E402
from wan_diloco.planning.timeline import compute_utilization  # noqa: E402
from wan_diloco.regions import Emulator, measure  # noqa: E402
from wan_diloco.regions.emulator import teardown_leftovers, unavailable_reason  # noqa: E402
from wan_diloco.regions.topology import regions_from_mapping  # noqa: E402
from wan_diloco.runtime.launch import RunState, launch  # noqa: E402
from wan_diloco.transport.dev_certs import make_dev_certs  # noqa: E402

from bench import perf_split, tcp_info  # noqa: E402

LARGE = {"params": 1e10, "step_s": 1.0, "rate_gbit_s": 2.0, "rtt_ms": 80.0}
STEP_S = 0.3  # every learner step padded to this (4 learners + syncer share 2 cores: ~0.2 s of compute)
# The large run's H; P = 16 balanced fragments (the tiny model's 27 tensors), so one fragment is as small
# a share of the model as one of the 10B model's 16; tau comes from planning.plan_run for the scaled link.
H, P = 100, 16
FAST_GBIT_S = 0.02  # links while learners join and during the final sync (keeps the emulator's MTU at 1500)
REGIONS = ["hub", "r1", "r2", "r3", "r4"]
PREFIX = "wdlb"
TOKEN = "wan-bench-token-not-secret"
PEER = str(ROOT / "bench" / "wan_peer.py")
# method -> (calculator's name, spec changes); bits go to [codec] per row. The synchronous methods are
# settings of the same protocol, as in the simulator (sim.baselines): blocking learners, K = M, no grace.
SYNC = {"quorum": 4, "grace": False}
METHODS = {
    "dp": ("data_parallel", {"learner": {"sync_every": 1, "num_fragments": 1, "tau": 0, "blocking": True,
                                         "keep_local": False},
                             "syncer": {**SYNC, "outer": {"lr": 1.0, "momentum": 0.0}}}),
    "diloco": ("diloco", {"learner": {"sync_every": H, "num_fragments": 1, "tau": 0, "blocking": True,
                                      "keep_local": False}, "syncer": SYNC}),
    "streaming": ("streaming_overlap", {"learner": {"sync_every": H, "num_fragments": P, "blocking": True},
                                        "syncer": SYNC}),
    "decoupled": ("decoupled", {"learner": {"sync_every": H, "num_fragments": P},
                                "syncer": {"quorum": 1, "grace": True}}),
}


def tiny_facts() -> ModelFacts:
    """Parameters and the P balanced fragments' sizes of the tiny preset, as a run cuts them."""
    # In a child: JAX starts threads, and this process forks (namespaces, subprocesses) afterwards.
    code = ("import json, math; from wan_diloco import model, spec, tree; from wan_diloco.fragments import "
            "make_fragments; s = spec.from_short(preset='tiny'); "
            "z = {n: math.prod(a.shape) for n, a in tree.flatten(model.abstract_params(s.model)).items()}; "
            f"f = make_fragments('balanced', z, {P}, model.layer_index); "
            "print(json.dumps([sum(z.values()), [sum(z[n] for n in x) for x in f]]))")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT, env=env)
    params, frags = json.loads(out.stdout.strip().splitlines()[-1])
    # The calculator cuts models by layers: the tiny model's P fragments stand for P equal layers.
    return ModelFacts(params=params, layers=P, fragment_params=tuple(frags))


def plan_tau(facts: ModelFacts, link: dict) -> dict:
    """planning.plan_run for the scaled link at H and P fixed, 4 bits: the tau the decoupled rows use."""
    links = {r: LinkEstimate(link["rate_gbit_s"], link["rtt_ms"] / 1e3) for r in REGIONS[1:]}
    plan = plan_run(facts, links, STEP_S, {r: 1 for r in REGIONS[1:]}, sync_every_options=(H,),
                    fragment_options=(P,), bits_options=(4,))
    return {"tau": plan.tau, "cu_predicted": plan.cu_predicted, "reached": plan.reached, "why": list(plan.why),
            "max_grace_s": plan.max_grace_s, "tau_by_region": plan.tau_by_region}


def scaling(params: int) -> dict:
    rate = LARGE["rate_gbit_s"] * (params / LARGE["params"]) * (LARGE["step_s"] / STEP_S)
    rtt_ms = LARGE["rtt_ms"] * STEP_S / LARGE["step_s"]
    return {"large_run": LARGE, "tiny_params": params, "tiny_step_s": STEP_S, "rate_gbit_s": rate, "rtt_ms": rtt_ms,
            "rule": "rate = large rate x (tiny params / large params) x (large step / tiny step); "
                    "rtt = large rtt x tiny step / large step: bytes per step over rate, and rtt in steps, as in the large run"}


def run_doc(method: str, bits: int, steps: int, link: dict, tau: int = 2) -> dict:
    doc = {
        "run": {"learners": 4, "steps": steps, "batch_size": 8, "eval_batches": 2, "eval_batch_size": 8,
                "min_step_s": STEP_S, "token": TOKEN, "report_every_s": 0.25},
        "model": {"preset": "tiny", "seq_len": 64},
        "data": {"max_bytes": 2 << 20},
        "train": {"warmup_steps": 10},
        "codec": {"bits": bits},
        "syncer": {"liveness_timeout_s": 120.0, "final_timeout_s": 120.0},
        # A probe at start only: at a fraction of a Mbit/s even a short probe is seconds of link.
        "transport": {"probe_every_s": 0.0, "call_timeout_s": 120.0, "retry_budget_s": 300.0},
        "regions": {"names": REGIONS, "syncer": "hub", "learners": REGIONS[1:],
                    "link": {"rate_gbit_s": link["rate_gbit_s"], "rtt_ms": link["rtt_ms"]}},
    }
    for table, changes in METHODS[method][1].items():
        doc[table] = {**doc.get(table, {}), **{k: v for k, v in changes.items() if k != "outer"}}
        if "outer" in changes:
            doc[table]["outer"] = changes["outer"]
    doc["learner"].setdefault("tau", tau)
    return doc


class Phases:
    """Fast links while learners join, shaped while they train, fast again for the final sync;
    ``events`` are (seconds after shaping began, callable) for the link-event runs."""

    def __init__(self, emu: Emulator, rate_gbit_s: float, steps: int, events=()):
        self.emu, self.rate, self.steps = emu, rate_gbit_s, steps
        self.events = sorted(events, key=lambda e: e[0])
        self.state, self.shaped_at = "warm", None
        self.log: list[dict] = []

    def set_all(self, rate: float) -> None:
        for r in REGIONS[1:]:
            self.emu.set_rate(r, rate)

    def __call__(self, mon: RunState) -> None:
        rows = list(mon.learners.values())
        if self.state == "warm" and all(r["status"] != "starting" for r in rows):
            self.set_all(self.rate)
            self.state, self.shaped_at = "shaped", time.monotonic()
            self.log.append({"t": time.time(), "what": f"links shaped to {self.rate:.4g} Gbit/s"})
        elif self.state == "shaped":
            while self.events and time.monotonic() - self.shaped_at >= self.events[0][0]:
                _, what, action = self.events.pop(0)
                action()
                self.log.append({"t": time.time(), "what": what})
            if any(r["status"] in ("final sync", "done") for r in rows):
                self.set_all(FAST_GBIT_S)
                self.state = "drain"
                self.log.append({"t": time.time(), "what": "links fast for the final sync"})


def finals(run_dir: Path) -> tuple[list[dict], list[dict], dict[int, tuple[int, int]]]:
    """Learners' final reports, step events, and each learner's bytes (sent, received) while training."""
    out, steps, start, end = [], [], {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        e = json.loads(line)
        kind = e.get("event")
        if kind == "final" and e.get("role") == "learner":
            out.append(e)
        elif kind == "step":
            steps.append(e)
        elif kind == "start":
            start[e["learner"]] = (e["bytes_sent"], e["bytes_received"])
        elif kind == "finishing":
            end[e["learner"]] = (e["bytes_sent"], e["bytes_received"])
    training = {m: (end[m][0] - start[m][0], end[m][1] - start[m][1]) for m in end if m in start}
    return out, steps, training


def train_row(method: str, bits: int, steps: int, link: dict, workdir: Path, emulate: bool, tau: int,
              events=(), changes: dict | None = None) -> dict:
    cfg = spec_lib.from_document(run_doc(method, bits, steps, link, tau))
    if changes:
        cfg = cfg.with_changes(**changes)
    name = f"{method}-{bits}-{'wan' if emulate else 'loopback'}"
    run_dir = workdir / name
    t0 = time.monotonic()
    phases = None
    if emulate:
        fast = dataclasses.replace(cfg.regions, link=dataclasses.replace(cfg.regions.link, rate_gbit_s=FAST_GBIT_S))
        with Emulator(fast, prefix=PREFIX) as emu:
            phases = Phases(emu, link["rate_gbit_s"], steps, events=[(t, w, a(emu)) for t, w, a in events])
            code, summary = launch(cfg, spec_lib.dumps(cfg), str(run_dir), watch=phases, emulate=emu)
    else:
        local = cfg.with_changes(regions={"names": ["local"], "learners": [], "syncer": ""})
        code, summary = launch(local, spec_lib.dumps(local), str(run_dir))
    wall = time.monotonic() - t0
    if code != 0:
        raise RuntimeError(f"{name}: run failed: {summary.get('error')} (logs in {run_dir})")
    fins, step_events, training = finals(run_dir)
    cu = sum(f["compute_s"] for f in fins) / sum(f["train_s"] for f in fins)
    step_s = sum(f["compute_s"] for f in fins) / sum(f["steps"] for f in fins)
    # Achieved link rate: each learner's busier direction while it trained (not the join, not the final
    # sync), over its training time, averaged; bytes per token counts the same bytes, both directions.
    link_gbit_s = sum(max(training[f["learner"]]) * 8 / f["train_s"] / 1e9 for f in fins) / len(fins)
    train_bytes = sum(sum(b) for b in training.values())
    row = {"method": method, "bits": bits, "network": "emulated" if emulate else "loopback", "steps": steps,
           "cu": cu, "step_s": step_s, "link_gbit_s": link_gbit_s, "shaped_gbit_s": link["rate_gbit_s"] if emulate else None,
           "bytes_per_token": train_bytes / max(1, summary["tokens"]),
           "final_eval_loss": summary["final_eval_loss"], "tokens": summary["tokens"], "wall_s": wall,
           "bit_identical": summary["bit_identical"], "merge_lag_steps": summary.get("merge_lag_steps")}
    if phases is not None:
        row["phases"] = phases.log
        if events:
            row["replans"], row["links"] = link_log(run_dir)
        row["step_timeline"] = [{"learner": e["learner"], "t": e["t"], "step": e["step"]} for e in step_events] if events else None
    print(f"  {name:<24} CU {cu:.3f}  link {link_gbit_s * 1e3:.3f} Mbit/s  loss {row['final_eval_loss']:.3f}  "
          f"{wall:.0f} s", flush=True)
    return row


def link_log(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """The learners' replan and link events (for the event run)."""
    replans, links = [], []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "replan":
            replans.append({k: e[k] for k in ("t", "learner", "region", "step", "tau_old", "tau_new", "reasons")})
        elif e.get("event") == "link":
            links.append({k: e[k] for k in ("t", "learner", "region", "rtt_ms", "rate_gbit_s")})
    return replans, links


def predicted_lag_steps(method: str, bits: int, facts: ModelFacts, step_s: float, link: dict) -> float:
    """Steps from sending a fragment to having the merged one back (``planning.round_trip_s``): a learner
    that does not wait (decoupled) trains them; one that waits stalls for what exceeds its tau."""
    lrn = METHODS[method][1]["learner"]
    fragment_bytes = facts.params * bits / 8 / lrn["num_fragments"]
    return round_trip_s(fragment_bytes, LinkEstimate(link["rate_gbit_s"], link["rtt_ms"] / 1e3)) / step_s


def predicted_cu(method: str, bits: int, facts: ModelFacts, step_s: float, link: dict, tau: int) -> float:
    calc, changes = METHODS[method]
    lrn = changes["learner"]
    cfg = BandwidthConfig(params=facts.params, layers=facts.layers, step_time_s=step_s, datacenters=2,
                          sync_every=max(2, lrn["sync_every"]), fragments=lrn["num_fragments"],
                          tau=min(lrn.get("tau", tau), max(2, lrn["sync_every"]) - 1), bits=bits, grad_bits=bits,
                          rtt_s=link["rtt_ms"] / 1e3)
    return compute_utilization(schedule_for(cfg, calc, via_hub=True), link["rate_gbit_s"])


# ---- the emulator and the transport at Gbit/s -----------------------------------

def emulator_check(rate: float = 1.0, rtt_ms: float = 50.0) -> dict:
    topo = regions_from_mapping({"names": ["hub", "far"], "link": {"rate_gbit_s": rate, "rtt_ms": rtt_ms}})
    with Emulator(topo, prefix=PREFIX) as emu:
        r = measure.rtt(emu, "hub", "far", count=20)
        pid = emu.forwarder_pid
        cpu0 = _cpu_s(pid) if pid else 0.0
        t0 = time.monotonic()
        ip = measure.iperf3(emu, "hub", "far", seconds=6.0, omit_s=2)
        tp = ip if ip is not None else measure.throughput(emu, "hub", "far", seconds=4.0).gbit_s
        cpu = (_cpu_s(pid) - cpu0) / (time.monotonic() - t0) if pid else None
        return {"backend": emu.backend, "rtt_ms_configured": rtt_ms, "rtt_ms_measured": r["rtt_ms_median"],
                "rate_gbit_s_configured": rate, "rate_gbit_s_measured": tp,
                "rate_tool": "iperf3" if ip is not None else "raw TCP (iperf3 not installed)",
                "forwarder_cores": cpu}


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (field 3, the state, first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _cpu_s(pid: int) -> float:
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _minor_faults(pid: int) -> int:
    """Page faults ``pid`` took so far without I/O (a fresh page the kernel zeroes and maps, mostly)."""
    return int(_stat(pid)[7])


DIRECT_PORT = 47_001  # in the emulated hub's own namespace: nothing else listens there
TRANSPORT_ROUNDS = 4  # the first on fresh connections (cold), the median of the others is the row's figure
TRANSPORT_OUT = ROOT / "bench" / "results" / "transport_wan.json"
TUNED_HOST, DEFAULT_HOST = 256 << 20, 4 << 20  # TCP buffer maximum of the emulated hosts (tcp_rmem/tcp_wmem)
SETTINGS_ARGS = {
    "default": lambda rate, rtt_ms: [],
    "tuned": lambda rate, rtt_ms: ["--tuned", f"{rate},{rtt_ms}"],  # transport.tune_for_link for the known link
    "auto": lambda rate, rtt_ms: ["--auto-channels"],  # connections widened from probes, as learners do
    # The same without striping: each fragment on one stream of one connection (before wire version 5).
    "auto-unstriped": lambda rate, rtt_ms: ["--auto-channels", "--unstriped"],
    "tuned-unstriped": lambda rate, rtt_ms: ["--tuned", f"{rate},{rtt_ms}", "--unstriped"],
    "8-channels": lambda rate, rtt_ms: ["--channels", "8"],  # default settings on 8 connections
    # Stripes over plain TLS connections into the receiver's buffer (transport.direct_port), not gRPC.
    "direct-tuned": lambda rate, rtt_ms: ["--tuned", f"{rate},{rtt_ms}", "--direct-port", str(DIRECT_PORT)],
    "direct-auto": lambda rate, rtt_ms: ["--auto-channels", "--direct-port", str(DIRECT_PORT)],
    # tune_for_link's settings on 4 connections (it opens 2 on 256 MiB hosts): a smaller window each.
    "tuned-4": lambda rate, rtt_ms: ["--tuned", f"{rate},{rtt_ms}", "--channels", "4"],
    "direct-tuned-4": lambda rate, rtt_ms: ["--tuned", f"{rate},{rtt_ms}", "--channels", "4",
                                            "--direct-port", str(DIRECT_PORT)],
}


def router_drops(emu) -> dict:
    """Packets the emulated links dropped so far, by where: ``queue`` (the shapers' queues: a link's own
    BDP-sized buffer overflowing, as a real WAN's would) and ``tun`` (the delay forwarder not reading in
    time: this machine's CPU, not the link)."""
    def query(argv):
        res = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        return json.loads(res.stdout or "[]") if res.returncode == 0 else []
    drops = {"queue": 0, "tun": 0}
    for q in query(["tc", "-n", emu.router, "-s", "-j", "qdisc", "show"]):
        drops["tun" if "tun" in q.get("dev", "") else "queue"] += q.get("drops", 0)
    for link in query(["ip", "-n", emu.router, "-s", "-j", "link", "show"]):
        if "tun" in link.get("ifname", ""):
            stats = link.get("stats64", {})
            drops["tun"] += stats.get("tx", {}).get("dropped", 0) + stats.get("rx", {}).get("dropped", 0)
    return drops


def raw_tls(emu, host: str, tls: Path, mib: int) -> dict:
    """Raw TLS over TCP through the same link (``wan_peer.py tls-sink``/``tls-send``): rate, the receiver's
    and sender's CPU seconds per GiB, and where the receiver's went (``perf_split``)."""
    sink = emu.popen("hub", [sys.executable, PEER, "tls-sink", "--host", host, "--tls", str(tls)],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    split: dict = {}
    try:
        port = json.loads(sink.stdout.readline())["ready"]
        with perf_split.profile(sink.pid, split):
            sent = json.loads(emu.exec("far", [sys.executable, PEER, "tls-send", "--target", f"{host}:{port}",
                                               "--tls", str(tls), "--mib", str(mib)], timeout=300).stdout)
        got = json.loads(sink.stdout.readline())
    finally:
        sink.kill()
        sink.wait(10)
    gib = got["bytes"] / (1 << 30)
    return {"gbit_s": sent["gbit_s"], "receiver_cpu_s_per_gib": got["cpu_s"] / gib,
            "sender_cpu_s_per_gib": sent["cpu_s"] / gib, "receiver_cpu_split": split}


def transport_rows(cases: list[tuple[float, float, int, tuple[str, ...]]], workdir: Path, fragments: int = 4,
                   iperf: bool = False, on_row=None, rounds: int = TRANSPORT_ROUNDS) -> list[dict]:
    """One row per (rate Gbit/s, RTT ms, host TCP buffer bytes) and setting of the case: a client in one
    emulated region uploads ``fragments`` fragments at once to a server in the other, ``rounds``
    times. With ``iperf``, each row also has, measured first through the same emulated link, iperf3's rate
    and CPU per GiB and raw TLS over TCP's (the receiver's own reference), and where the server's CPU went
    (``perf_split``, sampled during the uploads)."""
    rows = []
    for rate, rtt_ms, host_buffer, settings in cases:
        topo = regions_from_mapping({"names": ["hub", "far"], "link": {"rate_gbit_s": rate, "rtt_ms": rtt_ms},
                                     "tcp_buffer_max_bytes": host_buffer})
        with Emulator(topo, prefix=PREFIX) as emu:
            ip = measure.iperf3_run(emu, "hub", "far", seconds=6.0, omit_s=2) if iperf else None
            iperf3_gbit_s = None if ip is None else ip["gbit_s"]
            host = emu.address_of("hub")
            tls = workdir / "tls"
            make_dev_certs(tls, hosts=(host,))
            ref = raw_tls(emu, host, tls, max(64, int(rate * 1e9 / 8 * 4.0 / (1 << 20)))) if iperf else None
            for name in settings:
                extra = SETTINGS_ARGS[name](rate, rtt_ms)
                srv = emu.popen("hub", [sys.executable, PEER, "server", "--host", host, "--tls", str(tls), *extra],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                try:
                    port = json.loads(srv.stdout.readline())["ready"]
                    mib = max(16, int(rate * 1e9 / 8 * 1.0 / (1 << 20)))  # ~4 s of link in 4 fragments a round
                    pid, t0 = emu.forwarder_pid, time.monotonic()
                    cpu0, srv_cpu0, srv_faults0 = (_cpu_s(pid) if pid else 0.0), _cpu_s(srv.pid), _minor_faults(srv.pid)
                    # The same bytes a round whatever the fragments, each within the 1 GiB message limit.
                    mib = min(1000, max(16, mib * 4 // fragments))
                    split: dict = {}
                    tcp: list = []  # the uploading side's connections, as its kernel saw them
                    drops0 = router_drops(emu)
                    with perf_split.profile(srv.pid, split) if iperf else contextlib.nullcontext(), \
                            tcp_info.sampled(emu, "far", host, tcp):
                        res = emu.exec("far", [sys.executable, PEER, "upload", "--target", f"{host}:{port}",
                                               "--tls", str(tls), "--mib", str(mib), "--fragments", str(fragments),
                                               "--rounds", str(rounds), *extra],
                                       timeout=300)
                    got = json.loads(res.stdout.strip().splitlines()[-1])
                    wall = time.monotonic() - t0
                    got["forwarder_cores"] = (_cpu_s(pid) - cpu0) / wall if pid else None
                    got["server_cores"] = (_cpu_s(srv.pid) - srv_cpu0) / wall
                    # Probes and handshakes included: an upper bound of the receiver's cost per GiB uploaded.
                    gib = rounds * got["bytes_per_round"] / (1 << 30)
                    got["server_cpu_s_per_gib"] = (_cpu_s(srv.pid) - srv_cpu0) / gib
                    # 262,144 would be every page of every GiB received faulted in afresh
                    got["server_minor_faults_per_gib"] = round((_minor_faults(srv.pid) - srv_faults0) / gib)
                    got["sender_tcp"] = tcp
                    got["link_drops"] = {k: v - drops0[k] for k, v in router_drops(emu).items()}
                finally:
                    srv.stdin.close()
                    srv.wait(10)
                row = {"rate_gbit_s": rate, "rtt_ms": rtt_ms, "host_tcp_buffer_bytes": host_buffer,
                       "settings": name, "fragments": fragments, **got, "fraction_of_link": got["gbit_s"] / rate}
                if iperf3_gbit_s is not None:
                    row["iperf3_gbit_s"] = iperf3_gbit_s
                if ip is not None:
                    row["iperf3"] = ip
                if ref is not None:
                    per_gib = got["server_cpu_s_per_gib"]
                    row["raw_tls"] = ref
                    row["server_cpu_split_s_per_gib"] = {k: v * per_gib for k, v in split.items()}
                    row["server_cpu_over_raw_tls"] = per_gib / ref["receiver_cpu_s_per_gib"]
                print(f"  transport {rate:g} Gbit/s {rtt_ms:g} ms, hosts {host_buffer >> 20} MiB, {name:<8} "
                      f"{got['gbit_s']:.3f} Gbit/s ({row['fraction_of_link']:.0%}; cold {got['cold_gbit_s']:.3f}), "
                      f"{got['channels']} channels", flush=True)
                rows.append(row)
                if on_row is not None:
                    on_row(rows)
    return rows


# ---- events: a link that slows 10x and one that is cut --------------------------

def link_events(link: dict, seconds: float) -> list:
    slow, cut = "r1", "r2"
    return [
        (10.0, f"{slow}: rate / 10", lambda emu: lambda: emu.set_rate(slow, link["rate_gbit_s"] / 10)),
        (10.0 + seconds, f"{slow}: rate restored", lambda emu: lambda: emu.set_rate(slow, link["rate_gbit_s"])),
        (15.0, f"{cut}: cut", lambda emu: lambda: emu.cut(cut)),
        (45.0, f"{cut}: restored", lambda emu: lambda: emu.cut(cut, down=False)),
    ]


def steps_per_s(timeline: list[dict], learner: int, t0: float, t1: float) -> float | None:
    pts = [(e["t"], e["step"]) for e in timeline if e["learner"] == learner and t0 <= e["t"] <= t1]
    if len(pts) < 2:
        return 0.0 if pts or t1 - t0 > 5 else None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rows and steps (about 10 minutes)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "wan.json")
    ap.add_argument("--events-only", action="store_true", help="rerun only the link events into an existing --out")
    ap.add_argument("--transport-only", action="store_true",
                    help="rerun only the transport rows (full list) into an existing --out")
    ap.add_argument("--case", action="append", default=[], metavar="RATE_GBIT_S,RTT_MS,HOST_BUFFER_MIB",
                    help="with --transport-only: only this link (repeatable), every setting of --settings, "
                         "iperf3 through it first; rows go to bench/results/transport_wan.json, not --out")
    ap.add_argument("--settings", default="default,tuned,auto,auto-unstriped",
                    help=f"with --case: comma-separated, of {', '.join(SETTINGS_ARGS)}")
    ap.add_argument("--fragments", type=int, default=4, help="with --case: concurrent uploads per round")
    ap.add_argument("--rounds", type=int, default=TRANSPORT_ROUNDS,
                    help="with --case: rounds on the same connections (the first cold, the row's figure the "
                         "median of the rest): more show the rate once TCP's windows have grown")
    ap.add_argument("--case-out", type=Path, default=TRANSPORT_OUT, help="with --case: where the rows go")
    args = ap.parse_args(argv)
    if (why := unavailable_reason()) is not None:
        print(f"bench/wan.py: the emulated WAN {why}", file=sys.stderr)
        return 2
    teardown_leftovers(PREFIX)
    facts = tiny_facts()
    scale = scaling(facts.params)
    link = {"rate_gbit_s": scale["rate_gbit_s"], "rtt_ms": scale["rtt_ms"]}
    planned = plan_tau(facts, link)
    tau = planned["tau"]
    print(f"scaled link: {link['rate_gbit_s'] * 1e3:.3f} Mbit/s, rtt {link['rtt_ms']:.1f} ms "
          f"({facts.params:,} params, step {STEP_S} s); planned tau {tau} (H {H}, P {P}, 4 bits)", flush=True)
    if args.quick:
        plan = [("dp", 16, 2), ("decoupled", 4, 2 * H)]
        transport_cases = [(1.0, 50.0, TUNED_HOST, ("default", "auto")), (1.0, 50.0, DEFAULT_HOST, ("default", "auto"))]
    else:
        plan = [("dp", 16, 3), ("diloco", 16, 3 * H), ("streaming", 16, 3 * H),
                ("decoupled", 16, 3 * H), ("decoupled", 8, 3 * H), ("decoupled", 4, 3 * H)]
        every = ("default", "tuned", "auto")
        transport_cases = [(rate, rtt, TUNED_HOST, every) for rate in (1.0, 2.0, 5.0) for rtt in (50.0, 100.0)]
        transport_cases += [(2.0, 100.0, DEFAULT_HOST, every)]
    if args.events_only:
        out = json.loads(args.out.read_text())
        with tempfile.TemporaryDirectory(prefix="wan-bench-") as tmp:
            out["events"] = run_events(link, Path(tmp), tau)
        save(out, args.out)
        return 0
    if args.transport_only and args.case:
        settings = tuple(args.settings.split(","))
        unknown = sorted(set(settings) - set(SETTINGS_ARGS))
        if unknown:
            ap.error(f"--settings: unknown {', '.join(unknown)}; known: {', '.join(SETTINGS_ARGS)}")
        try:  # a fourth field, settings joined by "+", replaces --settings for that case
            cases = [(float(c[0]), float(c[1]), int(c[2]) << 20, tuple(c[3].split("+")) if len(c) == 4 else settings)
                     for c in (c.split(",") for c in args.case) if len(c) in (3, 4)]
            if len(cases) != len(args.case) or not set().union(*(c[3] for c in cases)) <= set(SETTINGS_ARGS):
                raise ValueError
        except ValueError:
            ap.error(f"--case takes RATE_GBIT_S,RTT_MS,HOST_BUFFER_MIB[,SETTING+SETTING] (settings of "
                     f"{', '.join(SETTINGS_ARGS)}), got {args.case}")
        def write(rows: list[dict], partial: bool = True) -> None:  # as each row finishes: a failure keeps them
            save({"benchmark": "transport through the emulated WAN (bench/wan.py --transport-only --case)",
                  "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                              "loadavg_1m_at_end": round(os.getloadavg()[0], 2)},
                  "rounds": args.rounds, "transport": rows, "partial": partial}, args.case_out)
        with tempfile.TemporaryDirectory(prefix="wan-bench-") as tmp:
            write(transport_rows(cases, Path(tmp), args.fragments, iperf=True, on_row=write, rounds=args.rounds),
                  partial=False)
        return 0
    if args.transport_only:
        out = json.loads(args.out.read_text())
        with tempfile.TemporaryDirectory(prefix="wan-bench-") as tmp:
            out["transport"] = transport_rows(transport_cases, Path(tmp))
        save(out, args.out)
        return 0
    t_start = time.monotonic()
    out: dict = {"scaling": scale, "settings": {"H": H, "P": P, "tau": tau, "step_s": STEP_S, "plan": planned,
                                                "calculator_layers": facts.layers}, "quick": args.quick, "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    print("emulator check", flush=True)
    out["emulator"] = emulator_check()
    if not args.quick:  # the ceiling of this machine: iperf3 through 2 and 5 Gbit/s links too
        out["emulator_rates"] = [out["emulator"]] + [emulator_check(rate) for rate in (2.0, 5.0)]
        for e in out["emulator_rates"][1:]:
            print(f"  emulator {e['rate_gbit_s_configured']:g} Gbit/s: {e['rate_tool']} {e['rate_gbit_s_measured']:.3f}, "
                  f"forwarder {e['forwarder_cores']:.2f} cores", flush=True)
    print(f"  {out['emulator']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="wan-bench-") as tmp:
        work = Path(tmp)
        print("transport through emulated links", flush=True)
        out["transport"] = transport_rows(transport_cases, work)
        print("training runs", flush=True)
        baseline: dict[str, dict] = {}
        rows = []
        for method, bits, steps in plan:
            if method not in baseline:
                baseline[method] = train_row(method, bits, steps, link, work, emulate=False, tau=tau)
            row = train_row(method, bits, steps, link, work, emulate=True, tau=tau)
            nonet = baseline[method]
            row["cu_nonet"] = nonet["cu"]
            row["cu_ratio"] = row["cu"] / nonet["cu"]
            row["cu_predicted"] = predicted_cu(method, bits, facts, nonet["step_s"], link, tau)
            row["merge_lag_predicted"] = predicted_lag_steps(method, bits, facts, nonet["step_s"], link)
            row.pop("step_timeline", None)
            rows.append(row)
            save(out | {"rows": rows, "partial": True}, args.out)  # a failure later keeps what was measured
        out["rows"] = rows
        out["loopback_rows"] = list(baseline.values())
        if not args.quick:
            out["events"] = run_events(link, work, tau)
    out["wall_s"] = time.monotonic() - t_start
    save(out, args.out)
    plot(out, args.out.with_suffix(".png"))
    print_table(out)
    return 0


def run_events(link: dict, work: Path, tau: int) -> dict:
    print("link events (decoupled, 4 bits)", flush=True)
    # Probes every 20 s or so (5 % duty) and tau planned from them: the learners adapt to the events.
    ev = train_row("decoupled", 4, 5 * H, link, work, emulate=True, tau=tau, events=link_events(link, 60.0),
                   changes={"plan": {"adapt_tau": True}, "transport": {"probe_every_s": 10.0, "probe_duty": 0.05}})
    return summarize_events(ev)


def save(out: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


def summarize_events(row: dict) -> dict:
    t = {p["what"]: p["t"] for p in row["phases"]}
    tl = row["step_timeline"]
    out = {"cu": row["cu"], "final_eval_loss": row["final_eval_loss"], "phases": row["phases"], "learners": {},
           "replans": row.get("replans", []), "links": row.get("links", [])}
    shaped = next(p["t"] for p in row["phases"] if p["what"].startswith("links shaped"))
    drop0, drop1 = t["r1: rate / 10"], t["r1: rate restored"]
    cut0, cut1 = t["r2: cut"], t["r2: restored"]
    end = next((p["t"] for p in row["phases"] if p["what"].startswith("links fast")), drop1 + 60)
    for m in range(4):
        out["learners"][m] = {
            "before_steps_per_s": steps_per_s(tl, m, shaped, min(drop0, cut0)),
            "during_drop_steps_per_s": steps_per_s(tl, m, drop0, drop1),
            "during_cut_steps_per_s": steps_per_s(tl, m, cut0, cut1),
            "after_steps_per_s": steps_per_s(tl, m, max(drop1, cut1) + 5, end),
        }
    return out


def print_table(out: dict) -> None:
    print(f"\n{'method':<10} {'bits':>4} {'CU':>6} {'/nonet':>7} {'pred':>6} {'link Mbit/s':>11} {'B/token':>8} "
          f"{'loss':>6} {'wall s':>7}")
    for r in out["rows"]:
        print(f"{r['method']:<10} {r['bits']:>4} {r['cu']:>6.3f} {r['cu_ratio']:>7.3f} {r['cu_predicted']:>6.3f} "
              f"{r['link_gbit_s'] * 1e3:>11.3f} {r['bytes_per_token']:>8.1f} {r['final_eval_loss']:>6.3f} "
              f"{r['wall_s']:>7.0f}")


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = out["rows"]
    labels = [f"{r['method']}\n{r['bits']}b" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([i - 0.2 for i in x], [r["cu_ratio"] for r in rows], width=0.4, label="measured CU / no-network CU")
    ax.bar([i + 0.2 for i in x], [r["cu_predicted"] for r in rows], width=0.4, label="calculator's CU")
    ax.set_xticks(list(x), labels)
    ax.set_ylim(0, 1.1)
    ax.axhline(0.95, color="gray", lw=0.8, ls="--")
    s = out["scaling"]
    ax.set_title(f"Emulated WAN ({s['rate_gbit_s'] * 1e3:.2f} Mbit/s, {s['rtt_ms']:.0f} ms): "
                 f"scaled from 10B params, 1 s steps, 2 Gbit/s, 80 ms")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
