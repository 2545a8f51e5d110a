import numpy as np

from wan_diloco.clock import VectorClock
from wan_diloco.compression import CodecConfig, FragmentCodec
from wan_diloco.core import FragmentUpload, Metadata
from wan_diloco.fragments import Layout

FRAGS = [("block_0/w",), ("embed/embedding",)]
PARAMS = {"block_0/w": np.array([1.0, 2.0, 3.0], np.float32), "embed/embedding": np.array([[0.5, -0.5]], np.float32)}
CODEC = FragmentCodec(CodecConfig(bits=32), Layout(FRAGS, {n: a.shape for n, a in PARAMS.items()}))


def is_embedding(name):
    return name.startswith("embed")


def upload(learner, fragment=0, due=8, delta=None, base_version=0, c_steps=8, c_tokens=800):
    name = FRAGS[fragment][0]
    d = delta if delta is not None else np.full_like(PARAMS[name], 0.1 * (learner + 1))
    return FragmentUpload(learner=learner, fragment=fragment, due_step=due, base_version=base_version,
                          c_steps=c_steps, c_tokens=c_tokens, clock=VectorClock({f"learner-{learner}": due}),
                          delta={name: d}, nbytes=d.nbytes)


def meta(learner, step=8, step_s=1.0, sync_s=None, tau=None):
    return Metadata(learner=learner, step=step, c_steps=(step, step), c_tokens=(100 * step, 100 * step),
                    clock=VectorClock({f"learner-{learner}": step}), step_s=step_s, sync_s=sync_s, tau=tau)
