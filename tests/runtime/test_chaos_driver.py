"""The chaos driver's timing of faults (runtime/chaos/driver.py), without processes."""
from types import SimpleNamespace

from wan_diloco.runtime import chaos
from wan_diloco.runtime.chaos.driver import _Driver

from tests.conftest import micro_spec


def test_a_full_disk_due_while_the_syncer_restarts_waits_until_it_listens(tmp_path):
    # bench.chaos --quick on a loaded machine: the --resume start ran into the disk-full window, and the
    # resumed syncer, which writes its incarnation before it listens, sat out the whole minute.
    driver = _Driver(SimpleNamespace(run_dir=tmp_path), None, micro_spec(run={"learners": 2}), [], None,
                     lambda line: None)
    driver.syncer_restarting = True
    driver._fire(chaos.Fault(0.0, "disk_full", "syncer", 60.0))
    assert not driver.disk_flag.exists() and driver.fired == [] and len(driver.actions) == 1
    _, _, retry = driver.actions.pop()
    retry()  # still restarting: it waits again
    assert not driver.disk_flag.exists() and len(driver.actions) == 1
    driver.syncer_restarting = False
    _, _, retry = driver.actions.pop()
    retry()
    try:
        assert driver.disk_flag.exists() and [f["kind"] for f in driver.fired] == ["disk_full"]
        assert len(driver.actions) == 1  # the space coming back, 60 s on
    finally:
        driver.disk_flag.unlink(missing_ok=True)
