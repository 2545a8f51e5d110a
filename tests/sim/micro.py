"""A micro run spec for simulator tests: the canonical "micro" model preset with the simulator tests' settings."""
from wan_diloco import spec as spec_lib

BASE = dict(preset="micro", learners=3, quorum=1, fragments=4, sync_every=8, tau=1, steps=48,
            batch_size=4, eval_every=16, eval_batches=2, inner_lr=1e-2, warmup_steps=4)


def micro(**kw):
    """The micro spec with ``kw`` changed."""
    return spec_lib.from_short(**{**BASE, **kw})
