"""What the syncer says once it listens (cli.join): its address, its dashboard, and a learner command that
`wan-diloco`'s own parser takes, naming the address learners dial."""
import shlex
import socket

from wan_diloco.cli import build_parser
from wan_diloco.cli.join import announcement, lines
from wan_diloco.spec import TOKEN_ENV

from tests.conftest import micro_spec

MUTUAL = "[transport.tls]\nmutual = true\n"
FROM_FLAGS = {"cert_file": "--tls-cert", "key_file": "--tls-key", "ca_file": "--tls-ca",
              "mutual": "transport.tls.mutual"}


def parsed(join: str, n: int):
    """Learner ``n``'s command as the printed one, parsed by wan-diloco's parser (after its VAR=value words)."""
    words = shlex.split(join.replace("learner-N", f"learner-{n}").replace("--id N", f"--id {n}"))
    assert words.index("wan-diloco") == len([w for w in words[:words.index("wan-diloco")] if "=" in w])
    return build_parser().parse_args(words[words.index("wan-diloco") + 1:])


def tls_spec(extra: str = MUTUAL, **run):
    spec = micro_spec(extra, run=run)
    return spec.with_changes(transport={"tls": {"cert_file": "/srv/tls/syncer.pem", "key_file": "/srv/tls/syncer.key",
                                                "ca_file": "/srv/tls/ca.pem", "mutual": True}})


def test_the_learner_command_parses_and_names_the_address_and_this_learners_files():
    said = announcement(tls_spec(host="10.1.2.3"), "run file.toml", 7070, 7071, FROM_FLAGS)
    assert said["address"] == said["dial"] == "10.1.2.3:7070" and said["status_url"] == "https://10.1.2.3:7071/"
    args = parsed(said["join"], 3)
    assert (args.command, args.config, args.id, args.syncer) == ("learner", "run file.toml", 3, "10.1.2.3:7070")
    assert (args.tls_cert, args.tls_key, args.tls_ca) == ("/srv/tls/learner-3.pem", "/srv/tls/learner-3.key",
                                                          "/srv/tls/ca.pem")
    assert said["join"].startswith('WAN_DILOCO_TOKEN="$(cat learner-N.token)" wan-diloco learner')
    shown = lines(tls_spec(host="10.1.2.3"), "run file.toml", said)
    assert shown[0] == "syncer: listening on 10.1.2.3:7070" and f"  {said['join']}" in shown
    assert "syncer: learner N (0..2) joins from its host with:" in shown
    assert shown[-1].startswith("syncer: learner-N.token, made here: wan-diloco token --config 'run file.toml' "
                                "--learner N > learner-N.token")


def test_every_interface_is_said_and_learners_dial_this_hosts_name():
    spec = micro_spec(run={"host": "0.0.0.0"})
    said = announcement(spec, None, 7070, 7071, {})
    name = socket.gethostname()
    assert said["address"] == "0.0.0.0:7070" and said["dial"] == f"{name}:7070"
    assert said["status_url"] == f"http://{name}:7071/"  # no TLS: plain HTTP
    assert lines(spec, None, said)[0] == f"syncer: listening on 0.0.0.0:7070 (every interface; this host is {name})"
    args = parsed(said["join"], 0)
    assert args.syncer == f"{name}:7070" and args.config is None and args.tls_ca is None
    v6 = announcement(micro_spec(run={"host": "::"}), None, 7070, None, {})
    assert v6["address"] == "[::]:7070" and v6["status_url"] is None


def test_what_every_host_already_has_is_not_repeated(monkeypatch):
    # Paths in the run file (the same on every host) and a token in it reach the learner with the file.
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    old_style = {"cert_file": "transport.tls.cert_file", "key_file": "transport.tls.key_file",
                 "ca_file": "transport.tls.ca_file", "mutual": "transport.tls.mutual"}
    spec = tls_spec(host="10.1.2.3", token="a-run-token-in-the-file")
    said = announcement(spec, "run.toml", 7070, None, old_style)
    assert said["join"] == "wan-diloco learner --config run.toml --id N --syncer 10.1.2.3:7070"
    assert not any("token" in line for line in lines(spec, "run.toml", said))
    # $WAN_DILOCO_TOKEN wins over the file's token: the learners must be given theirs too.
    monkeypatch.setenv(TOKEN_ENV, "the-syncers-own-token")
    said = announcement(spec, "run.toml", 7070, None, old_style)
    assert said["join"].startswith('WAN_DILOCO_TOKEN="$(cat learner-N.token)" wan-diloco learner')
    monkeypatch.delenv(TOKEN_ENV)
    # A mutual run the syncer was told of by --tls-mutual: the learner must be told too.
    said = announcement(tls_spec("", host="10.1.2.3"), "run.toml", 7070, None, {**FROM_FLAGS, "mutual": "--tls-mutual"})
    assert parsed(said["join"], 1).tls_mutual


def test_one_shared_token_and_shards():
    shared = micro_spec(run={"host": "10.1.2.3"}, transport={"per_learner_tokens": False, "allow_shared_token": True})
    assert announcement(shared, "r.toml", 1, None, {})["join"].startswith('WAN_DILOCO_TOKEN="$(cat token)" ')
    sharded = micro_spec(run={"host": "10.1.2.3", "run_id": "r1"}, syncer={"shards": 2})
    said = announcement(sharded, "r.toml", 7071, None, {})
    assert said["join"] is None  # a learner names every shard; one shard knows only its own address
    assert lines(sharded, "r.toml", said, shard=1)[-1] == ("syncer-1: learners name every shard's HOST:PORT in "
                                                           "--syncer, in shard order; shard 1 is 10.1.2.3:7071")
