"""Keep the process's heap from mapping fresh pages for every message it receives (glibc only).

gRPC hands each received message to Python as a new ``bytes`` (1 MiB by default), and
its C core reads the socket into buffers of up to 16 MiB that come and go alike. glibc
serves such blocks from ``mmap``, or trims its heap back to the kernel soon after they
are freed, so the next block lands on fresh pages the kernel must fault in and zero. On
loopback a TLS receiver of one 480 MiB upload at a time took 45,000-99,000 minor faults
per GiB (262,144 would be every page), 0-18,000 with the thresholds below, and spent
5-10 % less CPU per GiB (docs/benchmarks.md). The cost: up to ``TRIM_THRESHOLD_BYTES``
of freed heap kept per arena instead of returned to the kernel.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

log = logging.getLogger(__name__)

# glibc's <malloc.h> parameter numbers for mallopt(3)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20  # blocks below come from the heap (messages, gRPC read buffers of up to 16 MiB)
TRIM_THRESHOLD_BYTES = 128 << 20  # free heap kept before it is given back to the kernel

_pinned: bool | None = None


def pin_malloc_thresholds() -> bool:
    """Set glibc's mmap and trim thresholds for this process once (fixed values also stop glibc
    adjusting them); False where the C library is not glibc or refuses. Safe to call repeatedly."""
    global _pinned
    if _pinned is None:
        _pinned = False
        if platform.libc_ver()[0] == "glibc":
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                _pinned = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
                    libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
            except (OSError, AttributeError) as e:
                log.debug("mallopt unavailable: %s", e)
    return _pinned
