"""HTTP/1.1 status server (aiohttp): /healthz, /status (JSON), /metrics (Prometheus)."""
from __future__ import annotations

import inspect
import json
from typing import Any, Awaitable, Callable, Mapping, Union

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from .metrics import TransportMetrics

StatusFn = Callable[[], Union[Mapping[str, Any], Awaitable[Mapping[str, Any]]]]


class StatusServer:
    """Serves the application's status callable and a metrics registry.

    ``status`` returns a JSON-serializable mapping (learners, regions, versions per
    fragment, ...); it may be a coroutine function. Bind to loopback unless the
    status page should be reachable from elsewhere.
    """

    def __init__(self, status: StatusFn, metrics: TransportMetrics, host: str = "127.0.0.1", port: int = 0):
        self._status, self.metrics, self.host, self.port = status, metrics, host, port
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        """Start listening; returns the bound port (useful with port 0)."""
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/status", self._status_handler)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        try:
            await site.start()
        except BaseException:
            await self.stop()
            raise
        self.port = self._runner.addresses[0][1]
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> "StatusServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _status_handler(self, request: web.Request) -> web.Response:
        try:
            result = self._status()
            if inspect.isawaitable(result):
                result = await result
            body = json.dumps(result, sort_keys=True)
        except Exception as e:  # a broken status callable must not take the server down
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=500)
        return web.Response(text=body, content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
