"""Our own CLI parser, and fakes of `wan-diloco` and `srun` that record how the generated scripts call them
(the scripts themselves run for real, in bash)."""
import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def parser():
    from wan_diloco.cli import build_parser

    return build_parser()


# Records its command line and the environment the scripts set; answers as each tool would, just enough
# for a launch script to go on (sky's IP of a cluster, sbatch's job id, squeue's node of a job).
FAKE = """#!{python}
import json, os, sys
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
with open(os.environ["CAPTURE"], "a") as f:
    f.write(json.dumps({{"argv": [name] + args, "env": {{k: v for k, v in os.environ.items()
                                                     if k.startswith("WAN_DILOCO_") or k == "SYNCER"}}}}) + "\\n")
if name == "sky" and args[:2] == ["status", "--ip"]:
    print("ip-" + args[2])
elif name == "sbatch":
    print("job-" + args[-1].split(".")[0])
elif name == "squeue":
    print("node-" + args[args.index("-j") + 1])
"""
# srun runs its command once per task, as Slurm would, with that task's SLURM_PROCID
SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
for ((t = 0; t < FAKE_NTASKS; t++)); do SLURM_PROCID=$t "$@" || exit 1; done
"""


@pytest.fixture
def fakes(tmp_path):
    """run(script, env) -> the [{argv, env}] of every `wan-diloco` (sky, sbatch, ...) the bash script started."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tools = {name: FAKE.format(python=sys.executable) for name in ("wan-diloco", "sky", "sbatch", "squeue", "kubectl")}
    for name, text in {**tools, "srun": SRUN}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    capture = tmp_path / "capture.jsonl"

    def run(script: str, **env: str) -> list[dict]:
        capture.write_text("")
        path = tmp_path / "script.sh"
        path.write_text(script)
        full = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CAPTURE": str(capture), **env}
        proc = subprocess.run(["bash", str(path)], env=full, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return [json.loads(line) for line in capture.read_text().splitlines()]

    return run
