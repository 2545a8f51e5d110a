"""core.effects: the closed action sets, the effects interfaces and the one dispatch per side. Every action
of a union reaches exactly one effect; anything else is refused; every driver offers every effect and
interprets actions nowhere else."""
import ast
import dataclasses
import inspect
import os
import pathlib
import subprocess
import sys
import typing

import pytest

from wan_diloco.core import effects
from wan_diloco.core.effects import (
    LEARNER_ACTIONS, SYNCER_ACTIONS, LearnerAction, LearnerEffects, SyncerAction, SyncerEffects, dispatch_learner,
    dispatch_syncer,
)
from wan_diloco.runtime.learner import Learner
from wan_diloco.runtime.syncer import SyncerService
from wan_diloco.sim.decoupled import Simulation
from wan_diloco.sim.effects import LearnerFx, SimEffects, SyncerFx

ROOT = pathlib.Path(__file__).resolve().parents[2]
SIDES = [(LearnerAction, LearnerEffects, dispatch_learner), (SyncerAction, SyncerEffects, dispatch_syncer)]


def effect_names(protocol) -> set[str]:
    return {n for n, v in vars(protocol).items() if inspect.isfunction(v) and not n.startswith("_")}


class Recorder:
    """A fake driver: every effect of ``protocol`` records its name and arguments."""

    def __init__(self, protocol):
        self.calls: list[tuple[str, tuple]] = []
        for name in effect_names(protocol):
            setattr(self, name, lambda *args, _name=name: self.calls.append((_name, args)))


class Field:
    """A distinct placeholder for one field of an action: what the effect gets can be traced to it."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


def sample(cls):
    return cls(**{f.name: Field(f.name) for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("union, protocol, dispatch", SIDES, ids=["learner", "syncer"])
def test_every_action_of_the_union_reaches_exactly_one_effect_with_its_own_fields(union, protocol, dispatch):
    used = set()
    for cls in typing.get_args(union):  # the union itself: a member added without a case fails here
        action, fx = sample(cls), Recorder(protocol)
        dispatch(action, fx)
        assert len(fx.calls) == 1, f"{cls.__name__}: {fx.calls}"
        name, args = fx.calls[0]
        fields = [getattr(action, f.name) for f in dataclasses.fields(cls)]
        assert args == (action,) or all(any(a is f for f in fields) for a in args), f"{cls.__name__} -> {name}{args}"
        used.add(name)
    assert used == effect_names(protocol)  # no effect nobody asks for


def test_the_action_sets_are_disjoint_and_frozen_values():
    assert not LEARNER_ACTIONS & SYNCER_ACTIONS
    for cls in LEARNER_ACTIONS | SYNCER_ACTIONS:
        assert cls.__dataclass_params__.frozen, f"{cls.__name__}: actions are frozen values"


@pytest.mark.parametrize("union, protocol, dispatch", SIDES, ids=["learner", "syncer"])
def test_what_is_not_an_action_of_the_side_is_refused_naming_it_and_nothing_is_done(union, protocol, dispatch):
    other = sample(next(iter(SYNCER_ACTIONS if protocol is LearnerEffects else LEARNER_ACTIONS)))
    for bad in (object(), "Broadcast", None, other):
        fx = Recorder(protocol)
        with pytest.raises(TypeError, match=r"is not a (learner|syncer) action") as e:
            dispatch(bad, fx)
        assert repr(bad) in str(e.value) and fx.calls == []


DRIVERS = [(Learner, LearnerEffects), (SyncerService, SyncerEffects), (LearnerFx, LearnerEffects),
           (SyncerFx, SyncerEffects)]


@pytest.mark.parametrize("driver, protocol", DRIVERS, ids=lambda x: getattr(x, "__name__", ""))
def test_every_driver_offers_every_effect_with_its_arguments(driver, protocol):
    obj = object.__new__(driver)
    for name in effect_names(protocol):
        params = list(inspect.signature(getattr(protocol, name)).parameters)[1:]
        inspect.signature(getattr(obj, name)).bind(*params)  # TypeError: it cannot take these arguments


# What the simulator does not replay yet (sim.effects says why): the fetch after a version gap. Growing this
# set needs a reason; shrinking it is progress.
SIM_DOES_NOT_REPLAY = {"count_resync", "take_up_step"}


def test_the_simulation_holds_every_effect_its_adapters_forward_to():
    for name in effect_names(LearnerEffects):
        assert callable(getattr(Simulation, f"learner_{name}")), name
    for name in effect_names(SyncerEffects) - {"write_part", "announce_snapshot", "write_manifest",
                                               "snapshot_complete"}:  # the keeper's
        assert callable(getattr(Simulation, name)), name


def test_the_simulator_refuses_only_the_effects_it_does_not_replay():
    refused = set()
    for node in ast.parse(inspect.getsource(SimEffects)).body[0].body:
        if isinstance(node, ast.FunctionDef) and isinstance(node.body[0], ast.Raise):
            refused.add(node.name.removeprefix("learner_"))
    assert refused == SIM_DOES_NOT_REPLAY
    sim = object.__new__(Simulation)
    for name in SIM_DOES_NOT_REPLAY:
        fx = LearnerFx(sim, 0) if name in effect_names(LearnerEffects) else SyncerFx(sim)
        params = list(inspect.signature(getattr(fx, name)).parameters)
        with pytest.raises(NotImplementedError, match="the simulator"):
            getattr(fx, name)(*params)


def test_no_driver_interprets_actions_outside_the_one_dispatch():
    actions = {c.__name__ for c in LEARNER_ACTIONS | SYNCER_ACTIONS}
    for folder in ("runtime", "sim"):
        for path in sorted((ROOT / "wan_diloco" / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.MatchClass):
                    name = node.cls.attr if isinstance(node.cls, ast.Attribute) else node.cls.id
                    assert name not in actions, f"{path.relative_to(ROOT)}:{node.lineno}: a case on {name}"


@pytest.mark.slow  # mypy over the core's imports: ~25 s of CPU with a cold cache
def test_a_type_checker_refuses_a_union_member_without_its_case(tmp_path):
    pytest.importorskip("mypy")
    source = inspect.getsource(effects)
    cut = "        case FailRun(why=why):\n            fx.fail(why)\n"
    assert cut in source
    (tmp_path / "whole.py").write_text(source)
    (tmp_path / "missing.py").write_text(source.replace(cut, ""))

    def mypy(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
                               "--cache-dir", str(tmp_path / "cache"), str(tmp_path / name)],
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, "MYPYPATH": str(ROOT)})

    whole, missing = mypy("whole.py"), mypy("missing.py")
    assert whole.returncode == 0, whole.stdout
    assert missing.returncode == 1 and 'assert_never" has incompatible type "FailRun"' in missing.stdout
