"""The IO of a networked learner's own state (its parameters, inner optimizer, residuals, data position):
snapshot parts written and read back, donations sent to peers, a peer's state fetched and installed.

What to take up, when, and what comes next is decided in the core (``core.restore.Resume``,
``core.peer``); these functions only move tensors, bytes and futures for ``runtime.learner.Learner`` (``lrn``).
"""
from __future__ import annotations

import concurrent.futures
import time

import jax
import jax.numpy as jnp

from wan_diloco import train as train_lib
from wan_diloco import tree
from wan_diloco.checkpoint import CheckpointError, decode_state, encode_state
from wan_diloco.core.peer import (  # noqa: F401 - named_digest: importable from here as before
    PeerRequest, named_digest, peer_wait_s, position_from_bytes, state_tensors,
)
from wan_diloco.core.protocol import ObjectRequest
from wan_diloco.core.restore import InstallPart, LoadPart
from wan_diloco.runtime import serde
from wan_diloco.runtime.events import emit
from wan_diloco.runtime.exits import Stopped
from wan_diloco.runtime.inbox import Donated, Saved
from wan_diloco.transport import MessageError, TransportError


def state_on_host(lrn) -> tuple[dict, dict]:
    """``core.peer.state_tensors`` of this learner (the one pause of training a snapshot part or a donation causes)."""
    return state_tensors(lrn.core, lrn.state.params, lrn.state.opt_state, lrn.state.step)


def save_part(lrn, snap: int) -> None:
    """Copy this learner's state to host (training pauses only for this) and write it in the background."""
    if lrn.store is None:
        return
    t0 = time.monotonic()
    tensors, info = state_on_host(lrn)
    info.update(snapshot=snap, tokens=lrn.tokens, data=lrn.batches.position())
    lrn.snapshot_stall_s = max(lrn.snapshot_stall_s, time.monotonic() - t0)
    fut = lrn.writer.submit(lrn.store.save_part, snap, f"learner-{lrn.m}", tensors, info, "learner")
    fut.add_done_callback(lambda f: lrn.net.inbox.put(Saved(snap, f)))


