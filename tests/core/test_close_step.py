"""A round's close (``core.close_step``): the outer step streamed through the codec a work item at a time gives
the bits of the whole-array way (update, payload, Θ, momentum), never writes Θ's own arrays, and a refused
step leaves Θ and the momentum as they were."""
import itertools
import re

import numpy as np
import pytest

from wan_diloco.clock import VectorClock
from wan_diloco.compression import CodecConfig, FragmentCodec
from wan_diloco.core import FragmentUpload, SyncerConfig, SyncerCore
from wan_diloco.fragments import LazyValues, Layout
from wan_diloco.merge import CHUNK
from wan_diloco.outer import OuterConfig

from .helpers import is_embedding

# "w" spans several work items and zstd chunks (4-bit: 2^21 values a chunk), "b" pads its last block.
FRAGS = [("block_0/w", "block_0/b")]
PARAMS = {"block_0/w": np.linspace(-1, 1, 9 * CHUNK + 9, dtype=np.float32), "block_0/b": np.ones(7, np.float32)}
LAYOUT = Layout(FRAGS, {n: a.shape for n, a in PARAMS.items()})


class WholeArrays(FragmentCodec):
    """The same codec, made to take the whole-array way."""

    @property
    def streams(self) -> bool:
        return False


def run(codec, outer: OuterConfig, threads: int, rounds: int = 3):
    rng = np.random.default_rng(5)
    s = SyncerCore(SyncerConfig(num_learners=2, quorum=2, grace=False, threads=threads, outer=outer), FRAGS,
                   PARAMS, is_embedding, codec)
    sent = []
    for r in range(rounds):
        for m in range(2):
            delta = {n: (rng.standard_normal(a.shape) * 1e-2).astype(np.float32) for n, a in PARAMS.items()}
            up = FragmentUpload(learner=m, fragment=0, due_step=8 * (r + 1), base_version=r, c_steps=8,
                                c_tokens=800 * (m + 1), clock=VectorClock({f"learner-{m}": 8 * (r + 1)}),
                                delta=codec.decode(0, codec.encode(delta), deferred=True), nbytes=1)
            out = s.on_fragment(float(r), up)
        [b] = out
        sent.append((bytes(b.msg.payload), {n: np.array(v) for n, v in b.msg.update.items()}))
    return s, sent


@pytest.mark.parametrize("bits,outer", [(4, OuterConfig(lr=0.7, momentum=0.9)),
                                        (4, OuterConfig(lr=0.4, momentum=0.6, nesterov=False)),
                                        (8, OuterConfig(lr=0.4, momentum=0.0))])
def test_the_streamed_step_gives_the_bits_of_the_whole_array_step(bits, outer):
    cfg = CodecConfig(bits=bits, block_size=64, scale_dtype="bfloat16")
    results = []
    for cls, threads in itertools.product((FragmentCodec, WholeArrays), (1, 3)):
        codec = cls(cfg, LAYOUT)
        assert codec.streams == (cls is FragmentCodec)
        s, sent = run(codec, outer, threads)
        trace = s.outer.states[0][0].trace if outer.momentum else {}
        results.append((sent, {n: a.tobytes() for n, a in s.theta[0].items()},
                        {n: np.asarray(a).tobytes() for n, a in trace.items()}))
    (sent0, theta0, trace0) = results[0]
    for sent, theta, trace in results[1:]:
        assert theta == theta0 and trace == trace0
        for (p, u), (p0, u0) in zip(sent, sent0):
            assert p == p0 and all(u[n].tobytes() == u0[n].tobytes() for n in u0)


def test_the_update_a_broadcast_carries_is_its_payload_decoded_when_looked_up():
    codec = FragmentCodec(CodecConfig(bits=4, block_size=64), LAYOUT)
    s, _ = run(codec, OuterConfig(), 1, rounds=0)
    def up(m):
        return FragmentUpload(learner=m, fragment=0, due_step=8, base_version=0, c_steps=8, c_tokens=800,
                              clock=VectorClock({f"learner-{m}": 8}), nbytes=1,
                              delta={n: np.full(a.shape, 0.01 * (m + 1), np.float32) for n, a in PARAMS.items()})

    s.on_fragment(0.0, up(0))
    [b] = s.on_fragment(0.0, up(1))
    assert isinstance(b.msg.update, LazyValues) and not b.msg.update.made  # nothing decoded yet
    want = codec.decode(0, b.msg.payload)
    assert list(b.msg.update) == list(want) and len(b.msg.update) == 2
    assert all(b.msg.update[n].tobytes() == want[n].tobytes() for n in want)


def test_a_close_never_writes_into_thetas_own_arrays():
    # A snapshot being written shares Θ's arrays (``export``): the new Θ goes elsewhere.
    codec = FragmentCodec(CodecConfig(bits=4, block_size=64), LAYOUT)
    s, _ = run(codec, OuterConfig(), 1, rounds=1)
    shared, copies = dict(s.theta[0]), {n: a.copy() for n, a in s.theta[0].items()}
    before = s.version[0]
    for m in range(2):
        s.on_fragment(1.0, FragmentUpload(learner=m, fragment=0, due_step=16, base_version=before, c_steps=8,
                                          c_tokens=800, clock=VectorClock({f"learner-{m}": 16}), nbytes=1,
                                          delta={n: np.full(a.shape, 0.01, np.float32) for n, a in PARAMS.items()}))
    assert s.version[0] == before + 1
    assert all(np.array_equal(shared[n], copies[n]) for n in shared)
    assert all(not np.shares_memory(shared[n], s.theta[0][n]) for n in shared)


@pytest.mark.parametrize("theta_value,delta_value,lr,why", [
    (1.0, 5e37, 10.0, "'block_0/w': NaN/Inf values$"),
    (3e38, -1e38, 1.0, "'block_0/w': adding its decoded values to the base overflows float32"),
])
def test_a_refused_streamed_step_leaves_theta_and_the_momentum_as_they_were(theta_value, delta_value, lr, why):
    # A huge Δ with a large outer lr (the update leaves float32: the encoder refuses it), or Θ near float32's
    # largest value and a finite update of the same sign (only Θ + update overflows: the checking pass).
    shapes = {"block_0/w": (3,), "block_0/b": (7,)}
    params = {n: np.full(shape, theta_value, np.float32) for n, shape in shapes.items()}
    codec = FragmentCodec(CodecConfig(bits=4, block_size=64, scale_dtype="bfloat16"), Layout(FRAGS, shapes))
    s = SyncerCore(SyncerConfig(num_learners=1, quorum=1, grace=False, max_delta_ratio=1e38,
                                outer=OuterConfig(lr=lr, momentum=0.5)), FRAGS, params, is_embedding, codec)
    theta = {n: a.copy() for n, a in s.theta[0].items()}
    trace = {n: a.copy() for n, a in s.outer.states[0][0].trace.items()}
    delta = {n: np.full(shape, delta_value, np.float32) for n, shape in shapes.items()}
    up = FragmentUpload(learner=0, fragment=0, due_step=8, base_version=0, c_steps=8, c_tokens=800,
                        clock=VectorClock({"learner-0": 8}), delta=delta, nbytes=1)
    assert s.on_fragment(1.0, up) == []
    assert s.stats.refused_rounds == 1 and re.search(why, s.notices[-1]), s.notices
    assert all(np.array_equal(theta[n], s.theta[0][n]) for n in theta) and s.version == [0]
    assert all(np.array_equal(trace[n], s.outer.states[0][0].trace[n]) for n in trace)
