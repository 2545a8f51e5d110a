"""The run's eval schedule (core/evals.py, used by the runtime and the simulator): every multiple of run.eval_every_steps is one
learner's point, also when that learner's step jumps over it (#27: points fell at 0, 100, 150, 200, 300 of a
run set to every 50)."""
import pytest

from wan_diloco.core.evals import due_point, eval_point


def points(steps: list[int], every: int, learners: int, learner: int) -> list[int]:
    """The points one learner takes walking through ``steps`` (its step after each of its iterations)."""
    out, last = [], steps[0]
    for step in steps[1:]:
        due = eval_point(last, step, every, learners, learner)
        last = step
        if due is not None:
            out.append(due)
    return out


def test_each_multiple_is_taken_once_by_its_learner_also_across_jumps():
    # Four learners to step 300, every 50; learner 1 adopts a merged global step twice, each time over its turn.
    walks = {m: list(range(0, 301)) for m in range(4)}
    walks[1] = [s for s in range(0, 301) if s not in (49, 50, 51, 250)]  # 48 -> 52, 249 -> 251
    taken = sorted(p for m, w in walks.items() for p in points(w, 50, 4, m))
    assert taken == [50, 100, 150, 200, 250, 300]
    assert points(walks[1], 50, 4, 1) == [50, 250]


def test_a_jump_over_several_points_owes_only_the_latest_of_its_own():
    assert eval_point(10, 95, 10, 4, 1) == 90 and eval_point(10, 95, 10, 4, 2) == 60
    assert eval_point(10, 15, 10, 4, 2) is None  # no multiple crossed


@pytest.mark.parametrize("last, step, every", [(0, 50, 0), (50, 50, 50), (60, 55, 50)])
def test_no_point_when_off_or_no_step_forward(last, step, every):
    assert eval_point(last, step, every, 2, 1) is None and eval_point(last, step, every, 2, 0) is None


def test_a_learner_that_starts_late_does_not_take_the_points_before_it():
    assert eval_point(120, 121, 50, 4, 2) is None and eval_point(120, 150, 50, 4, 3) == 150


def test_a_point_is_due_at_the_latest_multiple_crossed_and_the_turns_split_exactly_those():
    assert [due_point(s - 1, s, 50) for s in (49, 50, 51, 100)] == [None, 50, None, 100]
    assert due_point(48, 152, 50) == 150 and due_point(150, 199, 50) is None and due_point(0, 500, 0) is None
    for last, step in [(0, 50), (10, 95), (120, 150), (49, 51), (150, 199)]:
        owed = {eval_point(last, step, 10, 3, m) for m in range(3)} - {None}
        assert (due_point(last, step, 10) in owed) == (due_point(last, step, 10) is not None)
