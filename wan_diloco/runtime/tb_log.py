"""The run's events as TensorBoard scalars (``run.tensorboard``; ``RUN_DIR/tensorboard``), beside
metrics.jsonl: learners' training loss, tokens and link, the global model's eval loss, the syncer's
merges and bytes. TensorBoard reads the folder: ``tensorboard --logdir RUN_DIR/tensorboard``."""
from __future__ import annotations

from pathlib import Path

from wan_diloco.config import ConfigError

# (event kind, field, tag, x field): one scalar per matching event; ``{m}`` is the learner's index.
LEARNER_SCALARS = [
    ("step", "loss", "learner-{m}/train_loss", "step"),
    ("step", "tokens", "learner-{m}/tokens", "step"),
    ("step", "bytes_sent", "learner-{m}/bytes_sent", "step"),
    ("link", "rate_gbit_s", "learner-{m}/link_gbit_s", "step"),
    ("link", "rtt_ms", "learner-{m}/link_rtt_ms", "step"),
    ("eval", "eval_loss", "global/eval_loss", "step"),
    ("final", "final_eval_loss", "global/final_eval_loss", "steps"),
]
SYNCER_SCALARS = [
    ("progress", "mean_quorum", "syncer/mean_quorum", "global_step"),
    ("progress", "bytes_in", "syncer/bytes_in", "global_step"),
    ("progress", "bytes_out", "syncer/bytes_out", "global_step"),
    ("progress", "recovery_bytes", "syncer/recovery_bytes", "global_step"),
]


def writer_class():
    """tensorboardX's SummaryWriter; ConfigError (one line, before any process starts) without it."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ConfigError("run.tensorboard: needs the tensorboardX package: pip install 'wan-diloco[tensorboard]'") from None
    return SummaryWriter


class TensorBoardLog:
    def __init__(self, logdir: Path):
        self.writer = writer_class()(str(logdir), flush_secs=10)
        self.last_step: dict[str, int] = {}

    def write(self, source: str, event: dict) -> None:
        kind = event.get("event")
        if source == "syncer":
            rows, m = SYNCER_SCALARS, None
        else:
            rows, m = LEARNER_SCALARS, source.rpartition("-")[2]
        for want, field, tag, x in rows:
            value, step = event.get(field), event.get(x)
            if kind != want or not isinstance(value, (int, float)) or not isinstance(step, int):
                continue
            self.writer.add_scalar(tag.format(m=m), float(value), step, walltime=event.get("t"))
        if source == "syncer" and kind == "progress" and isinstance(event.get("global_step"), int):
            self.writer.add_scalar("syncer/versions", float(sum(event.get("versions", []))), event["global_step"],
                                   walltime=event.get("t"))

    def close(self) -> None:
        self.writer.close()
