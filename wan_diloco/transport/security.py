"""Credentials: bearer tokens on every call, TLS / mutual TLS, cleartext only on loopback."""
from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path
from typing import Sequence

import grpc

from ..config import ConfigError
from .config import TlsConfig

AUTH_HEADER = "authorization"


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token``."""
    return ((AUTH_HEADER, f"Bearer {token}"),)


def token_matches(metadata: Sequence[tuple[str, str | bytes]] | None, token: str) -> bool:
    """True if the call metadata holds exactly our bearer token (constant-time compare)."""
    expected = f"Bearer {token}".encode()
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            got = value.encode() if isinstance(value, str) else bytes(value)
            return hmac.compare_digest(got, expected)
    return False


def check_token(token: str) -> str:
    if not isinstance(token, str) or len(token) < 8 or any(c.isspace() for c in token):
        raise ConfigError("token: must be a string of at least 8 non-space characters")
    return token


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); a bad address is a ConfigError."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"address {address!r}: expected host:port")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_secure_or_loopback(address: str, tls: TlsConfig | None, allow_insecure_remote: bool) -> None:
    """Refuse cleartext to anything but loopback unless explicitly allowed."""
    host, _ = split_host_port(address)
    if tls is None and not allow_insecure_remote and not is_loopback(host):
        raise ConfigError(
            f"address {address!r}: cleartext is only allowed on loopback; "
            "configure [transport.tls] or set allow_insecure_remote = true"
        )


def _read(path: str, what: str) -> bytes:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"tls.{what}: file {p} not found")
    return p.read_bytes()


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    """TLS server credentials; with ``tls.mutual`` clients must present a cert from ``ca_file``."""
    tls.validate()
    if not tls.cert_file:
        raise ConfigError("tls.cert_file: a TLS server needs cert_file and key_file")
    chain = _read(tls.cert_file, "cert_file")
    pair = (_read(tls.key_file, "key_file"), chain)
    roots = _read(tls.ca_file, "ca_file") if tls.ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=roots, require_client_auth=tls.mutual)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """TLS client credentials; presents our certificate when ``tls.mutual``."""
    tls.validate()
    roots = _read(tls.ca_file, "ca_file") if tls.ca_file else None
    key = _read(tls.key_file, "key_file") if tls.mutual else None
    chain = _read(tls.cert_file, "cert_file") if tls.mutual else None
    return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=chain)
