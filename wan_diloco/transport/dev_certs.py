"""Throwaway CA and certificates for tests, benchmarks and local trials (openssl CLI).

Not for production: keys are unencrypted and valid for a few days. Real
deployments bring their own PKI and point ``TlsConfig`` at it.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .config import TlsConfig

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise RuntimeError("the openssl command is needed to make test certificates")
    subprocess.run([exe, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_dev_certs(directory: str | Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> dict[str, TlsConfig]:
    """Write a CA, a server cert for ``hosts`` and a client cert into ``directory``.

    Returns TlsConfigs: ``server`` / ``client`` (server-authenticated TLS) and
    ``server_mutual`` / ``client_mutual`` (both sides present certificates).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", "3",
             "-subj", "/CN=wan-diloco test CA", cwd=d)
    san = ",".join(f"IP:{h}" if h.replace(".", "").isdigit() or ":" in h else f"DNS:{h}" for h in hosts)
    (d / "server.ext").write_text(f"subjectAltName={san}\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=wan-diloco {name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "3", "-extfile", f"{name}.ext", cwd=d)
    ca, p = str(d / "ca.pem"), lambda n: str(d / n)
    return {
        "server": TlsConfig(cert_file=p("server.pem"), key_file=p("server.key")),
        "client": TlsConfig(ca_file=ca),
        "server_mutual": TlsConfig(cert_file=p("server.pem"), key_file=p("server.key"), ca_file=ca, mutual=True),
        "client_mutual": TlsConfig(cert_file=p("client.pem"), key_file=p("client.key"), ca_file=ca, mutual=True),
    }
