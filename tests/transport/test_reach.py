"""Why a syncer cannot be reached, said in words (transport.reach), on loopback only."""
import asyncio
import dataclasses
import socket
import threading

from wan_diloco.transport.dev_certs import make_dev_certs
from wan_diloco.transport.reach import diagnose, split_target

from .conftest import SMALL, arun, syncer


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_targets_are_host_and_port():
    assert split_target("127.0.0.1:7070") == ("127.0.0.1", 7070)
    assert split_target("[::1]:7070") == ("::1", 7070)
    assert diagnose("no-port", None) == "'no-port' is not HOST:PORT"


def test_a_port_nobody_listens_on_is_refused():
    why = diagnose(f"127.0.0.1:{closed_port()}", None)
    assert why.startswith("connection refused") and not why.lasting  # a syncer not started yet may come


def test_something_else_on_the_port_is_named_so():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def answer():
        conn, _ = srv.accept()
        with conn:
            conn.recv(100)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        assert diagnose(f"127.0.0.1:{srv.getsockname()[1]}", None) == \
            "something that is not a gRPC server answered on that port"
    finally:
        t.join(5)
        srv.close()


def test_tls_and_cleartext_mismatches_and_untrusted_certificates_are_told_apart(tmp_path):
    certs = make_dev_certs(tmp_path / "a")
    stranger = make_dev_certs(tmp_path / "b")["client"]  # trusts another CA

    async def main():  # the servers run on this loop: diagnose (blocking sockets) on another thread
        async with syncer(config=SMALL) as (plain, _):
            assert await asyncio.to_thread(diagnose, plain.target, None) is None
            why = await asyncio.to_thread(diagnose, plain.target, certs["client"])
            assert "does not speak TLS" in why and why.lasting  # no retry heals a TLS mismatch (#23)
        async with syncer(config=dataclasses.replace(SMALL, tls=certs["server"])) as (tls, _):
            assert await asyncio.to_thread(diagnose, tls.target, certs["client"]) is None
            why = await asyncio.to_thread(diagnose, tls.target, None)  # gRPC hangs up: a TLS handshake tells why
            assert why.startswith("the syncer expects TLS but this learner has no [transport.tls]") and why.lasting
            why = await asyncio.to_thread(diagnose, tls.target, stranger)
            assert "not trusted" in why and why.lasting
    arun(main())


def test_a_server_that_hangs_up_on_everything_may_heal():
    """Closed at once, also to a TLS handshake (a syncer going down, say): not taken for a TLS syncer."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def hang_up():
        for _ in range(2):  # the cleartext try, then the TLS handshake
            conn, _ = srv.accept()
            conn.close()

    t = threading.Thread(target=hang_up, daemon=True)
    t.start()
    try:
        why = diagnose(f"127.0.0.1:{srv.getsockname()[1]}", None)
        assert why.startswith("the syncer closed the connection at once") and not why.lasting
    finally:
        t.join(5)
        srv.close()