def send_state(lrn, recipient: int, versions: tuple[int, ...]) -> None:
    """Send this learner's state to ``recipient`` (it keeps training: only the copy to host happens here,
    encoding and upload run on the writer thread)."""
    tensors, info = state_on_host(lrn)
    info.update(donor=lrn.m)

    def send():
        data = encode_state(tensors, info, "donation")
        part_bytes = min(serde.DONATION_PART_BYTES, lrn.cfg.transport.max_message_bytes // 2)
        for frame in serde.donation_frames(lrn.m, recipient, versions, data, part_bytes):
            lrn.net.upload_frame(frame).result()  # in order: the syncer appends each part
        return len(data), named_digest(tensors, "opt/")

    fut = lrn.writer.submit(send)
    fut.add_done_callback(lambda f: lrn.net.inbox.put(Donated(recipient, f)))


def parts_of(lrn) -> tuple[int, ...] | None:
    """The snapshots this learner's store holds a part of (None: no store)."""
    if lrn.store is None:
        return None
    return tuple(i for i in lrn.store.ids() if lrn.store.part(i, f"learner-{lrn.m}").exists())


def load_part(lrn, a: LoadPart) -> list:
    """``LoadPart``: read the part; the core's answer to what the store said."""
    try:
        tensors, info = lrn.store.load_part(a.snapshot, f"learner-{lrn.m}", "learner")
    except (CheckpointError, ValueError, KeyError, TypeError) as e:
        return lrn.resume.on_part_failed(time.monotonic(), a.snapshot, a.fallback, str(e))
    return lrn.resume.on_part(time.monotonic(), a.snapshot, a.fallback, tensors, info)


def install_part(lrn, a: InstallPart) -> list:
    """``InstallPart``: the inner optimizer, data position and residuals of a verified part."""
    try:
        opt = tree.from_named(a.tensors, "opt", lrn.state.opt_state, "learner part")
        lrn.batches.restore(a.data)
        lrn.core.restore_feedback(a.tensors)
    except (CheckpointError, ValueError, KeyError, TypeError) as e:
        return lrn.resume.on_part_failed(time.monotonic(), a.snapshot, a.fallback, str(e))
    lrn.state = lrn.state.replace(opt_state=jax.tree_util.tree_map(jnp.asarray, opt),
                                  step=jnp.asarray(max(a.train_step, lrn.core.step), jnp.int32))
    lrn.core.advance(a.step)
    lrn.tokens = a.tokens
    return lrn.resume.on_installed(time.monotonic(), a.snapshot, a.fallback, lrn.core.step)


def take_up_position(lrn) -> None:
    """``TakeUpPosition``: go on with the data stream where the syncer last saw it (its latest metadata),
    so its shard is not read again from the seed's first windows. What it drew after that metadata
    trained a state that died with it; those windows are drawn again, nothing is skipped."""
    try:
        data = lrn.wait(lrn.net.fetch_bytes(ObjectRequest("position", lrn.m).name), lrn.cfg.transport.call_timeout_s)
        position = position_from_bytes(data)
        if position is None:
            emit({"event": "data_position", "role": "learner", "learner": lrn.m, "restored": False,
                  "why": "the syncer has not seen this learner's data position"})
            return
        lrn.batches.restore(position)
    except (TransportError, MessageError, ValueError, concurrent.futures.TimeoutError) as e:
        emit({"event": "warning", "role": "learner", "learner": lrn.m,
              "what": f"data position not restored ({e or type(e).__name__}): the data stream starts from its seed"})
        return
    finally:
        lrn.position_known = True
    emit({"event": "data_position", "role": "learner", "learner": lrn.m, "restored": True,
          "batches": lrn.batches.drawn})


def recover_from_peer(lrn, patience_s: float) -> dict:
    """``RecoverFromPeer``: take a healthy peer's parameters, inner optimizer and residuals (the syncer
    picks the donor), then replay the updates that arrived meanwhile; how it went (``recovery``)."""
    t0 = time.monotonic()
    state_bytes = sum(getattr(a, "nbytes", 0) for a in jax.tree_util.tree_leaves((lrn.state, lrn.core.base)))
    lrn.send_metadata(lrn.core.metadata(), recovering=True)
    t = lrn.cfg.transport
    req = PeerRequest(t0, patience_s, peer_wait_s(lrn.cfg.syncer.donor_timeout_s, t.call_timeout_s,
                                                  t.upload_deadline_s(state_bytes)))
    fut = None
    try:
        while True:
            fut = lrn.net.fetch_bytes(ObjectRequest("donation", lrn.m).name,
                                      serde.max_state_bytes(sum(lrn.layout.nbytes)))
            try:
                data = lrn.wait(fut, req.wait_s(time.monotonic()))
                break
            except TransportError as e:
                again = req.on_refused(time.monotonic(), e.details)
                if again is None:
                    raise
                if again.after_s and lrn.stop.wait(again.after_s):
                    raise Stopped() from None
                if again.resend_metadata:
                    lrn.send_metadata(lrn.core.metadata(), recovering=True)  # the syncer asks again
        tensors, info = decode_state(data, "donation", what="peer state")
        params = tree.from_named(tensors, "params", lrn.state.params, "peer state")
        opt = tree.from_named(tensors, "opt", lrn.state.opt_state, "peer state")
        lrn.core.adopt(tensors, info)
    except (TransportError, MessageError, ValueError, KeyError, concurrent.futures.TimeoutError) as e:
        if fut is not None:
            fut.cancel()
        return {"from_peer": False, "why": str(e) or type(e).__name__}
    lrn.state = lrn.state.replace(params=jax.tree_util.tree_map(jnp.asarray, params),
                                  opt_state=jax.tree_util.tree_map(jnp.asarray, opt))
    # The donor's optimizer as it came, bit for bit; only its schedule position moves (take-up of the step).
    opt_digest = named_digest(tree.to_named(lrn.state.opt_state, "opt"), "opt/")
    lrn.core.advance(int(info.get("train_step", 0)))
    lrn.take_up_step()
    replayed = lrn.net.inbox.qsize()
    lrn.drain()  # the updates that arrived while the state travelled, in the order they came
    return {"from_peer": True, "donor": info.get("donor"), "bytes": len(data), "opt_digest": opt_digest,
            "schedule_step": int(train_lib.schedule_step(lrn.state)),
            "seconds": round(time.monotonic() - t0, 3), "replayed": replayed}


def on_state_sent(lrn, recipient: int, fut: concurrent.futures.Future) -> None:
    """The writer thread finished sending this learner's state to ``recipient``: say how it went."""
    if fut.exception() is not None:
        emit({"event": "warning", "role": "learner", "learner": lrn.m,
              "what": f"could not send this learner's state to learner {recipient}: {fut.exception()}"})
        return
    nbytes, opt_digest = fut.result()
    emit({"event": "donated", "role": "learner", "learner": lrn.m, "recipient": recipient,
          "bytes": nbytes, "opt_digest": opt_digest, "step": lrn.core.step})


def on_part_written(lrn, snap: int, fut: concurrent.futures.Future) -> None:
    """The writer thread finished this learner's part of snapshot ``snap``: from now on its metadata says so."""
    if fut.exception() is not None:
        emit({"event": "warning", "role": "learner", "learner": lrn.m,
              "what": f"snapshot {snap}: could not write this learner's part: {fut.exception()}"})
        return
    lrn.core.saved(snap)
    lrn.snapshots_written += 1
