"""`wan-diloco export skypilot|slurm|k8s --config F --out DIR`: launch files for one run file.

Writes the engine's own files (task YAML, sbatch scripts, manifests), a copy of the run file every process
reads and a ``launch.sh`` showing the order; prints what it wrote and the command to run next.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from wan_diloco.config import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from wan_diloco.export import ENGINES, ExportOptions

    d = ExportOptions()
    p.add_argument("engine", metavar="ENGINE", help=f"one of {', '.join(ENGINES)}")
    p.add_argument("--config", required=True, metavar="TOML", help="the run file (copied into --out as run.toml)")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="where to write the files")
    p.add_argument("--force", action="store_true", help="write into --out even if it is not empty")
    p.add_argument("--name", default=d.name, help=f"prefix of jobs, clusters and objects (default {d.name})")
    p.add_argument("--port", type=int, default=0,
                   help="the syncer's gRPC port (default run.port, or 7070 when that is 0)")
    p.add_argument("--syncer-host", action="append", default=[], metavar="HOST",
                   help="the name learners dial, once per syncer shard (default: known at launch; k8s: the "
                        "Service's pod names); the syncer's certificate names it")
    g = p.add_argument_group("skypilot")
    g.add_argument("--cloud", default="", help="the cloud whose regions regions.names are (aws, gcp, azure, ...)")
    g.add_argument("--accelerators", default="", metavar="SPEC", help="per learner node, e.g. H100:8")
    g.add_argument("--setup", default=d.setup, metavar="CMD",
                   help=f"how a node installs wan-diloco without --image (default: {d.setup})")
    g = p.add_argument_group("slurm")
    g.add_argument("--time", default=d.time, help=f"sbatch --time of every job (default {d.time})")
    g = p.add_argument_group("k8s (and skypilot's --image)")
    g.add_argument("--image", default="", metavar="IMG", help="container image with wan-diloco installed")
    g.add_argument("--namespace", default="", help="namespace of every object (default: kubectl's current one)")
    g.add_argument("--storage", default=d.storage, help=f"each syncer shard's volume (default {d.storage})")


def run(args: argparse.Namespace) -> int:
    from wan_diloco import spec as spec_lib
    from wan_diloco.export import ENGINES, ExportOptions, export
    from wan_diloco.export.common import bad_engine

    if args.engine not in ENGINES:  # before the run file: the cheaper mistake first
        raise bad_engine(args.engine)
    out: Path = args.out
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not args.force)):
        raise ConfigError(f"--out: {out} " + ("is not a folder" if not out.is_dir() else
                                              "exists and is not empty; pass --force to write into it"))
    spec = spec_lib.load(args.config)
    options = ExportOptions(name=args.name, port=args.port, syncer_hosts=tuple(args.syncer_host), cloud=args.cloud,
                            accelerators=args.accelerators, image=args.image, setup=args.setup, time=args.time,
                            namespace=args.namespace, storage=args.storage)
    files = export(spec, Path(args.config).read_text(), args.engine, options)  # all or nothing: before any write
    out.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        path = out / rel
        path.write_text(text)
        # the run file copy and the scripts may be read by whoever can read the folder: owner only
        path.chmod(0o700 if rel.endswith(".sh") else 0o600)
        print(path)
    if not spec.run.min_learners_to_start:  # launch sets it for its own learners; these start one by one
        print(f"note: run.min_learners_to_start is 0, so the syncer starts training when the first learner joins; "
              f"set it to {spec.run.learners} (run.learners) to wait for all of them", file=sys.stderr)
    print(f"next: bash {out / 'launch.sh'}   (it makes the tokens and certificates once, then launches in order; "
          f"docs/launchers.md)")
    return 0
