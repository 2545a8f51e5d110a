"""What /metrics says of the training, from the learners' metadata (#14): loss, tokens/s, quorum."""
import asyncio

from prometheus_client import generate_latest

from wan_diloco import spec as rt
from wan_diloco.clock import VectorClock
from wan_diloco.core import Metadata
from wan_diloco.runtime import serde
from wan_diloco.runtime.syncer import SyncerService
from wan_diloco.transport import TransportMetrics, run

from .conftest import micro_config


def sample(text: str, name: str) -> float:
    """The value of one sample (``name`` with its labels, as the exposition format writes it)."""
    return float(next(ln for ln in text.splitlines() if ln.startswith(name + " ")).rsplit(" ", 1)[1])


def test_metrics_show_each_learners_loss_and_tokens_per_second(tmp_path):
    cfg = rt.load(micro_config(tmp_path, learners=2))
    metrics = TransportMetrics()
    service = SyncerService(cfg, metrics)
    clock = [100.0]
    service.now = lambda: clock[0]

    def md(m, step, tokens, loss):
        return serde.to_frame(Metadata(learner=m, step=step, c_steps=(0, 0), c_tokens=(0, 0),
                                       clock=VectorClock({f"learner-{m}": step}), loss=loss, tokens=tokens))

    async def main():
        await service.on_metadata(md(0, 1, 0, 5.5))
        await service.on_metadata(md(1, 1, 0, None))  # no loss yet (or a diverged one): none shown
        clock[0] += 0.5
        await service.on_metadata(md(0, 2, 500, 5.0))  # under a second: the window stays open
        clock[0] += 1.5
        await service.on_metadata(md(0, 3, 4000, 4.25))
        await service.on_metadata(md(1, 3, 1000, 4.5))
        service.refresh_gauges()
        return generate_latest(metrics.registry).decode()

    text = run(asyncio.wait_for(main(), 30))
    assert sample(text, 'wan_diloco_learner_loss{learner="0"}') == 4.25
    assert sample(text, 'wan_diloco_learner_loss{learner="1"}') == 4.5
    assert sample(text, 'wan_diloco_learner_tokens_per_s{learner="0"}') == 2000.0  # 4000 tokens in 2 s
    assert sample(text, 'wan_diloco_learner_tokens_per_s{learner="1"}') == 500.0
    assert sample(text, "wan_diloco_tokens_per_s") == 2500.0
    assert sample(text, "wan_diloco_mean_quorum") == 0.0  # no round merged yet
