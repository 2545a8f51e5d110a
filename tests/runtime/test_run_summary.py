"""The launch summary tells the truth (#23, case 8): a learner that trained nothing is not finished, each
learner's own steps and tokens are shown, the initial eval never averages a late joiner's trained copy,
and a run short of its budget, or whose final fragments differ from the syncer's, is not a success."""
from wan_diloco import spec as rt
from wan_diloco.runtime.launch import RunState, first_starts, summarize, trained_finals, verdict

from .conftest import micro_config


def final(m, steps, tokens, digests=("a", "b"), eval_loss=4.0):
    return {"event": "final", "learner": m, "steps": steps, "tokens": tokens, "last_loss": 4.0, "bytes_sent": 1,
            "raw_bytes": 8, "payload_bytes": 2, "compute_s": 1.0, "train_s": 2.0, "digests": list(digests),
            "final_eval_loss": eval_loss if tokens else float("nan")}


def state(tmp_path, late_tokens=0, digests=("a", "b"), global_step=60, steps=60):
    cfg = rt.load(micro_config(tmp_path, learners=2, steps=60))
    mon = RunState(cfg)
    mon.fold("syncer", {"event": "listening", "params": 1000})
    mon.fold("learner-1", {"event": "start", "step": 0, "eval_loss": 4.22})
    mon.fold("learner-1", final(1, steps, 61_440))
    # Learner 0 joined once learner 1 had trained: its start evaluates a trained model.
    mon.fold("learner-0", {"event": "start", "step": 60, "eval_loss": 2.9})
    mon.fold("learner-0", final(0, steps, late_tokens, digests))
    mon.fold("syncer", {"event": "final", "global_step": global_step, "digests": ["a", "b"],
                        "final_learners": [0, 1], "fragment_syncs": [3, 3]})
    return mon


def test_a_learner_that_trained_nothing_is_not_counted_finished_nor_averaged(tmp_path):
    mon = state(tmp_path)
    s = summarize(mon, 10.0)
    assert s["learners_finished"] == 1 and s["tokens"] == 61_440
    assert s["per_learner"]["0"] == {"steps": 60, "tokens": 0, "finished": False, "status": "done"}
    assert s["per_learner"]["1"]["tokens"] == 61_440 and s["per_learner"]["1"]["finished"]
    assert s["initial_eval_loss"] == 4.22  # the run's start, not (4.22 + 2.9) / 2
    assert s["final_eval_loss"] == 4.0  # not NaN from the untrained copy
    assert list(first_starts(mon)) == [1] and list(trained_finals(mon)) == [1]
    assert verdict(s) == []  # the budget was reached and the trained learner's model is the syncer's


def test_a_run_short_of_its_budget_or_with_differing_digests_is_not_a_success(tmp_path):
    s = summarize(state(tmp_path, global_step=38, steps=40), 1.0)  # neither the syncer nor a learner got to 60
    assert any("global step 40 of its 60-step budget" in p for p in verdict(s))
    s = summarize(state(tmp_path, late_tokens=1024, digests=("a", "x")), 1.0)
    assert s["learners_finished"] == 2 and not s["bit_identical"]
    assert any("differ from the syncer's" in p for p in verdict(s))
    mon = state(tmp_path)
    mon.finals.clear()
    assert "no learner trained" in " ".join(verdict(summarize(mon, 1.0)))
