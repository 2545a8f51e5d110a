"""HTTP/1.1 status server (aiohttp): / (dashboard), /healthz, /status (JSON), /metrics (Prometheus).

/status and /metrics need the run's bearer token (``Authorization: Bearer
<token>``) and are served over HTTPS when given the gRPC port's ``TlsConfig``.
/ is a static page (``dashboard.html``) that holds no data: it is served without
the token, reads it from the URL fragment (``/#token=...``, which browsers never
send) and polls /status with it.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import inspect
import json
import logging
import math
import re
import ssl
from importlib import resources
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Union

from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.log import server_logger
from prometheus_client import CONTENT_TYPE_LATEST

from ..config import ConfigError, require
from .config import TlsConfig
from .metrics import TransportMetrics
from .security import bearer_matches, check_port, check_token, is_loopback, listen_error

log = logging.getLogger(__name__)

StatusFn = Callable[[], Union[Mapping[str, Any], Awaitable[Mapping[str, Any]]]]
DASHBOARD = "dashboard.html"


def _hashes(html: str, tag: str) -> str:
    """CSP source expressions allowing exactly the inline ``<tag>`` blocks of ``html``."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)
    return " ".join("'sha256-%s'" % base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() for b in blocks)


@functools.lru_cache(maxsize=1)
def dashboard_page() -> tuple[bytes, str]:
    """The dashboard's HTML and a Content-Security-Policy under which only its own inline
    style and script run and it may talk to nothing but its own origin (no CDN, no beacon)."""
    html = resources.files(__package__).joinpath(DASHBOARD).read_text(encoding="utf-8")
    csp = (f"default-src 'none'; script-src {_hashes(html, 'script')}; style-src {_hashes(html, 'style')}; "
           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html.encode(), csp


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float as None (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class _QuietBadRequests(logging.LoggerAdapter):
    """aiohttp's server logger, except that a malformed request is not our error.

    aiohttp logs each unparseable request as an ERROR with a traceback; anything
    that can reach the port (scanners, a TLS client on a cleartext port) could
    fill the log that way. They still get their 400; we log them at DEBUG.
    """

    def exception(self, msg, *args, exc_info=True, **kwargs):
        if isinstance(exc_info, HttpProcessingError):
            self.debug(msg + ": %s", *args, exc_info, **kwargs)
        else:
            super().exception(msg, *args, exc_info=exc_info, **kwargs)


def _ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """Server-side TLS from the gRPC port's files. Client certificates are not asked for:
    over HTTP the bearer token is the credential (and browsers or curl rarely hold one)."""
    tls.validate()
    require(bool(tls.cert_file), "tls.cert_file", "a TLS status server needs cert_file and key_file")
    for what in ("cert_file", "key_file"):
        path = Path(getattr(tls, what))
        require(path.is_file(), f"tls.{what}", f"file {path} not found")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except ssl.SSLError as e:
        raise ConfigError(f"tls.cert_file: cannot use {tls.cert_file} with {tls.key_file}: {e}") from None
    return context


class StatusServer:
    """Serves the application's status callable and a metrics registry.

    ``status`` returns a JSON-serializable mapping (learners, regions, versions per
    fragment, ...); it may be a coroutine function. Bind to loopback unless the
    status page should be reachable from elsewhere.

    ``token``: the run's bearer token, required on /status and /metrics. Without
    one (``None``) they are open, which is only allowed on a loopback host.
    ``tls``: serve HTTPS with the gRPC server's certificate and key.
    ``idle_timeout_s``: a connection is closed when no complete request arrived
    for this long (idle keep-alive, or a request that is sent too slowly).
    """

    def __init__(
        self,
        status: StatusFn,
        metrics: TransportMetrics,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        tls: TlsConfig | None = None,
        idle_timeout_s: float = 15.0,
    ):
        check_port(port, "status port")
        if token is None:
            require(is_loopback(host), "token",
                    f"a status server on {host!r} (not loopback) needs the run's bearer token")
        else:
            check_token(token)
        require(idle_timeout_s > 0, "idle_timeout_s", f"must be > 0, got {idle_timeout_s}")
        self._status, self.metrics, self.host, self.port = status, metrics, host, port
        self._token, self.idle_timeout_s = token, idle_timeout_s
        self._ssl = _ssl_context(tls) if tls is not None else None
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        """Start listening; returns the bound port (useful with port 0)."""
        app = web.Application()
        app.router.add_get("/", self._dashboard)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/status", self._status_handler)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            logger=_QuietBadRequests(server_logger, {}),
            # Also the longest a connection may take to send a whole request: aiohttp
            # closes one that has no complete request pending when it runs out.
            keepalive_timeout=self.idle_timeout_s,
            # A few small JSON pages: nothing long-running to wait for on stop.
            shutdown_timeout=2.0,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self._ssl)
        try:
            await site.start()
        except OSError as e:
            await self.stop()
            raise listen_error(f"{self.host}:{self.port}", e) from None
        except BaseException:
            await self.stop()
            raise
        self.port = self._runner.addresses[0][1]
        return self.port

    @property
    def url(self) -> str:
        return f"{'https' if self._ssl is not None else 'http'}://{self.host}:{self.port}"

    @property
    def auth_headers(self) -> dict[str, str]:
        """Headers that authorize a request to /status and /metrics (for tools and tests)."""
        return {hdrs.AUTHORIZATION: f"Bearer {self._token}"} if self._token is not None else {}

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> "StatusServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _refuse(self, request: web.Request) -> web.Response | None:
        """401 unless the request carries the bearer token (when one is set)."""
        if self._token is None or bearer_matches(request.headers.get(hdrs.AUTHORIZATION), self._token):
            return None
        return web.json_response({"error": "missing or wrong bearer token (Authorization: Bearer <run token>)"},
                                 status=401, headers={hdrs.WWW_AUTHENTICATE: "Bearer"})

    async def _healthz(self, request: web.Request) -> web.Response:
        # Open on purpose: load balancers and orchestration probes cannot hold the run's
        # secret, and the answer reveals nothing but that the process is alive.
        return web.Response(text="ok\n")

    async def _dashboard(self, request: web.Request) -> web.Response:
        # Open like /healthz: the page is the same static file for everyone and carries no run
        # data; its fetches of /status are what the token guards.
        try:
            body, csp = dashboard_page()
        except OSError as e:
            return web.Response(status=500, text=f"the dashboard page ({DASHBOARD}) is missing from the installed "
                                f"wan_diloco package: {e}; /status and /metrics still work\n")
        return web.Response(body=body, content_type="text/html", charset="utf-8", headers={
            "Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY", "Cache-Control": "no-cache"})

    async def _status_handler(self, request: web.Request) -> web.Response:
        if (refused := self._refuse(request)) is not None:
            return refused
        try:
            result = self._status()
            if inspect.isawaitable(result):
                result = await result
            try:
                body = json.dumps(result, sort_keys=True, allow_nan=False)
            except ValueError:  # a NaN or infinite float: Python writes NaN, which no browser's JSON.parse takes
                body = json.dumps(_finite(result), sort_keys=True, allow_nan=False)
        except Exception as e:  # a broken status callable must not take the server down
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=500)
        return web.Response(text=body, content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        if (refused := self._refuse(request)) is not None:
            return refused
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
