"""#23 case 10 with real processes: a learner started from a file with another schedule than the
syncer's is refused at its hello and stops with one line naming the setting, before its first step."""
from wan_diloco import spec as rt
from wan_diloco.runtime.launch import Cluster

from .conftest import micro_config
from .helpers import wait_for


def test_a_learner_with_another_sync_every_is_refused_at_its_hello_and_stops(tmp_path):
    path = micro_config(tmp_path, learners=2, steps=300)
    other = tmp_path / "other.toml"
    other.write_text(path.read_text().replace("sync_every = 8", "sync_every = 16"))
    cfg = rt.load(path)
    with Cluster(cfg, path, tmp_path / "run") as cluster:
        syncer = cluster.start_syncer()
        cluster.config_path = other  # the learner reads the other file
        learner = cluster.start_learner(0)
        wait_for("the learner to stop", lambda: learner.exit_code is not None, timeout_s=120)
        assert learner.exit_code == 3
        error = next(e for e in learner.events if e.get("event") == "error")["error"]
        assert error == "learner 0: settings differ from the syncer's: schedule (learner.sync_every 16 vs 8)"
        assert not any(e.get("event") == "step" for e in learner.events)  # refused before its first step
        wait_for("the syncer's warning", lambda: any(
            e.get("event") == "warning" and "settings differ" in e.get("what", "") for e in syncer.events), timeout_s=10)
        cluster.stop_all()
