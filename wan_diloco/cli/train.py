"""`wan-diloco train`: the embedded default run (examples/local.toml), or ``--config F`` like ``launch``."""
from __future__ import annotations

import argparse
from pathlib import Path

from wan_diloco import spec as spec_lib
from wan_diloco.cli.launch import add_common, finish, launch_and_show, view_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="TOML", help="run config (default: syncer + 4 learners in 2 regions, tiny preset)")
    add_common(p)


def run(args: argparse.Namespace) -> int:
    cfg = spec_lib.load(args.config)
    text = Path(args.config).read_text() if args.config else spec_lib.DEFAULT_TOML
    code, summary = launch_and_show(cfg, text, args.run_dir, view_of(args), every_s=args.progress_every_s)
    return finish(code, summary, args)
