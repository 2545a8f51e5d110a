"""Parameter fragments, their layout and their sync schedule (docs/method.md, "Fragments").

A fragmentation is a list of P fragments, each a tuple of flat tensor names.
Fragment p syncs every H learner steps at offset t_p = floor(k·H/P), k its send
slot (p itself unless ``learner.fragment_order`` says otherwise), so one
fragment is due every H/P steps and the WAN carries a steady stream. Both ends
of a run derive the same :class:`Layout` from the same config, so names and
shapes never travel with a fragment.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

import numpy as np

Strategy = Literal["layer", "tensor", "balanced"]
STRATEGIES: tuple[str, ...] = ("layer", "tensor", "balanced")

Fragments = list[tuple[str, ...]]


def _check(sizes: Mapping[str, int], num_fragments: int) -> None:
    if num_fragments < 1:
        raise ValueError(f"fragments: need at least 1 fragment, got {num_fragments}")
    if not sizes:
        raise ValueError("fragments: no tensors to split")


def layer_fragments(
    sizes: Mapping[str, int], num_fragments: int, layer_of: Callable[[str], int | None], strided: bool = False
) -> Fragments:
    """Consecutive (or strided) transformer blocks per fragment.

    Tensors outside blocks travel with the first block (inputs side) or the last
    (outputs side): names sorting before the first block go first. With fewer
    blocks than fragments, the surplus fragments are empty: that is the burst
    problem the balanced strategy avoids, kept here so it can be measured.
    """
    _check(sizes, num_fragments)
    layers = sorted({l for n in sizes if (l := layer_of(n)) is not None})
    if not layers:
        raise ValueError("fragments: layer strategy found no transformer blocks")
    frags: list[list[str]] = [[] for _ in range(num_fragments)]
    n_used = min(num_fragments, len(layers))
    home = {layer: (i % n_used if strided else i * n_used // len(layers)) for i, layer in enumerate(layers)}
    for n in sizes:
        layer = layer_of(n)
        if layer is None:
            # Embeddings travel with the first block, the final norm and head with the last.
            layer = layers[0] if n.startswith(("embed", "pos_embed")) else layers[-1]
        frags[home[layer]].append(n)
    return [tuple(f) for f in frags]


def tensor_fragments(sizes: Mapping[str, int], num_fragments: int, layer_of: Callable[[str], int | None]) -> Fragments:
    """All non-block tensors in fragment 0; block tensors dealt out by index to fragments 1..P-1.

    Every fragment gets something when there are enough block tensors, but sizes vary a lot.
    """
    _check(sizes, num_fragments)
    frags: list[list[str]] = [[] for _ in range(num_fragments)]
    block = [n for n in sizes if layer_of(n) is not None]
    frags[0].extend(n for n in sizes if layer_of(n) is None)
    rest = max(1, num_fragments - 1)
    for i, n in enumerate(block):
        frags[(1 + i % rest) if num_fragments > 1 else 0].append(n)
    return [tuple(f) for f in frags]


def balanced_fragments(sizes: Mapping[str, int], num_fragments: int) -> Fragments:
    """Greedy bin packing: largest tensor first, into the currently lightest fragment.

    Sizes come out nearly equal, so the peak bytes per sync slot is lowest.
    """
    _check(sizes, num_fragments)
    totals = [0] * num_fragments
    frags: list[list[str]] = [[] for _ in range(num_fragments)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        p = min(range(num_fragments), key=lambda i: (totals[i], i))
        frags[p].append(name)
        totals[p] += sizes[name]
    order = {n: i for i, n in enumerate(sizes)}
    return [tuple(sorted(f, key=order.__getitem__)) for f in frags]


def make_fragments(
    strategy: Strategy, sizes: Mapping[str, int], num_fragments: int, layer_of: Callable[[str], int | None]
) -> Fragments:
    """Split tensors (name -> element count, in model order) into ``num_fragments`` fragments."""
    if strategy == "layer":
        return layer_fragments(sizes, num_fragments, layer_of)
    if strategy == "tensor":
        return tensor_fragments(sizes, num_fragments, layer_of)
    if strategy == "balanced":
        return balanced_fragments(sizes, num_fragments)
    raise ValueError(f"fragments: unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


def tau_bounds(sync_every: int, num_fragments: int, max_tau: int | None = None) -> tuple[int, int]:
    """The overlaps τ a run with H = ``sync_every`` and P = ``num_fragments`` accepts: ``lo <= τ <= hi``.

    The one rule (docs/method.md, "Fragments"): 0 <= τ <= H − 1. A fragment is due again
    H steps after it was sent, so its answer must be merged before that; τ >= H/P is allowed (several
    fragments in flight at once, as the paper's own P = H = 24, τ = 2). ``max_tau`` (``plan.max_tau``,
    the published safe range) lowers ``hi`` further where a τ is chosen rather than configured.
    ``num_fragments`` is not part of the rule; it is checked so that every caller states its P.
    """
    Schedule(sync_every, num_fragments)  # H and P themselves valid
    hi = sync_every - 1 if max_tau is None else min(max_tau, sync_every - 1)
    return 0, hi


def check_order(order: Sequence[int], num_fragments: int, field: str = "fragment_order") -> tuple[int, ...]:
    """``order`` as a tuple when it is a permutation of 0..P−1 (empty: the identity); ValueError naming ``field``."""
    order = tuple(order)
    if not order:
        return tuple(range(num_fragments))
    if len(order) != num_fragments:
        raise ValueError(f"{field}: must list each of the {num_fragments} fragments (num_fragments) once, "
                         f"got {len(order)} entries")
    bad = [p for p in order if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < num_fragments]
    if bad:
        raise ValueError(f"{field}: entries must be fragment indices 0..{num_fragments - 1}, got {bad[0]!r}")
    twice = sorted({p for p in order if order.count(p) > 1})
    if twice:
        raise ValueError(f"{field}: fragment {twice[0]} is listed {order.count(twice[0])} times; each must be "
                         f"listed once (missing: {sorted(set(range(num_fragments)) - set(order))})")
    return order


@dataclass(frozen=True)
class Schedule:
    """The one sync schedule of a run: fragment p is due at steps s > 0 with s ≡ offset(p) (mod H).

    The P send slots of an H-step round sit at ⌊k·H/P⌋, k = 0..P−1; slot k sends fragment
    ``order[k]`` (``learner.fragment_order``, e.g. ``plan.fragment_order``; empty: slot k sends
    fragment k). Steps count from 1 (step 0 is the shared start, nothing due), so slot 0 is the end of
    each round: steps H, 2H, ...
    """

    sync_every: int
    num_fragments: int
    order: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"schedule: sync_every (H) must be >= 1, got {self.sync_every}")
        if self.num_fragments < 1:
            raise ValueError(f"schedule: num_fragments (P) must be >= 1, got {self.num_fragments}")
        order = check_order(self.order, self.num_fragments)
        object.__setattr__(self, "order", order)
        object.__setattr__(self, "_slot", {p: k for k, p in enumerate(order)})

    @staticmethod
    def slot_offset(k: int, sync_every: int, num_fragments: int) -> int:
        """The step within a round (mod H) of send slot k: ⌊k·H/P⌋."""
        return (k * sync_every) // num_fragments

    def offset(self, p: int) -> int:
        """Fragment p's sync step within an H-step round (mod H)."""
        return self.slot_offset(self._slot[p], self.sync_every, self.num_fragments)

    def round_index(self, p: int) -> int:
        """0-based index, within an H-step round, of the step after which fragment p is sent
        (the ``wan-diloco bandwidth`` timeline counts steps this way): (offset(p) − 1) mod H."""
        return (self.offset(p) - 1) % self.sync_every

    def tau_bounds(self, max_tau: int | None = None) -> tuple[int, int]:
        """:func:`tau_bounds` of this schedule's H and P."""
        return tau_bounds(self.sync_every, self.num_fragments, max_tau)

    def due(self, step: int) -> list[int]:
        """Fragments due at ``step`` (step 0 is the shared starting point: nothing is due), in slot order."""
        if step <= 0:
            return []
        r = step % self.sync_every
        H, P = self.sync_every, self.num_fragments
        return [self.order[k] for k in range(P) if self.slot_offset(k, H, P) == r]

    def due_between(self, after: int, upto: int) -> list[tuple[int, int]]:
        """(step, fragment) pairs due in (after, upto], in order."""
        return [(s, p) for s in range(after + 1, upto + 1) for p in self.due(s)]


