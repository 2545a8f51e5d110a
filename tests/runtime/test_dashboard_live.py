"""The dashboard against real servers (#23 case 7): a real syncer (one shard, then two) with real learners,
the page loaded from its status port in headless Chromium, live numbers in the DOM and nothing thrown.

The page once threw on every real run (it iterated ``shards``, a number with one shard) while its browser
test, fed a hand-written /status, passed; these tests feed it nothing but what the servers serve.
"""
from __future__ import annotations

import asyncio
import importlib.util
import re
from pathlib import Path

import pytest

from wan_diloco import spec as rt
from wan_diloco.runtime.launch import Cluster
from wan_diloco.transport import run

from .conftest import micro_config
from .helpers import status, wait_for

# The browser helpers live with the page's other tests; tests/ is no package, so load them by path.
_spec = importlib.util.spec_from_file_location(
    "dashboard_browser", Path(__file__).parents[1] / "transport" / "test_dashboard.py")
browser = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(browser)
chromium = browser.chromium  # the fixture: skips cleanly where Chromium is not installed

BUDGET_MS = 5000  # virtual time: two or three polls


def open_page(browser_path: str, cluster: Cluster, workdir: Path) -> str:
    """Shard 0's dashboard as Chromium renders it, the token in the URL fragment; checked clean."""
    workdir.mkdir()
    url = f"http://127.0.0.1:{cluster.status_port}/#token={cluster.token}"
    dom, _ = run(asyncio.wait_for(browser.browse(browser_path, url, workdir, BUDGET_MS), 150))
    assert int(re.search(r'<body [^>]*data-polls="(\d+)"', dom).group(1)) >= 1, "the page never read /status"
    browser.assert_rendered_cleanly(dom, workdir)
    assert cluster.token not in dom
    return dom


