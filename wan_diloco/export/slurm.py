"""sbatch scripts: one per site (region) running its learners, one task per node, and one per syncer shard.

Each script reads the run file, tokens and certificates from the folder it is submitted from
(``$SLURM_SUBMIT_DIR``): copy the folder to each site, leaving out what that site must not hold (the run's
``token``, ``tls/ca.key``, other sites' learner keys). Learner ids come from the task's ``SLURM_PROCID``
through the region's list of ids (regions take learners round-robin, so they are not one range).
"""
from __future__ import annotations

from wan_diloco.export.common import (RUN_FILE, Deployment, check_server_name, command, credentials_script, learner_env,
                                     syncer_env)

HERE = "$SLURM_SUBMIT_DIR"


def _header(dep: Deployment, name: str, nodes: int, extra: list[str]) -> list[str]:
    opts = [f"--job-name={dep.job(name)}", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
            f"--time={dep.options.time}", f"--output={dep.job(name)}-%j.out"] + extra
    return ["#!/bin/bash"] + [f"#SBATCH {o}" for o in opts]


def _gpus(dep: Deployment) -> list[str]:
    run = dep.spec.run
    if run.platform != "gpu":
        return []
    # devices_per_learner 0 is "every GPU the host has": the node to itself
    return [f"--gpus-per-task={run.devices_per_learner}"] if run.devices_per_learner else ["--exclusive"]


def syncer_script(dep: Deployment, shard: int) -> str:
    hosts = dep.options.syncer_hosts
    name = f"syncer-{shard}" if dep.shards > 1 else "syncer"
    argv = dep.syncer_argv(f"{HERE}/{RUN_FILE}", shard)
    lines = _header(dep, name, 1, [f"--nodelist={hosts[shard]}"] if hosts else [])
    lines += ["set -euo pipefail",
              f'echo "wan-diloco syncer shard {shard}: $(hostname):{dep.port}"',
              command(argv, syncer_env(f"{HERE}/tls", f"{HERE}/token"))]
    return "\n".join(lines) + "\n"


def region_script(dep: Deployment, region: str) -> str:
    ids = dep.regions[region]
    hosts = dep.options.syncer_hosts
    given = dep.syncer_addresses(list(hosts)) if hosts else ""
    argv = dep.learner_argv(f"{HERE}/{RUN_FILE}", "$ID", "$SYNCER")
    lines = _header(dep, region, len(ids), _gpus(dep))
    lines += [f"# learners {', '.join(map(str, ids))} of {RUN_FILE} (region {region})",
              "set -euo pipefail",
              (f'export SYNCER="${{SYNCER:-{given}}}"' if given else
               ': "${SYNCER:?set SYNCER to the HOST:PORT of each syncer shard, comma-separated: '
               'SYNCER=host:port sbatch ...}"'),
              "learner() {",
              f"  local IDS=({' '.join(map(str, ids))})  # task t runs learner IDS[t]",
              '  local ID="${IDS[$SLURM_PROCID]}"',
              "  " + command(argv, learner_env(f"{HERE}/tls", f"{HERE}/tokens", "$ID")),
              "}",
              "export -f learner",
              # one learner dying must not take its region down: the run goes on without it
              "srun --kill-on-bad-exit=0 bash -c learner"]
    return "\n".join(lines) + "\n"


def launch_script(dep: Deployment) -> str:
    names = [f"syncer-{s}.sbatch" if dep.shards > 1 else "syncer.sbatch" for s in range(dep.shards)]
    lines = ["#!/usr/bin/env bash",
             "# Written by `wan-diloco export slurm`: the order of a launch on one cluster. At another site,",
             "# copy this folder there and run its region's line with the SYNCER this prints.",
             "set -euo pipefail", 'cd "$(dirname "$0")"', "",
             credentials_script(dep), "",
             "node_of() {  # the node a job runs on, once it runs",
             '  local n; until n=$(squeue -h -j "$1" -t R -o %N) && [ -n "$n" ]; do sleep 5; done; echo "$n"',
             "}"]
    lines += [f"J{s}=$(sbatch --parsable {f})" for s, f in enumerate(names)]
    lines.append('SYNCER="' + ",".join(f"$(node_of $J{s}):{dep.port}" for s in range(dep.shards)) + '"')
    lines.append('echo "syncer at $SYNCER"')
    lines += [f'SYNCER="$SYNCER" sbatch region-{r}.sbatch' for r in dep.regions]
    return "\n".join(lines) + "\n"


def files(dep: Deployment) -> dict[str, str]:
    check_server_name(dep)
    out = {}
    for s in range(dep.shards):
        out[f"syncer-{s}.sbatch" if dep.shards > 1 else "syncer.sbatch"] = syncer_script(dep, s)
    for region in dep.regions:
        out[f"region-{region}.sbatch"] = region_script(dep, region)
    out["launch.sh"] = launch_script(dep)
    return out
