"""This host's TLS files over the run file's (host_tls.resolve): a flag wins over the environment, the
environment over [transport.tls]; each mistake is one line naming the flag, variable or key it came from."""
import pytest

from wan_diloco.cli import main
from wan_diloco.config import ConfigError
from wan_diloco.host_tls import ENV, resolve

from .conftest import micro_spec, write_micro

MUTUAL = "[transport.tls]\nmutual = true\n"  # the one run file every host gets: paths come from each host


@pytest.fixture
def pems(tmp_path):
    """Files standing for PEMs (resolve checks that they are there; gRPC reads them)."""
    for name in ("f.pem", "f.key", "e.pem", "e.key", "ca-f.pem", "ca-e.pem", "ca-x.pem", "x.pem", "x.key"):
        (tmp_path / name).write_text(name)
    return lambda name: str(tmp_path / name)


def test_a_flag_wins_over_the_environment_and_the_environment_over_the_file(pems):
    spec = micro_spec(f'[transport.tls]\ncert_file = "{pems("f.pem")}"\nkey_file = "{pems("f.key")}"\n'
                      f'ca_file = "{pems("ca-f.pem")}"\nmutual = true\nidentity_from_cert = false\n')
    env = {ENV["cert_file"]: pems("e.pem"), ENV["key_file"]: pems("e.key"), ENV["ca_file"]: pems("ca-e.pem")}
    flags = {"cert_file": pems("x.pem"), "key_file": pems("x.key"), "ca_file": None}
    got, origin = resolve(spec, "learner", flags, environ=env)
    tls = got.transport.tls
    assert (tls.cert_file, tls.key_file, tls.ca_file) == (pems("x.pem"), pems("x.key"), pems("ca-e.pem"))
    assert origin == {"cert_file": "--tls-cert", "key_file": "--tls-key", "ca_file": "WAN_DILOCO_TLS_CA",
                      "mutual": "transport.tls.mutual"}
    assert tls.mutual and not tls.identity_from_cert  # the file's other keys stand
    got, origin = resolve(spec, "learner", {}, environ={ENV["ca_file"]: ""})  # an empty variable is unset
    assert got.transport.tls == spec.transport.tls and origin["ca_file"] == "transport.tls.ca_file"
    assert got.run == spec.run and got.learner == spec.learner  # nothing but TLS changes


def test_one_file_with_mutual_and_no_paths_loads_and_each_host_completes_it(pems):
    spec = micro_spec(MUTUAL)  # validated at load: no error for the paths it leaves to each host
    assert spec.transport.tls.mutual and not spec.transport.tls.cert_file
    env = {ENV["cert_file"]: pems("e.pem"), ENV["key_file"]: pems("e.key"), ENV["ca_file"]: pems("ca-e.pem")}
    syncer, _ = resolve(spec, "syncer", {"cert_file": pems("x.pem"), "key_file": pems("x.key"),
                                         "ca_file": pems("ca-x.pem")}, environ={})
    learner, _ = resolve(spec, "learner", {}, environ=env)
    assert syncer.transport.tls.cert_file == pems("x.pem") and learner.transport.tls.cert_file == pems("e.pem")
    # (That the settings fingerprint leaves these paths out is shown by tests/runtime/test_one_run_file_tls.py:
    # processes with different files agree, where a learner whose settings differ is refused.)


def test_without_tls_anywhere_nothing_changes(pems):
    spec = micro_spec()
    assert resolve(spec, "syncer", {}, environ={}) == (spec, {})
    got, _ = resolve(spec, "learner", {"ca_file": pems("ca-x.pem")}, environ={})  # a CA alone turns TLS on
    assert got.transport.tls.ca_file == pems("ca-x.pem") and not got.transport.tls.mutual


@pytest.mark.parametrize("extra, role, flags, env, message", [
    ("", "learner", {"cert_file": "nope.pem", "key_file": "nope.key"}, {},
     "--tls-cert: file nope.pem not found"),
    ("", "learner", {}, {"WAN_DILOCO_TLS_CA": "/no/ca.pem"}, "WAN_DILOCO_TLS_CA: file /no/ca.pem not found"),
    ('[transport.tls]\nca_file = "/etc/none/ca.pem"\n', "learner", {}, {},
     "transport.tls.ca_file: file /etc/none/ca.pem not found"),
    ("", "learner", {"cert_file": "x.pem"}, {}, "--tls-cert: a certificate needs its key: give --tls-key "
                                                 "(or $WAN_DILOCO_TLS_KEY) too"),
    ("", "learner", {}, {"WAN_DILOCO_TLS_KEY": "x.key"}, "WAN_DILOCO_TLS_KEY: a key needs its certificate: give "
                                                          "--tls-cert (or $WAN_DILOCO_TLS_CERT) too"),
    (MUTUAL, "learner", {"cert_file": "x.pem", "key_file": "x.key"}, {},
     "transport.tls.mutual: mutual TLS needs a CA to verify the peer's certificate: give --tls-ca "
     "(or $WAN_DILOCO_TLS_CA)"),
    (MUTUAL, "learner", {"ca_file": "ca-x.pem"}, {}, "transport.tls.mutual: mutual TLS needs this host's "
     "certificate and key: give --tls-cert (or $WAN_DILOCO_TLS_CERT) and --tls-key (or $WAN_DILOCO_TLS_KEY)"),
    (MUTUAL, "syncer", {}, {}, "transport.tls.mutual: mutual TLS needs a CA"),
    ("", "syncer", {"ca_file": "ca-x.pem"}, {}, "--tls-cert: a TLS syncer needs its certificate and key"),
])
def test_each_mistake_is_one_line_naming_where_it_came_from(pems, extra, role, flags, env, message):
    spec = micro_spec(extra)
    here = lambda v: pems(v) if v in ("x.pem", "x.key", "ca-x.pem") else v  # noqa: E731
    with pytest.raises(ConfigError) as e:
        resolve(spec, role, {k: here(v) for k, v in flags.items()}, environ={k: here(v) for k, v in env.items()})
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_tls_mutual_flag_without_a_ca_is_named(pems):
    with pytest.raises(ConfigError, match=r"^--tls-mutual: mutual TLS needs a CA"):
        resolve(micro_spec(), "learner", {"cert_file": pems("x.pem"), "key_file": pems("x.key")}, mutual=True,
                environ={})


@pytest.mark.parametrize("command", ["syncer", "learner"])
def test_the_commands_take_the_flags_and_the_environment(tmp_path, monkeypatch, capsys, command):
    path = write_micro(tmp_path / "run.toml", MUTUAL)
    monkeypatch.setenv(ENV["ca_file"], str(tmp_path / "missing-ca.pem"))
    (tmp_path / "c.pem").write_text("c")
    (tmp_path / "c.key").write_text("k")
    args = [command, "--config", str(path), "--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "c.key")]
    with pytest.raises(SystemExit) as e:  # before any model or socket: the files are checked first
        main(args + (["--id", "0", "--syncer", "127.0.0.1:1"] if command == "learner" else []))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"wan-diloco {command}: error: WAN_DILOCO_TLS_CA: file "
                                         f"{tmp_path / 'missing-ca.pem'} not found"], err
