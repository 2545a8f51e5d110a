"""#23 case 2: writes that fail are failures. A full checkpoint disk (simulated: ``FAULT_ENV`` makes
every state-file write fail with ENOSPC while a flag file exists) is loud on /status["storage"], the
final parameters are tried again for ``checkpoint.final_write_retry_s`` and, if space never returns,
the syncer and `launch` exit non-zero naming the path and the OS error."""
import asyncio
import json

import pytest

from wan_diloco import spec as rt
from wan_diloco.checkpoint import read_params
from wan_diloco.checkpoint.format import FAULT_ENV
from wan_diloco.runtime.launch import launch
from wan_diloco.runtime.syncer import SyncerService
from wan_diloco.transport import TransportMetrics

from .conftest import micro_config


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """One micro model for the in-process syncers here (their configs differ only in [checkpoint])."""
    from wan_diloco.assemble import Assembly

    return Assembly(_config(tmp_path_factory.mktemp("parts"), retry_s=1))


def _config(tmp_path, retry_s, steps=40, every_merges=0):
    extra = (f'\n[checkpoint]\ndir = "{tmp_path / "ckpt"}"\nevery_merges = {every_merges}\n'
             f'final_write_retry_s = {retry_s}\n')
    return rt.load(micro_config(tmp_path, learners=1, steps=steps, extra=extra))


async def _final_write(service, free_after_s=None, flag=None):
    service.params_path = service.store.params_path
    if free_after_s is not None:
        asyncio.get_running_loop().call_later(free_after_s, flag.unlink)
    await service._save_final(service.core.global_params(), {"run_id": "r"}, [])


def test_a_final_write_on_a_full_disk_is_retried_then_fails_the_run_naming_path_and_error(tmp_path, monkeypatch,
                                                                                          parts):
    flag = tmp_path / "disk-full"
    flag.touch()
    monkeypatch.setenv(FAULT_ENV, str(flag))
    service = SyncerService(_config(tmp_path, retry_s=2.5), TransportMetrics(), parts=parts)
    asyncio.run(_final_write(service))
    path = tmp_path / "ckpt" / "params.safetensors"
    assert service.params_error.startswith(f"could not write the final parameters to {path}: "
                                           f"[Errno 28] No space left on device (gave up after ")
    assert service.params_path is None and not path.exists()
    assert service.final_report["params_error"] == service.params_error
    storage = service.status()["storage"]
    assert storage["ok"] is False and storage["failures"] >= 3 and storage["dir"] == str(tmp_path / "ckpt")
    assert "[Errno 28]" in storage["last_error"] and storage["free_bytes"] > 0
    assert any(e["kind"] == "warning" and "[Errno 28]" in e["what"] for e in service.status()["events"])
    service.refresh_gauges()
    text = service.metrics.render().decode()
    assert "wan_diloco_checkpoint_ok 0.0" in text
    assert f"wan_diloco_checkpoint_write_failures {float(storage['failures'])}" in text


def test_space_freed_while_the_final_write_is_retried_saves_the_run(tmp_path, monkeypatch, parts):
    flag = tmp_path / "disk-full"
    flag.touch()
    monkeypatch.setenv(FAULT_ENV, str(flag))
    service = SyncerService(_config(tmp_path, retry_s=30), TransportMetrics(), parts=parts)
    asyncio.run(_final_write(service, free_after_s=1.5, flag=flag))
    assert service.params_error is None and service.final_report["params_error"] is None
    _, info = read_params(tmp_path / "ckpt" / "params.safetensors")
    assert info["run_id"] == "r"
    storage = service.storage()
    assert storage["ok"] is True and storage["failures"] >= 1 and "[Errno 28]" in storage["last_error"]


