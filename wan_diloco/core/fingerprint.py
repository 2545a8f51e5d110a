"""The settings both ends of a run must agree on, as one short string a learner sends with its
metadata (its hello, and every metadata after it) and the syncer compares before it accepts anything
else from that learner.

A fingerprint is ``component=value;component=value``; a value is ``key:v,key:v`` (small settings, sent
as they are so a mismatch can name the key and both values; a key names its config key within the
component's table, or its own table when it has a dot) or ``#hash`` (the layout: too long to send).
Components, in order: ``protocol`` (``core.messages.PROTOCOL_VERSION``), ``layout`` (the fragmenter
and, as ``fragments``, a hash of every fragment's tensor names, shapes and dtype), ``learner`` (the
schedule: H, P, the offset rule, τ; eager updates and their outer lr when on), ``codec`` (the fragment
format's version and every setting of it), ``syncer`` (the shard plan), ``model`` (only with ``[model]
init``: a digest of the parameters read, Θ(0)), ``transport`` (only with direct stripes: their port), ``run`` (run id and number of learners). Built by
``assemble.Assembly.fingerprint``; pure here.
"""
from __future__ import annotations

from typing import Mapping

import xxhash

from wan_diloco.core.messages import MAX_FINGERPRINT_CHARS

SETTINGS_DIFFER = "settings differ from the syncer's"  # in the refusal: a learner stops on it, not retries
# What a mismatch in each component is called in the one line the operator reads.
LABELS = {"protocol": "protocol version", "layout": "layout", "learner": "schedule", "codec": "codec format",
          "syncer": "shard plan", "model": "starting parameters", "transport": "transport", "run": "run"}
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.+/#*")
_MAX_VALUE_CHARS = 24  # longer values (a long run id) travel as a hash
MAX_CHARS = MAX_FINGERPRINT_CHARS  # ``Metadata.fingerprint``; past it, the longest components go as hashes


def digest(text: str) -> str:
    return "#" + xxhash.xxh3_64_hexdigest(text.encode())[:8]


def value(v: object) -> str:
    """A setting as it travels: itself when short and plain, else its hash."""
    text = str(int(v)) if isinstance(v, bool) else str(v)
    return text if len(text) <= _MAX_VALUE_CHARS and set(text) <= _SAFE else digest(text)


def encode(components: Mapping[str, Mapping[str, object] | str]) -> str:
    """``{component: {key: setting} | "#hash"}`` -> the fingerprint string."""
    bodies = {name: settings if isinstance(settings, str) else ",".join(f"{k}:{value(v)}" for k, v in settings.items())
              for name, settings in components.items()}
    while len(text := ";".join(f"{n}={b}" for n, b in bodies.items())) > MAX_CHARS:
        longest = max(bodies, key=lambda n: len(bodies[n]))
        if bodies[longest].startswith("#"):
            raise ValueError(f"fingerprint: {len(bodies)} components do not fit {MAX_CHARS} characters")
        bodies[longest] = digest(bodies[longest])  # still compared; a mismatch names the component only
    return text


def _decode(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(";"):
        name, _, body = part.partition("=")
        out[name] = body
    return out


def _settings(body: str) -> dict[str, str]:
    return dict(kv.partition(":")[::2] for kv in body.split(",")) if body and not body.startswith("#") else {}


def differences(mine: str, theirs: str) -> list[str]:
    """What differs between the syncer's fingerprint (``mine``) and a learner's, one phrase per component,
    e.g. ``schedule (learner.sync_every 16 vs 8)``: the learner's value first, the syncer's second."""
    if mine == theirs:
        return []
    a, b = _decode(mine), _decode(theirs)
    out = []
    for name in list(a) + [n for n in b if n not in a]:
        if a.get(name) == b.get(name):
            continue
        label = LABELS.get(name, name[:20])
        ours, theirs_ = _settings(a.get(name, "")), _settings(b.get(name, ""))
        keys = [k for k in list(ours) + [k for k in theirs_ if k not in ours] if ours.get(k) != theirs_.get(k)]
        hashed = name == "layout" and (not (ours or theirs_) or "fragments" in keys)
        keys = [k for k in keys if not (name == "layout" and k == "fragments")]  # a hash: its values say nothing
        said = [f"{k[:40] if '.' in k else f'{name}.{k[:40]}'} {theirs_.get(k, 'missing')} vs "
                f"{ours.get(k, 'missing')}" for k in keys if ours or theirs_]
        if hashed:
            said.append("the model's fragments: tensor names, shapes or dtypes; compare [model] and "
                        "learner.num_fragments")
        if said:
            out.append(f"{label} ({', '.join(said)})")
        else:
            out.append(label)
    return out or ["the fingerprint"]


def protocol_differs(theirs: object, version: int) -> str | None:
    """The refusal phrase when a fingerprint names another protocol version than ``version``, else None
    (also for no fingerprint or none named): checked before the rest of a hello is read, because a
    learner of another version may send fields this side does not know."""
    if not isinstance(theirs, str) or len(theirs) > MAX_CHARS:
        return None
    body = _decode(theirs).get("protocol")
    got = _settings(body).get("version") if body is not None else None
    if got is None or got == str(version):
        return None
    return f"{LABELS['protocol']} (protocol.version {got[:20]} vs {version})"

