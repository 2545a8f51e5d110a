"""gRPC's C core keeps quiet in wan-diloco processes (#23, item 13): a cleartext client knocking at a TLS
syncer put raw "SSL_ERROR_SSL ... WRONG_VERSION_NUMBER" lines on the syncer's stderr for every try."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import wan_diloco.cli  # what `wan-diloco syncer` imports first
    import asyncio, dataclasses, sys
    from wan_diloco.transport import Frame, SyncerClient, TransportConfig, TransportError, TransportServer, run
    from wan_diloco.transport.dev_certs import make_dev_certs

    async def main():
        tls = make_dev_certs(sys.argv[1])["server"]
        server = TransportServer(object(), "token-0123456789", TransportConfig(tls=tls), "127.0.0.1:0")
        await server.start()
        cleartext = TransportConfig(call_timeout_s=1.5)
        async with SyncerClient(server.target, "token-0123456789", cleartext) as client:
            try:
                await client.send_metadata(Frame("learner-0", 0, {}))
            except TransportError as e:
                print("refused:", e.code.name)
        await server.stop(0)
    run(main())
''')


def test_a_cleartext_client_at_a_tls_server_leaves_stderr_clean(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != "GRPC_VERBOSITY"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "tls")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "refused: DEADLINE_EXCEEDED"  # the handshakes did fail
    assert "SSL_ERROR_SSL" not in proc.stderr and "WRONG_VERSION_NUMBER" not in proc.stderr, proc.stderr
