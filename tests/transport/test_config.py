import pytest

from wan_diloco.config import ConfigError, from_mapping
from wan_diloco.transport import TlsConfig, TransportConfig, channels_for_link, host_socket_buffer_bytes, tune_for_link
from wan_diloco.transport.config import MAX_FRAME_BYTES


def test_defaults_validate_and_load_from_toml_table():
    TransportConfig().validate()
    cfg = from_mapping(TransportConfig, {"chunk_bytes": 1 << 20, "channels": 4,
                                         "tls": {"cert_file": "c.pem", "key_file": "k.pem"}})
    assert cfg.channels == 4 and cfg.tls == TlsConfig(cert_file="c.pem", key_file="k.pem")


@pytest.mark.parametrize("table, field", [
    ({"chunk_bytes": 1000}, "chunk_bytes"),
    ({"chunk_bytes": 8 << 20, "max_message_bytes": 4 << 20}, "max_message_bytes"),
    ({"channels": 0}, "channels"),
    ({"max_frame_bytes": 100}, "max_frame_bytes"),
    ({"call_timeout_s": 0}, "call_timeout_s"),
    ({"backoff_initial_s": 2.0, "backoff_max_s": 1.0}, "backoff_max_s"),
    ({"tls": {"mutual": True, "cert_file": "c", "key_file": "k"}}, "tls.ca_file"),
    ({"tls": {"cert_file": "c"}}, "tls.cert_file"),
    ({"chanels": 2}, "chanels"),
])
def test_bad_values_name_the_field(table, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        from_mapping(TransportConfig, table)


def test_options_carry_the_settings():
    cfg = TransportConfig(lookahead_bytes=1 << 24, max_frame_bytes=MAX_FRAME_BYTES, bdp_probe=False)
    client, server = dict(cfg.client_options()), dict(cfg.server_options())
    for opts in (client, server):
        assert opts["grpc.http2.lookahead_bytes"] == 1 << 24
        assert opts["grpc.http2.max_frame_size"] == MAX_FRAME_BYTES
        assert opts["grpc.http2.bdp_probe"] == 0
        assert opts["grpc.max_receive_message_length"] >= cfg.chunk_bytes
    assert client["grpc.use_local_subchannel_pool"] == 1
    # the server must tolerate the client's keepalive pings
    assert server["grpc.http2.min_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]


def test_tune_for_link_follows_the_bandwidth_delay_product():
    wan = tune_for_link(rate_gbit_s=5, rtt_s=0.1)  # BDP 62.5 MB
    assert wan.channels == 15  # ceil(62.5 MB / 4 MiB socket buffers)
    assert wan.lookahead_bytes * wan.channels >= 62.5e6  # the windows together hold the BDP
    assert wan.max_frame_bytes == MAX_FRAME_BYTES and wan.bdp_probe
    assert wan.chunk_bytes == TransportConfig().chunk_bytes == 1 << 20  # a CPU choice, not the link's
    assert tune_for_link(5, 0.1, base=TransportConfig(chunk_bytes=2 << 20)).chunk_bytes == 2 << 20  # a user's stays
    assert tune_for_link(5, 0.1, socket_buffer_bytes=64 << 20).channels == 2  # tuned sysctls
    lan = tune_for_link(rate_gbit_s=40, rtt_s=1e-4)
    assert lan.channels == 2
    big = tune_for_link(rate_gbit_s=100, rtt_s=0.15)
    assert big.channels == 16 and big.lookahead_bytes * big.channels >= 100e9 / 8 * 0.15
    with pytest.raises(ConfigError, match="rate_gbit_s"):
        tune_for_link(0, 0.1)


def test_channels_for_a_probed_link():
    mib4 = 4 << 20
    assert channels_for_link(2.0, 0.1, mib4) == 6  # 25 MB BDP over 4 MiB connections
    assert channels_for_link(2.0, 0.1, 256 << 20) == 2  # hosts tuned for long fat links
    assert channels_for_link(40.0, 1e-4, mib4) == 2  # a LAN
    # A probe over 2 connections of 4 MiB at 100 ms can see at most 0.67 Gbit/s; seeing 0.62 means the
    # windows held it back, not the link: twice as many, whatever the BDP of 0.62 says.
    assert channels_for_link(0.62, 0.1, mib4, channels_now=2) == 4
    assert channels_for_link(0.30, 0.1, mib4, channels_now=2) == 2  # well under the ceiling: that is the link
    assert channels_for_link(0.30, 0.1, mib4, channels_now=8) == 8  # never fewer
    assert channels_for_link(0.30, 0.001, mib4, channels_now=1) == 1  # a user's single connection is enough here
    assert channels_for_link(100.0, 0.15, mib4, channels_now=12) == 16  # at most 16


def test_host_socket_buffer_is_the_smaller_autotuning_maximum(tmp_path):
    (tmp_path / "tcp_rmem").write_text("4096 131072 6291456\n")
    (tmp_path / "tcp_wmem").write_text("4096 16384 4194304\n")
    assert host_socket_buffer_bytes(tmp_path) == 4194304
    (tmp_path / "tcp_wmem").write_text("garbage\n")
    assert host_socket_buffer_bytes(tmp_path) == 4 << 20  # unreadable: Linux's usual default


@pytest.mark.parametrize("table, message", [
    ({"stream_idle_timeout_s": 0}, "stream_idle_timeout_s: must be > 0"),
    ({"max_uploads_per_sender": 0}, "max_uploads_per_sender: must be >= 1"),
    ({"max_concurrent_streams": 0}, "max_concurrent_streams: must be >= 1"),
])
def test_server_limits_are_validated(table, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        from_mapping(TransportConfig, table)


def test_server_options_limit_streams_and_refuse_a_shared_port():
    cfg = TransportConfig()
    assert (cfg.stream_idle_timeout_s, cfg.max_uploads_per_sender, cfg.max_concurrent_streams) == (30.0, 4, 64)
    server = dict(from_mapping(TransportConfig, {"max_concurrent_streams": 32}).server_options())
    assert server["grpc.max_concurrent_streams"] == 32
    assert server["grpc.so_reuseport"] == 0
    assert "grpc.max_concurrent_streams" not in dict(cfg.client_options())


def test_tune_for_link_lets_one_sender_use_every_connection():
    wan = tune_for_link(rate_gbit_s=5, rtt_s=0.1)
    assert wan.max_uploads_per_sender == wan.channels == 15
    assert tune_for_link(rate_gbit_s=100, rtt_s=0.15).max_uploads_per_sender == 16  # the server's slots
    assert tune_for_link(rate_gbit_s=40, rtt_s=1e-4).max_uploads_per_sender == 4
    slow = tune_for_link(rate_gbit_s=0.01, rtt_s=0.1)  # a 4 MiB chunk takes 13 s at a quarter of 10 Mbit/s
    assert slow.stream_idle_timeout_s >= 4 * slow.chunk_bytes * 8 / (slow.min_upload_rate_gbit_s * 1e9)
