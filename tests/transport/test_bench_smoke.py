"""The transport benchmark runs end to end (tiny sizes) and writes its report."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_transport_tiny_run(tmp_path):
    out = tmp_path / "transport.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "transport.py"), "--quick", "--rounds", "1",
                    "--total-mib", "32", "--fragment-mib", "16", "--out", str(out)],
                   check=True, timeout=300, capture_output=True)
    report = json.loads(out.read_text())
    assert report["rows"][0]["name"] == "raw asyncio tcp" and report["rows"][0]["ratio_vs_tcp"] == 1.0
    assert all(r["gbit_s"] > 0 and r["cpu_s_per_gib"] > 0 for r in report["rows"])
    assert all(r["cpu_s_per_gib"] == pytest.approx(r["sender_cpu_s_per_gib"] + r["receiver_cpu_s_per_gib"], abs=2e-3)
               for r in report["rows"])
    assert all("receiver_cpu_vs_tls_tcp" in r for r in report["rows"] if r["tls"] and r["kind"] == "grpc")
    assert not report["partial"]
    striped, unstriped = ({r["name"]: r["striped"] for r in report["rows"]}[n] for n in reversed(
        report["striping"]["rows"]))
    assert striped and not unstriped and report["striping"]["striped_over_unstriped_gbit_s"] > 0
    sizes = report["message_sizes"]  # the default message size against smaller and larger ones
    assert len(sizes) == 3 and [v["receiver_cpu_vs_default"] for n, v in sizes.items() if "(default)" in n] == [1.0]
    assert set(report["targets"]) == {"best_cleartext_ratio", "best_cleartext_cpu_vs_tcp", "tls_ratio",
                                      "tls_receiver_cpu_vs_tls_tcp", "int4_end_to_end_gbit_s",
                                      "direct_cleartext_ratio", "direct_cleartext_cpu_vs_tcp",
                                      "direct_tls_receiver_cpu_vs_tls_tcp", "int4_end_to_end_direct_gbit_s"}
    direct = [r for r in report["rows"] if r["kind"] == "direct"]  # the same stripes, not through gRPC
    assert [r["tls"] for r in direct] == [False, True] and all(r["striped"] for r in direct)
    assert report["grpc_floor"]["tls_receiver_cpu_vs_tls_tcp"] > 0  # gRPC with nothing of ours receiving
    assert out.with_suffix(".png").stat().st_size > 0
