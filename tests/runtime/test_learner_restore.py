"""What a (re)starting learner takes up: the global step's learning-rate schedule, and its own snapshot
part only while that part is the newest state it had (the rule is core.restore's, tests/core/test_restore.py;
here the store's IO and the take-up of the tensors)."""
import json
import types

import jax
import numpy as np

from wan_diloco import train as tr
from wan_diloco import tree
from wan_diloco.checkpoint import SnapshotStore
from wan_diloco.core.reports import Report
from wan_diloco.core.restore import InstallPart, LoadPart, RecoverFromPeer, Resume, TakeUpPosition
from wan_diloco.runtime import learner_state as ls_io
from wan_diloco.runtime.learner import Learner

from .conftest import micro_model

MICRO = micro_model(seq_len=16)
TRAIN = tr.TrainConfig(lr=1e-2, warmup_steps=5, total_steps=400)


class FakeCore:
    def __init__(self, step):
        self.step, self.run_id = step, "run-a"

    def restore_feedback(self, tensors):
        pass

    def advance(self, step):
        self.step = max(self.step, step)


def bare_learner(step: int, peer_recovery: bool = True) -> Learner:
    lrn = object.__new__(Learner)  # only the take-up bookkeeping is exercised
    lrn.m, lrn.state, lrn.tokens = 0, tr.init_state(MICRO, TRAIN, jax.random.key(0)), 0
    lrn.core = FakeCore(step)
    lrn.batches = types.SimpleNamespace(restore=lambda position: None)
    lrn.resume = Resume(0, resume=True, peer_recovery=peer_recovery, learners=2, donor_timeout_s=30.0)
    return lrn


def test_a_learner_that_takes_up_the_global_step_takes_up_the_learning_rate_schedule_too():
    # A learner that rejoins without a peer's state has a fresh inner optimizer whose schedule is at 0:
    # late in a run it would warm up again and train at the peak rate while the others have decayed.
    lrn = bare_learner(step=300)
    lrn.take_up_step()
    assert int(lrn.state.step) == 300 and int(tr.schedule_step(lrn.state)) == 300
    assert float(tr.lr_schedule(TRAIN)(300)) < 0.25 * TRAIN.lr  # where the others are: decayed

    lrn.state = tr.set_schedule_step(lrn.state, 350)  # a donor's optimizer ahead of the global step stays
    lrn.take_up_step()
    assert int(tr.schedule_step(lrn.state)) == 350


def test_a_learner_that_trained_past_the_resumed_snapshot_recovers_from_a_peer_instead(tmp_path):
    # The syncer resumed from snapshot 3; this learner then trained on (it wrote a part of snapshot 5) and
    # was killed. Going back to its part of 3 would rewind its optimizer, residuals and data position.
    store = SnapshotStore(tmp_path)
    info = {"run_id": "run-a", "learner": 0, "train_step": 10, "step": 10, "tokens": 100,
            "data": {"batches": 3}}
    lrn = bare_learner(step=40)
    part = {k: np.asarray(v) for k, v in tree.to_named(lrn.state.opt_state, "opt").items()}
    for snap in (3, 5):
        store.save_part(snap, "learner-0", part, info, "learner")
    lrn.store, before = store, lrn.state
    assert ls_io.parts_of(lrn) == (3, 5)
    load = lrn.resume.on_joined(0.0, "run-a", 3, 40, ls_io.parts_of(lrn))
    assert load == [LoadPart(3, fallback=False)]
    warning, *then = ls_io.load_part(lrn, load[0])
    assert lrn.state is before and lrn.core.step == 40  # nothing taken up
    assert warning.event["event"] == "warning" and "trained past snapshot 3" in warning.event["what"]
    assert then == [TakeUpPosition(), RecoverFromPeer(30.0)]  # a peer's state instead

    # A learner that has not lived past it (a whole run resumed from 3) takes its part up.
    store.part(5, "learner-0").unlink()
    load = lrn.resume.on_joined(0.0, "run-a", 3, 40, ls_io.parts_of(lrn))
    [install] = ls_io.load_part(lrn, load[0])
    assert isinstance(install, InstallPart) and install.data == {"batches": 3}
    [resumed] = ls_io.install_part(lrn, install)
    assert resumed.event["event"] == "resumed" and resumed.event["snapshot"] == 3
    assert int(lrn.state.step) == 40 and lrn.tokens == 100 and lrn.resume.restored


def test_a_learner_whose_part_is_broken_takes_its_earlier_part_before_a_fresh_state(tmp_path, capsys):
    # Case 12 of #23: the newest part has a flipped byte and no peer gave a state: its part of the earlier
    # snapshot (older optimizer, residuals and data position) beats a fresh inner optimizer.
    store = SnapshotStore(tmp_path)
    lrn = bare_learner(step=40, peer_recovery=False)
    restored = []
    lrn.batches = types.SimpleNamespace(restore=restored.append)
    opt = {k: np.asarray(v) for k, v in tree.to_named(lrn.state.opt_state, "opt").items()}
    for snap, batches in ((3, 7), (5, 9)):
        info = {"run_id": "run-a", "learner": 0, "train_step": 10 * snap, "step": 10 * snap, "tokens": 100 * snap,
                "data": {"batches": batches}}
        store.save_part(snap, "learner-0", opt, info, "learner")
    part = store.part(5, "learner-0")
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    lrn.store = store
    load = lrn.resume.on_joined(0.0, "run-a", 5, 40, ls_io.parts_of(lrn))
    warning, position, earlier = ls_io.load_part(lrn, load[0])
    assert "peer" in warning.event["what"] and "earlier snapshot" in warning.event["what"]
    assert position == TakeUpPosition() and earlier == LoadPart(3, fallback=True)
    lrn.handle([earlier])  # the driver loads it, installs it, and says so
    assert restored == [{"batches": 7}] and lrn.tokens == 300
    assert lrn.resume.recovery == {"from_peer": False, "from_snapshot": 3}
    said = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert said[-1]["event"] == "warning" and "earlier snapshot 3" in said[-1]["what"]
    assert any(e["event"] == "resumed" and e["snapshot"] == 3 and e["fallback"] for e in said)

    store.part(3, "learner-0").unlink()  # nothing earlier of its own: fresh, and it says so
    load = lrn.resume.on_joined(0.0, "run-a", 5, 40, ls_io.parts_of(lrn))
    *_, last = ls_io.load_part(lrn, load[0])
    assert isinstance(last, Report) and "fresh inner optimizer" in last.event["what"]
