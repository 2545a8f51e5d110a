"""A learner's sync worker: what a snapshot costs, done beside the training thread instead of on it.

The training thread counts a snapshot (``LearnerCore.begin_snapshot``), starts the device→host copy of
the fragment (``copy_to_host_async``: it returns at once, the step after it is dispatched behind it) and
hands the arrays here. This thread waits for the copy, computes Δ, error feedback and the encode
(``LearnerCore.encode_snapshot``) and hands the upload on (``send``: framing and the network thread).

Jobs run one at a time in the order given, so each fragment's error-feedback residual is read and
written in snapshot order: the bits sent are the synchronous path's. At most ``max_in_flight`` jobs are
held (each keeps one fragment's parameters, Δ and payload alive); past it ``submit`` waits, and the
time it waited is ``stall_s``. An error in a job is raised on the training thread, by the next
``submit``, ``check`` or ``flush``.

What the worker hands back crosses threads in one place: a finished upload's (fragment, payload bytes)
goes on a list under the worker's lock, and ``check`` (training thread) takes the list and calls
``on_sent`` for each, so the learner's counters are written on its own thread only, in upload order.

The thread runs at nice ``NICE`` (Linux: a thread's own priority): where it and the training step's
XLA threads want the same cores, the step gets them and the encode takes the gaps between, instead of
taking half of each step on a 2-core host. Where cores are idle (an accelerator's host) it runs at once.
"""
from __future__ import annotations

import collections
import os
import queue
import threading
import time
from typing import Callable

import jax
import numpy as np

from wan_diloco.core.learner import LearnerCore, PendingSnapshot
from wan_diloco.core.messages import FragmentUpload

NICE = 19  # the worker's niceness (the training thread's is the process's, usually 0)


class SyncWorker:
    def __init__(self, core: LearnerCore, send: Callable[[FragmentUpload], object], max_in_flight: int,
                 name: str = "learner-sync", on_sent: Callable[[int, int], object] = lambda fragment, nbytes: None,
                 nice: int = NICE):
        """``send``: the worker hands each upload on (framing, the network thread); ``on_sent(fragment,
        nbytes)``: called on the training thread for each upload sent, by ``check``."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.core, self.send, self.on_sent, self.nice = core, send, on_sent, nice
        self._sent: list[tuple[int, int]] = []  # (fragment, payload bytes) sent, not yet counted; under _done
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._jobs: queue.Queue = queue.Queue()
        self._pending = collections.Counter()  # fragment -> jobs submitted and not finished
        self._done = threading.Condition()
        self._error: BaseException | None = None
        self.stall_s = 0.0  # training-thread time spent waiting for a free slot
        self.stalls = 0
        self.busy_s = 0.0  # this thread's CPU-seconds in jobs
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    # ---- training thread --------------------------------------------------------------

    def submit(self, pending: PendingSnapshot, arrays: dict[str, jax.Array]) -> None:
        """Finish ``pending`` from these arrays (θ_p at the snapshot) off this thread."""
        self.check()
        for a in arrays.values():
            if isinstance(a, jax.Array):
                a.copy_to_host_async()
        if not self._slots.acquire(blocking=False):
            t0 = time.monotonic()
            self._slots.acquire()
            self.stall_s += time.monotonic() - t0
            self.stalls += 1
        with self._done:
            self._pending[pending.upload.fragment] += 1
        self._jobs.put((pending, arrays))

    def check(self) -> None:
        """Count the uploads sent since (``on_sent``), then raise the error of a failed job, if any (once)."""
        with self._done:
            sent, self._sent = self._sent, []
            err, self._error = self._error, None
        for fragment, nbytes in sent:
            self.on_sent(fragment, nbytes)
        if err is not None:
            raise err

    def flush(self, fragment: int | None = None) -> None:
        """Wait until every job (of ``fragment`` only, if given) is finished; then ``check``."""
        with self._done:
            self._done.wait_for(lambda: not (self._pending[fragment] if fragment is not None
                                             else sum(self._pending.values())))
        self.check()

    def close(self) -> None:
        """Finish the jobs given, count them, then end the thread (errors are dropped: the learner is ending)."""
        self._jobs.put(None)
        self._thread.join()
        with self._done:
            sent, self._sent, self._error = self._sent, [], None
        for fragment, nbytes in sent:
            self.on_sent(fragment, nbytes)

    # ---- worker thread ----------------------------------------------------------------

    def _main(self) -> None:
        if self.nice and hasattr(os, "setpriority"):
            try:  # on Linux PRIO_PROCESS with a thread id sets that thread's nice only
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except OSError:
                pass  # not permitted here: the worker runs at the training thread's priority
        while (job := self._jobs.get()) is not None:
            pending, arrays = job
            theta, t0, sent, error = None, time.thread_time(), None, None
            try:
                theta = {n: np.asarray(a) for n, a in arrays.items()}
                upload = self.core.encode_snapshot(pending, theta)
                self.send(upload)
                sent = (upload.fragment, upload.nbytes)
            except BaseException as e:  # raised again on the training thread, which decides
                error = e
            finally:
                job = arrays = theta = upload = None  # a free slot means this fragment's memory is free too
                self._slots.release()
                with self._done:
                    self.busy_s += time.thread_time() - t0
                    if sent is not None:
                        self._sent.append(sent)
                    self._error = self._error or error
                    self._pending[pending.upload.fragment] -= 1
                    self._done.notify_all()