@dataclass(frozen=True)
class BytesPerStep:
    peak_bytes: int
    mean_bytes: float
    empty_slots: int  # scheduled sync slots whose fragment is empty: bursts elsewhere
    slots: int


def bytes_per_step(fragments: Fragments, sizes: Mapping[str, int], sync_every: int, bytes_per_param: float = 4.0) -> BytesPerStep:
    """Bytes one learner sends at each of the H steps of a sync period."""
    sched = Schedule(sync_every, len(fragments))
    frag_bytes = [sum(sizes[n] for n in f) * bytes_per_param for f in fragments]
    per_step = np.zeros(sync_every)
    for p, b in enumerate(frag_bytes):
        per_step[sched.offset(p)] += b
    return BytesPerStep(
        peak_bytes=int(per_step.max()),
        mean_bytes=float(per_step.mean()),
        empty_slots=sum(1 for b in frag_bytes if b == 0),
        slots=len(fragments),
    )


def check_cover(fragments: Sequence[Sequence[str]], names: Sequence[str]) -> None:
    """Every tensor in exactly one fragment; raises ValueError otherwise."""
    seen: dict[str, int] = {}
    for p, f in enumerate(fragments):
        for n in f:
            if n in seen:
                raise ValueError(f"fragments: {n!r} is in fragments {seen[n]} and {p}")
            seen[n] = p
    missing = [n for n in names if n not in seen]
    if missing or len(seen) != len(names):
        raise ValueError(f"fragments: tensors not covered: {missing[:3]}")


