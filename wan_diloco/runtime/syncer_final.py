"""The end of a run at the syncer: serve ``final/P`` and write the final parameters.

``FinalWrite`` is mixed into ``runtime.syncer.SyncerService``: once its core
merged the final uploads (``core.objects.FinalSync`` says when), the final
global parameters go to ``CHECKPOINT_DIR/params.safetensors`` (a shard writes
its fragments' tensors to ``params.shard-S.safetensors``; `launch` joins them),
with retries while the disk is full, and the syncer ends once every learner
has its final fragments (``FinalSync.finished``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

from wan_diloco.assemble import fragment_digest
from wan_diloco.checkpoint import CheckpointError, save_params
from wan_diloco.core import ProtocolError
from wan_diloco.runtime import serde

log = logging.getLogger("wan_diloco.runtime.syncer")


class FinalWrite:
    """Mixed into ``SyncerService``: the final parameters, the final fragments' streams, the end."""

    def _init_final(self) -> None:
        self.final_done = asyncio.Event()  # final/P is served from now on
        self.final_saved = asyncio.Event()  # the final parameters are written (or given up on)
        self.finished = asyncio.Event()  # the syncer may end
        self.final_report: dict | None = None
        self.params_path: Path | None = None
        self.final_streams = 0  # final fragments being streamed right now

    def _final_merged(self) -> None:
        """The core merged the final uploads: serve ``final/P`` and write the parameters."""
        for h in self._timers.values():
            h.cancel()
        self._timers.clear()
        self.final_done.set()
        digests = [fragment_digest(self.core.theta[p], self.layout.fragments[p]) if self.core.owns(p) else None
                   for p in range(self.P)]
        if self.store is None:
            self._report_final(digests)
            return
        self.params_path = (self.store.params_path if self.S == 1 else
                            Path(self.cfg.checkpoint.dir) / f"params.shard-{self.shard}.safetensors")
        info = {"run_id": self.core.run_id, "epoch": self.core.epoch, "versions": list(self.core.version),
                "global_step": self.core.global_step, "digests": digests, "preset": self.cfg.preset,
                "shard": self.shard, "shards": self.S, "owned": list(self.core.owned),
                "model": dataclasses.asdict(self.cfg.model)}
        asyncio.get_running_loop().create_task(self._save_final(self.core.global_params(), info, digests))

    async def _save_final(self, params, info: dict, digests: list) -> None:
        """Write the final parameters; a failure (a full disk) is tried again with backoff for
        ``checkpoint.final_write_retry_s``, then the run has failed (``params_error``). The learners
        fetch their final fragments meanwhile; the syncer ends only after this."""
        retry_s = self.cfg.checkpoint.final_write_retry_s
        deadline, wait_s, tries = self.now() + retry_s, 1.0, 0
        while True:
            tries += 1
            try:
                await asyncio.to_thread(save_params, self.params_path, params, info)
                self.write_error = None
                break
            except (OSError, CheckpointError) as e:
                self._write_failed(f"could not write the final parameters to {self.params_path}", e)
                left = deadline - self.now()
                if left <= 0:
                    self.params_error = (f"{self.write_error} (gave up after {tries} tries over {retry_s:g} s, "
                                         f"checkpoint.final_write_retry_s)")
                    self.params_path = None
                    break
                log.error("trying the final parameters again in %.0f s (for %.0f s more): free some space in %s",
                          min(wait_s, left), left, self.params_path.parent)
                await asyncio.sleep(min(wait_s, left))
                wait_s = min(2 * wait_s, 15.0)
        self._report_final(digests)

    def _report_final(self, digests: list) -> None:
        self.final_report = {
            "event": "final", "role": "syncer", "versions": list(self.core.version), "digests": digests,
            "final_learners": sorted(self.core.final_participants()),
            "params_path": str(self.params_path) if self.params_path else None,
            "params_error": self.params_error,
            # uploads' bytes that came over direct stripes (transport.direct_port), not through gRPC
            "direct_bytes_in": self.metrics.total(self.metrics.bytes_in, "Direct"),
            **self.summary(),
        }
        self.final_saved.set()
        asyncio.get_running_loop().call_later(self.cfg.syncer.final_timeout_s, self.finished.set)
        if self.final.on_saved():
            self.finished.set()

    async def _final_pieces(self, sender: str, p: int, data: bytes):
        self.final_streams += 1
        try:
            yield data
        finally:
            self.final_streams -= 1
        # Only now has the transport taken the last byte (on a slow link, long after bulk() returned):
        # the syncer may end once every learner's final fragments are out, not when they were asked for.
        try:
            if self.final.on_fetched(serde.learner_id(sender, self.M), p):
                self.finished.set()
        except ProtocolError:
            pass

    async def final_streams_done(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until no final fragment is still being streamed."""
        deadline = time.monotonic() + timeout_s
        while self.final_streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
