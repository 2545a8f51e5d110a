"""Snapshots that do not wait for learners that never trained (#23, case 9), and what a resume of an
incomplete one says and keeps: the parts missing, the learners' data positions, the started barrier."""
import asyncio

import numpy as np

from wan_diloco import spec as rt
from wan_diloco.clock import VectorClock
from wan_diloco.core import Metadata
from wan_diloco.core.messages import Barrier, Identity, SnapshotCut
from wan_diloco.runtime import serde
from wan_diloco.runtime.syncer import SyncerService
from wan_diloco.transport import Subscribe, TransportMetrics

from .conftest import micro_config


def metadata(m, step, data=""):
    return serde.to_frame(Metadata(learner=m, step=step, c_steps=(0, 0), c_tokens=(0, 0),
                                   clock=VectorClock({f"learner-{m}": step + 1}), data=data))


def test_a_learner_that_never_trained_is_not_in_the_cut_and_a_resume_says_what_is_missing(tmp_path):
    extra = f'\n[checkpoint]\ndir = "{tmp_path / "ckpt"}"\nevery_merges = 0\n'
    cfg = rt.load(micro_config(tmp_path, learners=3, extra=extra))
    cfg = cfg.with_changes(run={"min_learners_to_start": 3, "run_id": "run-x"})
    service = SyncerService(cfg, TransportMetrics())

    async def run():
        for m in range(3):
            await service.on_metadata(metadata(m, 0))
        assert service.barrier.started
        await service.on_metadata(metadata(0, 12, data='{"batches":12}'))
        await service.on_metadata(metadata(1, 11, data='{"batches":11}'))
        # Learner 2 joined but is still in its first step (a slow compile): nothing of its own to keep.
        snap = service.snapshot_now()
        assert service.snapshots.pending[snap].learners == {0, 1}
        while not service.snapshots.pending[snap].syncer:
            await asyncio.sleep(0.05)
        # The cut was announced (SnapshotCut); an update stream opened since starts with it, after the barrier.
        stream = service.subscribe(Subscribe(sender="learner-2", region="eu", instance="i-2"))
        first = [serde.control_from_frame(await anext(stream)) for _ in range(3)]
        await stream.aclose()  # learner 2 leaves: it was not in the cut
        assert [type(m) for m in first] == [Identity, Barrier, SnapshotCut] and first[2] == SnapshotCut(snap, 1)
        return snap

    snap = asyncio.run(run())
    # Learner 0 wrote its part, learner 1 did not before the run stopped: the snapshot is incomplete.
    service.store.save_part(snap, "learner-0", {"opt": np.zeros(2, np.float32)}, {}, "learner")
    resumed = SyncerService(cfg, TransportMetrics(), resume=True)
    assert resumed.resumed["snapshot"] == snap and not resumed.resumed["complete"]
    note = resumed.resumed["notes"][-1]
    assert "no part of learner-1, learner-2" in note and "recover from a peer" in note and "learner-0" in note
    assert resumed.positions.by_learner == {0: '{"batches":12}', 1: '{"batches":11}'}  # learner 1 takes up its own
    assert resumed.barrier.started  # the run had started: nobody waits for the others again
