"""Link probe over the production transport: RTT by small round trips, rate by a timed download.

A learner measures its own link to the syncer with the same channels, TLS and
HTTP/2 settings its fragments use, so what it measures is what its transfers
can get (window limits included), not what a raw socket could.

- RTT: the smallest of a few ``Probe`` calls asking for 0 bytes (one HTTP/2
  request/response round trip on a warm connection).
- Rate: one ``Probe`` call per channel, in parallel, each streaming its share
  of ``nbytes`` of zeros back. The transfer time is the wall time minus one
  RTT (the request's way there and the first byte's way back), so a short
  probe is not charged its round trip.
- Duty cycle: :class:`ProbePolicy` sizes each probe to last about
  ``probe_seconds`` at the last measured rate, and at least ``PROBE_RTTS``
  round trips (a transfer of a few RTTs on a long link measures TCP's ramp,
  not the link), and spaces probes so that they keep the link busy at most
  ``probe_duty`` of the time. At start a learner probes again, bigger, while
  the samples are too short or still rising (``ProbePolicy.take``).

The request is a ``Frame`` whose meta carries the bytes wanted and, so the
syncer can show every learner's link on /status and /metrics, the sender's
previous measurement. The server caps the size (``MAX_PROBE_BYTES``) and the
number of probes served at once.
"""
from __future__ import annotations

import dataclasses
import math
import time

MAX_PROBE_BYTES = 256 << 20
MIN_PROBE_BYTES = 16 << 10  # a fifth of a second at 0.66 Mbit/s
PROBE_CUTOFF = 5  # a probe transfer is cut short after this many times its target length
PROBE_RTTS = 10  # a timed transfer spans at least this many round trips
START_PROBES = 6  # at most this many probes at start before the first sample counts
RAMP_RTT_S = 0.005  # below this round trip TCP ramps up in no time: a faster sample is noise, not a ramp
RISING = 1.1  # a start-up sample this much faster than the one before: TCP is still ramping, probe again
PROBE_MESSAGE_MIN_BYTES = 4 << 10
MAX_CONCURRENT_PROBES = 8  # server side: probe streams served at once (several channels per learner)


@dataclasses.dataclass(frozen=True)
class LinkSample:
    """One measurement of a learner's link to the syncer (syncer -> learner direction)."""

    rtt_s: float
    rate_gbit_s: float
    nbytes: int  # bytes of the timed transfer
    transfer_s: float  # time the transfer kept the link busy (wall minus one RTT)
    at_s: float  # time.monotonic() when it finished

    def to_event(self) -> dict:
        return {"rtt_ms": round(self.rtt_s * 1e3, 3), "rate_gbit_s": round(self.rate_gbit_s, 4),
                "probe_bytes": self.nbytes, "probe_s": round(self.transfer_s, 4)}


def rate_from_transfer(nbytes: int, wall_s: float, rtt_s: float) -> tuple[float, float]:
    """(Gbit/s, transfer seconds) of ``nbytes`` that arrived ``wall_s`` after the request.

    One RTT of the wall time is the request travelling and the first byte
    returning; it is not link time. Never less than a millisecond, so a tiny
    transfer on a fast link is not reported as infinitely fast.
    """
    transfer_s = max(wall_s - rtt_s, 1e-3, wall_s * 0.05)
    return nbytes * 8 / transfer_s / 1e9, transfer_s


