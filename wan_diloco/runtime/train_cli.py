"""`wan-diloco train`: the embedded default run (examples/local.toml), or ``--config F`` like ``launch``."""
from __future__ import annotations

import argparse
from pathlib import Path

from wan_diloco.runtime import config as rt_config
from wan_diloco.runtime.launch_cli import add_common, finish, launch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="TOML", help="run config (default: syncer + 4 learners in 2 regions, tiny preset)")
    add_common(p)


def run(args: argparse.Namespace) -> int:
    cfg = rt_config.load(args.config)
    text = Path(args.config).read_text() if args.config else rt_config.DEFAULT_TOML
    code, summary = launch(cfg, text, args.run_dir, args.quiet)
    return finish(code, summary, args)
