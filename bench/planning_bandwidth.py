"""The bandwidth calculator against Streaming DiLoCo's Table 4, cell by cell.

Writes bench/results/planning_bandwidth.json (ours, the paper's, the ratio),
bench/results/planning_bandwidth_1b.png (CU against bandwidth) and prints the
markdown table quoted in docs/planning.md.

    python bench/planning_bandwidth.py [--quick]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from wan_diloco.planning.bandwidth import PAPER_METHODS, BandwidthConfig, required_rates
from wan_diloco.planning.cli_bandwidth import plot_cu_curves

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "tests" / "planning" / "reference" / "streaming_diloco_bandwidth.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the 1B model only")
    args = ap.parse_args()
    ref = json.loads(REFERENCE.read_text())
    targets = tuple(ref["cu_targets"])
    out_rows, worst = [], 1.0
    print("| model | method | " + " | ".join(f"CU {t:g}" for t in targets) + " |")
    print("|---|---|" + "---|" * len(targets))
    for row in ref["rows"][:1] if args.quick else ref["rows"]:
        cfg = BandwidthConfig(params=row["params"], layers=row["layers"], step_time_s=row["step_time_s"])
        ours = required_rates(cfg, PAPER_METHODS, targets)
        for m in PAPER_METHODS:
            ratios = [a / b for a, b in zip(ours[m], row[m])]
            worst = max(worst, *(max(r, 1 / r) for r in ratios))
            out_rows.append({"model": row["model"], "method": m, "ours_gbit": ours[m], "paper_gbit": row[m],
                             "ratio": ratios})
            cells = [f"{a:.3g} ({b:g})" for a, b in zip(ours[m], row[m])]
            print(f"| {row['model']} | {m} | " + " | ".join(cells) + " |")
        if row["model"] == "1B":
            plot_cu_curves(cfg, PAPER_METHODS, ours, ROOT / "bench" / "results" / "planning_bandwidth_1b.png")
    print(f"\nworst factor between ours and the paper: {worst:.3f}")
    out = ROOT / "bench" / "results" / "planning_bandwidth.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cu_targets": targets, "worst_factor": worst, "rows": out_rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
