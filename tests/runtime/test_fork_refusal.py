"""#23 case 3 on the syncer's side: a syncer started without --resume over a checkpoint.dir holding
snapshots refuses to start (one line, exit 2) instead of forking the run under the same run id."""
import pytest

from wan_diloco import spec as rt
from wan_diloco.assemble import Assembly
from wan_diloco.checkpoint import SnapshotStore
from wan_diloco.cli import main
from wan_diloco.runtime.syncer import ForkRefused, SyncerService
from wan_diloco.transport import TransportMetrics

from .conftest import micro_config


def _config(tmp_path):
    return micro_config(tmp_path, learners=2, extra=f'\n[checkpoint]\ndir = "{tmp_path / "ckpt"}"\n')


def _with_run_id(path):
    text = path.read_text().replace("[run]\n", '[run]\nrun_id = "run-fixed"\n', 1)
    path.write_text(text)
    return path


def test_a_syncer_without_resume_over_existing_snapshots_refuses_to_start(tmp_path):
    path = _with_run_id(_config(tmp_path))
    cfg = rt.load(path)
    parts = Assembly(cfg)
    SyncerService(cfg, TransportMetrics(), parts=parts)  # an empty folder: a fresh start is fine
    SnapshotStore(tmp_path / "ckpt").save_part(1, "syncer", {}, {"run_id": "run-fixed"}, "syncer")
    with pytest.raises(ForkRefused, match=r"1 snapshot\(s\) \(0 complete, newest 1\).*--resume.*move that folder"):
        SyncerService(cfg, TransportMetrics(), parts=parts)


def test_the_syncer_command_refuses_in_one_line_with_exit_2(tmp_path, capsys):
    path = _with_run_id(_config(tmp_path))
    SnapshotStore(tmp_path / "ckpt").save_part(3, "syncer", {}, {"run_id": "run-fixed"}, "syncer")
    assert main(["syncer", "--config", str(path), "--port", "0", "--no-table"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("wan-diloco syncer: refusing to start:") and "--resume" in err[0]
