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
                    "--total-mib", "16", "--fragment-mib", "4", "--out", str(out)],
                   check=True, timeout=300, capture_output=True)
    report = json.loads(out.read_text())
    assert report["rows"][0]["name"] == "raw asyncio tcp" and report["rows"][0]["ratio_vs_tcp"] == 1.0
    assert all(r["gbit_s"] > 0 and r["cpu_s_per_gib"] > 0 for r in report["rows"])
    assert set(report["targets"]) == {"best_cleartext_ratio", "tls_ratio", "int4_end_to_end_gbit_s"}
    assert out.with_suffix(".png").stat().st_size > 0
