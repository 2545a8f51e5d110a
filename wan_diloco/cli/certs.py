"""`wan-diloco certs --dir DIR --syncer-host HOST [--syncer-host HOST ...] (--learners N | --config F)`:
a small PKI for a run across machines (mutual TLS): a CA, the syncer's certificate, one client
certificate per learner, and the `[transport.tls]` block each host's run file needs.

Uses the `openssl` command. For trials and small clusters: keys are unencrypted and valid for
`--days`; the CA key must stay on the machine that ran this (it can mint more learners).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from wan_diloco import spec as spec_lib
from wan_diloco.cli.args import count
from wan_diloco.config import require


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", required=True, type=Path, help="where to write ca.pem, syncer.pem, learner-N.pem and keys")
    p.add_argument("--syncer-host", action="append", required=True, metavar="HOST",
                   help="a DNS name or IP address learners use to reach the syncer (repeat for several)")
    p.add_argument("--learners", type=count, help="learner certificates to make (default: run.learners of --config)")
    p.add_argument("--config", metavar="TOML", help="the run file (for run.learners)")
    p.add_argument("--days", type=count, default=30, help="validity in days (default 30)")
    p.add_argument("--install-dir", metavar="DIR",
                   help="where the files will sit on each host, for the printed config (default: --dir)")


def tls_block(where: str, name: str) -> str:
    return (f'[transport.tls]\ncert_file = "{where}/{name}.pem"\nkey_file = "{where}/{name}.key"\n'
            f'ca_file = "{where}/ca.pem"\nmutual = true\n')


def run(args: argparse.Namespace) -> int:
    from wan_diloco.transport.dev_certs import make_run_certs

    learners = args.learners if args.learners is not None else spec_lib.load(args.config).run.learners
    require(learners >= 1, "learners", f"must be >= 1, got {learners}")
    require(args.days >= 1, "days", f"must be >= 1, got {args.days}")
    hosts = tuple(h.strip() for h in args.syncer_host)
    require(all(hosts) and all(" " not in h and "," not in h for h in hosts), "syncer-host",
            f"expected DNS names or IP addresses, got {list(args.syncer_host)}")
    try:
        make_run_certs(args.dir, hosts, learners, args.days)
    except FileExistsError as e:
        require(False, "dir", str(e))
    except RuntimeError as e:  # no openssl
        require(False, "certs", str(e))
    where = args.install_dir or str(args.dir.resolve())
    print(f"wrote a CA, the syncer's certificate ({', '.join(hosts)}) and {learners} learner certificates "
          f"to {args.dir} (valid {args.days} days; keys 0600)\n")
    print(f"syncer host: copy ca.pem, syncer.pem, syncer.key to {where}; its run file:\n{tls_block(where, 'syncer')}")
    print(f"learner N's host: copy ca.pem, learner-N.pem, learner-N.key to {where}; its run file "
          f"(learner 0 shown; each learner its own):\n{tls_block(where, 'learner-0')}")
    print(f"keep ca.key off the learner hosts. Learners dial the syncer as {hosts[0]}:PORT "
          "(a name or address in its certificate).")
    print("a learner certificate's name (CN learner-N) is that learner's id: its host can speak only as learner N.")
    print(f"or one run file for every host, saying only [transport.tls] mutual = true: each host names its own "
          f"files, e.g. learner N: --tls-cert {where}/learner-N.pem --tls-key {where}/learner-N.key "
          f"--tls-ca {where}/ca.pem (or $WAN_DILOCO_TLS_CERT, _KEY, _CA)")
    return 0
