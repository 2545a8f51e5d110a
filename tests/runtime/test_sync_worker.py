"""The sync worker (#26): a learner's snapshots finished off its training thread send and apply the same
bits as on it, hold at most ``sync_in_flight`` fragments, and raise a job's error on the training thread."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from bench.learner_sync import close, local_learner, spec_for
from wan_diloco import tree
from wan_diloco.assemble import Assembly
from wan_diloco.core import ProtocolError
from wan_diloco.runtime.sync_worker import NICE, SyncWorker


def _spec(sync_in_flight: int, keep_local: bool = False):
    # int4 with error feedback: every upload depends on the residual the one before it left.
    return spec_for("micro", 4, sync_in_flight, 2, 4, 2, 1, keep_local=keep_local)


@pytest.fixture(scope="module")
def parts():
    """One Assembly per keep_local, shared by the learners of this module (its init compiles take seconds)."""
    made = {}
    return lambda keep_local=False: made.setdefault(keep_local, Assembly(_spec(0, keep_local), 0))


def _run(parts, sync_in_flight: int, keep_local: bool, steps: int = 22):
    lrn = local_learner(_spec(sync_in_flight, keep_local), parts=parts(keep_local))
    try:
        for _ in range(steps):
            lrn.train_step()
        if lrn.sync is not None:
            lrn.sync.flush()
        lrn.drain()
        return lrn
    finally:
        close(lrn)


def _bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).tobytes()


# keep_local: θ_p as sent stays in the core until its answer arrives, set there by the worker.
@pytest.mark.parametrize("keep_local", [False, True])
def test_a_run_uploads_and_ends_with_the_same_bits_whichever_thread_encodes(parts, keep_local):
    sync, worker = _run(parts, 0, keep_local), _run(parts, 2, keep_local)
    assert worker.sync is not None and sync.sync is None
    assert len(worker.net.uploads) == len(sync.net.uploads) >= 10
    for a, b in zip(sync.net.uploads, worker.net.uploads):
        assert (a.fragment, a.due_step, a.base_version, a.c_steps, a.c_tokens, a.clock, a.nbytes, a.epoch) == \
               (b.fragment, b.due_step, b.base_version, b.c_steps, b.c_tokens, b.clock, b.nbytes, b.epoch)
        assert a.payload == b.payload
        assert {n: _bits(v) for n, v in a.delta.items()} == {n: _bits(v) for n, v in b.delta.items()}
    params = [{n: _bits(v) for n, v in tree.flatten(r.state.params).items()} for r in (sync, worker)]
    assert params[0] == params[1]
    assert [{n: _bits(v) for n, v in f.items()} for f in sync.core.base] == \
           [{n: _bits(v) for n, v in f.items()} for f in worker.core.base]
    residuals = [{k: _bits(v) for k, v in r.core.feedback.state_dict().items()} for r in (sync, worker)]
    assert residuals[0] == residuals[1] and residuals[0]
    assert sync.core.version == worker.core.version and min(worker.core.version) >= 4


def test_submit_waits_at_the_bound_and_counts_the_wait(parts):
    lrn = local_learner(_spec(0), parts=parts())
    release, sent = threading.Event(), []
    worker = SyncWorker(lrn.core, lambda msg: (release.wait(30), sent.append(msg)), max_in_flight=1)
    try:
        flat = tree.flatten(lrn.state.params)
        arrays = [{n: flat[n] for n in names} for names in lrn.layout.fragments]
        worker.submit(lrn.core.begin_snapshot(0.0, 0, 2), arrays[0])
        second = threading.Thread(target=worker.submit, args=(lrn.core.begin_snapshot(0.0, 1, 2), arrays[1]))
        second.start()
        time.sleep(0.3)
        assert second.is_alive() and worker.stalls == 0  # held at the bound: one fragment in flight
        release.set()
        second.join(30)
        worker.flush()
        assert [m.fragment for m in sent] == [0, 1]
        assert worker.stalls == 1 and worker.stall_s >= 0.2
    finally:
        release.set()
        worker.close()
        close(lrn)


def test_a_job_that_fails_raises_on_the_training_thread(parts):
    lrn = local_learner(_spec(2), parts=parts())
    try:
        flat = tree.flatten(lrn.state.params)
        names = lrn.layout.fragments[0]
        bad = {n: np.full(np.shape(flat[n]), np.nan, np.float32) for n in names}  # a diverged θ: refused
        lrn.sync.submit(lrn.core.begin_snapshot(0.0, 0, 2), bad)
        with pytest.raises(ProtocolError, match="fragment 0"):
            lrn.sync.flush()
        lrn.sync.flush()  # said once; the worker goes on
        assert lrn.net.uploads == []
    finally:
        close(lrn)


def test_uploads_are_counted_on_the_training_thread_in_order_and_the_worker_yields_to_it(parts):
    lrn = local_learner(_spec(0), parts=parts())
    release, counted, sent = threading.Event(), [], []
    worker = SyncWorker(lrn.core, lambda msg: (release.wait(30), sent.append((msg.fragment, msg.nbytes))), 2,
                        on_sent=lambda fragment, nbytes: counted.append((threading.get_ident(), fragment, nbytes)))
    try:
        flat = tree.flatten(lrn.state.params)
        for p, names in enumerate(lrn.layout.fragments):
            worker.submit(lrn.core.begin_snapshot(0.0, p, 2), {n: flat[n] for n in names})
        release.set()
        deadline = time.monotonic() + 30
        while len(sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(sent) == 2 and counted == []  # sent by the worker, counted by no one yet
        worker.flush(0)
        assert [c[1:] for c in counted] == sent
        if hasattr(os, "getpriority"):
            assert os.getpriority(os.PRIO_PROCESS, worker._thread.native_id) == NICE  # it ran jobs: set by now
        worker.submit(lrn.core.begin_snapshot(0.0, 0, 4), {n: flat[n] for n in lrn.layout.fragments[0]})
    finally:
        release.set()
        worker.close()  # counts what was sent since the last check
        close(lrn)
    assert [c[1:] for c in counted] == sent and len(sent) == 3
    assert {c[0] for c in counted} == {threading.get_ident()}


def test_a_learner_counts_the_worker_s_uploads_as_it_counts_its_own(parts):
    for inflight in (0, 2):
        lrn = _run(parts, inflight, False)
        assert lrn.uploads == len(lrn.net.uploads) >= 10
        assert lrn.payload_bytes == sum(m.nbytes for m in lrn.net.uploads)
        assert lrn.raw_bytes == sum(lrn.layout.nbytes[m.fragment] for m in lrn.net.uploads)
