"""`wan-diloco token --learner N [--config F]`: learner N's own token under
``transport.per_learner_tokens``, derived from the run's token ($WAN_DILOCO_TOKEN or run.token).

Give each learner host only its own (as its $WAN_DILOCO_TOKEN); the run's token stays with the syncer.
"""
from __future__ import annotations

import argparse

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
    return 0