def test_launch_on_a_full_checkpoint_disk_exits_non_zero_naming_the_lost_final_parameters(tmp_path, monkeypatch):
    flag = tmp_path / "disk-full"
    flag.touch()
    monkeypatch.setenv(FAULT_ENV, str(flag))
    cfg = _config(tmp_path, retry_s=1, steps=24, every_merges=2)
    code, summary = launch(cfg, "", str(tmp_path / "run"))
    assert code == 1, summary
    assert summary["error"].startswith(f"final parameters not written: could not write the final parameters to "
                                       f"{tmp_path / 'ckpt' / 'params.safetensors'}: [Errno 28] No space left")
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    progress = [e for e in events if e["source"] == "syncer" and e.get("event") == "progress"]
    assert progress and progress[-1]["storage"]["ok"] is False  # the snapshots failed loudly first
    assert any(e.get("event") == "warning" and "snapshot" in e.get("what", "") for e in events)


def test_a_run_folder_that_cannot_be_created_is_one_line_not_a_traceback(tmp_path):
    (tmp_path / "blocked").write_text("a file where the run folder should go")
    cfg = _config(tmp_path, retry_s=1)
    code, summary = launch(cfg, "", str(tmp_path / "blocked" / "run"))
    assert code == 1 and summary["error"].startswith(f"cannot write the run folder {tmp_path / 'blocked' / 'run'}: ")
    assert "\n" not in summary["error"]


def test_failing_writes_are_a_red_row_of_the_live_table_with_the_free_space():
    from rich.console import Console

    from wan_diloco.cli.launch import table
    from wan_diloco.runtime.launch import RunState

    state = RunState(rt.from_document({"run": {"learners": 1}}))
    state.fold("syncer", {"event": "progress", "versions": [1, 1], "global_step": 8, "bytes_out": 10,
                          "storage": {"dir": "/ckpt", "ok": True, "failures": 0, "last_error": None,
                                      "free_bytes": 1 << 30}})
    console = Console(width=250, record=True)
    console.print(table(state))
    assert "WRITES FAILING" not in console.export_text()
    state.fold("syncer", {"event": "progress", "storage": {
        "dir": "/ckpt", "ok": False, "failures": 3, "free_bytes": 5 << 20,
        "last_error": "snapshot 2: could not write the syncer's part: [Errno 28] No space left on device"}})
    console.print(table(state))
    text = console.export_text()
    assert "WRITES FAILING (3 so far) in /ckpt: snapshot 2: could not write the syncer's part: [Errno 28]" in text
    assert "free 5.2 MB" in text


def test_the_launchers_own_file_failing_is_one_line_and_stops_the_run(tmp_path):
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)  # what the launcher writes every event to
    code, summary = launch(_config(tmp_path, retry_s=1), "", str(tmp_path / "run"))
    assert code == 1, summary
    assert summary["error"] == (f"the launcher failed on {tmp_path / 'run' / 'metrics.jsonl'}: [Errno 21] Is a "
                                f"directory; every process was stopped")


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 64 KiB tmpfs (smaller than the micro model's parameters), unmounted afterwards; root only."""
    import os
    import subprocess

    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and tmpfs mounts")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_real_full_disk_then_space_freed_during_the_retries(tmp_path, tiny_tmpfs, parts):
    import subprocess

    cfg = _config(tmp_path, retry_s=30).with_changes(checkpoint={"dir": str(tiny_tmpfs / "ckpt")})
    service = SyncerService(cfg, TransportMetrics(), parts=parts)

    async def go():
        service.params_path = service.store.params_path
        grow = ["mount", "-o", "remount,size=4m", str(tiny_tmpfs)]  # the operator frees space
        asyncio.get_running_loop().call_later(1.5, lambda: subprocess.run(grow, check=True))
        await service._save_final(service.core.global_params(), {"run_id": "r"}, [])

    asyncio.run(go())
    assert service.params_error is None and read_params(tiny_tmpfs / "ckpt" / "params.safetensors")[1]["run_id"] == "r"
    assert service.write_failures >= 1 and "[Errno 28] No space left on device" in service.last_write_error


def test_a_shards_missing_final_file_is_named_not_skipped(tmp_path):
    from wan_diloco.checkpoint import CheckpointError
    from wan_diloco.runtime.launch import join_shard_params

    cfg = _config(tmp_path, retry_s=1)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "params.shard-0.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"params.shard-1.safetensors is missing"):
        join_shard_params(cfg, 2)
