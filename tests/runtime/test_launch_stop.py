"""A stop of a launched run, without processes: the signals noted (not raised) while the run loop owns
them, and the last snapshot a stop asks every syncer shard for and waits on."""
import queue
import signal
from types import SimpleNamespace

from wan_diloco.runtime import launch_stop
from wan_diloco.runtime.launch_stop import stop_signals, stop_snapshot


def test_stop_signals_are_noted_counted_and_handed_back():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with stop_signals() as stop:
        assert stop == {"sig": 0, "count": 0}
        signal.raise_signal(signal.SIGTERM)  # would end this process if it were not caught
        assert stop == {"sig": signal.SIGTERM, "count": 1}
        signal.raise_signal(signal.SIGINT)
        assert stop == {"sig": signal.SIGINT, "count": 2}  # the last one, and that there were two
    assert {s: signal.getsignal(s) for s in before} == before


def child(pid, exit_code=None):
    return SimpleNamespace(exit_code=exit_code, proc=SimpleNamespace(pid=pid))


def cluster(events, checkpoint_dir="/ckpt", syncer_exit=None):
    q = queue.Queue()
    for e in events:
        q.put(e)
    children = {"syncer": child(101, syncer_exit), "syncer-1": child(102), "syncer-2": child(103, exit_code=0),
                "learner-0": child(201)}
    return SimpleNamespace(children=children, events=q, cfg=SimpleNamespace(checkpoint=SimpleNamespace(dir=checkpoint_dir)))


def asked(monkeypatch):
    sent = []
    monkeypatch.setattr(launch_stop.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    return sent


def test_a_stop_waits_for_the_snapshot_it_cut_and_feeds_every_event_meanwhile(monkeypatch):
    sent = asked(monkeypatch)
    events = [("learner-0", {"event": "step", "step": 7}),
              ("syncer", {"event": "snapshot_requested", "snapshot": 4}),
              ("syncer-1", {"event": "snapshot", "snapshot": 4}),  # a shard's part is not the whole snapshot
              ("syncer", {"event": "snapshot", "snapshot": 3}),  # an older one finishing: not the one cut
              ("syncer", {"event": "snapshot", "snapshot": 4}),
              ("learner-0", {"event": "step", "step": 8})]
    seen = []
    got = stop_snapshot(cluster(events), lambda name, e: seen.append((name, e)), {"sig": 2, "count": 1}, wait_s=30)
    assert got == 4
    assert seen == events[:5]  # every event up to the snapshot, in order; the rest is the run loop's
    assert sent == [(101, signal.SIGUSR1), (102, signal.SIGUSR1)]  # live syncer shards only, never a learner


def test_no_cut_no_checkpoint_dir_or_a_dead_syncer_means_no_wait(monkeypatch):
    sent = asked(monkeypatch)
    nothing = [("syncer", {"event": "snapshot_requested", "snapshot": None}),  # the final sync began
               ("syncer", {"event": "snapshot", "snapshot": 9})]
    assert stop_snapshot(cluster(nothing), lambda *a: None, {"sig": 2, "count": 1}, wait_s=30) is None
    assert len(sent) == 2
    sent.clear()
    assert stop_snapshot(cluster([], checkpoint_dir=""), lambda *a: None, {"sig": 2, "count": 1}) is None
    assert stop_snapshot(cluster([], syncer_exit=1), lambda *a: None, {"sig": 2, "count": 1}) is None
    assert sent == []  # nothing asked of a syncer that cannot write a snapshot


def test_a_second_signal_or_the_deadline_ends_the_wait(monkeypatch):
    asked(monkeypatch)
    stop = {"sig": 2, "count": 1}

    def take(name, e):
        stop["count"] += 1  # a second Ctrl-C while waiting

    events = [("syncer", {"event": "snapshot_requested", "snapshot": 4}),
              ("syncer", {"event": "snapshot", "snapshot": 4})]
    c = cluster(events)
    assert stop_snapshot(c, take, stop, wait_s=30) is None
    assert c.events.qsize() == 1  # it stopped listening at once
    cut_only = [("syncer", {"event": "snapshot_requested", "snapshot": 4})]
    assert stop_snapshot(cluster(cut_only), lambda *a: None, {"sig": 2, "count": 1}, wait_s=0.3) is None
