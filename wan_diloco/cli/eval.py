"""`wan-diloco eval --params P [--config F]`: the held-out loss of saved parameters (a run's
``checkpoints/params.safetensors``) on the config's eval set.

Without ``--config`` the run's own config is read from beside the weights (RUN_DIR/config.toml for
RUN_DIR/checkpoints/params.safetensors); when there is none, eval refuses rather than score the
weights on the built-in default's data and model (a plausible, wrong loss). Either way the model the
file was written with (its ``model`` info) must be the config's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from wan_diloco import spec as spec_lib
from wan_diloco.checkpoint import CheckpointError, read_params


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=Path, required=True, metavar="FILE", help="a params.safetensors a run wrote")
    p.add_argument("--config", metavar="TOML",
                   help="run config with the model and eval data (default: RUN_DIR/config.toml next to the "
                        "file's checkpoints folder; without one, eval refuses)")


def run_config_of(params: Path) -> Path | None:
    """The run's config beside a parameter file: RUN_DIR/config.toml for RUN_DIR/checkpoints/FILE (or a
    config.toml in the file's own folder); None when there is none."""
    here = params.resolve().parent
    for candidate in (here.parent / "config.toml", here / "config.toml"):
        if candidate.is_file():
            return candidate
    return None


def model_mismatch(stored: object, cfg: spec_lib.RunSpec) -> str | None:
    """Which model setting the file was written with differs from the config's, or None."""
    if not isinstance(stored, dict):
        return None  # a file written by hand (save_params without info): the shapes are checked on load
    want = json.loads(json.dumps(dataclasses.asdict(cfg.model)))
    for key in sorted((set(want) | set(stored)) - {"init"}):  # where training started is no setting of the model
        if stored.get(key) != want.get(key):
            return f"model.{key} {stored.get(key)!r} in the file vs {want.get(key)!r} in the config"
    return None


def run(args: argparse.Namespace) -> int:
    from wan_diloco.assemble import Assembly

    config = args.config
    if config is None:
        beside = run_config_of(args.params)
        if beside is None:
            print(f"wan-diloco eval: no run config beside {args.params} (looked for "
                  f"{args.params.resolve().parent.parent / 'config.toml'}); pass the run's --config", file=sys.stderr)
            return 2
        config = str(beside)
    cfg = spec_lib.load(config)
    parts = Assembly(cfg)
    try:
        params, info = read_params(args.params, like=parts.params0)
    except CheckpointError as e:
        print(f"wan-diloco eval: {e}", file=sys.stderr)
        return 2
    differs = model_mismatch(info.get("model"), cfg)
    if differs is not None:
        print(f"wan-diloco eval: {args.params} was written by another model than {config}'s: {differs}",
              file=sys.stderr)
        return 2
    loss = parts.evaluate(params)
    print(json.dumps({"params": str(args.params), "config": config, "eval_loss": loss,
                      "run_id": info.get("run_id"), "versions": info.get("versions")}))
    return 0
