"""What a (re)starting learner takes up: the global step's learning-rate schedule, and its own snapshot
part only while that part is the newest state it had."""
import json
import types

import jax
import numpy as np

from wan_diloco import train as tr
from wan_diloco import tree
from wan_diloco.checkpoint import SnapshotStore
from wan_diloco.runtime.learner import Learner

from .conftest import micro_model

MICRO = micro_model(seq_len=16)
TRAIN = tr.TrainConfig(lr=1e-2, warmup_steps=5, total_steps=400)


def bare_learner(step: int) -> Learner:
    lrn = object.__new__(Learner)  # only the take-up bookkeeping is exercised
    lrn.m, lrn.state = 0, tr.init_state(MICRO, TRAIN, jax.random.key(0))
    lrn.core = types.SimpleNamespace(step=step, run_id="run-a", restore_feedback=lambda tensors: None)
    lrn.batches = types.SimpleNamespace(restore=lambda position: None)
    return lrn


def test_a_learner_that_takes_up_the_global_step_takes_up_the_learning_rate_schedule_too():
    # A learner that rejoins without a peer's state has a fresh inner optimizer whose schedule is at 0:
    # late in a run it would warm up again and train at the peak rate while the others have decayed.
    lrn = bare_learner(step=300)
    lrn._take_up_step()
    assert int(lrn.state.step) == 300 and int(tr.schedule_step(lrn.state)) == 300
    assert float(tr.lr_schedule(TRAIN)(300)) < 0.25 * TRAIN.lr  # where the others are: decayed

    lrn.state = tr.set_schedule_step(lrn.state, 350)  # a donor's optimizer ahead of the global step stays
    lrn._take_up_step()
    assert int(tr.schedule_step(lrn.state)) == 350


def test_a_learner_that_trained_past_the_resumed_snapshot_recovers_from_a_peer_instead(tmp_path, capsys):
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
    assert lrn._restore_part(3) is False
    assert lrn.state is before and lrn.core.step == 40  # nothing taken up
    warning = [json.loads(line) for line in capsys.readouterr().out.splitlines()][-1]
    assert warning["event"] == "warning" and "trained past snapshot 3" in warning["what"] and "peer" in warning["what"]

    # A learner that has not lived past it (a whole run resumed from 3) takes its part up.
    store.part(5, "learner-0").unlink()
    assert lrn._restore_part(3) is True and int(lrn.state.step) == 40


def test_a_learner_whose_part_is_broken_takes_its_earlier_part_before_a_fresh_state(tmp_path, capsys):
    # Case 12 of #23: the newest part has a flipped byte and no peer gave a state: its part of the earlier
    # snapshot (older optimizer, residuals and data position) beats a fresh inner optimizer.
    store = SnapshotStore(tmp_path)
    lrn = bare_learner(step=40)
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
    assert lrn._restore_part(5) is False and lrn.part_unusable
    assert lrn._restore_earlier_part(5) is True
    assert restored == [{"batches": 7}] and lrn.tokens == 300 and lrn.recovery == {"from_peer": False, "from_snapshot": 3}
    said = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "peer" in said[0]["what"] and "earlier snapshot" in said[0]["what"]
    assert said[-1]["event"] == "warning" and "earlier snapshot 3" in said[-1]["what"]
    assert any(e["event"] == "resumed" and e["snapshot"] == 3 and e["fallback"] for e in said)
    store.part(3, "learner-0").unlink()
    assert lrn._restore_earlier_part(5) is False  # nothing earlier of its own: fresh, and it says so
    assert "fresh inner optimizer" in json.loads(capsys.readouterr().out.splitlines()[-1])["what"]
