"""The emulated WAN, for real: RTT and rate as configured, and nothing left behind.

Needs root and `ip netns`; skipped otherwise. Every address used lives in the
namespaces these tests create (10.77.x.y); no traffic leaves them.
"""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from wan_diloco.regions import measure
from wan_diloco.regions.emulator import (
    CC_ALLOWED, Emulator, EmulatorError, forwarder_pids, list_namespaces, teardown_leftovers, unavailable_reason,
)
from wan_diloco.regions.topology import regions_from_mapping

pytestmark = pytest.mark.netns

RTT_MS = 50.0
RATE_GBIT_S = 1.0
ROOT = Path(__file__).resolve().parents[2]


if (reason := unavailable_reason()) is not None:
    pytestmark = [pytest.mark.netns, pytest.mark.skip(reason=reason)]


def topology():
    return regions_from_mapping({
        "names": ["hub", "east", "west"], "syncer": "hub",
        "link": {"rate_gbit_s": RATE_GBIT_S, "rtt_ms": RTT_MS},
    })


def leftovers(prefix: str) -> dict:
    """Namespaces, host devices and forwarder processes carrying ``prefix``."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {
        "namespaces": list_namespaces(prefix),
        "devices": [line for line in links.splitlines() if prefix in line],
        "forwarders": forwarder_pids(prefix),
    }


NOTHING = {"namespaces": [], "devices": [], "forwarders": []}


@pytest.fixture(scope="module")
def wan():
    teardown_leftovers("wdlt")
    with Emulator(topology(), prefix="wdlt") as emu:
        yield emu
    assert leftovers("wdlt") == NOTHING


def test_reports_its_backend_and_addresses(wan):
    assert wan.backend in ("netem", "tun")
    assert wan.backend == "tun" or wan.forwarder_pid is None
    addrs = {r: wan.address_of(r) for r in ("hub", "east", "west")}
    assert len(set(addrs.values())) == 3 and all(a.startswith("10.77.") for a in addrs.values())
    own = wan.exec("east", ["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
    assert addrs["east"] + "/30" in own
    print(f"\nbackend: {wan.backend}")


def test_rtt_to_the_syncer_region_is_the_configured_rtt(wan):
    for region in ("east", "west"):
        r = measure.rtt(wan, "hub", region, count=20)
        print(f"\n{region} -> hub: rtt median {r['rtt_ms_median']:.2f} ms (min {r['rtt_ms_min']:.2f}, "
              f"max {r['rtt_ms_max']:.2f}; kernel TCP srtt {r['kernel_srtt_ms']:.2f}) for configured {RTT_MS} ms, backend {wan.backend}")
        assert r["rtt_ms_median"] == pytest.approx(RTT_MS, rel=0.05, abs=0.5)
        assert r["kernel_srtt_ms"] == pytest.approx(RTT_MS, rel=0.05, abs=0.5)


def test_region_hosts_run_the_configured_congestion_control_and_the_host_list_comes_back(wan):
    for region in ("hub", "east"):
        assert wan.exec(region, ["sysctl", "-n", "net.ipv4.tcp_congestion_control"]).stdout.strip() == "cubic"
    assert "cubic" in CC_ALLOWED.read_text().split()  # while up (added if the host did not allow it)


def test_the_allowed_list_is_restored_and_an_unknown_congestion_control_is_refused():
    before = CC_ALLOWED.read_text()
    topo = regions_from_mapping({"names": ["hub", "far"], "link": {"rate_gbit_s": 0.1, "rtt_ms": 2.0}})
    with Emulator(topo, prefix="wdlc"):
        pass
    assert CC_ALLOWED.read_text() == before
    bad = regions_from_mapping({"names": ["hub", "far"], "congestion_control": "nosuchcc"})
    with pytest.raises(EmulatorError, match="congestion_control: 'nosuchcc' is not available"):
        with Emulator(bad, prefix="wdlc"):
            pass
    assert leftovers("wdlc") == NOTHING and CC_ALLOWED.read_text() == before


def test_region_to_region_crosses_both_links(wan):
    r = measure.rtt(wan, "west", "east", count=10)
    assert r["rtt_ms_median"] == pytest.approx(2 * RTT_MS, rel=0.05, abs=0.5)


@pytest.mark.parametrize("src, dst", [("east", "hub"), ("hub", "east")])
def test_throughput_reaches_the_shaped_rate(wan, src, dst):
    cpu0 = _cpu_s(wan.forwarder_pid)
    t = measure.throughput(wan, dst, src, seconds=4.0, warmup_s=1.0)
    cpu = (_cpu_s(wan.forwarder_pid) - cpu0) / t.seconds if wan.forwarder_pid else 0.0
    print(f"\n{src} -> {dst}: {t.gbit_s:.3f} Gbit/s after warm-up ({t.total_gbit_s:.3f} over the whole "
          f"{t.seconds:.1f} s) through a {RATE_GBIT_S} Gbit/s link; forwarder CPU {cpu:.0%} of a core")
    assert t.gbit_s >= 0.9 * RATE_GBIT_S
    assert t.gbit_s <= 1.05 * RATE_GBIT_S  # the shaper holds it to the rate


def _cpu_s(pid):
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_nothing_is_left_after_an_exception_inside():
    teardown_leftovers("wdlx")
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError, match="boom"):
        with Emulator(topology(), prefix="wdlx") as emu:
            proc = emu.popen("east", ["sleep", "30"])
            assert list_namespaces("wdlx")
            raise RuntimeError("boom")
    assert leftovers("wdlx") == NOTHING
    assert proc.poll() is not None
    assert signal.getsignal(signal.SIGINT) is before


def test_a_killed_emulator_process_is_cleaned_by_teardown_leftovers():
    teardown_leftovers("wdlk")
    script = textwrap.dedent("""
        import sys, time
        from wan_diloco.regions.emulator import Emulator
        from wan_diloco.regions.topology import regions_from_mapping
        with Emulator(regions_from_mapping({"names": ["a", "b"]}), prefix="wdlk"):
            print("up", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "up"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        time.sleep(0.3)
        assert list_namespaces("wdlk")  # SIGKILL cannot be caught: the namespaces stay ...
        assert forwarder_pids("wdlk") == []  # ... but the forwarder died with its parent
    finally:
        teardown_leftovers("wdlk")
    assert leftovers("wdlk") == NOTHING


def test_sigterm_tears_down_and_restores_handlers():
    teardown_leftovers("wdls")
    script = textwrap.dedent("""
        import signal, time
        from wan_diloco.regions.emulator import Emulator
        from wan_diloco.regions.topology import regions_from_mapping
        try:
            with Emulator(regions_from_mapping({"names": ["a", "b"]}), prefix="wdls"):
                print("up", flush=True)
                time.sleep(60)
        except SystemExit:
            print("handler restored", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "up"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert "handler restored True" in out
    assert leftovers("wdls") == NOTHING


def test_refuses_a_prefix_in_use_and_a_missing_backend():
    teardown_leftovers("wdlr")
    with Emulator(regions_from_mapping({"names": ["a", "b"]}), prefix="wdlr") as emu:
        with pytest.raises(EmulatorError, match="exist already"):
            Emulator(regions_from_mapping({"names": ["a", "b"]}), prefix="wdlr").__enter__()
        if emu.backend == "tun":  # this kernel has no netem
            with pytest.raises(EmulatorError, match="no netem"):
                with Emulator(regions_from_mapping({"names": ["a", "b"]}), prefix="wdlq", backend="netem"):
                    pass
    assert leftovers("wdlr") == NOTHING and leftovers("wdlq") == NOTHING


@pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 not installed (optional test tool)")
def test_iperf3_agrees_on_the_rate(wan):
    gbit_s = measure.iperf3(wan, "hub", "west", seconds=4.0)
    print(f"\niperf3 west -> hub: {gbit_s:.3f} Gbit/s through a {RATE_GBIT_S} Gbit/s link")
    # The first second (slow start at 50 ms RTT) is left out, as the raw-TCP probe's warm-up is.
    assert 0.85 * RATE_GBIT_S <= gbit_s <= 1.05 * RATE_GBIT_S


def test_jitter_spreads_the_rtt_around_the_configured_value():
    teardown_leftovers("wdlj")
    topo = regions_from_mapping({"names": ["hub", "east"], "link": {"rtt_ms": 40.0, "jitter_ms": 5.0}})
    with Emulator(topo, prefix="wdlj") as emu:
        r = measure.rtt(emu, "hub", "east", count=30)
    print(f"\njitter 5 ms each way: rtt median {r['rtt_ms_median']:.2f} ms, min {r['rtt_ms_min']:.2f}, "
          f"max {r['rtt_ms_max']:.2f}")
    assert r["rtt_ms_max"] - r["rtt_ms_min"] > 4.0
    # Nothing arrives before delay - jitter. The maximum is not bounded here: on a loaded host it also holds
    # the time the emulator's process waited for a core (62.8 ms seen once in CI with other jobs running).
    assert 30.0 - 1.0 <= r["rtt_ms_min"]
    # in-order delivery pulls delays up towards delay + jitter, hence the skew
    assert 38.0 <= r["rtt_ms_median"] <= 47.0
    assert leftovers("wdlj") == NOTHING


def test_a_link_can_slow_down_be_cut_and_come_back_while_in_use():
    teardown_leftovers("wdlc")
    topo = regions_from_mapping({"names": ["hub", "east"], "link": {"rate_gbit_s": 0.2, "rtt_ms": 20.0}})
    with Emulator(topo, prefix="wdlc") as emu:
        emu.set_rate("east", 0.02)
        slow = measure.throughput(emu, "hub", "east", seconds=3.0)
        knock = [sys.executable, "-c", f"import socket; socket.create_connection(('{emu.address_of('hub')}', 9), 2)"]
        assert "refused" in emu.exec("east", knock, check=False).stderr  # the link is up: a closed port answers
        emu.cut("east")
        assert "timed out" in emu.exec("east", knock, check=False).stderr  # cut: silence
        emu.cut("east", down=False)
        emu.set_rate("east", 0.2)
        back = measure.rtt(emu, "hub", "east", count=5)
        fast = measure.throughput(emu, "hub", "east", seconds=3.0)
    print(f"\nslowed to 0.02: {slow.gbit_s:.4f} Gbit/s; back at 0.2: {fast.gbit_s:.3f} Gbit/s, rtt {back['rtt_ms_median']:.1f}")
    assert slow.gbit_s == pytest.approx(0.02, rel=0.15)
    assert fast.gbit_s == pytest.approx(0.2, rel=0.15)
    assert back["rtt_ms_median"] == pytest.approx(20.0, rel=0.15)
    assert leftovers("wdlc") == NOTHING
