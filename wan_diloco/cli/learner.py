"""`wan-diloco learner --config F --id N --syncer HOST:PORT [--resume]`: one learner process of a run.

A learner of several processes (``learner.hosts`` = P, one per host) is started as P of these, each with
``--process-id I --num-processes P --coordinator HOST:PORT`` (process 0's address, the same for all).
"""
from __future__ import annotations

import argparse
import logging

from wan_diloco.config import ConfigError, require
from wan_diloco import spec as spec_lib


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="TOML", help="run config (default: the embedded local default)")
    p.add_argument("--id", type=int, required=True, help="learner index, 0..run.learners-1")
    p.add_argument("--syncer", required=True, metavar="HOST:PORT[,...]",
                   help="the syncer's gRPC address; with syncer.shards = S, every shard's, in shard order")
    p.add_argument("--resume", action="store_true",
                   help="take up this learner's part of the snapshot the syncer resumed from (checkpoint.dir)")
    p.add_argument("--devices", metavar="I,J", help="this learner's devices: indices into jax.local_devices() "
                                                    "(run.devices; default all, e.g. every GPU the host shows it)")
    p.add_argument("--process-id", type=int, metavar="I",
                   help="a learner of several processes: this one's index, 0 (the leader, which talks to the "
                        "syncer and hosts the coordinator) .. P-1")
    p.add_argument("--num-processes", type=int, metavar="P",
                   help="processes of this learner (learner.hosts; default the config's)")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="process 0's address for the learner's processes to meet (jax.distributed); the same "
                        "for every process, reachable from each")
    from wan_diloco.cli.args import add_tls_arguments
    from wan_diloco.cli.syncer import add_view_arguments

    add_tls_arguments(p)
    add_view_arguments(p)


def multihost_config(args: argparse.Namespace, cfg: spec_lib.RunSpec):
    """(the config with ``learner.hosts`` as the flags say, this process's ``MultihostConfig`` or None for a
    one-process learner); ConfigError on flags that disagree with each other or with the config."""
    hosts = cfg.learner.hosts
    if args.num_processes is not None:
        require(args.num_processes >= 1, "num-processes", f"must be >= 1, got {args.num_processes}")
        require(hosts in (1, args.num_processes), "num-processes",
                f"{args.num_processes}, but the config says learner.hosts = {hosts}")
        if args.num_processes != hosts:
            cfg = cfg.with_changes(learner={"hosts": args.num_processes})
            hosts = args.num_processes
    if hosts == 1:
        require(args.process_id in (None, 0), "process-id",
                f"must be 0 for a learner of one process (learner.hosts = 1), got {args.process_id}")
        require(args.coordinator is None, "coordinator",
                "only for a learner of several processes (--num-processes P > 1 or learner.hosts > 1)")
        return cfg, None
    require(args.process_id is not None, "process-id",
            f"required: this learner has {hosts} processes (learner.hosts); give each its index 0..{hosts - 1}")
    require(args.coordinator is not None, "coordinator",
            f"required: this learner has {hosts} processes (learner.hosts); give each process 0's HOST:PORT")
    from wan_diloco.config import from_mapping
    from wan_diloco.runtime.multihost import MultihostConfig

    flags = {"coordinator": "--coordinator", "process_id": "--process-id", "num_processes": "--num-processes"}
    try:
        mcfg = from_mapping(MultihostConfig, {"coordinator": args.coordinator.strip(), "num_processes": hosts,
                                              "process_id": args.process_id})
    except ConfigError as e:
        field, _, why = str(e).partition(": ")
        raise ConfigError(f"{flags.get(field, field).lstrip('-')}: {why}") from None
    return cfg, mcfg


def run(args: argparse.Namespace) -> int:
    who = f"learner-{args.id}" + (f".p{args.process_id}" if args.process_id else "")
    logging.basicConfig(level=logging.WARNING, format=f"{who} %(levelname)s %(name)s: %(message)s")
    from wan_diloco.cli.args import host_tls

    cfg, _ = host_tls(args, spec_lib.load(args.config), "learner")
    if args.devices:
        ids = args.devices.split(",")
        require(all(i.strip().isdigit() for i in ids), "devices", f"must be indices like 0,1, got {args.devices!r}")
        cfg = cfg.with_changes(run={"devices": [int(i) for i in ids]})
    require(0 <= args.id < cfg.run.learners, "id", f"must be in 0..{cfg.run.learners - 1}, got {args.id}")
    cfg, mcfg = multihost_config(args, cfg)
    targets = [t.strip().removeprefix("http://").removeprefix("https://") for t in args.syncer.split(",")]
    require(len(targets) == cfg.syncer.shards and all(targets), "--syncer",
            f"names {len(targets)} address(es); syncer.shards = {cfg.syncer.shards} needs one HOST:PORT per "
            f"shard, in shard order")
    target = ",".join(targets)
    if mcfg is not None:
        from wan_diloco.runtime import multihost

        multihost.initialize(mcfg)  # before anything touches a JAX device
    from wan_diloco.assemble import preflight
    from wan_diloco.runtime.learner_main import run_learner, run_multihost

    preflight(cfg, learner=args.id)  # ConfigError: one line from cli.main, exit code 2, before connecting

    from wan_diloco.cli import live

    def go() -> int:
        if mcfg is None:
            return run_learner(cfg, args.id, target, cfg.token(), resume=args.resume)
        return run_multihost(cfg, args.id, target, cfg.token(), mcfg, resume=args.resume)

    if mcfg is not None and not mcfg.leader:  # a follower has nothing to show
        return go()
    with live.open_view(cfg, who, args):
        return go()
