"""Event loops: uvloop when installed (grpc.aio moves ~40 % more bytes under it here)."""
from __future__ import annotations

import asyncio
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
    uvloop = None


def have_uvloop() -> bool:
    return uvloop is not None


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new uvloop loop if uvloop is importable, else the default asyncio loop."""
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a loop from :func:`new_event_loop`."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
