"""The link probe: the Probe RPC on loopback, its refusals, and the duty-cycle policy."""
import grpc
import pytest

from wan_diloco.transport import Frame, ProbePolicy, TransportError, encode_message
from wan_diloco.transport.probe import MAX_PROBE_BYTES, PROBE_CUTOFF, START_PROBES, LinkSample, rate_from_transfer
from wan_diloco.transport.security import bearer_metadata
from wan_diloco.transport.server import SERVICE

from .conftest import TOKEN, arun, client_for, syncer


def test_probe_measures_rtt_and_rate_and_the_server_records_the_report():
    async def main():
        async with syncer() as (server, _), client_for(server) as client:
            first = await client.probe("learner-0", 2 << 20)
            assert first.nbytes == 2 << 20
            assert 0 < first.rtt_s < 0.5 and first.rate_gbit_s > 0.01
            assert server.peer_links == {}  # the first probe has nothing to report yet
            await client.probe("learner-0", 1 << 20, report=first.to_event())
            got = server.peer_links["learner-0"]
            assert got["rtt_ms"] == pytest.approx(first.rtt_s * 1e3, rel=1e-3)
            assert got["rate_gbit_s"] == pytest.approx(first.rate_gbit_s, rel=1e-3)
            text = server.metrics.render().decode()
            assert 'wan_diloco_link_rate_gbit_s{peer="learner-0"}' in text
            # every byte asked for was sent, spread over both channels
            assert server.metrics.bytes_out.labels("Probe")._value.get() == 3 << 20
            # probe bytes are counted apart from training traffic
            assert server.metrics.total(server.metrics.bytes_out, "Probe") == 3 << 20
            assert server.metrics.total(server.metrics.bytes_out) == 0
    arun(main())


@pytest.mark.parametrize("nbytes", [-1, MAX_PROBE_BYTES + 1, "10", 1.5, True, None])
def test_bad_probe_size_is_invalid_argument(nbytes):
    async def main():
        async with syncer() as (server, _):
            async with grpc.aio.insecure_channel(server.target) as ch:
                req = encode_message(Frame("learner-0", 0, {"bytes": nbytes}))
                call = ch.unary_stream(f"/{SERVICE}/Probe")(req, metadata=bearer_metadata(TOKEN), timeout=5)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "meta.bytes" in err.value.details()
    arun(main())


def test_probe_needs_the_token_and_nonsense_reports_are_not_recorded():
    async def main():
        async with syncer() as (server, _):
            async with client_for(server, token="wrong-token-0123456") as bad:
                with pytest.raises(TransportError) as err:
                    await bad.probe("learner-0", 1024)
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
            async with client_for(server) as client:
                await client.probe("learner-1", 1024, report={"rtt_ms": -3, "rate_gbit_s": 5})
                await client.probe("learner-2", 1024, report={"rtt_ms": "1", "rate_gbit_s": 2})
            assert server.peer_links == {}
    arun(main())


def test_rate_from_transfer_takes_one_rtt_off_the_wall_time():
    rate, transfer = rate_from_transfer(125_000_000, wall_s=1.1, rtt_s=0.1)  # 1 Gbit in 1 s of transfer
    assert transfer == pytest.approx(1.0) and rate == pytest.approx(1.0)
    _, transfer = rate_from_transfer(1000, wall_s=0.1000001, rtt_s=0.1)
    assert transfer >= 0.005  # never near zero: a tiny probe is not reported as infinitely fast


