"""Kubernetes manifests: the syncer (a headless Service and one StatefulSet per shard), one Job per learner
(grouped per region: a region is often its own cluster), the run file as a ConfigMap, and each process's
credentials as a Secret.

Secrets are never invented: ``secrets.yaml`` holds placeholders that a process refuses if left unfilled
(a token with spaces in it, a certificate that is no PEM); ``launch.sh`` creates the same Secrets from the
files ``wan-diloco token`` and ``wan-diloco certs`` write, without putting them in a manifest.
"""
from __future__ import annotations

from wan_diloco.config import require
from wan_diloco.export.common import RUN_FILE, TLS_ENV, Deployment, credentials_script, dump_yaml
from wan_diloco.spec import TOKEN_ENV

ETC = "/etc/wan-diloco"
WORKDIR = "/var/lib/wan-diloco"  # the syncer's volume: a relative checkpoint.dir and run.run_dir land here
SECRET_FILES = (("tls.crt", "pem"), ("tls.key", "key"), ("ca.crt", None))  # Secret key -> file suffix


def check(dep: Deployment) -> None:
    run = dep.spec.run
    require(bool(dep.options.image), "--image", "required for k8s: a container image with wan-diloco installed")
    require(run.platform != "gpu" or run.devices_per_learner > 0, "run.devices_per_learner",
            'run.platform is "gpu": k8s needs the GPUs per learner (nvidia.com/gpu), got 0 ("all")')


def _meta(dep: Deployment, name: str, **labels: str) -> dict:
    meta: dict = {"name": dep.job(name), "labels": {"app.kubernetes.io/name": "wan-diloco",
                                                     "app.kubernetes.io/instance": dep.options.name, **labels}}
    if dep.options.namespace:
        meta["namespace"] = dep.options.namespace
    return meta


def syncer_hosts(dep: Deployment) -> list[str]:
    """The address of each shard learners dial: --syncer-host, else its pod's name under the Service."""
    return list(dep.options.syncer_hosts) or [f"{dep.job(f'syncer-{s}')}-0.{dep.job('syncer')}"
                                              for s in range(dep.shards)]


def config_map(dep: Deployment, run_file: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(dep, "run"), "data": {RUN_FILE: run_file}}


def secret(dep: Deployment, who: str, token_file: str, cert: str) -> dict:
    files = {"token": token_file, **{k: f"tls/{cert}.{ext}" if ext else "tls/ca.pem" for k, ext in SECRET_FILES}}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(dep, who), "type": "Opaque",
            "stringData": {k: f"FILL IN: the contents of {f}" for k, f in files.items()}}


def _container(dep: Deployment, name: str, argv: list[str], secret_name: str, gpus: int = 0) -> dict:
    env = [{"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": "token"}}}]
    env += [{"name": var, "value": f"{ETC}/tls/{key}"} for var, (key, _) in zip(TLS_ENV, SECRET_FILES)]
    c: dict = {"name": name, "image": dep.options.image, "command": argv[:1], "args": argv[1:], "env": env,
               "volumeMounts": [{"name": "run", "mountPath": f"{ETC}/run", "readOnly": True},
                                {"name": "tls", "mountPath": f"{ETC}/tls", "readOnly": True}]}
    if gpus:
        c["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}  # a quantity: a string in the API
    return c


def _volumes(dep: Deployment, secret_name: str) -> list[dict]:
    return [{"name": "run", "configMap": {"name": dep.job("run")}},
            # the TLS files only: the token reaches the process as an environment variable, not a file. The
            # default mode (0644) keeps them readable by an image that runs as a non-root user.
            {"name": "tls", "secret": {"secretName": secret_name,
                                       "items": [{"key": k, "path": k} for k, _ in SECRET_FILES]}}]


def syncer_objects(dep: Deployment) -> list[dict]:
    st = dep.spec.run.status_port
    dp = dep.spec.transport.direct_port  # direct stripes: a second port learners connect to
    ports = ([{"name": "grpc", "port": dep.port}] + ([{"name": "direct", "port": dp}] if dp else [])
             + ([{"name": "status", "port": st}] if st > 0 else []))
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(dep, "syncer"),
               "spec": {"clusterIP": "None", "selector": {"app.kubernetes.io/instance": dep.options.name,
                                                          "app.kubernetes.io/component": "syncer"},
                        "ports": [{**p, "targetPort": p["port"]} for p in ports]}}
    out = [service]
    for s in range(dep.shards):
        labels = {"app.kubernetes.io/instance": dep.options.name, "app.kubernetes.io/component": "syncer",
                  "wan-diloco/shard": str(s)}
        container = _container(dep, "syncer", dep.syncer_argv(f"{ETC}/run/{RUN_FILE}", s), dep.job("syncer"))
        container["ports"] = [{"name": p["name"], "containerPort": p["port"]} for p in ports]
        container["workingDir"] = WORKDIR
        container["volumeMounts"].append({"name": "state", "mountPath": WORKDIR})
        out.append({
            "apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": _meta(dep, f"syncer-{s}", **{"app.kubernetes.io/component": "syncer"}),
            "spec": {"serviceName": dep.job("syncer"), "replicas": 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": {"app.kubernetes.io/name": "wan-diloco", **labels}},
                                  "spec": {"containers": [container], "volumes": _volumes(dep, dep.job("syncer"))}},
                     # snapshots and the final parameters outlive a restarted pod (`--resume` takes them up)
                     "volumeClaimTemplates": [{"metadata": {"name": "state"}, "spec": {
                         "accessModes": ["ReadWriteOnce"],
                         "resources": {"requests": {"storage": dep.options.storage}}}}]}})
    return out


