"""`wan-diloco eval --params P [--config F]`: the held-out loss of saved parameters (a run's
``checkpoints/params.safetensors``) on the config's eval set."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from wan_diloco import spec as spec_lib
from wan_diloco.checkpoint import CheckpointError, load_params


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=Path, required=True, metavar="FILE", help="a params.safetensors a run wrote")
    p.add_argument("--config", metavar="TOML",
                   help="run config with the model and eval data (default: RUN_DIR/config.toml next to the "
                        "file's checkpoints folder, else the embedded default)")


def run(args: argparse.Namespace) -> int:
    from wan_diloco.assemble import Assembly

    config = args.config
    beside = args.params.resolve().parent.parent / "config.toml"
    if config is None and beside.is_file():
        config = str(beside)
    cfg = spec_lib.load(config)
    parts = Assembly(cfg)
    try:
        params, info = load_params(args.params, like=parts.params0)
    except CheckpointError as e:
        print(f"wan-diloco eval: {e}", file=sys.stderr)
        return 2
    loss = parts.evaluate(params)
    print(json.dumps({"params": str(args.params), "config": config or "default", "eval_loss": loss,
                      "run_id": info.get("run_id"), "versions": info.get("versions")}))
    return 0