class ProbePolicy:
    """How big the next probe is, whether its sample counts and when the next one runs (sans-IO).

    ``probe_seconds``: target duration of one timed transfer. ``duty``: the
    largest share of time probes may keep the link busy. ``every_s``: the
    shortest interval between probes (0 disables probing after the first).

    A driver loops: ``nbytes, max_s = request()``, probe, ``take(sample)``;
    a sample that counts is reported and followed by ``delay_s()`` of sleep,
    one that does not (start-up, unsettled) by the next probe at once.
    """

    def __init__(self, probe_seconds: float = 0.2, duty: float = 0.02, every_s: float = 30.0):
        if not (probe_seconds > 0 and 0 < duty <= 1 and every_s >= 0):
            raise ValueError("probe_seconds must be > 0, duty in (0, 1], every_s >= 0")
        self.probe_seconds, self.duty, self.every_s = probe_seconds, duty, every_s
        self.last: LinkSample | None = None
        self.start_probes = 0  # probes made before the first that counted
        self.started = False
        self.previous: LinkSample | None = None  # the start-up sample before this one
        self.floor = 0  # at start: at least this many bytes next (the last probe was too short)

    def target_s(self, rtt_s: float | None = None) -> float:
        """Length a probe should last: ``probe_seconds``, or ``PROBE_RTTS`` round trips if longer."""
        if rtt_s is None:
            rtt_s = self.last.rtt_s if self.last is not None else 0.0
        return max(self.probe_seconds, PROBE_RTTS * rtt_s)

    def next_bytes(self) -> int:
        """Bytes to ask for: about ``target_s()`` at the last measured rate."""
        if self.last is None:
            return max(self.floor, 1 << 20)
        want = max(self.floor, self.last.rate_gbit_s * 1e9 / 8 * self.target_s())
        return int(min(MAX_PROBE_BYTES, max(MIN_PROBE_BYTES, want)))

    def request(self) -> tuple[int, float]:
        """(bytes to ask for, seconds after which the transfer is cut short)."""
        return self.next_bytes(), PROBE_CUTOFF * self.target_s()

    def too_short(self, sample: LinkSample) -> bool:
        """True when a probe was so short that its rate is mostly noise (measure again, bigger)."""
        return sample.transfer_s < self.target_s(sample.rtt_s) / 4 and sample.nbytes < MAX_PROBE_BYTES

    def take(self, sample: LinkSample) -> bool:
        """Record ``sample``; True if it counts. At start it does not while it is too short, or, on a
        link of ``RAMP_RTT_S`` or more, while it is the first or faster than the one before by
        ``RISING`` (TCP and HTTP/2 windows still ramping on a fresh connection: the link is
        probably faster than measured), for at most ``START_PROBES`` probes."""
        previous, self.last = self.previous, sample
        if self.started:
            return True
        self.previous = sample
        self.start_probes += 1
        short = self.too_short(sample)
        wan = sample.rtt_s >= RAMP_RTT_S
        # On a WAN the first transfer of a fresh connection measures TCP's and HTTP/2's ramp, never the link.
        rising = wan and (previous is None or sample.rate_gbit_s > RISING * previous.rate_gbit_s)
        if self.start_probes < START_PROBES and (short or rising):
            self.floor = 4 * sample.nbytes if short else 0
            return False
        self.started, self.floor = True, 0
        return True

    def restart(self) -> None:
        """New connections were opened: measure them as at start (they ramp up like the first ones)."""
        self.started, self.start_probes, self.previous, self.floor = False, 0, None, 0

    def delay_s(self) -> float:
        """Seconds to wait after a counted sample: the duty cycle or ``every_s``, whichever is longer."""
        busy = self.last.transfer_s if self.last is not None else 0.0
        return max(self.every_s, busy / self.duty - busy)


def finite_positive(x: object) -> float | None:
    """``x`` as a float if it is a finite number > 0 (for values read from a peer's meta)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) and x > 0 else None


def record_link(links: dict, metrics, sender: str, meta: dict, max_links: int) -> None:
    """Keep ``sender``'s latest link measurement as it reported it in a Probe's meta (for /status and
    /metrics); a first probe carries none, and nonsense is not recorded."""
    rtt_ms, rate = finite_positive(meta.get("rtt_ms")), finite_positive(meta.get("rate_gbit_s"))
    if rtt_ms is None or rate is None:
        return
    if sender not in links and len(links) >= max_links:
        links.pop(next(iter(links)))  # oldest first: a token holder cannot grow it
    links[sender] = {"rtt_ms": rtt_ms, "rate_gbit_s": rate, "at_s": time.monotonic()}
    metrics.gauge("link_rtt_ms", "Round-trip time each peer measured to us, ms", ["peer"]).labels(sender).set(rtt_ms)
    metrics.gauge("link_rate_gbit_s", "Download rate each peer measured from us, Gbit/s", ["peer"]).labels(
        sender).set(rate)
