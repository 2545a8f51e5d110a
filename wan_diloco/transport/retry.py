"""Retrying calls: which failures are worth another try, and the backoff between tries."""
from __future__ import annotations

import asyncio
import random
import time

import grpc

from .config import TransportConfig

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
# grpcio's asyncio client reports a client-streaming call that the server ended (a refusal, say) while
# we were still writing as this, instead of the server's status (grpc/grpc#36066): the real answer is
# unknown, so it is asked again, within the same budget.
STATUS_LOST = (grpc.StatusCode.INTERNAL, "Internal error from Core")


def worth_retrying(error: grpc.aio.AioRpcError) -> bool:
    """A failure another try may get past: the syncer unreachable, or its answer lost by grpcio."""
    return error.code() in RETRYABLE or (error.code(), error.details()) == STATUS_LOST


class TransportError(Exception):
    """A call failed for good; ``code`` is the gRPC status code, the text says why."""

    def __init__(self, rpc: str, code: grpc.StatusCode, details: str):
        super().__init__(f"{rpc} failed: {code.name}: {details}")
        self.rpc, self.code, self.details = rpc, code, details


class Backoff:
    """Exponential backoff with full jitter, bounded by a total time budget."""

    def __init__(self, config: TransportConfig) -> None:
        self.config = config
        self.reset()

    def reset(self) -> None:
        self.delay_s = self.config.backoff_initial_s
        self.started = time.monotonic()

    async def wait(self) -> bool:
        """Sleep before the next try; False once the budget is spent."""
        if time.monotonic() - self.started > self.config.retry_budget_s:
            return False
        await asyncio.sleep(random.uniform(0.5, 1.0) * self.delay_s)
        self.delay_s = min(self.config.backoff_max_s, self.delay_s * self.config.backoff_multiplier)
        return True
