"""The networked learner carries out the learner-side core's actions through core.effects (every action has
its effect: tests/core/test_effects.py), refuses anything else, and ends with the exit status of
runtime.exits' table."""
import grpc
import pytest

from wan_diloco.core import IncarnationError
from wan_diloco.runtime import exits
from wan_diloco.runtime.learner import Learner
from wan_diloco.transport import TransportError


def test_an_action_nobody_handles_fails_loudly():
    lrn = object.__new__(Learner)
    with pytest.raises(TypeError, match="is not a learner action"):
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
