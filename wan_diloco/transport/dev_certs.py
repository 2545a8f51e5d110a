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


def _san(hosts) -> str:
    return ",".join(f"IP:{h}" if h.replace(".", "").isdigit() or ":" in h else f"DNS:{h}" for h in hosts)


def _new_ca(d: Path, days: int, name: str) -> None:
    _openssl("req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", str(days), "-subj", f"/CN={name}",
             cwd=d)


def _sign(d: Path, name: str, common_name: str, ext: str, days: int) -> None:
    """``name.key`` and ``name.pem`` (signed by the CA in ``d``) with the X.509 extensions ``ext``."""
    (d / f"{name}.ext").write_text(ext + "\n")
    _openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={common_name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", str(days), "-extfile", f"{name}.ext", cwd=d)
    for leftover in (f"{name}.csr", f"{name}.ext"):
        (d / leftover).unlink()


def make_dev_certs(directory: str | Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> dict[str, TlsConfig]:
    """Write a CA, a server cert for ``hosts`` and a client cert into ``directory``.

    Returns TlsConfigs: ``server`` / ``client`` (server-authenticated TLS) and
    ``server_mutual`` / ``client_mutual`` (both sides present certificates).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _new_ca(d, 3, "wan-diloco test CA")
    _sign(d, "server", "wan-diloco server", f"subjectAltName={_san(hosts)}", 3)
    _sign(d, "client", "learner-0", "extendedKeyUsage=clientAuth", 3)  # CN: the sender it may speak as
    ca, p = str(d / "ca.pem"), lambda n: str(d / n)
    return {
        "server": TlsConfig(cert_file=p("server.pem"), key_file=p("server.key")),
        "client": TlsConfig(ca_file=ca),
        "server_mutual": TlsConfig(cert_file=p("server.pem"), key_file=p("server.key"), ca_file=ca, mutual=True),
        "client_mutual": TlsConfig(cert_file=p("client.pem"), key_file=p("client.key"), ca_file=ca, mutual=True),
    }


def make_run_certs(directory: str | Path, syncer_hosts: tuple[str, ...], learners: int, days: int = 30) -> list[Path]:
    """A run's own small PKI in ``directory``: a CA, the syncer's certificate for ``syncer_hosts`` (the
    names or addresses learners dial) and one client certificate per learner (``learner-N``), for
    mutual TLS. Keys are written 0600. Returns the files written. For trials and small clusters: keys
    are unencrypted and the CA key sits beside them (keep it off the learner hosts)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if any((d / n).exists() for n in ("ca.pem", "ca.key", "syncer.pem")):
        raise FileExistsError(f"{d} already holds certificates; remove them or pick another directory")
    _new_ca(d, days, "wan-diloco run CA")
    _sign(d, "syncer", syncer_hosts[0], f"subjectAltName={_san(syncer_hosts)}\nextendedKeyUsage=serverAuth", days)
    for m in range(learners):
        _sign(d, f"learner-{m}", f"learner-{m}", "extendedKeyUsage=clientAuth", days)
    files = sorted(d.glob("*.pem")) + sorted(d.glob("*.key"))
    for f in d.glob("*.key"):
        f.chmod(0o600)
    (d / "ca.srl").unlink(missing_ok=True)
    return files
