"""`wan-diloco certs` (``dev_certs.make_run_certs``): a CA, the syncer's and each learner's certificates,
and they work for mutual TLS."""
import dataclasses
import stat
import tomllib

import pytest

from wan_diloco.cli import main
from wan_diloco.transport import Frame, TlsConfig, TransportError

from .conftest import SMALL, arun, client_for, syncer

META = Frame("learner-1", 0, {"step": 1})


def tls_of(printed: str, name: str) -> TlsConfig:
    """The [transport.tls] block the command printed for ``name`` (learners: learner 0's, shown as the
    example, with the learner's own files), read back as a TlsConfig."""
    shown = "syncer" if name == "syncer" else "learner-0"
    block = printed[printed.rindex("[transport.tls]", 0, printed.index(f'/{shown}.pem"')):]
    block = block[: block.index("mutual = true") + len("mutual = true")].replace(shown, name)
    return TlsConfig(**tomllib.loads(block)["transport"]["tls"])


def test_certs_make_a_pki_that_mutual_tls_accepts_and_refuses_strangers(tmp_path, capsys):
    d = tmp_path / "tls"
    assert main(["certs", "--dir", str(d), "--syncer-host", "127.0.0.1", "--syncer-host", "syncer.example",
                 "--learners", "2", "--days", "2"]) == 0
    printed = capsys.readouterr().out
    assert {p.name for p in d.iterdir()} == {"ca.pem", "ca.key", "syncer.pem", "syncer.key", "learner-0.pem",
                                            "learner-0.key", "learner-1.pem", "learner-1.key"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in d.glob("*.key"))
    server_tls, learner_tls = tls_of(printed, "syncer"), tls_of(printed, "learner-1")
    assert learner_tls.cert_file == str(d.resolve() / "learner-1.pem")
    with_tls = lambda tls: dataclasses.replace(SMALL, tls=tls, call_timeout_s=1.0, retry_budget_s=1.0)  # noqa: E731

    async def run():
        async with syncer(config=with_tls(server_tls)) as (server, handler):
            async with client_for(server, config=with_tls(learner_tls)) as client:
                assert (await client.send_metadata(META)).global_step == 1
            stranger = TlsConfig(ca_file=learner_tls.ca_file)  # trusts the syncer, shows no certificate
            async with client_for(server, config=with_tls(stranger)) as client:
                with pytest.raises(TransportError):
                    await client.send_metadata(META)
            assert len(handler.metadata) == 1
    arun(run())
    # A second run into the same folder would silently replace the CA every host trusts: refused.
    with pytest.raises(SystemExit) as e:
        main(["certs", "--dir", str(d), "--syncer-host", "127.0.0.1", "--learners", "1"])
    assert e.value.code == 2 and "already holds certificates" in capsys.readouterr().err
