"""What a syncer says once it listens: its address, its dashboard's URL and the command a learner host runs
to join, so whoever starts learners elsewhere copies one line instead of composing it from the docs."""
from __future__ import annotations

import os
import shlex
import socket

from wan_diloco.host_tls import FLAGS, FROM_FILE
from wan_diloco.spec import TOKEN_ENV, RunSpec

EVERY_INTERFACE = ("0.0.0.0", "::", "")


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _token_from_file(cfg: RunSpec) -> bool:
    """Whether this syncer runs with the run file's token, which reaches every host with the file ($WAN_DILOCO_TOKEN
    wins over it: then learners need theirs in the environment too)."""
    return bool(cfg.run.token) and not os.environ.get(TOKEN_ENV)


def announcement(cfg: RunSpec, config: str | None, port: int, status_port: int | None,
                 tls_origin: dict[str, str]) -> dict:
    """The fields the syncer's ``listening`` event carries: ``address`` (what it is bound to), ``dial``
    (what a learner names in ``--syncer``), ``status_url`` (None when off) and ``join`` (the learner's
    command, learner N as ``N``; None for a shard, since a learner names every shard)."""
    host = cfg.run.host
    # Bound to every interface, the syncer cannot know which of its names the learners reach it by: this
    # host's name is the likeliest (with TLS it must be one in the syncer's certificate).
    dial_host = socket.gethostname() if host in EVERY_INTERFACE else host
    dial = _hostport(dial_host, port)
    tls = cfg.transport.tls
    status_url = (None if status_port is None
                  else f"{'https' if tls is not None else 'http'}://{_hostport(dial_host, status_port)}/")
    return {"address": _hostport(host or "0.0.0.0", port), "dial": dial, "status_url": status_url,
            "join": None if cfg.syncer.shards > 1 else _command(cfg, config, dial, tls_origin)}


def _command(cfg: RunSpec, config: str | None, dial: str, tls_origin: dict[str, str]) -> str:
    words = []
    if not _token_from_file(cfg):
        words.append('WAN_DILOCO_TOKEN="$(cat learner-N.token)"' if cfg.transport.per_learner_tokens
                     else 'WAN_DILOCO_TOKEN="$(cat token)"')
    words += ["wan-diloco", "learner"] + (["--config", shlex.quote(config)] if config else [])
    words += ["--id", "N", "--syncer", dial]
    tls = cfg.transport.tls
    if tls is not None:
        words += _tls_flags(tls, tls_origin)
    return " ".join(words)


def _tls_flags(tls, origin: dict[str, str]) -> list[str]:
    """The flags learner N needs for what the run file does not give every host: the CA the syncer was
    given, and with mutual TLS learner N's own pair, named as `wan-diloco certs` names it, next to the CA."""
    given = lambda key: getattr(tls, key) and not origin.get(key, FROM_FILE).startswith(FROM_FILE)  # noqa: E731
    out = []
    if given("ca_file"):
        out += [FLAGS["ca_file"], shlex.quote(tls.ca_file)]
    if tls.mutual and given("cert_file"):
        where = os.path.dirname(tls.ca_file or tls.cert_file)
        out += [FLAGS["cert_file"], shlex.quote(os.path.join(where, "learner-N.pem")),
                FLAGS["key_file"], shlex.quote(os.path.join(where, "learner-N.key"))]
    if origin.get("mutual") == "--tls-mutual":
        out.append("--tls-mutual")
    return out


def lines(cfg: RunSpec, config: str | None, said: dict, shard: int = 0) -> list[str]:
    """``announcement``'s fields as the few lines a person reads on the syncer's terminal."""
    name = f"syncer-{shard}" if cfg.syncer.shards > 1 else "syncer"
    where = said["address"]
    if cfg.run.host in EVERY_INTERFACE:
        where += f" (every interface; this host is {said['dial'].rpartition(':')[0]})"
    out = [f"{name}: listening on {where}"]
    if said["status_url"]:
        out.append(f"{name}: dashboard and /status at {said['status_url']} (the run's token opens them)")
    if said["join"] is None:
        out.append(f"{name}: learners name every shard's HOST:PORT in --syncer, in shard order; shard {shard} "
                   f"is {said['dial']}")
        return out
    out.append(f"{name}: learner N (0..{cfg.run.learners - 1}) joins from its host with:")
    out.append(f"  {said['join']}")
    if not _token_from_file(cfg) and cfg.transport.per_learner_tokens:
        token = " ".join(["wan-diloco token"] + (["--config", shlex.quote(config)] if config else []) + ["--learner N"])
        out.append(f"{name}: learner-N.token, made here: {token} > learner-N.token "
                   f"(a learner on this host: WAN_DILOCO_TOKEN=$({token}))")
    return out
