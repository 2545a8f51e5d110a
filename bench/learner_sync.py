"""What syncing costs a learner's step: a real learner with syncing on against the same learner with it off.

Each variant is a real ``runtime.learner.Learner`` (its ``train_step``: drain, step, snapshot, merge)
whose network is ``LocalNet``: a syncer of one learner in process, which frames every upload as the
network thread would and answers it τ steps after its due step with Θ_p ← Θ_p − Δ. Everything a
learner does for syncing runs (host copy, Δ, error feedback, encode, framing, merge, apply) except the
network itself. Variants:

- ``off``: H so large that no fragment is ever due (the step, the drain and metadata only);
- ``on_training_thread``: ``learner.sync_in_flight = 0`` (all on the training thread, the pre-#26 path);
- ``on_worker``: ``learner.sync_in_flight = 2`` (runtime.sync_worker, its thread at nice ``NICE``);
- ``on_worker_nice0``: the same with the worker at the training thread's priority (the pre-nice worker).

The variants run in alternating blocks of whole rounds, so drift of a shared machine falls on each alike;
each block's median on / off is one ratio, and a row gives their median, min and max. Per stage, the
training thread's wall and CPU seconds per step, and the worker thread's CPU. ``encode`` in each row:
a snapshot's Δ + error feedback + encode + decode in MB of fp32 per CPU-second, fused
(``FragmentCodec.roundtrip_delta``) against the same steps one whole array at a time (the path before it),
with ``np.copy`` of the same bytes, in the same run; the two must give the same bytes.

    python -m bench.train_throughput --sync                      # tiny, int4, H = 8 and 100
    python -m bench.learner_sync --preset base --sync-every 8 --batch-size 1 --steps 16 --block-steps 8
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import queue
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from wan_diloco import model, tree  # noqa: E402
from wan_diloco.assemble import Assembly  # noqa: E402
from wan_diloco.core.learner import LearnerCore  # noqa: E402
from wan_diloco.core.messages import GlobalUpdate  # noqa: E402
from wan_diloco.fragments import Encoded, Schedule  # noqa: E402
from wan_diloco.runtime import serde  # noqa: E402
from wan_diloco.runtime.inbox import Arrived  # noqa: E402
from wan_diloco.runtime.learner import Learner  # noqa: E402
from wan_diloco.runtime.sync_worker import NICE, SyncWorker  # noqa: E402
from wan_diloco.spec import RunSpec  # noqa: E402

OFF_H = 10**9  # "syncing off": no fragment is due within any run


class LocalNet:
    """The network side of a learner with a one-learner syncer in its place (what ``Learner`` calls).

    An upload is framed (``serde.to_frame``, on the caller's thread as in ``NetThread.upload``) and
    kept; the answer to the fragment due at step s is handed out by ``next`` once the learner is at step
    s + ``delay``, waiting for its upload if a worker has not finished it: a run is then the same
    whatever thread encoded, as the bit-identity test needs."""

    def __init__(self, schedule: Schedule, step_of, delay: int, frame_timer=None):
        self.schedule, self.step_of, self.delay = schedule, step_of, delay
        self.uploads: list = []  # every FragmentUpload, in the order sent
        self._got: dict[tuple[int, int], object] = {}
        self._answer_bufs: dict[int, list[dict]] = {}
        self._cond = threading.Condition()
        self._answered_upto = 0
        self._inbox: collections.deque = collections.deque()
        self.metadata = 0
        self.frame_timer = frame_timer
        self.hello_answered = threading.Event()

    def upload(self, msg) -> None:
        if self.frame_timer is not None:
            with self.frame_timer("frame"):
                serde.to_frame(msg)
        else:
            serde.to_frame(msg)
        # The answer a one-learner syncer sends back (−Δ), decoded here as a learner's network thread decodes
        # an arriving update: off the training thread (a fused encode's values are decoded from its payload
        # when looked up). Into two reused buffers per fragment, as a decode into the pool would be: an answer
        # is applied long before its fragment's next one is made.
        bufs = self._answer_bufs.setdefault(msg.fragment, [{}, {}])
        bufs.reverse()
        answer = {}
        for n, d in msg.delta.items():
            d = np.asarray(d)
            out = bufs[0].get(n)
            if out is None or out.shape != d.shape:
                out = bufs[0][n] = np.empty(d.shape, np.float32)
            answer[n] = np.negative(d, out=out)
        with self._cond:
            self.uploads.append(msg)
            self._got[(msg.due_step, msg.fragment)] = (msg, answer)
            self._cond.notify_all()

    def next(self, block_s: float = 0.0):
        upto = self.step_of() - self.delay
        for s, p in self.schedule.due_between(self._answered_upto, upto):
            with self._cond:
                if not self._cond.wait_for(lambda: (s, p) in self._got, timeout=60):
                    raise RuntimeError(f"LocalNet: no upload of fragment {p} due at step {s} within 60 s")
                msg, answer = self._got.pop((s, p))
            self._inbox.append(Arrived(time.monotonic(), GlobalUpdate(
                fragment=p, from_version=msg.base_version, to_version=msg.base_version + 1, due_step=s,
                global_step=s, clock=msg.clock, update=answer, nbytes=msg.nbytes,
                contributors=(msg.learner,), held_s={msg.learner: 0.0})))
        self._answered_upto = max(self._answered_upto, upto)
        if not self._inbox:
            raise queue.Empty
        return self._inbox.popleft()

    def send_metadata(self, msg) -> None:
        self.metadata += 1

    def silent_s(self):
        return None

    def wait_uploads(self, budget_s: float) -> None:
        pass

    bytes_sent = bytes_received = 0


class Stages:
    """Exclusive wall and CPU seconds per stage, split by thread (the training thread, or any other)."""

    def __init__(self):
        self.main = threading.get_ident()
        self.totals: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
        self._stack = threading.local()

    def __call__(self, name: str):
        return _Timer(self, name)

    def wrap(self, name, fn):
        def timed(*a, **k):
            with self(name):
                return fn(*a, **k)
        return timed

    def reset(self) -> None:
        self.totals.clear()

    def report(self, steps: int) -> dict:
        return {f"{where}/{name}": {"wall_ms_per_step": 1e3 * t[0] / steps, "cpu_ms_per_step": 1e3 * t[1] / steps,
                                    "calls": t[2]}
                for (where, name), t in sorted(self.totals.items())}


class _Timer:
    def __init__(self, stages: Stages, name: str):
        self.s, self.name = stages, name

    def __enter__(self):
        stack = self.s._stack.__dict__.setdefault("frames", [])
        stack.append([time.perf_counter(), time.thread_time(), 0.0, 0.0])  # start, cpu start, children
        return self

    def __exit__(self, *exc):
        stack = self.s._stack.frames
        t0, c0, child_wall, child_cpu = stack.pop()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        if stack:
            stack[-1][2] += wall
            stack[-1][3] += cpu
        where = "training" if threading.get_ident() == self.s.main else "worker"
        t = self.s.totals[(where, self.name)]
        t[0] += wall - child_wall
        t[1] += cpu - child_cpu
        t[2] += 1


def spec_for(preset: str, sync_every: int, sync_in_flight: int, batch_size: int, bits: int, fragments: int,
             tau: int, keep_local: bool = False, error_feedback: bool = True) -> RunSpec:
    return RunSpec.from_dict({
        "run": {"learners": 1, "batch_size": batch_size, "steps": 10**6},
        "model": {"preset": preset},
        "codec": {"bits": bits},
        "learner": {"sync_every": sync_every, "num_fragments": fragments, "tau": tau, "error_feedback": error_feedback,
                    "sync_in_flight": sync_in_flight, "keep_local": keep_local},
        "data": {"max_bytes": 1 << 20},
    })


def local_learner(spec: RunSpec, stages: Stages | None = None, parts: Assembly | None = None) -> Learner:
    """A real Learner of ``spec`` whose network is a ``LocalNet`` (answers τ steps after each due step).
    ``parts``: an ``Assembly`` of the same model and schedule to build it from (saves the init's compiles)."""
    lrn = Learner(spec, 0, "127.0.0.1:9", "bench-token-" + "x" * 32, parts=parts)
    lrn.net = LocalNet(lrn.core.schedule, lambda: lrn.core.step, spec.learner.tau, stages)
    if stages is not None:
        handle, core = lrn.handle, lrn.core
        lrn.handle = lambda actions: [stages.wrap(type(a).__name__, handle)([a]) for a in actions] and None
        core.snapshot = stages.wrap("delta_feedback_encode", core.snapshot)
        core.encode_snapshot = stages.wrap("delta_feedback_encode", core.encode_snapshot)
        core.on_update = stages.wrap("merge", core.on_update)
    return lrn


def close(lrn: Learner) -> None:
    if lrn.sync is not None:
        lrn.sync.close()
    lrn.writer.shutdown(wait=True)


class StepByStep:
    """The codec path before ``roundtrip_delta``: ``LearnerCore`` then computes Δ and error feedback a whole
    array at a time, and ``roundtrip`` packs and unpacks the raw bytes (the pair-table decode)."""

    def __init__(self, codec):
        self.codec = codec

    def roundtrip(self, values) -> Encoded:
        data, p, raw = self.codec._encode(values, None)
        return Encoded(values=self.codec._unpack(p, self.codec.cfg.format, raw), nbytes=len(data), payload=data)


def encode_row(lrn: Learner, reps: int = 3) -> dict:
    """MB of fp32 per CPU-second of a snapshot's Δ + error feedback + encode (+ the decode the sender keeps),
    fused against step by step, and ``np.copy`` of the same bytes, alternating, on this thread."""
    flat = {n: np.asarray(v) for n, v in tree.flatten(lrn.state.params).items()}
    cfg = lrn.core.cfg
    cores = {name: LearnerCore(cfg, 0, lrn.core.fragments, flat, codec) for name, codec in
             (("fused", lrn.core.codec), ("step_by_step", StepByStep(lrn.core.codec)))}
    cpu = {"fused": 0.0, "step_by_step": 0.0, "np_copy": 0.0}
    nbytes, rng = 0, np.random.default_rng(0)
    for r in range(reps):
        for p, names in enumerate(lrn.core.fragments):
            theta = {n: flat[n] + np.float32(1e-3) * rng.standard_normal(flat[n].shape, np.float32) for n in names}
            payloads = []
            for name, core in cores.items():
                c0 = time.thread_time()
                [send] = core.snapshot(0.0, p, (r + 1) * cfg.sync_every, theta)
                cpu[name] += time.thread_time() - c0
                payloads.append(send.msg.payload)
            assert payloads[0] == payloads[1], "fused and step-by-step encodes differ"
            c0 = time.thread_time()
            copies = [np.copy(theta[n]) for n in names]
            cpu["np_copy"] += time.thread_time() - c0
            del copies
            nbytes += sum(theta[n].nbytes for n in names)
    mb = {k: nbytes / 1e6 / v for k, v in cpu.items()}
    return {"fp32_mb": nbytes / 1e6, "mb_per_cpu_s": mb, "cpu_s": cpu,
            "speedup": mb["fused"] / mb["step_by_step"], "fused_vs_np_copy": mb["fused"] / mb["np_copy"]}


VARIANTS = {"off": (True, 0, None), "on_training_thread": (False, 0, None), "on_worker": (False, 2, None),
            "on_worker_nice0": (False, 2, 0)}  # name: (off, sync_in_flight, the worker's nice if not NICE)


def sync_row(preset: str, sync_every: int, batch_size: int, bits: int, fragments: int, tau: int, steps: int,
             warmup: int, block_steps: int = 16, variants: list[str] | None = None, encode_reps: int = 0) -> dict:
    variants = {v: VARIANTS[v] for v in ["off"] + [v for v in (variants or list(VARIANTS)) if v != "off"]}
    built = {}
    load0 = os.getloadavg()[0]
    for name, (off, inflight, nice) in variants.items():
        stages = Stages()
        lrn = local_learner(spec_for(preset, OFF_H if off else sync_every, inflight, batch_size, bits, fragments,
                                     tau), stages)
        if nice is not None:
            lrn.sync.close()
            lrn.sync = SyncWorker(lrn.core, lambda msg, lrn=lrn: lrn.net.upload(msg), inflight,
                                  on_sent=lrn.count_upload, nice=nice)
        for _ in range(warmup):
            lrn.train_step()
        built[name] = (lrn, stages, [], [])
        stages.reset()
        if lrn.sync is not None:
            lrn.sync.busy_s = lrn.sync.stall_s = 0.0
    block = sync_every * max(1, -(-block_steps // sync_every))  # whole rounds, at least block_steps
    blocks = max(2, -(-steps // block))
    for _ in range(blocks):
        for name, (lrn, stages, times, cpu) in built.items():
            for _ in range(block):
                t0, c0 = time.perf_counter(), time.process_time()  # the process: worker and XLA threads too
                lrn.train_step()
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            if lrn.sync is not None:  # its last job must not run during the next variant's steps
                lrn.sync.flush()
    out = {"preset": preset, "sync_every": sync_every, "num_fragments": fragments, "tau": tau, "bits": bits,
           "batch_size": batch_size, "steps_per_variant": blocks * block, "block_steps": block, "blocks": blocks,
           "warmup_steps": warmup, "worker_nice": NICE, "load_avg_1min_at_start": load0, "variants": {}}
    if encode_reps:
        out["encode"] = encode_row(built["off"][0], encode_reps)
    for name, (lrn, stages, times, cpu) in built.items():
        t = np.array(times)
        out["variants"][name] = {
            "step_ms_median": 1e3 * float(np.median(t)), "step_ms_p90": 1e3 * float(np.percentile(t, 90)),
            "step_ms_mean": 1e3 * float(t.mean()), "cpu_ms_per_step": 1e3 * float(np.mean(cpu)),
            "uploads": lrn.uploads, "payload_bytes": lrn.payload_bytes,
            "stages": stages.report(len(t)),
            # The sync work left on the training thread (all but the metadata every variant sends), per step.
            "sync_training_wall_ms_per_step": sum(v["wall_ms_per_step"] for k, v in stages.report(len(t)).items()
                                                  if k.startswith("training/") and k != "training/SendMetadata"),
            "sync_training_cpu_ms_per_step": sum(v["cpu_ms_per_step"] for k, v in stages.report(len(t)).items()
                                                 if k.startswith("training/") and k != "training/SendMetadata"),
            "worker_cpu_ms_per_step": 1e3 * lrn.sync.busy_s / len(t) if lrn.sync else 0.0,
            "stall_ms_per_step": 1e3 * lrn.sync.stall_s / len(t) if lrn.sync else 0.0,
        }
        close(lrn)
    off = out["variants"]["off"]
    off_blocks = np.median(np.reshape(built["off"][2], (blocks, block)), axis=1)
    for name in [v for v in variants if v != "off"]:
        v = out["variants"][name]
        ratios = np.median(np.reshape(built[name][2], (blocks, block)), axis=1) / off_blocks
        v["ratio_blocks"] = [float(x) for x in ratios]  # each block's median step on / off's in the same pass
        v["ratio_block_median"], v["ratio_block_min"], v["ratio_block_max"] = (
            float(np.median(ratios)), float(ratios.min()), float(ratios.max()))
        v["ratio_median"] = v["step_ms_median"] / off["step_ms_median"]
        v["ratio_mean"] = v["step_ms_mean"] / off["step_ms_mean"]
        v["ratio_p90"] = v["step_ms_p90"] / off["step_ms_p90"]
        v["ratio_cpu"] = v["cpu_ms_per_step"] / off["cpu_ms_per_step"]
        # Off's median step plus the sync stages timed on the training thread: the ratio a quiet host would see
        # if the stages' wall time is all they add (the worker's CPU aside, which competes for the same cores).
        v["ratio_from_stages"] = 1 + v["sync_training_wall_ms_per_step"] / off["step_ms_median"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=list(model.PRESETS))
    ap.add_argument("--sync-every", type=int, nargs="+", default=[8, 100])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--tau", type=int, default=2)
    ap.add_argument("--steps", type=int, default=96, help="timed steps per variant (at least: whole rounds, "
                    "in alternating blocks of at least --block-steps, two blocks or more)")
    ap.add_argument("--block-steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=5, help="steps per variant before timing (the compile included)")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                    help="on-variants to run beside off")
    ap.add_argument("--encode-reps", type=int, default=3, help="passes over every fragment for the encode row "
                    "(first row only; 0: none)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_throughput_sync.json"))
    args = ap.parse_args(argv)
    doc = {"devices": [str(d) for d in jax.local_devices()], "cpu_count": os.cpu_count(),
           "machine": platform.machine(), "jax": jax.__version__, "rows": []}
    for i, H in enumerate(args.sync_every):
        row = sync_row(args.preset, H, args.batch_size, args.bits, args.fragments, args.tau, args.steps, args.warmup,
                       args.block_steps, args.variants, args.encode_reps if i == 0 else 0)
        row["load_avg_1min_at_end"] = os.getloadavg()[0]
        doc["rows"].append(row)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")  # each row as it finishes
        v = row["variants"]
        if "encode" in row:
            e = row["encode"]
            print(f"{args.preset} encode, MB fp32 per CPU-s: fused {e['mb_per_cpu_s']['fused']:.0f}, step by step "
                  f"{e['mb_per_cpu_s']['step_by_step']:.0f} ({e['speedup']:.2f}x), np.copy "
                  f"{e['mb_per_cpu_s']['np_copy']:.0f}", flush=True)
        print(f"{args.preset} H={H} int{args.bits} (load {row['load_avg_1min_at_start']:.1f} -> "
              f"{row['load_avg_1min_at_end']:.1f}): off {v['off']['step_ms_median']:.1f} ms/step, "
              f"{v['off']['cpu_ms_per_step']:.1f} CPU-ms/step; on/off per-block median [min, max], CPU, stages:\n  " +
              "\n  ".join(f"{k} {v[k]['ratio_block_median']:.3f}x [{v[k]['ratio_block_min']:.3f}, "
                          f"{v[k]['ratio_block_max']:.3f}] CPU {v[k]['ratio_cpu']:.3f}x, training thread "
                          f"{v[k]['sync_training_wall_ms_per_step']:.2f} ms/step ({v[k]['ratio_from_stages']:.3f}x), "
                          f"worker {v[k]['worker_cpu_ms_per_step']:.2f} CPU-ms/step, stall "
                          f"{v[k]['stall_ms_per_step']:.2f} ms/step" for k in v if k != "off"), flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