def learner_job(dep: Deployment, m: int, syncer: str) -> dict:
    who = f"learner-{m}"
    gpus = dep.spec.run.devices_per_learner if dep.spec.run.platform == "gpu" else 0
    container = _container(dep, "learner", dep.learner_argv(f"{ETC}/run/{RUN_FILE}", str(m), syncer),
                           dep.job(who), gpus)
    labels = {"app.kubernetes.io/component": "learner", "wan-diloco/region": dep.spec.region(m)}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(dep, who, **labels),
            # a learner that died rejoins with --resume (by hand): a plain retry would start it afresh
            "spec": {"backoffLimit": 0, "template": {
                "metadata": {"labels": {"app.kubernetes.io/name": "wan-diloco",
                                        "app.kubernetes.io/instance": dep.options.name, **labels}},
                "spec": {"restartPolicy": "Never", "containers": [container], "volumes": _volumes(dep, dep.job(who))}}}}


def launch_script(dep: Deployment, hosts: list[str]) -> str:
    ns = f" -n {dep.options.namespace}" if dep.options.namespace else ""
    def create(name: str, token: str, cert: str) -> str:
        files = [f"--from-file=token={token}"] + [f"--from-file={k}=" + (f"tls/{cert}.{e}" if e else "tls/ca.pem")
                                                  for k, e in SECRET_FILES]
        return (f"kubectl{ns} create secret generic {dep.job(name)} {' '.join(files)} "
                f"--dry-run=client -o yaml | kubectl{ns} apply -f -")
    lines = ["#!/usr/bin/env bash",
             "# Written by `wan-diloco export k8s`. One cluster shown; for a region in another cluster, run its",
             "# learners' lines with that cluster's context (kubectl --context ...).",
             "set -euo pipefail", 'cd "$(dirname "$0")"', "", credentials_script(dep, hosts), "",
             "# The Secrets, from those files (secrets.yaml shows the same objects with placeholders).",
             create("syncer", "token", "syncer")]
    lines += [create(f"learner-{m}", f"tokens/learner-{m}.token", f"learner-{m}")
              for ids in dep.regions.values() for m in ids]
    lines += [f"kubectl{ns} apply -f syncer.yaml"]
    lines += [f"kubectl{ns} apply -f region-{r}.yaml" for r in dep.regions]
    lines.append(f"echo \"follow the run: kubectl{ns} logs -f statefulset/{dep.job('syncer-0')}\"")
    return "\n".join(lines) + "\n"


def files(dep: Deployment, run_file: str) -> dict[str, str]:
    check(dep)
    hosts = syncer_hosts(dep)
    address = dep.syncer_addresses(hosts)
    out = {"syncer.yaml": dump_yaml(config_map(dep, run_file), *syncer_objects(dep))}
    for region, ids in dep.regions.items():
        out[f"region-{region}.yaml"] = dump_yaml(config_map(dep, run_file),
                                                 *[learner_job(dep, m, address) for m in ids])
    learners = [secret(dep, f"learner-{m}", f"tokens/learner-{m}.token", f"learner-{m}")
                for ids in dep.regions.values() for m in ids]
    out["secrets.yaml"] = dump_yaml(secret(dep, "syncer", "token", "syncer"), *learners)
    out["launch.sh"] = launch_script(dep, hosts)
    return out
