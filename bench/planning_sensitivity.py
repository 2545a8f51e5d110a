"""How the goodput anchors move with the assumptions the paper did not publish.

Runs the three anchor systems (2.4M chips, MTBF 1 chip-year) at the defaults,
then varies one assumption at a time: slice size, repair distribution,
reconfiguration (elastic pause) time, and dp's restart time and checkpoint
interval. Writes bench/results/planning_sensitivity.json and prints a
markdown table (the one in docs/planning.md).

    python bench/planning_sensitivity.py [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from wan_diloco.planning.goodput import GoodputConfig, sample_repairs_s, simulate

SYSTEMS = {"dp": {"system": "dp"}, "elastic-dp": {"system": "elastic-dp"},
           "decoupled M=16": {"system": "decoupled", "learners": 16}}
VARIATIONS = [
    ("defaults", {}),
    ("slice 64 chips", {"slice_chips": 64}),
    ("slice 1024 chips", {"slice_chips": 1024}),
    ("repair scale 1 h", {"repair_scale_h": 1.0}),
    ("repair scale 4 h", {"repair_scale_h": 4.0}),
    ("repair heavy tail (k=0.5, alpha=4)", {"repair_shape": 0.5, "repair_exponent": 4.0, "repair_scale_h": 0.6}),
    ("pauses 3 s down / 3 s up", {"downscale_s": 3.0, "upscale_s": 3.0}),
    ("pauses 20 s down / 30 s up", {"downscale_s": 20.0, "upscale_s": 30.0}),
    ("restart 30 s", {"restart_s": 30.0}),
    ("restart 120 s", {"restart_s": 120.0}),
    ("checkpoint every 10 s", {"checkpoint_interval_s": 10.0}),
    ("speed CV 2 %", {"speed_cv": 0.02}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 simulated days instead of 14")
    args = ap.parse_args()
    base = GoodputConfig(chips=2.4e6, mtbf_chip_years=1.0, days=2.0 if args.quick else 14.0)
    rows = []
    for name, changes in VARIATIONS:
        cfg = dataclasses.replace(base, **changes)
        mean_repair_h = float(np.mean(sample_repairs_s(np.random.default_rng(0), 200_000, cfg))) / 3600
        row = {"variation": name, "changes": changes, "mean_repair_h": mean_repair_h}
        for label, system in SYSTEMS.items():
            r = simulate(dataclasses.replace(cfg, **system))
            row[label] = {"goodput": r.goodput, "uptime": r.uptime}
        rows.append(row)
    out = Path(__file__).parent / "results" / "planning_sensitivity.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"days": base.days, "chips": base.chips, "rows": rows}, indent=2) + "\n")
    print("| assumption | mean repair | " + " | ".join(f"{s} goodput / uptime" for s in SYSTEMS) + " |")
    print("|---|---|" + "---|" * len(SYSTEMS))
    for row in rows:
        cells = [f"{row[s]['goodput']:.2f} / {row[s]['uptime']:.2f}" for s in SYSTEMS]
        print(f"| {row['variation']} | {row['mean_repair_h']:.1f} h | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
