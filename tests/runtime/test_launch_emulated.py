"""A whole run over the emulated WAN: every process in its region's namespace, TLS, link probes.

Needs root and `ip netns` (skipped otherwise). Nothing may be left behind.
"""
import json

import pytest

from wan_diloco import spec as rt
from wan_diloco.regions.emulator import list_namespaces, unavailable_reason
from wan_diloco.runtime.launch import launch

from .conftest import micro_config

pytestmark = pytest.mark.netns
if (reason := unavailable_reason()) is not None:
    pytestmark = [pytest.mark.netns, pytest.mark.skip(reason=reason)]

# Two regions joined by one emulated link; the plan adapts tau to it.
REGIONS = {"names": ["hub", "far"], "link": {"rate_gbit_s": 0.2, "rtt_ms": 40.0}}


def test_a_run_across_emulated_regions_ends_bit_identical_and_logs_its_links(tmp_path):
    path = micro_config(tmp_path, learners=2, steps=48, min_step_s=0.25, regions=REGIONS, plan={"adapt_tau": True})
    cfg = rt.load(path)
    code, summary = launch(cfg, path.read_text(), str(tmp_path / "run"), emulate=True, emulator_prefix="wdlt")
    assert code == 0, summary
    assert summary["bit_identical"] and summary["learners_finished"] == 2
    assert summary["emulator"]["backend"] in ("netem", "tun")
    resolved = rt.load(tmp_path / "run" / "config.toml")
    assert resolved.transport.tls is not None and resolved.run.host.startswith("10.77.")
    links, replans = {}, []
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "link":
            links[e["region"]] = e
        elif e.get("event") == "replan":
            replans.append(e)
    # learner 1 lives in "far", 40 ms away; learner 0 shares the syncer's region
    assert links["far"]["rtt_ms"] == pytest.approx(40.0, rel=0.5) and links["far"]["rtt_ms"] > 35
    assert links["hub"]["rtt_ms"] < 10
    # [plan] adapt_tau: each learner planned its tau from its first measured link, and said why
    assert {e["learner"] for e in replans} == {0, 1}
    assert all(e["reasons"] and 1 <= e["tau_new"] <= 5 for e in replans)
    assert list_namespaces("wdlt") == []
