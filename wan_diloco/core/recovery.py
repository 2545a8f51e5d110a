"""Sans-IO peer recovery (docs/method.md, "Recovery"): which healthy learner gives its state to one
that (re)joins, and what happens when that donor goes away.

The syncer side is :class:`Donations`: a recipient asks (``request``), a donor
is chosen (``choose_donor``: same region first, then the least busy donor,
then the most advanced), and an ``AskDonor`` action names the global versions
V the recipient saw; the donor answers once it has seen V, without stopping
its training. If the donor is lost before its state arrives, the next donor
is asked (``peer_lost``); a recipient nobody can serve gets ``NoDonor``.
The donor's state arrives in parts (``on_part``: in order, within the
model's bound, checked against its digest once whole); the syncer keeps it
until the recipient took it up (``lookup`` answers the recipient's fetch).
The learner side (installing the state and replaying the updates buffered
meanwhile) is ``LearnerCore.adopt`` plus the driver's replay. The simulator
and the networked runtime both go through these.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import xxhash

from wan_diloco.core.messages import Donation
from wan_diloco.core.protocol import ProtocolError

DONATION_PART_BYTES = 32 << 20  # one Upload per part: a failed part is sent again alone


def state_digest(data) -> str:
    """XXH3-64 (hex) of a donated state: what its parts are checked against once all arrived
    (the same digest as ``runtime.serde.bytes_digest``)."""
    return xxhash.xxh3_64_hexdigest(data)


def max_state_bytes(model_bytes: int) -> int:
    """The largest state a learner can donate for a model of ``model_bytes`` (fp32): parameters,
    inner optimizer (two moments), global view and residuals are 5x the model; twice that, and room
    for the header, bounds what the syncer buffers for one recipient."""
    return 10 * model_bytes + (16 << 20)


def donation_parts(recipient: int, versions: tuple[int, ...], state: bytes,
                   part_bytes: int = DONATION_PART_BYTES) -> Iterator[tuple[Donation, memoryview]]:
    """A donor's ``state`` (a ``checkpoint`` state file of kind "donation") for ``recipient`` as its parts,
    in order: each ``Donation`` with its payload (what ``SendState`` sends; ``Donations.on_part`` takes)."""
    digest, view = state_digest(state), memoryview(state)
    for offset in range(0, len(state), part_bytes):
        yield Donation(recipient, tuple(versions), offset, len(state), digest), view[offset : offset + part_bytes]


@dataclass(frozen=True)
class Candidate:
    """What the syncer knows of a learner that could donate."""

    region: str
    step: int
    busy: int = 0  # donations it is serving now


def choose_donor(candidates: Mapping[int, Candidate], region: str, exclude: frozenset[int] = frozenset()) -> int | None:
    """The donor for a recipient in ``region``: same region (its link is the short one), then the
    least busy (a donor that already serves one would split its upload), then the most advanced, then
    the lowest id (deterministic). None if nobody can donate."""
    ok = [m for m in candidates if m not in exclude]
    if not ok:
        return None
    return min(ok, key=lambda m: (candidates[m].region != region, candidates[m].busy, -candidates[m].step, m))


@dataclass(frozen=True)
class AskDonor:
    """Driver: ask learner ``donor`` for its state for ``recipient``, once it has seen ``versions``."""

    donor: int
    recipient: int
    versions: tuple[int, ...]


@dataclass(frozen=True)
class NoDonor:
    """Driver: nobody can give ``recipient`` a state (it starts from the global parameters alone)."""

    recipient: int
    why: str


@dataclass(frozen=True)
class RecoveryStarted:
    """Driver: ``recipient`` asks for a peer's state anew: what an earlier attempt left is gone; a fetch
    of ``donation/M`` from now on waits for this attempt (keep the same waiter: the fetch may be there
    before the metadata that asked)."""

    recipient: int


@dataclass(frozen=True)
class StateReady:
    """Driver: the state for ``recipient`` arrived whole from ``donor`` (``nbytes``) and matches its
    digest: wake the recipient's fetch (``Donations.lookup`` has it)."""

    recipient: int
    donor: int
    nbytes: int


@dataclass(frozen=True)
class StateTaken:
    """Driver: ``recipient`` took its state up or went away: drop its waiter; the copy is gone."""

    recipient: int


class PartRefused(Exception):
    """A donation part that cannot be taken now (not asked, or out of order): refused with this text, the
    donor may send it again (unlike ``ProtocolError``: a malformed or false part, counted as refused)."""


@dataclass(frozen=True)
class DonatedState:
    """What ``Donations.lookup`` answers for a recipient whose state is here."""

    digest: str
    data: bytearray