class Layout:
    """Names and shapes of every fragment, derived from the model config on both ends of a run."""

    def __init__(self, fragments: Sequence[Sequence[str]], shapes: Mapping[str, tuple[int, ...]]):
        self.fragments = [tuple(f) for f in fragments]
        self.shapes = {n: tuple(shapes[n]) for f in self.fragments for n in f}
        self.fragment_of = {n: p for p, f in enumerate(self.fragments) for n in f}
        self.nbytes = [4 * sum(math.prod(self.shapes[n]) for n in f) for f in self.fragments]

    def check_index(self, fragment: int) -> None:
        if not isinstance(fragment, int) or not 0 <= fragment < len(self.fragments):
            raise ValueError(f"fragment {fragment!r} out of range 0..{len(self.fragments) - 1}")


class LazyValues(Mapping):
    """A fragment's tensors made on first lookup by ``make()`` (a decode of the payload), then kept: an
    ``Encoded``'s values where the encoder did not hold them and most callers never read them."""

    def __init__(self, names: Sequence[str], make: Callable[[], Mapping[str, Any]]):
        self._names, self._make = list(names), make
        self._values: Mapping[str, Any] | None = None

    @property
    def made(self) -> bool:
        return self._values is not None

    def __getitem__(self, name: str) -> Any:
        if self._values is None:
            self._values = self._make()
        return self._values[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@dataclass(frozen=True)
class Encoded:
    """One fragment as it crosses the wire: the bytes, their length, and exactly what decoding them gives."""

    values: dict[str, Any]
    nbytes: int
    payload: bytes | bytearray | None = None
