"""Every driver carries out the cores' closed action sets (core.actions) with one exhaustive match:
an action added to a core without a case in the drivers fails here."""
import ast
import inspect
import textwrap

from wan_diloco.core import actions
from wan_diloco.runtime.learner import Learner
from wan_diloco.runtime.syncer import SyncerService
from wan_diloco.sim import decoupled, faults, resume, snapshots, start_end


def case_classes(node: ast.AST) -> set[str]:
    """Class names the ``case`` patterns under ``node`` match on (``A() | B()`` included)."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.MatchClass):
            names.add(n.cls.attr if isinstance(n.cls, ast.Attribute) else n.cls.id)
    return names


def one_match(fn) -> ast.Match:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    matches = [n for n in ast.walk(tree) if isinstance(n, ast.Match)]
    assert len(matches) == 1, f"{fn.__qualname__}: one match dispatches every action"
    last = matches[0].cases[-1]
    assert isinstance(last.pattern, ast.MatchAs) and last.pattern.pattern is None, "it ends in `case _:`"
    assert "assert_never" in ast.unparse(last.body[0]), f"{fn.__qualname__}: `case _:` asserts never"
    return matches[0]


def names(classes) -> set[str]:
    return {c.__name__ for c in classes}


def test_the_action_sets_are_disjoint_and_closed():
    assert not actions.LEARNER_ACTIONS & actions.SYNCER_ACTIONS
    for cls in actions.LEARNER_ACTIONS | actions.SYNCER_ACTIONS:
        assert cls.__dataclass_params__.frozen, f"{cls.__name__}: actions are frozen values"


def test_the_network_learner_handles_every_learner_action_and_nothing_else():
    assert case_classes(one_match(Learner.handle)) == names(actions.LEARNER_ACTIONS)


def test_the_network_syncer_handles_every_syncer_action_and_nothing_else():
    assert case_classes(one_match(SyncerService._act)) == names(actions.SYNCER_ACTIONS)


# What the simulator does not replay yet, by name: the donor's side of peer recovery (its state is copied at
# once, ``sim.resume``) and the fetch after a version gap (the simulator resyncs from the syncer's memory).
# Growing this set needs a reason; shrinking it is progress.
SIM_DOES_NOT_REPLAY = {"SendState", "Resynced", "TakeUpStep", "RecoveryStarted", "StateReady", "StateTaken"}


def test_the_simulator_replays_the_actions_of_every_fault_it_simulates():
    handled = set()
    for module in (decoupled, faults, resume, snapshots, start_end):
        handled |= case_classes(ast.parse(inspect.getsource(module)))
    every = names(actions.LEARNER_ACTIONS | actions.SYNCER_ACTIONS)
    assert every - handled == SIM_DOES_NOT_REPLAY