def test_policy_sizes_probes_from_the_last_rate_and_keeps_the_duty_cycle():
    pol = ProbePolicy(probe_seconds=0.2, duty=0.02, every_s=5.0)
    assert pol.request() == (1 << 20, PROBE_CUTOFF * 0.2)  # nothing measured yet
    s = LinkSample(rtt_s=0.001, rate_gbit_s=2.0, nbytes=50_000_000, transfer_s=0.2, at_s=0.0)
    assert pol.take(s)
    delay = pol.delay_s()
    assert delay == pytest.approx(0.2 / 0.02 - 0.2)  # 2 % of the time busy, longer than every_s
    assert s.transfer_s / (delay + s.transfer_s) == pytest.approx(0.02)
    assert pol.next_bytes() == 50_000_000  # 2 Gbit/s x 0.2 s
    fast = ProbePolicy(probe_seconds=0.2, duty=0.5, every_s=30.0)
    fast.take(s)
    assert fast.delay_s() == 30.0
    with pytest.raises(ValueError):
        ProbePolicy(duty=0)


def test_probes_on_a_long_link_span_ten_round_trips():
    pol = ProbePolicy(probe_seconds=0.2)
    pol.take(LinkSample(rtt_s=0.1, rate_gbit_s=2.0, nbytes=250_000_000, transfer_s=1.0, at_s=0.0))
    nbytes, max_s = pol.request()
    assert nbytes == 250_000_000 and max_s == pytest.approx(PROBE_CUTOFF * 1.0)  # 2 Gbit/s x 10 x 100 ms
    assert pol.too_short(LinkSample(0.1, 2.0, 50_000_000, 0.2, 0.0))  # 0.2 s < 10 RTTs / 4


def test_start_up_probes_grow_until_long_enough_and_no_longer_rising():
    pol = ProbePolicy(probe_seconds=0.2)
    assert not pol.take(LinkSample(0.05, 0.5, 1 << 20, 0.017, 0.0))  # too short: not counted
    assert pol.next_bytes() == 31_250_000  # 0.5 Gbit/s over 10 round trips
    assert not pol.take(LinkSample(0.05, 1.2, 75_000_000, 0.5, 0.0))  # long enough but 2.4x faster: ramping
    assert pol.take(LinkSample(0.05, 1.25, 75_000_000, 0.48, 0.0))  # settled
    assert pol.take(LinkSample(0.05, 0.2, 1 << 20, 0.04, 0.0))  # once started, every sample counts
    fresh = ProbePolicy(probe_seconds=0.2)
    assert not fresh.take(LinkSample(0.1, 0.012, 1 << 20, 0.7, 0.0))  # long enough, but a fresh WAN connection
    assert not fresh.take(LinkSample(0.1, 0.5, 1 << 26, 1.0, 0.0))  # 40x faster: still ramping
    assert fresh.take(LinkSample(0.1, 0.52, 1 << 26, 1.0, 0.0))
    fresh.restart()  # more connections opened: they ramp like the first ones
    assert not fresh.take(LinkSample(0.1, 0.6, 1 << 26, 1.0, 0.0))
    assert fresh.take(LinkSample(0.1, 0.62, 1 << 26, 1.0, 0.0))
    slow = ProbePolicy(probe_seconds=0.2)
    assert not slow.take(LinkSample(0.001, 0.01, 1 << 20, 0.002, 0.0))
    assert slow.next_bytes() == 4 << 20  # four times the last probe, more than its noisy rate asks for
    lan = ProbePolicy(probe_seconds=0.2)
    lan.take(LinkSample(0.0002, 5.0, 125_000_000, 0.2, 0.0))
    assert lan.take(LinkSample(0.0002, 8.0, 125_000_000, 0.2, 0.0))  # sub-ms round trip: no ramp, just noise
    stubborn = ProbePolicy(probe_seconds=0.2)
    counted = [stubborn.take(LinkSample(0.05, 0.1 * 2 ** i, 1 << 20, 0.01, 0.0)) for i in range(START_PROBES)]
    assert counted == [False] * (START_PROBES - 1) + [True]  # a link that never settles still gets a figure


def test_a_probe_past_its_time_limit_is_measured_on_what_arrived():
    async def main():
        async with syncer() as (server, _), client_for(server) as client:
            s = await client.probe("learner-0", MAX_PROBE_BYTES, max_s=0.05)
            assert 0 < s.nbytes < MAX_PROBE_BYTES and s.rate_gbit_s > 0
    arun(main())