@dataclass(frozen=True)
class NoState:
    """What ``Donations.lookup`` answers when there is no state to serve: ``waiting`` (a donor is still at
    work: ask again) or not (``why`` there is none)."""

    why: str
    waiting: bool


@dataclass
class _Incoming:
    """A donor's state arriving in parts."""

    donor: int
    digest: str
    total_bytes: int
    received: int = 0
    data: bytearray = field(init=False)

    def __post_init__(self) -> None:
        self.data = bytearray(self.total_bytes)


@dataclass
class _Pending:
    donor: int
    versions: tuple[int, ...]
    asked_s: float
    tried: set[int] = field(default_factory=set)


class Donations:
    """Syncer-side bookkeeping of recoveries in progress (see the module docstring)."""

    def __init__(self, timeout_s: float, max_state_bytes: int | None = None):
        self.timeout_s = timeout_s  # a donor that has not delivered by then is replaced
        self.max_state_bytes = max_state_bytes  # the largest state a donor may send (None: no bound)
        self.pending: dict[int, _Pending] = {}  # recipient -> its current donor
        self.served = 0
        self.replaced = 0
        self.received_bytes = 0  # donation bytes taken in, parts sent again included
        self.incoming: dict[int, _Incoming] = {}  # recipient -> the state arriving in parts
        # recipient -> (digest, the state its donor sent), or why there is none; kept until the recipient
        # took it up (its next metadata no longer recovering), so a broken fetch resumes where it stopped
        self.donated: dict[int, tuple[str, bytearray] | str] = {}

    # ---- events of the networked syncer: requests, parts, fetches -------------------------------

    def on_metadata(self, now_s: float, learner: int, recovering: bool, versions: tuple[int, ...],
                    candidates: Mapping[int, Candidate], region: str) -> list:
        """A learner's metadata: recovering (and not asked for yet), it asks for a peer's state; no longer
        recovering, the state kept for it goes."""
        if not recovering:
            return self._taken(learner) if learner in self.donated else []
        if learner in self.pending:
            return []
        self.donated.pop(learner, None)
        self.incoming.pop(learner, None)
        return [RecoveryStarted(learner)] + self._record(self.request(now_s, learner, versions, candidates, region))

    def on_part(self, now_s: float, donor: int, recipient: int, offset: int, total_bytes: int, digest: str,
                payload) -> list:
        """One part of ``donor``'s state for ``recipient``: bytes [offset, offset + len(payload)) of
        ``total_bytes`` whose digest is ``digest``. The last one completes it (``StateReady``). A part sent
        again lands on itself. PartRefused: not asked, or out of order; ProtocolError: too large for this
        model, or the whole does not match its digest (never handed on; the donor is replaced in time)."""
        if self.donor_of(recipient) != donor:
            raise PartRefused(f"learner {donor} was not asked for a state for learner {recipient} (or was replaced)")
        if self.max_state_bytes is not None and total_bytes > self.max_state_bytes:
            raise ProtocolError(f"Donation: a state of {total_bytes} bytes is larger than this model's state can be "
                                f"({self.max_state_bytes} bytes)")
        got = self.incoming.get(recipient)
        if got is None or (got.donor, got.digest, got.total_bytes) != (donor, digest, total_bytes):
            if offset:
                raise PartRefused(f"Donation: a part at offset {offset} of a state whose first part never arrived "
                                  f"(send it again from offset 0)")
            got = self.incoming[recipient] = _Incoming(donor, digest, total_bytes)
        if offset > got.received:
            raise PartRefused(f"Donation: a part at offset {offset}, but only {got.received} bytes arrived so far")
        got.data[offset : offset + len(payload)] = payload
        got.received = max(got.received, offset + len(payload))
        self.received_bytes += len(payload)
        self.progress(now_s, recipient)
        if got.received < got.total_bytes:
            return []
        del self.incoming[recipient]
        if state_digest(got.data) != got.digest:
            raise ProtocolError(f"Donation: the state for learner {recipient} does not match its digest")
        self.delivered(recipient, donor)
        self.donated[recipient] = (got.digest, got.data)
        return [StateReady(recipient, donor, got.total_bytes)]

    def on_peer_lost(self, now_s: float, learner: int, candidates: Mapping[int, Candidate],
                     regions: Mapping[int, str]) -> list:
        """``learner``'s stream ended: its own recovery ends, and donors it was are replaced."""
        return self._taken(learner) + self._record(self.peer_lost(now_s, learner, candidates, regions))

    def on_tick(self, now_s: float, candidates: Mapping[int, Candidate], regions: Mapping[int, str]) -> list:
        return self._record(self.tick(now_s, candidates, regions)) if self.pending else []

    def lookup(self, recipient: int) -> DonatedState | NoState | None:
        """What a fetch of ``donation/M`` gets once its waiter woke: the state, why there is none
        (``NoState``), or None when nothing is kept for it (a newer request superseded it)."""
        state = self.donated.get(recipient)
        if isinstance(state, tuple):
            return DonatedState(*state)
        return None if state is None else NoState(f"no peer state: {state}", waiting=False)

    def not_yet(self, recipient: int) -> NoState:
        """What a fetch of ``donation/M`` gets when its wait ran out: a donor still at work (ask again), or none."""
        if recipient in self.pending:
            got = self.incoming.get(recipient)
            arrived = f"{got.received} of {got.total_bytes} bytes" if got else "no part yet"
            return NoState(f"peer state still arriving ({arrived}): ask again", waiting=True)
        return NoState("no peer state arrived in time", waiting=False)

    def candidates(self, now_s: float, learners: Mapping[int, Any], quarantined: Mapping[int, tuple[float, str]],
                   region_of: Mapping[int, str]) -> dict[int, Candidate]:
        """Learners that can donate: alive, trained at least a step, not quarantined, not recovering
        themselves (``learners``: the syncer core's, with ``alive`` and ``step``)."""
        return {m: Candidate(region_of[m], info.step) for m, info in learners.items()
                if info.alive and info.step > 0 and quarantined.get(m, (0.0, ""))[0] <= now_s
                and m not in self.pending}

    def _taken(self, recipient: int) -> list:
        self.donated.pop(recipient, None)
        self.incoming.pop(recipient, None)
        return [StateTaken(recipient)]

    def _record(self, actions: list) -> list:
        """A recipient nobody can serve: that is its answer (kept, as a state would be)."""
        for a in actions:
            if isinstance(a, NoDonor):
                self.donated[a.recipient] = a.why
        return actions

    def busy(self, donor: int) -> int:
        return sum(1 for p in self.pending.values() if p.donor == donor)

    def request(self, now_s: float, recipient: int, versions: tuple[int, ...], candidates: Mapping[int, Candidate],
                region: str) -> list:
        """``recipient`` (re)joined and saw ``versions``: ask a donor (a repeated request is ignored)."""
        if recipient in self.pending:
            return []
        return self._ask(now_s, recipient, versions, candidates, region, set())

    def _ask(self, now_s, recipient, versions, candidates, region, tried: set[int]) -> list:
        cands = {m: Candidate(c.region, c.step, self.busy(m)) for m, c in candidates.items() if m != recipient}
        donor = choose_donor(cands, region, frozenset(tried))
        if donor is None:
            self.pending.pop(recipient, None)
            why = "no healthy learner to copy from" if not tried else f"donors {sorted(tried)} went away"
            return [NoDonor(recipient, why)]
        self.pending[recipient] = _Pending(donor, tuple(versions), now_s, tried | {donor})
        return [AskDonor(donor, recipient, tuple(versions))]

    def donor_of(self, recipient: int) -> int | None:
        """The donor asked now for ``recipient``'s state, if any."""
        p = self.pending.get(recipient)
        return None if p is None else p.donor

    def progress(self, now_s: float, recipient: int) -> None:
        """A part of ``recipient``'s state arrived: its donor is alive and working, so the timeout counts
        from now (a large state on a slow link may take longer than ``timeout_s`` in all)."""
        if recipient in self.pending:
            self.pending[recipient].asked_s = now_s

    def delivered(self, recipient: int, donor: int) -> bool:
        """The state for ``recipient`` arrived from ``donor``; False if that donor was not (or no longer) asked."""
        p = self.pending.get(recipient)
        if p is None or p.donor != donor:
            return False
        del self.pending[recipient]
        self.served += 1
        return True

    def peer_lost(self, now_s: float, learner: int, candidates: Mapping[int, Candidate], regions: Mapping[int, str]) -> list:
        """``learner`` went away: as a recipient its recovery ends; as a donor, the next one is asked."""
        self.pending.pop(learner, None)
        actions: list = []
        for r, p in list(self.pending.items()):
            if p.donor == learner:
                self.replaced += 1
                actions += self._ask(now_s, r, p.versions, candidates, regions.get(r, ""), p.tried)
        return actions

    def tick(self, now_s: float, candidates: Mapping[int, Candidate], regions: Mapping[int, str]) -> list:
        """Donors that did not deliver within ``timeout_s`` are replaced by the next one."""
        actions: list = []
        for r, p in list(self.pending.items()):
            if now_s - p.asked_s > self.timeout_s:
                self.replaced += 1
                actions += self._ask(now_s, r, p.versions, candidates, regions.get(r, ""), p.tried)
        return actions
