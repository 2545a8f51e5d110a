"""Shard 0's /status gathers the other shards' (#15): versions from each fragment's owner, counters added up,
an unreachable shard named with the reason while its fragments keep the versions it last reported."""
import asyncio

from wan_diloco.runtime.shard_status import ShardStatus, aggregate
from wan_diloco.transport import StatusServer, TransportMetrics

TOKEN = "shard-status-token-0123"


def page(owned, versions, **kw):
    return {"owned": owned, "versions": versions, "fragment_syncs": [v for v in versions], "epoch": 1,
            "bytes_in": 100, "bytes_out": 10, "quorum_sizes": [2], "grace_s": [0.1], "final_done": False,
            "history": [{"closed_s": 1.0 + owned[0], "fragment": owned[0], "due_step": 4, "contributors": [0]}],
            "learners": {"0": {"step": 4}}, **kw}


def test_aggregate_takes_each_fragment_from_its_owner_and_adds_counters():
    own = page([0, 2], [3, 0, 5, 0])
    out = aggregate(own, {1: page([1, 3], [0, 7, 0, 9])})
    assert out["versions"] == [3, 7, 5, 9] and out["fragment_syncs"] == [3, 7, 5, 9]
    assert out["bytes_in"] == 200 and out["quorum_sizes"] == [2, 2]
    assert [h["fragment"] for h in out["history"]] == [0, 1]
    assert [(r["shard"], r["reachable"], r["owned"]) for r in out["shards"]] == [(0, True, [0, 2]), (1, True, [1, 3])]
    assert out["learners"] == own["learners"] and not out["final_done"]


def test_an_unreachable_shard_is_named_and_keeps_its_last_versions():
    last = {}
    aggregate(page([0], [3, 0]), {1: page([1], [0, 7])}, last)
    out = aggregate(page([0], [4, 0]), {1: "ClientConnectorError from http://x: refused"}, last)
    assert out["versions"] == [4, 7]
    assert out["shards"][1]["reachable"] is False and "refused" in out["shards"][1]["error"]
    assert not out["final_done"]


def test_shard_status_fetches_real_status_servers_with_the_token():
    async def main():
        metrics = TransportMetrics()
        async with StatusServer(lambda: page([1], [0, 7]), metrics, token=TOKEN) as one:
            gone = StatusServer(lambda: {}, metrics, token=TOKEN)
            port = await gone.start()
            await gone.stop()  # a port nothing listens on any more
            wrong = StatusServer(lambda: page([2], [0, 0, 1]), metrics, token="another-token-0123456")
            async with wrong:
                status = ShardStatus([one.url, f"http://127.0.0.1:{port}", wrong.url], TOKEN, timeout_s=2.0)
                return await status.status(page([0], [3, 0, 0]))
    out = asyncio.run(main())
    assert out["versions"] == [3, 7, 0]
    rows = {r["shard"]: r for r in out["shards"]}
    assert rows[1]["reachable"] and rows[1]["owned"] == [1]
    assert not rows[2]["reachable"] and "127.0.0.1" in rows[2]["error"]
    assert not rows[3]["reachable"] and "HTTP 401" in rows[3]["error"]


def test_the_launch_table_and_summary_show_each_shard_and_the_whole_run(tmp_path):
    from rich.console import Console

    from wan_diloco import spec as rt
    from wan_diloco.cli.launch import table
    from wan_diloco.runtime.launch import RunState, summarize

    cfg = rt.from_document({"run": {"learners": 2, "run_id": "r"}, "learner": {"num_fragments": 4},
                            "syncer": {"shards": 2}})
    state = RunState(cfg)
    state.fold("syncer", {"event": "listening", "owned": [0, 3], "params": 10})
    state.fold("syncer-1", {"event": "listening", "owned": [1, 2]})
    state.fold("syncer", {"event": "progress", "versions": [5, 0, 0, 6], "global_step": 40, "bytes_out": 1000})
    state.fold("syncer-1", {"event": "progress", "versions": [0, 7, 8, 0], "global_step": 40, "bytes_out": 2000})
    console = Console(width=200, record=True)
    console.print(table(state))
    text = console.export_text()
    assert "fragments 0,3: [5, 6]" in text and "fragments 1,2: [7, 8]" in text and "syncer-1" in text
    # The summary joins the shards' finals: each fragment's digest and merges from its owner, bytes added.
    state.fold("syncer", {"event": "final", "digests": ["a", None, None, "d"], "fragment_syncs": [5, 0, 0, 6],
                          "bytes_in": 10, "bytes_out": 1, "final_learners": [0, 1]})
    state.fold("syncer-1", {"event": "final", "digests": [None, "b", "c", None], "fragment_syncs": [0, 7, 8, 0],
                            "bytes_in": 20, "bytes_out": 2})
    for m in (0, 1):
        state.fold(f"learner-{m}", {"event": "final", "steps": 40, "last_loss": 2.0, "tokens": 100, "bytes_sent": 1,
                                    "raw_bytes": 4, "payload_bytes": 1, "final_eval_loss": 2.0, "compute_s": 1.0,
                                    "train_s": 1.0, "digests": ["a", "b", "c", "d"]})
    summary = summarize(state, 10.0)
    assert summary["bit_identical"] and summary["fragment_syncs"] == [5, 7, 8, 6] and summary["bytes_sent"] == 33
