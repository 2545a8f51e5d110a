"""The TUN forwarder's scheduling, without a TUN: delay per crossed link, jitter, loss, order."""
import struct

import pytest

from wan_diloco.regions.forwarder import Forwarder, parse_link


def packet(src: str, dst: str, n: int = 0) -> bytes:
    ip = lambda a: bytes(int(x) for x in a.split("."))  # noqa: E731
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40, n & 0xFFFF, 0, 64, 6, 0, ip(src), ip(dst))
    return header + bytes(20)


def forwarder(**links):
    return Forwarder(fd=-1, links={parse_link(f"10.77.{k[1:]}={v}")[0]: parse_link(f"10.77.{k[1:]}={v}")[1]
                                   for k, v in links.items()}, seed=1)


def test_parse_link():
    assert parse_link("10.77.3=0.025,0.001,0.01") == (b"\x0a\x4d\x03", (0.025, 0.001, 0.01))
    with pytest.raises(ValueError, match="first three"):
        parse_link("10.77=0,0,0")


def test_delay_is_the_sum_of_the_links_crossed():
    f = forwarder(r2="0.025,0,0", r3="0.040,0,0")  # region 1 is the syncer's: no link
    f.schedule(packet("10.77.2.2", "10.77.1.2"), now=100.0)
    f.schedule(packet("10.77.1.2", "10.77.3.2"), now=100.0)
    f.schedule(packet("10.77.2.2", "10.77.3.2"), now=100.0)
    assert sorted(round(r - 100.0, 6) for r, _, _ in f.heap) == [0.025, 0.040, 0.065]


def test_non_ipv4_is_dropped_silently():
    f = forwarder(r2="0.025,0,0")
    f.schedule(b"\x60" + bytes(39), now=0.0)
    f.schedule(b"\x45", now=0.0)
    assert f.heap == []


def test_loss_rate_and_jitter_keep_each_direction_in_order():
    f = forwarder(r2="0.025,0.005,0.1")
    n = 4000
    for k in range(n):
        # 20 ms apart: wider than the jitter range, so order does not mask it
        f.schedule(packet("10.77.2.2", "10.77.1.2", k), now=k * 0.02)
    kept = len(f.heap)
    assert kept / n == pytest.approx(0.9, abs=0.03)
    assert f.stats["dropped"] == n - kept
    releases = sorted(f.heap, key=lambda e: e[1])  # in arrival order
    times = [r for r, _, _ in releases]
    assert times == sorted(times)  # no reordering within a direction
    delays = [r - struct.unpack("!H", p[4:6])[0] * 0.02 for r, _, p in releases]
    assert min(delays) >= 0.020 - 1e-9 and max(delays) <= 0.030 + 1e-9
    assert max(delays) - min(delays) > 0.008  # jitter is there
    assert sum(delays) / len(delays) == pytest.approx(0.025, abs=0.0005)


def test_dense_traffic_stays_in_order_under_jitter():
    f = forwarder(r2="0.025,0.005,0")
    for k in range(1000):
        f.schedule(packet("10.77.2.2", "10.77.1.2", k), now=k * 1e-4)
        f.schedule(packet("10.77.1.2", "10.77.2.2", k), now=k * 1e-4)
    for direction in (b"\x0a\x4d\x02", b"\x0a\x4d\x01"):
        times = [r for r, _, p in sorted(f.heap, key=lambda e: e[1]) if p[12:15] == direction]
        assert len(times) == 1000 and times == sorted(times)
