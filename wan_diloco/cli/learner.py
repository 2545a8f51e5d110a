"""`wan-diloco learner --config F --id N --syncer HOST:PORT [--resume]`: one learner process of a run."""
from __future__ import annotations

import argparse
import logging

from wan_diloco.config import require
from wan_diloco import spec as spec_lib


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="TOML", help="run config (default: the embedded local default)")
    p.add_argument("--id", type=int, required=True, help="learner index, 0..run.learners-1")
    p.add_argument("--syncer", required=True, metavar="HOST:PORT", help="the syncer's gRPC address")
    p.add_argument("--resume", action="store_true",
                   help="take up this learner's part of the snapshot the syncer resumed from (checkpoint.dir)")
    p.add_argument("--devices", metavar="I,J", help="this learner's devices: indices into jax.local_devices() "
                                                    "(run.devices; default all, e.g. every GPU the host shows it)")
    from wan_diloco.cli.syncer import add_view_arguments

    add_view_arguments(p)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format=f"learner-{args.id} %(levelname)s %(name)s: %(message)s")
    cfg = spec_lib.load(args.config)
    if args.devices:
        ids = args.devices.split(",")
        require(all(i.strip().isdigit() for i in ids), "devices", f"must be indices like 0,1, got {args.devices!r}")
        cfg = cfg.with_changes(run={"devices": [int(i) for i in ids]})
    require(0 <= args.id < cfg.run.learners, "id", f"must be in 0..{cfg.run.learners - 1}, got {args.id}")
    target = args.syncer.removeprefix("http://").removeprefix("https://")
    from wan_diloco.assemble import preflight
    from wan_diloco.runtime.learner import run_learner

    preflight(cfg, learner=args.id)  # ConfigError: one line from cli.main, exit code 2, before connecting

    from wan_diloco.cli import live

    if not live.wanted(args.table):
        return run_learner(cfg, args.id, target, cfg.token(), resume=args.resume)
    name = f"learner-{args.id}"
    with live.ProcessView(cfg, name, live.events_path(cfg, name, args.events)):
        return run_learner(cfg, args.id, target, cfg.token(), resume=args.resume)
