"""`wan-diloco wan up|down|status`: an emulated WAN between region namespaces on this machine."""
from __future__ import annotations

import argparse
import signal
import subprocess
import threading

from wan_diloco.config import ConfigError, load_toml
from wan_diloco.regions.emulator import Emulator, EmulatorError, forwarder_pids, list_namespaces, teardown_leftovers
from wan_diloco.regions.topology import regions_from_mapping


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("up", "down", "status"),
                   help="up: build it and keep it until Ctrl-C; down: remove leftovers; status: list what exists")
    p.add_argument("--config", help="run file with a [regions] table (needed for up)")
    p.add_argument("--prefix", default="wdl", help="name prefix of namespaces and devices (default wdl)")
    p.add_argument("--backend", choices=("auto", "netem", "tun"), default="auto",
                   help="delay/loss: netem if the kernel has it (auto), or the user-space TUN forwarder")


def run(args: argparse.Namespace) -> int:
    if args.action == "down":
        removed = teardown_leftovers(args.prefix)
        print("\n".join(f"removed {r}" for r in removed) or f"nothing with prefix {args.prefix!r} to remove")
        return 0
    if args.action == "status":
        namespaces = list_namespaces(args.prefix)
        pids = forwarder_pids(args.prefix)
        if not namespaces and not pids:
            print(f"no emulated WAN with prefix {args.prefix!r}")
        for ns in namespaces:
            addrs = subprocess.run(["ip", "-n", ns, "-4", "-o", "addr", "show"], capture_output=True, text=True)
            shown = [line.split()[3] for line in addrs.stdout.splitlines() if " lo " not in line]
            print(f"namespace {ns:<24} {' '.join(shown)}")
        for pid in pids:
            print(f"forwarder process {pid}")
        return 0
    if not args.config:
        raise ConfigError("--config: needed for `wan up` (a run file with a [regions] table)")
    # Until spec.RunSpec carries [regions], read the table straight from the file.
    table = load_toml(args.config).get("regions")
    if table is None:
        raise ConfigError(f"config file {args.config}: no [regions] table")
    topo = regions_from_mapping(table)
    try:
        with Emulator(topo, prefix=args.prefix, backend=args.backend) as emu:
            print("\n".join(emu.describe()), flush=True)
            print("emulated WAN is up; Ctrl-C to tear it down", flush=True)
            # signal.pause() wakes on SIGINT/SIGTERM, whose handlers raise and unwind through __exit__.
            if threading.current_thread() is threading.main_thread():
                signal.pause()
            else:
                threading.Event().wait()
    except EmulatorError as e:
        raise ConfigError(f"wan up: {e}") from None
    except (KeyboardInterrupt, SystemExit):
        print("emulated WAN torn down")
    return 0
