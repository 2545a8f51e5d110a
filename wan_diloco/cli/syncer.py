"""`wan-diloco syncer --config F [--resume]`: serve one run's syncer until its final sync is done (or SIGTERM).

SIGUSR1 cuts a snapshot now (besides every ``checkpoint.every_merges`` merges).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time

from wan_diloco import spec as spec_lib
from wan_diloco.cli.args import add_tls_arguments, host_tls
from wan_diloco.runtime.events import emit
from wan_diloco.transport import StatusServer, TransportMetrics, TransportServer, run as run_loop

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="TOML", help="run config (default: the embedded local default)")
    p.add_argument("--port", type=int, default=None, help="override run.port (0: any free port)")
    p.add_argument("--resume", action="store_true",
                   help="resume from the newest complete snapshot in checkpoint.dir; running learners rejoin")
    p.add_argument("--shard", type=int, default=0, metavar="S",
                   help="which of the syncer.shards shards this process is (0..shards-1); it merges only the "
                        "fragments shards.owners gives it")
    p.add_argument("--shard-status", metavar="URL,...",
                   help="shard 0: the other shards' status URLs (shards 1.. in order); its /status then shows "
                        "the whole run")
    add_tls_arguments(p)
    add_view_arguments(p)


def add_view_arguments(p: argparse.ArgumentParser) -> None:
    from wan_diloco.cli import live

    live.add_view_arguments(p)


async def serve(cfg: spec_lib.RunSpec, token: str, port: int | None = None, resume: bool = False,
                view=None, shard: int = 0, shard_status: list[str] | None = None, config: str | None = None,
                tls_origin: dict[str, str] | None = None) -> int:
    """Run the syncer; returns 0 after a completed final sync, 1 when its final parameters could not
    be written, 143 when stopped by a signal. ``view``
    (cli.live.ProcessView) is shown the learners as the syncer sees them at each report. Once it listens
    it says how learners join (``cli.join``; ``config``: the run file's path as given, ``tls_origin``:
    where each TLS file came from, ``host_tls.resolve``)."""
    from wan_diloco.cli import join
    from wan_diloco.runtime.syncer import SyncerService

    metrics = TransportMetrics()
    service = SyncerService(cfg, metrics, resume=resume, shard=shard)
    if not cfg.checkpoint.dir:
        log.warning("checkpoint.dir is empty: no snapshots and no final parameters will be written")
    host = cfg.run.host
    server = TransportServer(service, token, cfg.transport, f"{host}:{cfg.run.port if port is None else port}",
                             metrics, name="syncer", per_sender_tokens=cfg.transport.per_learner_tokens)
    service.peer_links = server.peer_links  # one dict: the server records, /status shows
    server.on_warning = lambda what: emit({"event": "warning", "role": "syncer", "what": what})  # e.g. slots busy
    # The run's token guards /status and /metrics; HTTPS with the gRPC port's certificate when it has one.
    status_fn = service.status
    if shard_status:
        from wan_diloco.runtime.shard_status import ShardStatus

        others = ShardStatus(shard_status, token, cfg.transport.tls)
        status_fn = lambda: others.status(service.status())  # noqa: E731
    # Shards 1.. of a run with a fixed status port take free ones: shard 0's page shows them all.
    status_port = 0 if shard and cfg.run.status_port > 0 else cfg.run.status_port
    status = (StatusServer(status_fn, metrics, host, status_port, token=token, tls=cfg.transport.tls)
              if cfg.run.status_port >= 0 else None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    def on_stop() -> None:
        service.stopping = True  # from now on learners going away is the shutdown, not a failure
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_stop)
    def on_snapshot_request() -> None:
        # Said on stdout: a launcher stopping the run waits for this snapshot, or not at all when there is none.
        emit({"event": "snapshot_requested", "role": "syncer", "snapshot": service.snapshot_now()})

    loop.add_signal_handler(signal.SIGUSR1, on_snapshot_request)
    await server.start()
    try:
        status_port = await status.start() if status is not None else None
        service.refresh_gauges()
        said = join.announcement(cfg, config, server.port, status_port, tls_origin or {})
        emit({"event": "listening", "role": "syncer", "port": server.port, "status_port": status_port,
              "fragments": len(service.layout.fragments), "params": sum(service.layout.nbytes) // 4,
              "run_id": service.core.run_id, "epoch": service.core.epoch, "resumed": service.resumed,
              "shard": shard, "owned": list(service.core.owned), **said})
        if view is not None:  # a person reads the terminal (or a log): the JSON event has the same when piped
            for line in join.lines(cfg, config, said, shard):
                view.console.print(line, highlight=False, markup=False, soft_wrap=True)
        last_report = 0.0
        while not service.finished.is_set() and not stop.is_set():
            try:
                await asyncio.wait_for(asyncio.shield(service.finished.wait()), cfg.run.tick_s)
            except asyncio.TimeoutError:
                pass
            service.tick()
            service.refresh_gauges()
            if time.monotonic() - last_report >= cfg.run.report_every_s:
                last_report = time.monotonic()
                emit({"event": "progress", "role": "syncer", "versions": list(service.core.version),
                      "alive": service.core.connected(), **service.summary()})  # never a learner not yet seen
                if view is not None:
                    view.watch_syncer(service.status(), service.progress)
        if service.failed is not None:  # the run could not start: one line, and not a success
            print(f"wan-diloco syncer: {service.failed}", file=sys.stderr)
            return 1
        if service.final_report is not None:
            emit({**service.final_report, **service.summary()})
        if service.params_error is not None:
            # The run's result is lost: not a success, whatever else went well (one line, exit 1).
            emit({"event": "error", "role": "syncer", "error": f"final parameters not written: {service.params_error}"})
            print(f"wan-diloco syncer: final parameters not written: {service.params_error}", file=sys.stderr,
                  flush=True)
            return 1
        # Stopped while the final parameters were still being written (or retried): not a success.
        return 0 if service.final_saved.is_set() else 143
    finally:
        service.stopping = True
        if status is not None:
            await status.stop()
        # Final fragments still streaming to a learner on a slow link get time to arrive.
        await service.final_streams_done(cfg.syncer.final_timeout_s)
        await server.stop(2.0 if service.final_done.is_set() else 0.5)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="syncer %(levelname)s %(name)s: %(message)s")
    from wan_diloco.runtime.syncer import ForkRefused, ResumeError
    from wan_diloco.transport import ListenError
    from wan_diloco.transport.security import check_port

    if args.port is not None:
        # Before the config and the model: a mistyped port should not cost the seconds of JAX start-up.
        check_port(args.port, "--port")  # ConfigError: one line from cli.main, exit code 2
    cfg, tls_origin = host_tls(args, spec_lib.load(args.config), "syncer")
    from wan_diloco.transport.security import require_bound_identity

    # Off loopback a learner's id must be bound to its credential unless the operator says otherwise.
    require_bound_identity(f"{cfg.run.host}:{cfg.run.port if args.port is None else args.port}", cfg.transport)
    from wan_diloco.assemble import preflight

    from wan_diloco.config import require

    require(0 <= args.shard < cfg.syncer.shards, "--shard",
            f"must be in 0..{cfg.syncer.shards - 1} (syncer.shards = {cfg.syncer.shards}), got {args.shard}")
    require(cfg.syncer.shards == 1 or bool(cfg.run.run_id), "run.run_id",
            "syncer.shards > 1 needs one run id set in the config: every shard must serve the same run")
    others = [u.strip() for u in args.shard_status.split(",")] if args.shard_status else []
    require(not others or (args.shard == 0 and len(others) == cfg.syncer.shards - 1), "--shard-status",
            f"shard 0 takes the status URLs of shards 1..{cfg.syncer.shards - 1}, got {len(others)} for shard "
            f"{args.shard}")
    require(all(u.startswith(("http://", "https://")) for u in others), "--shard-status",
            f"expected http(s)://HOST:PORT URLs, got {args.shard_status!r}")
    if cfg.checkpoint.dir and not args.resume:  # before the model is built: a refusal costs no start-up
        from pathlib import Path

        from wan_diloco.checkpoint import SnapshotStore

        root = Path(cfg.checkpoint.dir) / f"shard-{args.shard}" if args.shard else Path(cfg.checkpoint.dir)
        why = SnapshotStore(root).fork_refusal()
        if why is not None:
            print(f"wan-diloco syncer: refusing to start: {why}", file=sys.stderr)
            return 2
    preflight(cfg, data=False)  # the syncer reads no data: its host need not have the corpus
    from wan_diloco.cli import live

    try:
        name = f"syncer-{args.shard}" if cfg.syncer.shards > 1 else "syncer"
        with live.open_view(cfg, name, args) as view:
            return run_loop(serve(cfg, cfg.token(), args.port, args.resume, view, shard=args.shard,
                                  shard_status=others, config=args.config, tls_origin=tls_origin))
    except ResumeError as e:
        print(f"wan-diloco syncer: cannot resume: {e}", file=sys.stderr)
        return 2
    except ForkRefused as e:
        print(f"wan-diloco syncer: refusing to start: {e}", file=sys.stderr)
        return 2
    except ListenError as e:
        # A port in use (say a syncer still running) is the operator's to fix, not a crash:
        # one line naming the address and the reason, no traceback; 2 like other usage errors.
        print(f"wan-diloco syncer: {e}", file=sys.stderr)
        return 2
