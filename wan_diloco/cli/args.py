"""Argument types shared by the subcommands."""
from __future__ import annotations

import argparse
import math


def count(text: str) -> int:
    """A whole number that may be written like 2e6, 2_000_000 or 2000000 (token budgets, chips, steps)."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(value)


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    """This host's TLS files: one run file serves every host, each naming its own here (or in the
    environment); a flag wins over the environment, the environment over the run file."""
    from wan_diloco.host_tls import ENV

    g = p.add_argument_group("TLS files of this host (over the run file's [transport.tls])")
    g.add_argument("--tls-cert", metavar="PEM", help=f"this host's certificate (${ENV['cert_file']})")
    g.add_argument("--tls-key", metavar="PEM", help=f"its private key (${ENV['key_file']})")
    g.add_argument("--tls-ca", metavar="PEM", help=f"the CA that signed the peer's certificate (${ENV['ca_file']})")
    g.add_argument("--tls-mutual", action="store_true",
                   help="both sides show certificates (as transport.tls.mutual = true)")
    g.add_argument("--tls-server-name", metavar="NAME", default="",
                   help="learner: the name in the syncer's certificate, when --syncer is an address")


def host_tls(args: argparse.Namespace, cfg, role: str):
    """(``cfg`` with this host's TLS files from ``args``' flags and the environment, their origins):
    ``host_tls.resolve``."""
    from wan_diloco.host_tls import resolve

    flags = {"cert_file": args.tls_cert, "key_file": args.tls_key, "ca_file": args.tls_ca}
    return resolve(cfg, role, flags, mutual=args.tls_mutual, server_name=args.tls_server_name)
