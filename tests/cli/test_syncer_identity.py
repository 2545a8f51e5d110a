"""`wan-diloco syncer` off loopback with one shared token refuses to start (#23): any holder of that token
could speak for any learner. One line naming transport.allow_shared_token, exit 2, before anything binds."""
import pytest

from wan_diloco.cli import main

RUN = '''[run]
host = "{host}"
port = 7070
token = "shared-token-0123456789"

[transport]
per_learner_tokens = false
[transport.tls]
cert_file = "{tls}/syncer.pem"
key_file = "{tls}/syncer.key"
'''


def test_a_shared_token_off_loopback_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "run.toml"
    for name in ("syncer.pem", "syncer.key"):  # there (the files are checked first), never read: refused before
        (tmp_path / name).write_text(name)
    path.write_text(RUN.format(host="192.0.2.10", tls=tmp_path))  # TEST-NET-1: not this host's, never bound
    with pytest.raises(SystemExit) as e:
        main(["syncer", "--config", str(path), "--no-table"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("wan-diloco syncer: error: transport.allow_shared_token: the syncer would listen on "
                             "192.0.2.10:7070 (not loopback) with one shared token"), err
    assert "set allow_shared_token = true to run so anyway" in err[0]

