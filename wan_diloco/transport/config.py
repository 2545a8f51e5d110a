"""Transport settings: chunking, HTTP/2 windows, channels, deadlines, backoff, TLS.

``tune_for_link`` derives the settings that matter on a long fat link from its
rate and round-trip time (see its docstring for the reasoning).
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from ..config import require
from .messages import MAX_HEADER_BYTES, PRELUDE_BYTES

MiB = 1 << 20
MAX_FRAME_BYTES = (1 << 24) - 1  # HTTP/2 ceiling for SETTINGS_MAX_FRAME_SIZE
MIN_FRAME_BYTES = 1 << 14  # HTTP/2 floor (and default)


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """PEM files for TLS. Server: ``cert_file``/``key_file``, plus ``ca_file`` to
    verify client certificates when ``mutual``. Client: ``ca_file`` to verify the
    server (empty: system roots), plus ``cert_file``/``key_file`` when ``mutual``."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    mutual: bool = False
    server_name: str = ""  # client: expected name in the server certificate, if not the host
    # server with mutual: a caller's id is its certificate's common name (`wan-diloco certs` issues CN
    # learner-N); a call declaring another sender is refused. False for a PKI whose names are not ids.
    identity_from_cert: bool = True

    def validate(self) -> None:
        require(bool(self.cert_file) == bool(self.key_file), "cert_file", "cert_file and key_file go together")
        # mutual with no certificate of our own: a run file copied to every host, each naming its own files
        # (--tls-cert, $WAN_DILOCO_TLS_CERT; host_tls.resolve checks they did). A block naming one is complete.
        if self.mutual and self.cert_file:
            require(bool(self.ca_file), "ca_file", "mutual TLS needs a CA to verify the peer's certificate")


