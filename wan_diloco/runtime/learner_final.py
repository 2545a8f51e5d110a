"""The IO of a networked learner's final sync (``lrn``: the ``runtime.learner.Learner``); its rules are
``core.final_sync``'s."""
from __future__ import annotations

import concurrent.futures
import time

import numpy as np

from wan_diloco import tree
from wan_diloco.assemble import fragment_digest
from wan_diloco.core import ProtocolError
from wan_diloco.core.final_sync import BROADCAST_GRACE_S, Final, FinalSync
from wan_diloco.runtime.events import emit
from wan_diloco.runtime.exits import Stopped, SyncerLost
from wan_diloco.transport import MessageError, TransportError


def final_sync(lrn) -> dict:
    """Upload every fragment (flagged final); take the syncer's final fragments, by broadcast or bulk.

    A syncer that resumes from a snapshot meanwhile dropped these uploads (old incarnation): the
    learner rejoins it and syncs again."""
    fs = FinalSync(lrn.m, len(lrn.layout.fragments))
    while True:
        try:
            names = fs.begin()
        except ValueError as e:
            raise SyncerLost(str(e)) from None
        report = _once(lrn, fs, names)
        if report is not None:
            return report


def _once(lrn, fs: FinalSync, names: list[str]) -> dict | None:
    lrn.drain()
    rejoins = lrn.rejoins
    lrn.handle(lrn.core.finish())
    budget_s = lrn.cfg.syncer.final_timeout_s + lrn.cfg.transport.retry_budget_s
    lrn.net.wait_uploads(budget_s)
    futs = [lrn.net.fetch_fragment(name) for name in names]
    # Until the finals are served, keep reading the update stream: it says when the syncer came back
    # as a new incarnation (the identity frame; the drain rejoins it).
    deadline = time.monotonic() + budget_s
    while not all(f.done() for f in futs) and time.monotonic() < deadline and not lrn.stop.is_set():
        lrn.drain(block_s=0.1)
        if lrn.rejoins != rejoins:
            for f in futs:
                f.cancel()
            return None
    if lrn.stop.is_set():
        raise Stopped()
    got = [final_fragment(lrn.net, fs, p, fut, budget_s) for p, fut in enumerate(zip(names, futs))]
    finals = [Final(g.fragment, g.version, g.epoch, g.resumed_from) for g in got]
    rejoin = fs.on_finals(lrn.core.epoch, finals)
    if rejoin:  # served by an incarnation it has not joined
        lrn.handle(rejoin)
        return None
    # The broadcast of the final merge normally arrives on the update stream; bulk is the fallback.
    deadline = time.monotonic() + BROADCAST_GRACE_S
    while fs.behind(lrn.core.version, finals) and time.monotonic() < deadline:
        lrn.drain(block_s=0.05)
    by_bulk = fs.behind(lrn.core.version, finals)
    served = {g.fragment: g for g in got}
    for p in by_bulk:
        lrn.handle(lrn.core.resync(p, served[p].values, served[p].version))
    flat = {n: np.asarray(a) for n, a in tree.flatten(lrn.state.params).items()}
    fragments = lrn.layout.fragments
    digests = [fragment_digest(lrn.core.base[p], names) for p, names in enumerate(fragments)]
    # The syncer's final fragments as served: a learner whose model drifted from them must not pass as done.
    mismatch = FinalSync.verdict([fragment_digest(served[p].values, names) for p, names in enumerate(fragments)],
                                 digests)
    return {
        "versions": list(lrn.core.version), "final_by_bulk": len(by_bulk), "digest_mismatch": mismatch,
        "digests": digests,
        "param_digests": [fragment_digest(flat, names) for names in fragments],
        "final_eval_loss": lrn.evaluate(),
    }


def final_fragment(net, fs: FinalSync, p: int, name_fut: tuple[str, concurrent.futures.Future], budget_s: float):
    """The syncer's final fragment p, fetched as ``name``; a failed fetch is asked again (``FinalSync``)."""
    name, fut = name_fut
    attempt = 0
    while True:
        attempt += 1
        try:
            return fut.result(timeout=budget_s)
        except (TransportError, MessageError, ProtocolError) as e:
            report = fs.on_fetch_failed(p, attempt, str(e))
            if report is None:
                raise
            emit(report.event)
            fut = net.fetch_fragment(name)
