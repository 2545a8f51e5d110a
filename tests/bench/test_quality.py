"""The quality benchmark's failure tape (the benchmark itself is too long for the test run)."""
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_quality", Path(__file__).parents[2] / "bench" / "quality.py")
quality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(quality)


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.4])
def test_failure_tape_keeps_learners_down_the_asked_share(fraction):
    tape = quality.failure_tape(4, 1000.0, fraction, seed=7)
    assert quality.down_share(tape, 4, 1000.0) == pytest.approx(fraction, abs=0.02)
    assert {o.learner for o in tape} <= set(range(4)) and all(o.down_at < o.up_at for o in tape)
    assert max(o.down_at for o in tape) > 1000.0  # outages go on past the expected end
    assert tape == quality.failure_tape(4, 1000.0, fraction, seed=7)  # deterministic


def test_failure_tape_gives_up_on_an_impossible_share():
    with pytest.raises(RuntimeError, match="tape seed"):
        quality.failure_tape(1, 1000.0, 0.25, seed=0, cycles=1, tolerance=1e-9)