@dataclasses.dataclass(frozen=True)
class TransportConfig:
    """How bytes move between learners and the syncer. Zero means "gRPC's default"."""

    # gRPC message size for fragment/update/bulk streams. 1 MiB: on loopback (TLS, one striped upload) the
    # sender spent 7-10 % less CPU per GiB than at 4 MiB and the upload ran 7-12 % faster, the receiver the
    # same; 256 KiB cost both ends more (bench/transport.py, docs/benchmarks.md)
    chunk_bytes: int = 1 * MiB
    max_message_bytes: int = 512 * MiB  # largest encoded message accepted (one fragment)
    channels: int = 2  # HTTP/2 connections per peer; uploads round-robin over them
    # client: an upload of at least twice this many bytes is striped over the channels (one stripe per
    # channel, each at least this big) instead of riding one connection; 0: never striped
    stripe_min_bytes: int = 8 * MiB
    # the syncer's port for direct stripes (direct.py: a striped upload's bytes over plain TLS connections,
    # decrypted straight into the buffer they are decoded from, at about half the receiver's CPU per GiB of
    # gRPC's); the same number on both sides, on the syncer's host. 0: off, every byte rides gRPC
    direct_port: int = 0
    max_inflight_uploads: int = 8  # client: fragment uploads in flight at once (capped by max_uploads_per_sender)
    max_concurrent_uploads: int = 16  # server: uploads reassembled at once (memory bound)
    max_uploads_per_sender: int = 4  # server: open uploads of one sender; more are refused (RESOURCE_EXHAUSTED)
    # server: Metadata, Probe and Bulk calls per second of one sender (a burst of twice as many is let
    # through); learners send one Metadata per step. More are refused (RESOURCE_EXHAUSTED).
    max_calls_per_s_per_sender: float = 200.0
    stream_idle_timeout_s: float = 30.0  # server: an upload whose next chunk takes longer is aborted
    max_concurrent_streams: int = 64  # server: HTTP/2 streams one connection may have open
    bdp_probe: bool = True  # let gRPC grow flow-control windows from measured BDP
    lookahead_bytes: int = 0  # initial per-stream HTTP/2 window target
    max_frame_bytes: int = 0  # HTTP/2 SETTINGS_MAX_FRAME_SIZE we accept
    read_chunk_bytes: int = 0  # bytes per TCP read in gRPC's endpoint
    keepalive_time_s: float = 20.0
    keepalive_timeout_s: float = 10.0
    call_timeout_s: float = 30.0  # deadline of unary calls; base of upload deadlines
    min_upload_rate_gbit_s: float = 0.1  # upload deadline = call_timeout_s + size / this rate
    subscribe_renew_s: float = 600.0  # a subscribe call is renewed after this, make before break (client.py)
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    backoff_multiplier: float = 2.0
    retry_budget_s: float = 60.0  # stop retrying an unavailable peer after this long
    probe_every_s: float = 30.0  # learners measure their link at start, then at most this often (0: start only)
    probe_duty: float = 0.02  # largest share of time link probes may keep the link busy
    probe_seconds: float = 0.2  # target length of one timed probe transfer
    auto_channels: bool = True  # learners open more connections when a probe finds the link needs them
    allow_insecure_remote: bool = False  # cleartext to a non-loopback address
    # Each learner holds its own token (`wan-diloco token --learner N`; launch hands them out), so one cannot
    # speak for another; the run's token stays on the syncer's host. A client given the run's token derives
    # the sender's own per call, so by-hand runs with one token still work.
    per_learner_tokens: bool = True
    # A syncer off loopback with per_learner_tokens = false (and no per-learner certificates) refuses to
    # start unless this is set: one shared token lets any holder speak for any learner.
    allow_shared_token: bool = False
    tls: TlsConfig | None = None

    def validate(self) -> None:
        require(self.chunk_bytes >= 64 * 1024, "chunk_bytes", f"must be >= 65536, got {self.chunk_bytes}")
        require(self.chunk_bytes <= 256 * MiB, "chunk_bytes", "must be <= 256 MiB (gRPC copies each message)")
        require(
            self.max_message_bytes >= self.chunk_bytes,
            "max_message_bytes",
            f"must be >= chunk_bytes ({self.chunk_bytes}), got {self.max_message_bytes}",
        )
        require(self.stripe_min_bytes == 0 or self.stripe_min_bytes >= 64 * 1024, "stripe_min_bytes",
                f"must be 0 (never stripe) or >= 65536, got {self.stripe_min_bytes}")
        require(0 <= self.direct_port <= 65535, "direct_port", f"must be a port in [1, 65535] or 0 (off), got "
                f"{self.direct_port}")
        require(1 <= self.channels <= 64, "channels", f"must be in [1, 64], got {self.channels}")
        require(self.max_inflight_uploads >= 1, "max_inflight_uploads", "must be >= 1")
        require(self.max_concurrent_uploads >= 1, "max_concurrent_uploads", "must be >= 1")
        for name in ("max_uploads_per_sender", "max_concurrent_streams"):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        require(self.max_calls_per_s_per_sender > 0, "max_calls_per_s_per_sender",
                f"must be > 0, got {self.max_calls_per_s_per_sender}")
        require(self.lookahead_bytes >= 0, "lookahead_bytes", "must be >= 0 (0 = gRPC default)")
        require(
            self.max_frame_bytes == 0 or MIN_FRAME_BYTES <= self.max_frame_bytes <= MAX_FRAME_BYTES,
            "max_frame_bytes",
            f"must be 0 or in [{MIN_FRAME_BYTES}, {MAX_FRAME_BYTES}], got {self.max_frame_bytes}",
        )
        require(self.read_chunk_bytes >= 0, "read_chunk_bytes", "must be >= 0 (0 = gRPC default)")
        for name in ("keepalive_time_s", "keepalive_timeout_s", "call_timeout_s", "subscribe_renew_s",
                     "backoff_initial_s", "min_upload_rate_gbit_s", "retry_budget_s", "stream_idle_timeout_s"):
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        require(self.probe_every_s >= 0, "probe_every_s", f"must be >= 0 (0: probe at start only), got {self.probe_every_s}")
        require(0 < self.probe_duty <= 0.5, "probe_duty", f"must be in (0, 0.5], got {self.probe_duty}")
        require(0 < self.probe_seconds <= 10, "probe_seconds", f"must be in (0, 10], got {self.probe_seconds}")
        require(self.backoff_max_s >= self.backoff_initial_s, "backoff_max_s", "must be >= backoff_initial_s")
        require(self.backoff_multiplier >= 1.0, "backoff_multiplier", "must be >= 1")
        if self.tls is not None:
            self.tls.validate()

    @property
    def grpc_message_bytes(self) -> int:
        """Largest single gRPC message: a chunk, or an unchunked message with a full header."""
        return max(self.chunk_bytes, MAX_HEADER_BYTES + PRELUDE_BYTES) + 4096

    def upload_deadline_s(self, size_bytes: int) -> float:
        return self.call_timeout_s + size_bytes * 8 / (self.min_upload_rate_gbit_s * 1e9)

    def _http2_options(self) -> list[tuple[str, int]]:
        opts = [
            ("grpc.max_send_message_length", self.grpc_message_bytes),
            ("grpc.max_receive_message_length", self.grpc_message_bytes),
            ("grpc.http2.bdp_probe", int(self.bdp_probe)),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
        if self.lookahead_bytes:
            opts.append(("grpc.http2.lookahead_bytes", self.lookahead_bytes))
        if self.max_frame_bytes:
            opts.append(("grpc.http2.max_frame_size", self.max_frame_bytes))
        if self.read_chunk_bytes:
            opts += [
                ("grpc.experimental.tcp_read_chunk_size", self.read_chunk_bytes),
                ("grpc.experimental.tcp_max_read_chunk_size", 4 * self.read_chunk_bytes),
            ]
        return opts

    def server_options(self) -> list[tuple[str, int]]:
        """gRPC channel arguments for the server."""
        # Clients ping every keepalive_time_s even when idle; without this the server
        # counts those pings as abuse and sends GOAWAY("too_many_pings").
        ping_ms = max(1000, int(self.keepalive_time_s * 1000) // 2)
        return self._http2_options() + [
            ("grpc.http2.min_ping_interval_without_data_ms", ping_ms),
            # Bounds the streams (each a handler task) one connection can open at once.
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            # gRPC sets SO_REUSEPORT by default: a second syncer on a busy port would then
            # bind without error and take half the connections. Fail the bind instead.
            ("grpc.so_reuseport", 0),
        ]

    def client_options(self) -> list[tuple[str, int]]:
        """gRPC channel arguments for one client channel."""
        return self._http2_options() + [
            # A private subchannel pool per channel: otherwise channels with equal
            # arguments to one target share a single TCP connection.
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", int(self.backoff_initial_s * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(self.backoff_initial_s * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(self.backoff_max_s * 1000)),
        ]


MAX_CHANNELS = 16
# What a client applies to connections it opens after a probe (``SyncerClient.channel_options``):
# per-connection HTTP/2 and socket sizes, which the peer need not agree on.
PROBE_TUNED = ("bdp_probe", "lookahead_bytes", "max_frame_bytes", "read_chunk_bytes")
WINDOW_BOUND = 0.8  # a probe this close to its connections' window ceiling may not have seen the link


def host_socket_buffer_bytes(proc: Path = Path("/proc/sys/net/ipv4")) -> int:
    """The most one TCP connection of this host may buffer: the smaller of tcp_rmem's and tcp_wmem's
    maximum (Linux autotuning stops there); 4 MiB where they cannot be read."""
    try:
        return min(int((proc / name).read_text().split()[2]) for name in ("tcp_rmem", "tcp_wmem"))
    except (OSError, ValueError, IndexError):
        return 4 * MiB


def channels_for_link(rate_gbit_s: float, rtt_s: float, socket_buffer_bytes: int, channels_now: int = 0) -> int:
    """Connections to one peer for a link of ``rate_gbit_s`` and ``rtt_s`` (at most 16; without
    ``channels_now``, at least 2).

    One connection carries at most socket_buffer / rtt, so the bandwidth-delay
    product needs ceil(BDP / socket_buffer) of them. When the rate is a probe's,
    measured over ``channels_now`` connections that were at WINDOW_BOUND of their
    ceiling or closer, the link may be faster than the probe could see: twice as many.
    Never fewer than ``channels_now``.
    """
    bdp_bytes = rate_gbit_s * 1e9 / 8 * rtt_s
    need = max(channels_now or 2, math.ceil(bdp_bytes / socket_buffer_bytes))
    if channels_now and rtt_s > 0:
        ceiling_gbit_s = channels_now * socket_buffer_bytes * 8 / rtt_s / 1e9
        if rate_gbit_s >= WINDOW_BOUND * ceiling_gbit_s:
            need = max(need, 2 * channels_now)
    return min(MAX_CHANNELS, need)


def tune_for_link(
    rate_gbit_s: float,
    rtt_s: float,
    base: TransportConfig | None = None,
    socket_buffer_bytes: int = 4 * MiB,
) -> TransportConfig:
    """Settings for a link of ``rate_gbit_s`` and round-trip ``rtt_s``.

    The bandwidth-delay product BDP = rate * rtt is the number of bytes that must
    be in flight to keep the link busy; every window on the path must hold it:

    - TCP: one connection carries at most (socket buffer) / rtt. Linux caps
      autotuned buffers at tcp_wmem/tcp_rmem max (4-6 MiB by default), i.e. about
      0.3 Gbit/s at 100 ms, so we open ceil(BDP / socket_buffer_bytes) channels
      (at least 2: on loopback a second connection lets gRPC's I/O use a second
      core; at most 16). Raise the sysctls and pass ``socket_buffer_bytes`` to
      use fewer connections.
    - HTTP/2: each stream's window must cover its share of the BDP or the sender
      idles one rtt per window; ``lookahead_bytes`` starts streams there instead of
      at 64 KiB, and BDP probing keeps adjusting it if the link changes.
    - Chunks (gRPC messages): ``base.chunk_bytes`` whatever the link: a message
      costs CPU per byte on both ends (gRPC copies it into one buffer, then into
      a Python ``bytes``), least at about 1 MiB on loopback, while the windows,
      not the message size, keep a long link full.
    - Frames: the largest HTTP/2 frame (16 MiB) so fewer frame headers and
      syscalls are spent per byte at multi-Gbit/s.
    - Deadlines: an upload must be allowed to run at a quarter of the link rate,
      and a chunk at that rate must arrive well within the idle timeout.
    - Uploads: one sender may keep one upload per connection open (within the
      server's slots), so its uploads can use every connection.
    """
    require(rate_gbit_s > 0, "rate_gbit_s", f"must be > 0, got {rate_gbit_s}")
    require(rtt_s >= 0, "rtt_s", f"must be >= 0, got {rtt_s}")
    require(socket_buffer_bytes > 0, "socket_buffer_bytes", "must be > 0")
    base = base or TransportConfig()
    bdp_bytes = rate_gbit_s * 1e9 / 8 * rtt_s
    channels = channels_for_link(rate_gbit_s, rtt_s, socket_buffer_bytes)
    chunk_bytes = base.chunk_bytes
    lookahead_bytes = int(min(1 << 30, max(4 * chunk_bytes, 2 * bdp_bytes / channels)))
    cfg = dataclasses.replace(
        base,
        channels=channels,
        max_inflight_uploads=max(base.max_inflight_uploads, 2 * channels),
        # One upload per connection keeps every connection busy; the server's slots stay the cap.
        max_uploads_per_sender=min(base.max_concurrent_uploads, max(base.max_uploads_per_sender, channels)),
        bdp_probe=True,
        lookahead_bytes=lookahead_bytes,
        max_frame_bytes=MAX_FRAME_BYTES,
        read_chunk_bytes=4 * MiB,
        keepalive_timeout_s=max(base.keepalive_timeout_s, 4 * rtt_s),
        min_upload_rate_gbit_s=rate_gbit_s / 4,
        stream_idle_timeout_s=max(base.stream_idle_timeout_s, 4 * chunk_bytes * 8 / (rate_gbit_s / 4 * 1e9)),
    )
    cfg.validate()
    return cfg
