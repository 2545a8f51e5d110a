"""`wan-diloco token --learner N [--config F]`: learner N's own token, derived from the run's token
($WAN_DILOCO_TOKEN or run.token). The syncer accepts it only from learner N (``transport.per_learner_tokens``,
on by default), so a learner host given it cannot speak for another.

Give each learner host only its own (as its $WAN_DILOCO_TOKEN); the run's token stays with the syncer.
The token alone goes to stdout (for scripts); what to do with it, to stderr.
"""
from __future__ import annotations

import argparse
import sys

from wan_diloco import spec as spec_lib
from wan_diloco.config import require


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--learner", type=int, required=True, metavar="N", help="learner index, 0..run.learners-1")
    p.add_argument("--config", metavar="TOML", help="run config (default: the embedded local default)")


def run(args: argparse.Namespace) -> int:
    from wan_diloco.core import learner_node
    from wan_diloco.transport import derive_token

    cfg = spec_lib.load(args.config)
    require(0 <= args.learner < cfg.run.learners, "learner", f"must be in 0..{cfg.run.learners - 1}, got {args.learner}")
    print(derive_token(cfg.token(), learner_node(args.learner)))
    print(f"learner {args.learner}'s own token: give it to that learner's host as its $WAN_DILOCO_TOKEN; "
          "keep the run's token on the syncer's host", file=sys.stderr)
    return 0
