"""Why a syncer cannot be reached, in words a person can act on (before gRPC's own retries hide it).

gRPC waits for a channel to become ready until a call's deadline and then says
only DEADLINE_EXCEEDED or UNAVAILABLE. A learner asks :func:`diagnose` first:
a plain TCP connection tells a refused port from a silent address or a name
that does not resolve, and the first bytes of the handshake tell a TLS syncer
from a cleartext one and an untrusted certificate from a missing one.
"""
from __future__ import annotations

import socket
import ssl

from .config import TlsConfig

# HTTP/2 connection preface and an empty SETTINGS frame: a cleartext gRPC server answers with SETTINGS.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_TLS_RECORD_TYPES = (0x15, 0x16)  # alert, handshake: what a TLS server sends to bytes that are not TLS


class Diagnosis(str):
    """Why a syncer cannot be reached (the text), and whether waiting can help: ``lasting`` is True for a
    TLS setting the two sides disagree on (TLS on one side only, an untrusted certificate, a client
    certificate missing), which no retry heals; a port not yet open or a host not yet up may."""

    lasting: bool = False


def _lasting(text: str) -> Diagnosis:
    why = Diagnosis(text)
    why.lasting = True
    return why


def split_target(target: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError naming the target otherwise."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{target!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def diagnose(target: str, tls: TlsConfig | None, timeout_s: float = 5.0) -> Diagnosis | None:
    """None if ``target`` answers as a gRPC server with the TLS setting ``tls`` expects; else why not
    (a ``Diagnosis``: a str that says whether it can heal)."""
    why = _diagnose(target, tls, timeout_s)
    return why if why is None or isinstance(why, Diagnosis) else Diagnosis(why)


def _diagnose(target: str, tls: TlsConfig | None, timeout_s: float) -> str | None:
    try:
        host, port = split_target(target)
    except ValueError as e:
        return str(e)
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except socket.gaierror:
        return f"cannot resolve the name {host!r}"
    except ConnectionRefusedError:
        return "connection refused (no syncer listening on that port: not started yet, or another port?)"
    except (socket.timeout, TimeoutError):
        return f"no answer within {timeout_s:g} s (a firewall, a wrong address, or the host is down?)"
    except OSError as e:
        return f"cannot connect: {e.strerror or e}"
    with sock:
        sock.settimeout(timeout_s)
        if tls is not None:
            return _tls_handshake(sock, host, tls)
        why = _cleartext(sock)
    if why == _CLOSED_AT_ONCE and _speaks_tls(host, port, timeout_s):  # gRPC's TLS server just hangs up
        return _lasting(_EXPECTS_TLS)
    return why


_EXPECTS_TLS = "the syncer expects TLS but this learner has no [transport.tls] (set it on both sides or neither)"
_CLOSED_AT_ONCE = "the syncer closed the connection at once (does it expect TLS? [transport.tls] must match)"


def _speaks_tls(host: str, port: int, timeout_s: float) -> bool:
    """True if a TLS handshake (without checking the certificate) gets a TLS answer on ``host:port``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, ctx.wrap_socket(raw):
            return True
    except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError):
        return False  # hung up again (a server going down, say): no sign of TLS, so it may heal
    except ssl.SSLError as e:  # a TLS alert (e.g. a client certificate wanted) is TLS too; garbage is not
        return "WRONG_VERSION_NUMBER" not in str(e) and "record layer failure" not in str(e)
    except OSError:
        return False


def _cleartext(sock: socket.socket) -> str | None:
    try:
        sock.sendall(_H2_PREFACE)
        first = sock.recv(9)
    except (socket.timeout, TimeoutError):
        return "the syncer accepted the connection but did not answer HTTP/2 (is that port the syncer's gRPC port?)"
    except ConnectionResetError:
        first = b""
    except OSError as e:
        return f"connection failed: {e.strerror or e}"
    if first and first[0] in _TLS_RECORD_TYPES:
        return _lasting(_EXPECTS_TLS)
    if len(first) >= 4 and first[3] == 0x04:  # a SETTINGS frame: an HTTP/2 server
        return None
    if not first:
        return _CLOSED_AT_ONCE
    return "something that is not a gRPC server answered on that port"


def _tls_handshake(sock: socket.socket, host: str, tls: TlsConfig) -> str | None:
    ctx = ssl.create_default_context(cafile=tls.ca_file or None)
    ctx.set_alpn_protocols(["h2"])
    if tls.cert_file:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    try:
        with ctx.wrap_socket(sock, server_hostname=tls.server_name or host):
            return None
    except ssl.SSLCertVerificationError as e:
        return _lasting(f"TLS: the syncer's certificate is not trusted here ({e.verify_message}); check ca_file"
                        f"{' and server_name' if not tls.server_name else ''} in [transport.tls]")
    except ssl.SSLError as e:
        if "WRONG_VERSION_NUMBER" in str(e) or "record layer failure" in str(e):
            return _lasting("the syncer does not speak TLS but this learner has [transport.tls] (set it on both "
                            "sides or neither)")
        if "CERTIFICATE_REQUIRED" in str(e) or "HANDSHAKE_FAILURE" in str(e):
            return _lasting("TLS: the syncer wants a client certificate this learner did not give (cert_file/"
                            "key_file, mutual)")
        return f"TLS handshake failed: {e.reason or e}"
    except (socket.timeout, TimeoutError):
        return "TLS handshake: no answer (is that port the syncer's gRPC port?)"
    except OSError as e:
        return f"TLS handshake failed: {e.strerror or e}"
