"""The networked learner carries out every action the learner-side core returns, with one match, and
ends with the exit status of runtime.exits' table."""
import ast
import inspect
import textwrap

import grpc
import pytest

from wan_diloco.core import IncarnationError, actions
from wan_diloco.runtime import exits
from wan_diloco.runtime.learner import Learner
from wan_diloco.transport import TransportError

LEARNER_ACTIONS = actions.LEARNER_ACTIONS  # what the learner-side core returns (core.actions)


def handled_classes() -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(Learner.handle)))
    matches = [n for n in ast.walk(tree) if isinstance(n, ast.Match)]
    assert len(matches) == 1, "one match dispatches every action"
    names = set()
    for case in matches[0].cases:
        if isinstance(case.pattern, ast.MatchClass):
            cls = case.pattern.cls
            names.add(cls.attr if isinstance(cls, ast.Attribute) else cls.id)
    return names


def test_every_learner_action_has_its_case_and_nothing_else_does():
    assert handled_classes() == {cls.__name__ for cls in LEARNER_ACTIONS}


def test_an_action_nobody_handles_fails_loudly():
    lrn = object.__new__(Learner)
    with pytest.raises(AssertionError, match="Expected code to be unreachable"):
        lrn.handle([object()])


def test_each_way_a_learner_ends_has_its_exit_status():
    assert exits.exit_code({"event": "final", "digest_mismatch": []}) == exits.EXIT_OK == 0
    assert exits.exit_code({"event": "final", "digest_mismatch": [1]}) == exits.EXIT_DIGEST_MISMATCH == 4
    assert exits.exit_code({"event": "stopped"}) == exits.EXIT_STOPPED == 143
    for e in (exits.SyncerLost("x"), exits.StartTimeout("x"), IncarnationError("x")):
        assert isinstance(e, exits.STOPS)
    assert exits.EXIT_SYNCER == 3 and not isinstance(exits.Stopped(), exits.STOPS)
    refused = TransportError("Metadata", grpc.StatusCode.UNAUTHENTICATED, "bad token")
    line = exits.stop_line(refused, 2, "syncer:7000")
    assert "refused this learner's token (UNAUTHENTICATED)" in line and "--learner 2" in line
    assert exits.stop_line(exits.SyncerLost("gone"), 2, "syncer:7000") == "gone"
