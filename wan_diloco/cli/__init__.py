"""`wan-diloco` command line: parses arguments and calls into the library.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only lists them.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# gRPC's C core logs at absl's INFO level unless GRPC_VERBOSITY is set, and is read once, when grpc is
# imported (below, by the subcommands): without this a syncer's log fills with raw "SSL_ERROR_SSL ...
# WRONG_VERSION_NUMBER" lines for every handshake a cleartext client tries. Ours say what went wrong;
# GRPC_VERBOSITY=debug (or info) in the environment still shows gRPC's own.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from wan_diloco import __version__  # noqa: E402
from wan_diloco.config import ConfigError, did_you_mean  # noqa: E402

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("wan_diloco.cli.simulate", "simulated multi-region training run on a virtual clock"),
    "bandwidth": ("wan_diloco.cli.bandwidth", "Gbit/s between datacenters needed for a compute-utilization target"),
    "plan": ("wan_diloco.cli.plan", "choose H, P, tau, bits and grace for a run from its links and step time"),
    "goodput": ("wan_diloco.cli.goodput", "chaos simulation of goodput and uptime under chip failures"),
    "syncer": ("wan_diloco.cli.syncer", "serve the syncer of a networked run (gRPC over HTTP/2)"),
    "learner": ("wan_diloco.cli.learner", "one learner process of a networked run"),
    "launch": ("wan_diloco.cli.launch", "start a syncer and M learners as local processes, with live progress"),
    "eval": ("wan_diloco.cli.eval", "held-out loss of saved parameters (a run's checkpoints/params.safetensors)"),
    "token": ("wan_diloco.cli.token", "a learner's own token, to hand its host instead of the run's"),
    "certs": ("wan_diloco.cli.certs", "a CA and certificates for mutual TLS between the syncer and each learner host"),
    "train": ("wan_diloco.cli.train", "the default local run: syncer + 4 learners in 2 regions on loopback"),
    "wan": ("wan_diloco.cli.wan", "emulated WAN between region namespaces on this machine (needs root)"),
    "chaos": ("wan_diloco.cli.chaos", "a real run under process kills and resumes, against a fault-free run"),
    "export": ("wan_diloco.cli.export", "launch files for SkyPilot, Slurm or Kubernetes from one run file"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with ``only``, the arguments of that command alone (the others' modules,
    which import JAX, are not loaded: `--version` or one command need not wait for them)."""
    parser = argparse.ArgumentParser(
        prog="wan-diloco",
        description="Decoupled DiLoCo across regions joined by WAN links: simulate, plan and train.",
    )
    parser.add_argument("-V", "--version", action="version", version=f"wan-diloco {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is not None and name != only:
            continue
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("WAN_DILOCO_PARENT_PID"):  # started by the launcher: stop when it dies
        from wan_diloco.runtime.launch import die_with_parent

        die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=command or "")
    if command is not None and command not in SUBCOMMANDS:  # argparse alone lists every choice, no near miss
        parser.error(f"unknown command {command!r}{did_you_mean(command, SUBCOMMANDS)} "
                     f"(commands: {', '.join(SUBCOMMANDS)})")
    args = parser.parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except ConfigError as e:
        parser.exit(2, f"wan-diloco {args.command}: error: {e}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
