"""The chaos harness cuts a region's link in an emulated WAN (#13): the learner behind it stalls, the
other goes on, and once the link is back the cut learner receives new versions again and the run
finishes. Needs root and `ip netns` (skipped otherwise); slow (a real run of ~1 min)."""
import pytest

from wan_diloco import spec as rt
from wan_diloco.regions.emulator import list_namespaces, unavailable_reason
from wan_diloco.runtime import chaos

from .conftest import micro_config

pytestmark = [pytest.mark.netns, pytest.mark.slow]
if (reason := unavailable_reason()) is not None:
    pytestmark = [*pytestmark, pytest.mark.skip(reason=reason)]

# Two regions joined by one emulated link.
REGIONS = {"names": ["hub", "far"], "link": {"rate_gbit_s": 0.2, "rtt_ms": 20.0}}


def test_a_cut_link_stalls_only_its_region_and_the_run_recovers(tmp_path):
    cfg = rt.load(micro_config(tmp_path, learners=2, steps=300, min_step_s=0.1, regions=REGIONS))
    cfg = cfg.with_changes(transport={"retry_budget_s": 60.0})
    assert cfg.region(1) == "far" and cfg.region(0) == "hub"
    faults = chaos.parse_schedule([{"t_s": 3.0, "kind": "cut_link", "target": "far", "duration_s": 4.0}],
                                  "test", learners=2, regions=cfg.regions.names)
    notes = []
    report, record, _ = chaos.run_with_baseline(
        cfg, faults, tmp_path / "runs", chaos.ChaosOptions(timeout_s=200, emulate=True, emulator_prefix="wdlx"),
        baseline=False, note=notes.append, png=None)
    assert record.error is None and report["notes"]["finished"], (record.error, notes)
    (cut,) = report["faults"]
    assert cut["kind"] == "cut_link" and cut["recovered_s"] is not None and cut["recovered_s"] < 60, (cut, notes)
    assert not report["notes"]["skipped"] and all(p["exit_t"] is not None for p in record.procs)
    assert list_namespaces("wdlx") == []  # the emulator is gone, the cut undone with it
