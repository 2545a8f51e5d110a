"""heap.pin_malloc_thresholds: a received message's block comes from the heap, not from fresh mmap'ed pages."""
import platform
import subprocess
import sys

import pytest

from wan_diloco.transport.heap import pin_malloc_thresholds

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")

# In a fresh process (glibc has not raised its threshold yet): is a 2 MiB block, about two default
# messages, mmap'ed? mallinfo2's hblks counts the blocks that are.
PROBE = """
import ctypes, sys
from wan_diloco.transport.heap import pin_malloc_thresholds
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
                                               "fordblks keepcost").split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "pin":
    assert pin_malloc_thresholds()
before = libc.mallinfo2().hblks
block = bytearray(2 << 20)
print(libc.mallinfo2().hblks - before)
"""


def mmapped_blocks(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.strip())


def test_pinned_thresholds_serve_message_sized_blocks_from_the_heap():
    assert mmapped_blocks("default") == 1  # glibc's own threshold (128 KiB at start): a fresh mapping
    assert mmapped_blocks("pin") == 0  # pinned at 32 MiB: heap pages, reused once freed


def test_pinning_is_idempotent():
    assert pin_malloc_thresholds() is True and pin_malloc_thresholds() is True
