"""The emulator's footing on this host: running ``ip``/``tc``, whether it can run at all, and finding and
removing what an emulator (a crashed one included) left behind: its namespaces and forwarder processes."""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

FORWARDER_MODULE = "wan_diloco.regions.forwarder"
PR_SET_PDEATHSIG = 1


class EmulatorError(RuntimeError):
    """The emulated network could not be built or used."""


def run_checked(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run ``argv``; EmulatorError with its stderr when it fails and ``check``."""
    res = subprocess.run(list(argv), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise EmulatorError(f"`{' '.join(argv)}` failed ({res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
    return res


def die_with_parent() -> None:
    # Runs in the child before exec: SIGTERM it when the emulator process dies,
    # so a crashed or SIGKILLed emulator leaves no forwarder behind. (Linux
    # sends it when the *thread* that started the child exits, so enter the
    # Emulator from a thread that outlives it, normally the main thread.)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def unavailable_reason() -> str | None:
    """Why the emulator cannot run here (not root, no iproute2, no ``ip netns``), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (`ip`, `tc`)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` is not available here"
    return None


def router_name(prefix: str) -> str:
    """Name of the router namespace (double dash: region names never start with '-')."""
    return f"{prefix}--router"


def list_namespaces(prefix: str) -> list[str]:
    """Namespaces whose names start with ``prefix-``."""
    res = run_checked(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix + "-")]


def forwarder_pids(prefix: str) -> list[int]:
    """Pids of forwarder processes started with ``--tag prefix``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if FORWARDER_MODULE.encode() in argv and b"--tag" in argv:
            i = argv.index(b"--tag")
            if i + 1 < len(argv) and argv[i + 1] == prefix.encode():
                out.append(int(d.name))
    return out


def kill_pids(pids: Sequence[int], grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL what is still alive (and not a zombie) after ``grace_s``."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if Path(f"/proc/{p}").exists() and _state(p) != "Z"]
        time.sleep(0.02)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def teardown_leftovers(prefix: str = "wdl") -> list[str]:
    """Remove namespaces and processes a crashed run with ``prefix`` left behind.

    Kills every process inside those namespaces and every forwarder tagged with
    ``prefix``, then deletes the namespaces (which removes their veth and TUN
    devices). Returns what was removed, for printing.
    """
    removed: list[str] = []
    namespaces = list_namespaces(prefix)
    pids = set(forwarder_pids(prefix))
    for ns in namespaces:
        res = run_checked(["ip", "netns", "pids", ns], check=False)
        pids.update(int(p) for p in res.stdout.split() if p.isdigit())
    pids.discard(os.getpid())
    if pids:
        kill_pids(sorted(pids))
        removed += [f"process {p}" for p in sorted(pids)]
    for ns in namespaces:
        run_checked(["ip", "netns", "del", ns], check=False)
        removed.append(f"namespace {ns}")
    return removed
