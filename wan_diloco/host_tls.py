"""TLS files each host names for itself, so one run file is copied to every host unchanged.

The run file says whether the run uses TLS (``[transport.tls] mutual = true``, with no paths); each host
names its own certificate, key and CA with ``--tls-cert``/``--tls-key``/``--tls-ca`` or the environment
variables in :data:`ENV`. For each file a flag wins over the environment and the environment over the run
file. :func:`resolve` gives the spec the process runs with, checked as a whole, every error naming where
the wrong value came from. Paths never enter the settings fingerprint: hosts differ in them.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from wan_diloco.config import require
from wan_diloco.spec import RunSpec

FILES = ("cert_file", "key_file", "ca_file")
FLAGS = {"cert_file": "--tls-cert", "key_file": "--tls-key", "ca_file": "--tls-ca"}
ENV = {"cert_file": "WAN_DILOCO_TLS_CERT", "key_file": "WAN_DILOCO_TLS_KEY", "ca_file": "WAN_DILOCO_TLS_CA"}
FROM_FILE = "transport.tls."  # an origin naming the run file's key: "transport.tls.ca_file"


def _ways(key: str) -> str:
    return f"{FLAGS[key]} (or ${ENV[key]})"


def resolve(spec: RunSpec, role: str, flags: Mapping[str, str | None] | None = None, mutual: bool = False,
            server_name: str = "", environ: Mapping[str, str] | None = None) -> tuple[RunSpec, dict[str, str]]:
    """(``spec`` with ``[transport.tls]`` as this host gives it, where each file (and ``mutual``) came from:
    ``{key: origin}``, an origin being a flag, a variable or ``transport.tls.KEY``). ``role`` is "syncer" (a TLS server needs
    its own certificate) or "learner"; ``flags`` maps ``cert_file``/``key_file``/``ca_file`` to the flags'
    values; ``mutual``/``server_name`` are ``--tls-mutual``/``--tls-server-name``. Without TLS anywhere
    the spec is returned as it is. ConfigError, one line naming the flag, variable or key, on a file that
    is not there, a certificate without its key, mutual TLS without a CA or without this host's certificate.
    """
    environ = os.environ if environ is None else environ
    flags = flags or {}
    file = spec.transport.tls
    paths: dict[str, str] = {}
    origin: dict[str, str] = {}
    for key in FILES:
        for where, value in ((FLAGS[key], flags.get(key)), (ENV[key], environ.get(ENV[key])),
                             (FROM_FILE + key, getattr(file, key, ""))):
            if value:  # an empty variable is an unset one
                paths[key], origin[key] = value, where
                break
    if file is None and not paths and not mutual and not server_name:
        return spec, {}
    for key, path in paths.items():
        require(Path(path).is_file(), origin[key], f"file {path} not found")
    for have, lack in (("cert_file", "key_file"), ("key_file", "cert_file")):
        require(have not in paths or lack in paths, origin.get(have, ""),
                f"{'a certificate needs its key' if lack == 'key_file' else 'a key needs its certificate'}: "
                f"give {_ways(lack)} too")
    is_mutual = mutual or (file is not None and file.mutual)
    said = "--tls-mutual" if mutual else FROM_FILE + "mutual"
    if is_mutual:
        require("ca_file" in paths, said, f"mutual TLS needs a CA to verify the peer's certificate: give "
                                          f"{_ways('ca_file')}")
        require("cert_file" in paths, said, f"mutual TLS needs this host's certificate and key: give "
                                            f"{_ways('cert_file')} and {_ways('key_file')}")
    if role == "syncer":
        require("cert_file" in paths, FLAGS["cert_file"], f"a TLS syncer needs its certificate and key: give "
                                                          f"{_ways('cert_file')} and {_ways('key_file')}")
    tls = {**paths, "mutual": is_mutual}
    if is_mutual:
        origin["mutual"] = said
    if server_name:
        tls["server_name"] = server_name
    # The file's other keys (identity_from_cert, server_name) stand unless a flag replaced them.
    return spec.with_changes(transport={"tls": {**_file_keys(file), **tls}}), origin


def _file_keys(file) -> dict:
    if file is None:
        return {}
    return {"server_name": file.server_name, "identity_from_cert": file.identity_from_cert}
