"""SkyPilot task YAML: one task per region (its learners, one per node) and one per syncer shard.

A region's name is taken as the cloud's region name (``--cloud aws`` with ``regions.names = ["us-east-1",
"eu-west-1"]``): users already name regions after where they run. The syncer's address is known only once its
cluster is up, so the learner tasks take it as ``--env SYNCER=IP:PORT`` (a required env: SkyPilot refuses
to launch without it) and the syncer's certificate names ``<name>-syncer``, which the learners check
(``transport.tls.server_name``) whatever IP they dial.
"""
from __future__ import annotations

from wan_diloco.config import require
from wan_diloco.export.common import (RUN_FILE, Deployment, check_server_name, command, credentials_script, dump_yaml,
                                     learner_env, syncer_env)

REMOTE = "~/wan-diloco"  # where file_mounts put the run file, tokens and certificates on every node
SHELL_REMOTE = "$HOME/wan-diloco"  # the same folder, as the run script's shell sees it


def check(dep: Deployment) -> None:
    opts, spec = dep.options, dep.spec
    require(bool(opts.cloud), "--cloud", "required for skypilot: the cloud whose regions regions.names are "
                                         "(aws, gcp, azure, ...)")
    require(spec.run.platform != "gpu" or bool(opts.accelerators), "--accelerators",
            'run.platform is "gpu": say which, per learner node (e.g. H100:8)')
    check_server_name(dep)


def _resources(dep: Deployment, region: str, learners: bool) -> dict:
    res: dict = {"cloud": dep.options.cloud, "region": region}
    if learners and dep.options.accelerators:
        res["accelerators"] = dep.options.accelerators
    if not learners:
        st = dep.spec.run.status_port
        dp = dep.spec.transport.direct_port  # learners connect in (gRPC, direct stripes); the dashboard too
        res["ports"] = [dep.port] + ([dp] if dp else []) + ([st] if st > 0 else [])
    if dep.options.image:
        res["image_id"] = f"docker:{dep.options.image}"
    return res


def _task(dep: Deployment, name: str, resources: dict, num_nodes: int, envs: dict, mounts: list[str],
          run: str) -> dict:
    task: dict = {"name": name, "num_nodes": num_nodes, "resources": resources}
    if envs:
        task["envs"] = envs
    task["file_mounts"] = {f"{REMOTE}/{p}": p for p in [RUN_FILE, "tls/ca.pem"] + mounts}
    if not dep.options.image:
        task["setup"] = dep.options.setup
    task["run"] = run
    return task


def syncer_task(dep: Deployment, shard: int) -> dict:
    argv = dep.syncer_argv(f"{SHELL_REMOTE}/{RUN_FILE}", shard)
    run = "set -euo pipefail\n" + command(argv, syncer_env(f"{SHELL_REMOTE}/tls", f"{SHELL_REMOTE}/token")) + "\n"
    return _task(dep, dep.job(f"syncer-{shard}" if dep.shards > 1 else "syncer"),
                 _resources(dep, dep.syncer_region, learners=False), 1, {},
                 ["token", "tls/syncer.pem", "tls/syncer.key"], run)


def region_task(dep: Deployment, region: str) -> dict:
    ids = dep.regions[region]
    argv = dep.learner_argv(f"{SHELL_REMOTE}/{RUN_FILE}", "$ID", "$SYNCER")
    run = "\n".join([
        "set -euo pipefail",
        f"IDS=({' '.join(map(str, ids))})  # this region's learners: node rank r runs learner IDS[r]",
        'ID="${IDS[$SKYPILOT_NODE_RANK]}"',
        command(argv, learner_env(f"{SHELL_REMOTE}/tls", f"{SHELL_REMOTE}/tokens", "$ID")),
    ]) + "\n"
    mounts = [f"{kind}/learner-{m}.{ext}" for m in ids for kind, ext in
              (("tokens", "token"), ("tls", "pem"), ("tls", "key"))]
    hosts = dep.options.syncer_hosts
    # null: `sky launch` refuses to start without --env SYNCER=... (the syncer's IP is known only then)
    envs = {"SYNCER": dep.syncer_addresses(list(hosts)) if hosts else None}
    return _task(dep, dep.job(region), _resources(dep, region, learners=True), len(ids), envs, mounts, run)


def launch_script(dep: Deployment, files: list[str]) -> str:
    syncers = [(dep.job(f"syncer-{s}" if dep.shards > 1 else "syncer"), f) for s, f in enumerate(files[:dep.shards])]
    lines = ["#!/usr/bin/env bash",
             "# Written by `wan-diloco export skypilot`. Run it from this folder: file_mounts are relative to it.",
             "set -euo pipefail", 'cd "$(dirname "$0")"', "", credentials_script(dep), "",
             "# The syncer first: the learners need its address."]
    lines += [f"sky launch -y -d -c {c} {f}" for c, f in syncers]
    if dep.options.syncer_hosts:
        lines.append(f"SYNCER={dep.syncer_addresses(list(dep.options.syncer_hosts))}")
    else:
        ips = ",".join(f"$(sky status --ip {c}):{dep.port}" for c, _ in syncers)
        lines.append(f'SYNCER="{ips}"')
    lines.append("# Then each region's learners, told where the syncer is.")
    lines += [f'sky launch -y -d -c {dep.job(r)} region-{r}.yaml --env SYNCER="$SYNCER"' for r in dep.regions]
    lines.append(f"echo \"follow the run: sky logs {syncers[0][0]}\"")
    return "\n".join(lines) + "\n"


def files(dep: Deployment) -> dict[str, str]:
    check(dep)
    out = {}
    for s in range(dep.shards):
        out[f"syncer-{s}.yaml" if dep.shards > 1 else "syncer.yaml"] = dump_yaml(syncer_task(dep, s))
    for region in dep.regions:
        out[f"region-{region}.yaml"] = dump_yaml(region_task(dep, region))
    out["launch.sh"] = launch_script(dep, list(out))
    return out
