"""A round's outer step at its close: the update, its encoding, the new Θ_p (docs/method.md, "Syncer loop").

Two ways, the same bits. Where the codec encodes host arrays a work item at a time (8/4 bits on the
CPU: ``FragmentCodec.roundtrip_streamed``), ``OuterOptimizer.step_streamed`` makes each item's update in
a thread's scratch, encodes it, then decodes it and adds it to Θ_p: the close holds the merged Δ (which
takes the new momentum), the payload and scratch, never an update array; the update's values a driver
may read (the simulator's learners apply them) are decoded from the payload when first looked up
(``fragments.LazyValues``). Elsewhere (``outer_step``): the update in an array of its own, encoded in place,
decoded over itself, and the momentum and Θ_p advanced after.
"""
from __future__ import annotations

import math
from contextlib import AbstractContextManager
from typing import Any, Callable, Mapping

import numpy as np

from wan_diloco.core.protocol import Codec, ProtocolError, Tensors, encode_or_refuse
from wan_diloco.fragments import Encoded, LazyValues
from wan_diloco.merge import Workers, chunk_sum_squares, chunks, per_tensor
from wan_diloco.outer import NO_OVERFLOW, OuterOptimizer

Timing = Callable[[str], AbstractContextManager[Any]]


def close_step(outer: OuterOptimizer, codec: Codec, p: int, theta: Tensors, delta: dict[str, np.ndarray],
               workers: Workers, timing: Timing, theta_sq: float | None
               ) -> tuple[Encoded, Mapping[str, np.ndarray], dict[str, np.ndarray], float | None]:
    """(the encoded update, its values, the new Θ_p, ‖new Θ_p‖² or None: computed when next needed) for the
    merged ``delta`` (spent), the momentum advanced. ProtocolError where the update is refused (an outer
    step that overflowed): Θ_p and the momentum as they were."""
    if getattr(codec, "streams", False):
        streamed = codec.roundtrip_streamed
        try:
            with timing("encode"):
                got = outer.step_streamed(p, theta, delta, lambda *fns: streamed(p, *fns), theta_sq)
        except ValueError as e:
            raise ProtocolError(f"update of fragment {p}: {e}") from None
        if got is not None:
            new_theta, enc = got
            # ‖new Θ_p‖² is left to the next upload's norm check: summed over the merge's items there, the
            # bits a pass here would give.
            return enc, LazyValues(list(delta), lambda: codec.decode(p, enc.payload)), new_theta, None
    enc = outer_step(outer, codec, p, theta, delta, workers, timing, theta_sq)
    with timing("outer_step"):
        outer.commit(p, delta, workers)
        new_theta, sq = apply_update(theta, enc.values, workers, out=delta)
    return enc, enc.values, new_theta, sq


def outer_step(outer: OuterOptimizer, codec: Codec, p: int, theta: Tensors, delta: Mapping[str, np.ndarray],
               workers: Workers, timing: Timing, theta_sq: float | None = None) -> Encoded:
    """The encoded update for the merged ``delta``, its values in the update's own arrays; Θ_p and the
    momentum untouched (``outer.commit`` advances it once the round is taken; ``apply_update`` then makes
    the new Θ_p). ProtocolError where the outer step came out non-finite: the codec refuses such an update,
    or Θ_p + update would overflow (checked by a pass only where ||Θ_p|| (``theta_sq``) and the update's
    norm leave it possible: ``apply_update`` must not fail once the momentum has moved)."""
    with np.errstate(over="ignore", invalid="ignore"), timing("outer_step"):
        update = outer.update(p, delta, workers)
    # Everyone, the syncer included, applies the same decoded update: all copies stay bit-identical.
    # The codec refuses a non-finite update (an outer step that overflowed). Decoded over the update's
    # own arrays (encoded, they are not needed again): a round holds no third fragment.
    with timing("encode"):
        enc = encode_or_refuse(codec, update, f"update of fragment {p}", in_place=True)
    u_sq = getattr(enc.values, "sum_squares", None)
    if theta_sq is None or u_sq is None or math.sqrt(theta_sq) + math.sqrt(float(np.sum(u_sq))) >= NO_OVERFLOW:
        if not math.isfinite(add(theta, enc.values, workers)[1]):
            raise ProtocolError("the outer step overflowed (non-finite result)")
    return enc


def apply_update(theta: Tensors, update: Tensors, workers: Workers, out: Mapping[str, np.ndarray]
                 ) -> tuple[dict[str, np.ndarray], float]:
    """(the new Θ_p = Θ_p + update in ``out``'s arrays, ||new Θ_p||² from the same pass). Not in place:
    a snapshot being written shares Θ_p's arrays (``export``); ``out`` is the merged Δ, spent once the
    momentum has taken it."""
    with np.errstate(over="ignore", invalid="ignore"):
        return add(theta, update, workers, out=out)


def add(a: Tensors, b: Tensors, workers: Workers, out: Mapping[str, np.ndarray] | None = None
        ) -> tuple[dict[str, np.ndarray], float]:
    """({n: a[n] + b[n]} as float32, in ``out``'s arrays or fresh ones, Σ of its squares), chunk by
    chunk on ``workers``: each chunk's squares are summed while it is in cache (NaN/Inf: non-finite)."""
    names = list(a)
    xs, ys = [np.ravel(a[n]) for n in names], [np.ravel(b[n]) for n in names]
    res = [np.empty(x.size, np.float32) if out is None else out[n].reshape(-1) for n, x in zip(names, xs)]
    items = chunks([x.size for x in xs])

    def run(it) -> float:
        i, lo, hi = it
        np.add(xs[i][lo:hi], ys[i][lo:hi], out=res[i][lo:hi])
        return chunk_sum_squares(res[i][lo:hi])

    with np.errstate(over="ignore", invalid="ignore"):
        sq = float(per_tensor(len(names), items, workers.map(run, items)).sum())
    return {n: o.reshape(np.shape(a[n])) for n, o in zip(names, res)}, sq
