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
  ``probe_seconds`` at the last measured rate and spaces probes so that they
  keep the link busy at most ``probe_duty`` of the time.

The request is a ``Frame`` whose meta carries the bytes wanted and, so the
syncer can show every learner's link on /status and /metrics, the sender's
previous measurement. The server caps the size (``MAX_PROBE_BYTES``) and the
number of probes served at once.
"""
from __future__ import annotations

import dataclasses
import math

MAX_PROBE_BYTES = 256 << 20
MIN_PROBE_BYTES = 16 << 10  # a fifth of a second at 0.66 Mbit/s
PROBE_CUTOFF = 5  # a probe transfer is cut short after this many times its target length
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
    """How big the next probe is and when it runs, from what the last one found.

    ``probe_seconds``: target duration of one timed transfer. ``duty``: the
    largest share of time probes may keep the link busy. ``every_s``: the
    shortest interval between probes (0 disables probing after the first).
    """

    def __init__(self, probe_seconds: float = 0.2, duty: float = 0.02, every_s: float = 30.0):
        if not (probe_seconds > 0 and 0 < duty <= 1 and every_s >= 0):
            raise ValueError("probe_seconds must be > 0, duty in (0, 1], every_s >= 0")
        self.probe_seconds, self.duty, self.every_s = probe_seconds, duty, every_s
        self.last: LinkSample | None = None

    def next_bytes(self) -> int:
        """Bytes to ask for: about ``probe_seconds`` at the last measured rate."""
        if self.last is None:
            return 1 << 20
        want = self.last.rate_gbit_s * 1e9 / 8 * self.probe_seconds
        return int(min(MAX_PROBE_BYTES, max(MIN_PROBE_BYTES, want)))

    def too_short(self, sample: LinkSample) -> bool:
        """True when a probe was so short that its rate is mostly noise (measure again, bigger)."""
        return sample.transfer_s < self.probe_seconds / 4 and sample.nbytes < MAX_PROBE_BYTES

    def delay_s(self, sample: LinkSample) -> float:
        """Seconds to wait before the next probe: the duty cycle or ``every_s``, whichever is longer."""
        self.last = sample
        return max(self.every_s, sample.transfer_s / self.duty - sample.transfer_s)


def finite_positive(x: object) -> float | None:
    """``x`` as a float if it is a finite number > 0 (for values read from a peer's meta)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) and x > 0 else None

