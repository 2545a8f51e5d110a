"""Credentials (bearer tokens, TLS / mutual TLS, cleartext only on loopback) and listen addresses."""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import socket
import ssl
from pathlib import Path
from typing import Sequence

import grpc

from ..config import ConfigError
from .config import TlsConfig

AUTH_HEADER = "authorization"


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token``."""
    return ((AUTH_HEADER, f"Bearer {token}"),)


def bearer_matches(value: str | bytes | None, token: str) -> bool:
    """True if an authorization value is exactly ``Bearer <token>`` (constant-time compare)."""
    if value is None:
        return False
    try:
        got = value.encode() if isinstance(value, str) else bytes(value)
    except UnicodeEncodeError:  # lone surrogates: not our token either
        return False
    return hmac.compare_digest(got, f"Bearer {token}".encode())


def token_matches(metadata: Sequence[tuple[str, str | bytes]] | None, token: str) -> bool:
    """True if the call metadata holds exactly our bearer token (constant-time compare)."""
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            return bearer_matches(value, token)
    return False


DERIVED_PREFIX = "wdl1."  # a sender's own token: it can only speak as that sender


def derive_token(master: str, sender: str) -> str:
    """The token of one sender under per-sender credentials (``transport.per_learner_tokens``):
    HMAC-SHA256 of the sender's name under the run's token. A learner given its own can speak only as
    itself, and the run's token never has to leave the syncer's host (``wan-diloco token``)."""
    return DERIVED_PREFIX + hmac.new(check_token(master).encode(), sender.encode(), hashlib.sha256).hexdigest()


def call_token(token: str, sender: str) -> str:
    """The token a client holding ``token`` puts on a call as ``sender``: a sender's own token as it is; the
    run's token derived for ``sender``, so the run's token itself never goes on the wire and a syncer with
    per-sender credentials accepts it (who holds the run's token may be any sender anyway)."""
    return token if token.startswith(DERIVED_PREFIX) else derive_token(token, sender)


def certificate_identity(tls: TlsConfig | None) -> bool:
    """True when a server with ``tls`` takes a caller's id from its client certificate (mutual TLS with
    ``identity_from_cert``): a call that declares another sender is refused."""
    return tls is not None and tls.mutual and tls.identity_from_cert


def certificate_name(auth_context: dict | None) -> str | None:
    """The common name (CN) of the verified client certificate in a gRPC call's ``auth_context()``."""
    names = (auth_context or {}).get("x509_common_name") or ()
    if len(names) != 1:
        return None
    name = names[0]
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)


def require_bound_identity(address: str, transport) -> None:
    """Refuse a syncer off loopback where one shared token lets any holder speak for any learner, unless
    ``transport.allow_shared_token`` says so (``transport`` is a TransportConfig)."""
    host, _ = split_host_port(address)
    if (is_loopback(host) or transport.per_learner_tokens or certificate_identity(transport.tls)
            or transport.allow_shared_token):
        return
    raise ConfigError(
        f"transport.allow_shared_token: the syncer would listen on {address} (not loopback) with one shared "
        "token (transport.per_learner_tokens = false, no per-learner certificates), so any token holder could "
        "speak for any learner; turn per_learner_tokens back on, or set allow_shared_token = true to run so anyway")


def check_token(token: str, where: str = "token") -> str:
    """``token`` if it can be a bearer token; else a ConfigError naming ``where`` it came from."""
    if not isinstance(token, str) or len(token) < 8 or any(c.isspace() for c in token):
        raise ConfigError(f"{where}: must be a string of at least 8 non-space characters")
    return token


MAX_PORT = 65535


def check_port(port: int, where: str) -> int:
    """``port`` if it is a TCP port (0: any free one); else a ConfigError (a ValueError) naming it.

    gRPC would silently listen on ``port % 65536`` instead, asyncio raise OverflowError."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_PORT:
        raise ConfigError(f"{where}: port {port!r} is outside the valid range 0..{MAX_PORT} (0: any free port)")
    return port


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); a bad address is a ConfigError."""
    host, sep, port = address.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not host:
        raise ConfigError(f"address {address!r}: expected host:port")
    return host.strip("[]"), check_port(int(port), f"address {address!r}")


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


def _path(path: str, what: str) -> str:
    if not Path(path).is_file():
        raise ConfigError(f"tls.{what}: file {path} not found")
    return path


def _read(path: str, what: str) -> bytes:
    return Path(_path(path, what)).read_bytes()


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


def server_ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """``server_credentials``' settings for a socket the gRPC core does not own (direct stripes)."""
    tls.validate()
    if not tls.cert_file:
        raise ConfigError("tls.cert_file: a TLS server needs cert_file and key_file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(_path(tls.cert_file, "cert_file"), _path(tls.key_file, "key_file"))
    if tls.mutual:
        ctx.load_verify_locations(_path(tls.ca_file, "ca_file"))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """``channel_credentials``' settings for a socket the gRPC core does not own (direct stripes)."""
    tls.validate()
    ctx = ssl.create_default_context(cafile=_path(tls.ca_file, "ca_file") if tls.ca_file else None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.mutual:
        ctx.load_cert_chain(_path(tls.cert_file, "cert_file"), _path(tls.key_file, "key_file"))
    return ctx


def peer_common_name(ssl_object) -> str | None:
    """The common name of a verified client certificate on a TLS socket (``certificate_name``'s rule:
    exactly one, else None)."""
    cert = ssl_object.getpeercert() if ssl_object is not None else None
    names = [v for rdn in (cert or {}).get("subject", ()) for k, v in rdn if k == "commonName"]
    return names[0] if len(names) == 1 else None


class ListenError(OSError):
    """A server cannot listen on its address; the one-line text says where and why."""

    def __init__(self, address: str, reason: str, errno: int | None = None):
        super().__init__(f"cannot listen on {address}: {reason}")
        self.address = address
        self.errno = errno  # strerror stays unset, so str() is the line above, without "[Errno n]"


def listen_error(address: str, error: OSError) -> ListenError:
    """``error`` from binding ``address`` as a ListenError (``asyncio`` words it for its own sockaddr)."""
    if isinstance(error, socket.gaierror):
        return ListenError(address, f"cannot resolve the host: {error.strerror}", error.errno)
    if error.errno:
        return ListenError(address, os.strerror(error.errno).lower(), error.errno)
    return ListenError(address, str(error))


def why_not_listening(address: str) -> ListenError:
    """Why binding ``address`` fails, found by trying it: gRPC only says that it failed."""
    host, port = split_host_port(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return listen_error(address, e)
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
                sock.bind(sockaddr)
        except OSError as e:
            return listen_error(address, e)
    return ListenError(address, "gRPC could not bind it (set GRPC_VERBOSITY=debug for its reason)")