def cells(dom: str, key: str, value: str) -> list[str]:
    return [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", browser.row(dom, key, value))]


def start_run(tmp_path: Path, shards: int) -> tuple[Cluster, rt.RunSpec]:
    # Many steps: the test stops the run once it has seen it mid-way, so no budget is waited for.
    path = micro_config(tmp_path, learners=2, steps=4000, min_step_s=0.05)
    # A run id, as launch always writes one (and shards need one).
    path.write_text(path.read_text().replace("[run]\n", '[run]\nrun_id = "dashboard-test"\n', 1)
                    .replace("[syncer]\n", f"[syncer]\nshards = {shards}\n", 1))
    cfg = rt.load(path)
    return Cluster(cfg, path, tmp_path / "run"), cfg


def merged_everywhere(cluster: Cluster, timeout_s: float = 300) -> dict:
    """/status once every fragment merged and both learners reported a loss and a joined event."""
    seen = {}

    def ready():
        st = seen["last"] = status(cluster)
        # Rejoined, too: on a loaded machine a learner still compiling can be lost before its first step.
        came = {e["learner"] for e in st["events"] if e["kind"] in ("joined", "rejoined")}
        return all(v >= 1 for v in st["versions"]) and len(st["loss_history"]) == 2 and came == {0, 1} \
            and st["history"]
    try:
        wait_for("merges of every fragment", ready, timeout_s)
    except AssertionError:
        st = seen.get("last", {})
        raise AssertionError(f"no merge of every fragment within {timeout_s} s: versions {st.get('versions')}, "
                             f"steps {[lr['step'] for lr in st.get('learners', {}).values()]}, "
                             f"events {st.get('events')}") from None
    return seen["last"]


def assert_live(dom: str, before: dict, after: dict) -> None:
    """The page shows the run between two /status reads: learners, losses, versions, merges, events."""
    for m in ("0", "1"):
        row = cells(dom, "learner", m)
        assert row[2] == "alive", row
        assert before["learners"][m]["step"] <= int(row[3].replace(",", "")) <= after["learners"][m]["step"], row
        assert re.fullmatch(r"\d+\.\d{4}", row[4]), row  # a loss, not "–"
    assert browser.element(dom, r'<b id="alive">') == "2 / 2"
    points = int(re.search(r'data-points="(\d+)"', dom).group(1))
    assert points >= sum(len(c) for c in before["loss_history"].values()) > 0  # the loss chart is drawn
    legend = browser.element(dom, r'<div id="legend">')
    assert "learner 0 (" in legend and "learner 1 (" in legend, legend
    for p, v in enumerate(before["versions"]):
        shown = int(cells(dom, "fragment", str(p))[1].replace(",", ""))
        assert v <= shown <= after["versions"][p] and shown >= 1, (p, shown)
    events = browser.element(dom, r'<ul id="events">')
    assert re.search(r"learner 0 (re)?joined", events) and re.search(r"learner 1 (re)?joined", events), events
    assert "merged (due step" in events
    quorum = browser.element(dom, r'<b id="quorum">')
    assert quorum.endswith("of 2 up") and quorum != "– of 2 up", quorum
    assert browser.element(dom, r'<b id="run">') == after["run_id"] == "dashboard-test"


def assert_waiting(dom: str) -> None:
    """Before any learner connected: every learner is waiting (not up), nothing thrown."""
    for m in ("0", "1"):
        assert cells(dom, "learner", m)[2] == "waiting"
    assert browser.element(dom, r'<b id="alive">') == "0 / 2"
    assert 'data-points="0"' in dom
    assert "nothing yet" in browser.element(dom, r'<ul id="events">')


@browser.FORK_WARNING
def test_the_dashboard_of_a_real_one_shard_run_shows_it_live(chromium, tmp_path):
    cluster, _ = start_run(tmp_path, shards=1)
    with cluster:
        cluster.start_syncers()
        assert status(cluster)["shards"] == 1  # what broke the page: a number, not a list of shards
        assert_waiting(open_page(chromium, cluster, tmp_path / "before"))
        for m in range(2):
            cluster.start_learner(m)
        before = merged_everywhere(cluster)
        dom = open_page(chromium, cluster, tmp_path / "live")
        after = status(cluster)
        assert_live(dom, before, after)
        assert [cells(dom, "fragment", str(p))[4] for p in range(len(after["versions"]))] == ["0", "0"]
        assert browser.element(dom, r'<b id="shards"[^>]*>') == "1"


@pytest.mark.slow  # 30-90 s; the one-shard test and the schema test of shard pages stay in the default run
@browser.FORK_WARNING
def test_the_dashboard_of_a_real_two_shard_run_shows_both_shards_and_one_that_is_down(chromium, tmp_path):
    cluster, _ = start_run(tmp_path, shards=2)
    with cluster:
        cluster.start_syncers()
        for m in range(2):
            cluster.start_learner(m)
        before = merged_everywhere(cluster)
        dom = open_page(chromium, cluster, tmp_path / "live")
        after = status(cluster)
        assert_live(dom, before, after)
        owners = {p: str(r["shard"]) for r in after["shards"] for p in r["owned"]}
        assert sorted(set(owners.values())) == ["0", "1"]
        assert {p: cells(dom, "fragment", str(p))[4] for p in owners} == owners
        assert browser.element(dom, r'<b id="shards"[^>]*>') == "2"

        cluster.kill("syncer-1")  # shard 0's page names it down, and the rest of the page stays whole
        wait_for("shard 1 unreachable", lambda: not status(cluster)["shards"][1]["reachable"], timeout_s=30)
        dom = open_page(chromium, cluster, tmp_path / "down")
        assert browser.element(dom, r'<b id="shards"[^>]*>') == "2 (1 down)"
        for p, shard in owners.items():
            assert cells(dom, "fragment", str(p))[4] == ("1 (down)" if shard == "1" else "0")
        assert cells(dom, "learner", "0")[2] in ("alive", "lost")
