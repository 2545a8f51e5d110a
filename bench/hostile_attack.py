"""The hostile peer (#23) as a process of its own: sends ``bench.hostile_cases`` to a running syncer.

    python -m bench.hostile_attack --config RUN/config.toml --target HOST:PORT --status URL \
        --messages N --rate R --rows ROWS.jsonl     # tokens in the environment (see main)

Every call's outcome is one JSON line in ``--rows`` as soon as it is known (a crash loses nothing):
the case (``Case.row``) plus ``code`` (the gRPC status name, ``OK`` when taken), ``detail`` and
``verdict``: ``refused`` / ``taken`` as expected, or ``taken_past_limit`` / ``impersonation_taken``
(a refusal that should have happened and did not). The live state the mutations aim at (versions,
epoch, global step) is read from the syncer's /status once a second. Raw gRPC calls (not
``SyncerClient``): the attacker must be able to send what the client would refuse to.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from bench import hostile_cases as hc  # noqa: E402
from wan_diloco import spec as spec_lib  # noqa: E402
from wan_diloco.transport.security import bearer_metadata  # noqa: E402
from wan_diloco.transport.server import SERVICE, sender_metadata  # noqa: E402

OWN_TOKEN_ENV, RUN_TOKEN_ENV = "HOSTILE_OWN_TOKEN", "HOSTILE_RUN_TOKEN"
WRONG_TOKEN = "not-the-token-0123456789"
CALL_TIMEOUT_S = 10.0
SLOW_HOLD_S = 5.0  # a slow stream trickles this long, then gives up


def payloads(spec) -> dict[str, bytes]:
    """Fragment-0 payloads through the run's own codec: zeros (a harmless Δ), a huge Δ, garbage."""
    from wan_diloco.assemble import Assembly

    asm = Assembly(spec)
    layout, codec = asm.layout, asm.codec
    names = layout.fragments[0]
    zero = codec.encode({n: np.zeros(layout.shapes[n], np.float32) for n in names})
    huge = codec.encode({n: np.full(layout.shapes[n], 1e6, np.float32) for n in names})
    rng = np.random.default_rng(0)
    return {"zero": bytes(zero), "fragment_P": bytes(zero), "huge": bytes(huge), "truncated": bytes(zero)[: len(zero) // 2],
            "garbage": rng.integers(0, 256, len(zero), dtype=np.uint8).tobytes(), "donation0": b""}


def expected(case: hc.Case, per_learner: bool) -> str:
    """With a shared token the run's token is learner-2's credential too."""
    if case.cred == "run" and not per_learner:
        return "refuse" if case.impersonates or case.limit == "past" else "either"
    return case.expect


def verdict(case: hc.Case, expect: str, code: str, detail: str = "") -> str:
    """``refused`` / ``taken``, or what should have been refused and was not. A slow upload that the
    server held until the attacker itself gave up (``ended mid-message``) held a slot: it was taken."""
    if case.rpc == "SlowUpload" and "ended mid-message" in detail:
        code = "OK"
    if code != "OK":
        return "refused"
    if expect == "refuse":
        return "impersonation_taken" if case.impersonates else "taken_past_limit"
    return "taken"


class Attacker:
    def __init__(self, args, spec):
        self.args, self.spec = args, spec
        self.own, self.run = os.environ[OWN_TOKEN_ENV], os.environ[RUN_TOKEN_ENV]
        self.live: dict = {"versions": [0], "epoch": 1, "global_step": 0}
        self.rows = open(args.rows, "a", buffering=1)
        self.channels: list[grpc.aio.Channel] = []
        self.slow: list[asyncio.Task] = []

    def metadata(self, case: hc.Case) -> tuple:
        cred = {"own": bearer_metadata(self.own), "run": bearer_metadata(self.run), "none": (),
                "wrong": bearer_metadata(WRONG_TOKEN)}[case.cred]
        return cred + (sender_metadata(case.header_sender),)

    async def refresh_live(self) -> None:
        """The syncer's versions, epoch and global step, once a second (what mutations aim at)."""
        while True:
            try:
                req = urllib.request.Request(self.args.status + "/status",
                                             headers={"Authorization": f"Bearer {self.run}"})
                doc = await asyncio.to_thread(lambda: json.loads(urllib.request.urlopen(req, timeout=5).read()))
                self.live.update(versions=doc.get("versions") or [0], epoch=doc.get("epoch") or 1,
                                 global_step=doc.get("global_step") or 0)
            except Exception:  # noqa: BLE001 - the syncer may be busy or gone; aim at the last known state
                pass
            await asyncio.sleep(1.0)

    async def call(self, case: hc.Case, data) -> tuple[str, str]:
        ch = self.channels[case.i % len(self.channels)]
        md = self.metadata(case)
        try:
            if case.rpc == "Metadata":
                await ch.unary_unary(f"/{SERVICE}/Metadata")(data, timeout=CALL_TIMEOUT_S, metadata=md)
            elif case.rpc == "Upload":
                await ch.stream_unary(f"/{SERVICE}/Upload")(iter([data]), timeout=CALL_TIMEOUT_S, metadata=md)
            elif case.rpc == "SlowUpload":
                async def trickle():
                    yield data
                    for _ in range(int(SLOW_HOLD_S)):
                        await asyncio.sleep(1.0)
                        yield b"\0"
                await ch.stream_unary(f"/{SERVICE}/Upload")(trickle(), timeout=SLOW_HOLD_S + CALL_TIMEOUT_S,
                                                            metadata=md)
            else:  # Subscribe, Bulk, Probe: server streams; a Subscribe taken is read to its first frame
                call = ch.unary_stream(f"/{SERVICE}/{case.rpc}")(data, timeout=CALL_TIMEOUT_S, metadata=md)
                try:
                    async for _ in call:
                        if case.rpc == "Subscribe":
                            break
                finally:
                    call.cancel()
            return "OK", ""
        except grpc.aio.AioRpcError as e:
            return e.code().name, (e.details() or "")[:160]

    async def one(self, case: hc.Case) -> None:
        try:
            data = case.build(self.live)
        except Exception as e:  # noqa: BLE001 - a generator bug must show, not stop the run
            self.write(case, "BUILD_ERROR", f"{type(e).__name__}: {e}"[:160])
            return
        code, detail = await self.call(case, data)
        self.write(case, code, detail)

    def write(self, case: hc.Case, code: str, detail: str) -> None:
        expect = expected(case, self.args.per_learner)
        self.rows.write(json.dumps({**case.row(), "expect": expect, "code": code, "detail": detail,
                                    "verdict": verdict(case, expect, code, detail), "t": time.time()}) + "\n")

    async def main(self) -> int:
        self.live["payloads"] = payloads(self.spec)
        # Ready (JAX imported, payloads built: tens of seconds on a loaded machine); the driver starts the
        # learners now and says go once they train, so that every message lands in the training.
        ready, go = Path(f"{self.args.rows}.ready"), Path(f"{self.args.rows}.go")
        ready.touch()
        while not go.exists():
            await asyncio.sleep(0.05)
        ctx = hc.Context(learners=self.spec.run.learners, steps=self.spec.run.steps,
                         fragments=self.spec.learner.num_fragments)
        # Several connections, as a real peer could open: one would serialize everything on one HTTP/2 link.
        self.channels = [grpc.aio.insecure_channel(self.args.target) for _ in range(4)]
        live_task = asyncio.create_task(self.refresh_live())
        await asyncio.sleep(0.2)
        inflight = asyncio.Semaphore(self.args.concurrency)
        pending: set[asyncio.Task] = set()
        t0, period = time.monotonic(), 1.0 / self.args.rate
        for k, case in enumerate(hc.generate(ctx, self.args.messages, self.args.seed)):
            await asyncio.sleep(max(0.0, t0 + k * period - time.monotonic()))
            if case.rpc == "SlowUpload":  # they hold a slot for seconds: in the background, not in the window
                self.slow.append(asyncio.create_task(self.one(case)))
                continue
            await inflight.acquire()
            task = asyncio.create_task(self.one(case))
            task.add_done_callback(lambda _t: inflight.release())
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending, *self.slow)
        live_task.cancel()
        await asyncio.gather(*(c.close() for c in self.channels), return_exceptions=True)
        self.rows.close()
        print(json.dumps({"event": "attack_done", "messages": self.args.messages,
                          "wall_s": round(time.monotonic() - t0, 2)}), flush=True)
        return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--target", required=True, help="the syncer's HOST:PORT")
    ap.add_argument("--status", required=True, help="the syncer's status URL (http://HOST:PORT)")
    ap.add_argument("--messages", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=200.0, help="messages a second")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", type=Path, required=True)
    ap.add_argument("--per-learner", action="store_true", help="the run binds ids to per-learner tokens")
    args = ap.parse_args(argv)
    random.seed(args.seed)
    spec = spec_lib.load(args.config)
    return asyncio.run(Attacker(args, spec).main())


if __name__ == "__main__":
    sys.exit(main())
