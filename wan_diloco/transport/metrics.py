"""Per-server Prometheus metrics (a private CollectorRegistry, never the global one)."""
from __future__ import annotations

from typing import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class TransportMetrics:
    """Counters the transport updates itself, plus gauges the application sets.

    Each instance owns its registry, so several servers in one process (tests,
    ``launch``) never collide.
    """

    def __init__(self, namespace: str = "wan_diloco") -> None:
        self.namespace = namespace
        self.registry = CollectorRegistry(auto_describe=True)
        self.bytes_in = Counter("transport_bytes_in", "Bytes received, by RPC", ["rpc"],
                                namespace=namespace, registry=self.registry)
        self.bytes_out = Counter("transport_bytes_out", "Bytes sent, by RPC", ["rpc"],
                                 namespace=namespace, registry=self.registry)
        self.messages = Counter("transport_messages", "Messages handled, by RPC and direction",
                                ["rpc", "direction"], namespace=namespace, registry=self.registry)
        self.errors = Counter("transport_errors", "Calls that ended in an error, by RPC and status code",
                              ["rpc", "code"], namespace=namespace, registry=self.registry)
        self.resumes = Counter("transport_resumes", "Broken transfers resumed from where they stopped, by RPC",
                               ["rpc"], namespace=namespace, registry=self.registry)
        self.identity_refusals = Counter(
            "identity_refused", "Calls refused because the caller is not who it says (per-sender token, "
            "certificate), by reason", ["reason"], namespace=namespace, registry=self.registry)
        self._gauges: dict[str, Gauge] = {}

    def received(self, rpc: str, nbytes: int, messages: int = 1) -> None:
        self.bytes_in.labels(rpc).inc(nbytes)
        self.messages.labels(rpc, "in").inc(messages)

    def sent(self, rpc: str, nbytes: int, messages: int = 1) -> None:
        self.bytes_out.labels(rpc).inc(nbytes)
        self.messages.labels(rpc, "out").inc(messages)

    def error(self, rpc: str, code: str) -> None:
        self.errors.labels(rpc, code).inc()

    def identity_refused(self, reason: str) -> None:
        self.identity_refusals.labels(reason).inc()

    def resumed(self, rpc: str) -> None:
        self.resumes.labels(rpc).inc()

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        """The gauge ``name`` in this registry, created on first use."""
        if name not in self._gauges:
            self._gauges[name] = Gauge(name, documentation, list(labelnames),
                                       namespace=self.namespace, registry=self.registry)
        return self._gauges[name]

    @staticmethod
    def total(counter: Counter, rpc: str | None = None) -> int:
        """Sum of a by-RPC counter (``bytes_in``, ``bytes_out``): every RPC but the link
        probe's (training traffic), or only ``rpc``."""
        return int(sum(s.value for metric in counter.collect() for s in metric.samples if s.name.endswith("_total")
                       and (s.labels.get("rpc") != "Probe" if rpc is None else s.labels.get("rpc") == rpc)))

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format."""
        return generate_latest(self.registry)
