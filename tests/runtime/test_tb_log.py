"""run.tensorboard: the run's events as TensorBoard scalars, read back from the event files."""
import struct

import pytest

from wan_diloco.config import ConfigError
from wan_diloco.runtime import tb_log


def read_scalars(logdir):
    from tensorboardX.proto import event_pb2

    found = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):  # TFRecord: length, its CRC, the record, its CRC
            (n,) = struct.unpack_from("<Q", data, at)
            record = data[at + 12:at + 12 + n]
            at += 12 + n + 4
            event = event_pb2.Event.FromString(record)
            for v in event.summary.value:
                found.setdefault(v.tag, []).append((event.step, round(v.simple_value, 4)))
    return found


def test_learner_and_syncer_events_become_scalars(tmp_path):
    log = tb_log.TensorBoardLog(tmp_path / "tb")
    log.write("learner-1", {"event": "step", "step": 10, "loss": 3.5, "tokens": 1280, "bytes_sent": 900, "t": 1.0})
    log.write("learner-1", {"event": "step", "step": 20, "loss": 3.0, "tokens": 2560, "bytes_sent": 1800, "t": 2.0})
    log.write("learner-0", {"event": "eval", "step": 20, "eval_loss": 2.75, "tokens": 5000, "t": 2.0})
    log.write("learner-0", {"event": "link", "step": 12, "rate_gbit_s": 2.5, "rtt_ms": 40.0, "t": 2.0})
    log.write("syncer", {"event": "progress", "global_step": 20, "versions": [3, 4], "mean_quorum": 1.5,
                         "bytes_in": 1e6, "bytes_out": 2e6, "recovery_bytes": 0, "t": 2.0})
    log.write("learner-0", {"event": "start", "step": 0, "eval_loss": 5.5})  # nothing to plot
    log.close()
    got = read_scalars(tmp_path / "tb")
    assert got["learner-1/train_loss"] == [(10, 3.5), (20, 3.0)]
    assert got["learner-1/tokens"] == [(10, 1280.0), (20, 2560.0)]
    assert got["global/eval_loss"] == [(20, 2.75)]
    assert got["learner-0/link_gbit_s"] == [(12, 2.5)] and got["learner-0/link_rtt_ms"] == [(12, 40.0)]
    assert got["syncer/versions"] == [(20, 7.0)] and got["syncer/mean_quorum"] == [(20, 1.5)]
    assert not any(tag.startswith("learner-0/train") for tag in got)


def test_without_tensorboardx_it_is_a_config_error_naming_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_tbx(name, *a, **kw):
        if name.startswith("tensorboardX"):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tbx)
    with pytest.raises(ConfigError, match=r"run.tensorboard: needs the tensorboardX package: pip install 'wan-diloco\[tensorboard\]'"):
        tb_log.writer_class()
