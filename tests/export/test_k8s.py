"""Kubernetes manifests: each object read into the official Python client's models (required fields
checked there; a field it does not know is dropped, so a round trip that loses anything fails), and every
container's command line parsed by our own CLI."""
import json
import subprocess
import tomllib

import pytest
import yaml

from wan_diloco.config import ConfigError
from wan_diloco.export import ExportOptions, export
from wan_diloco.transport.security import check_token

from .helpers import parse, run_file

OPTIONS = ExportOptions(image="ghcr.io/me/wan-diloco:1")
MODELS = {"ConfigMap": "V1ConfigMap", "Secret": "V1Secret", "Service": "V1Service",
          "StatefulSet": "V1StatefulSet", "Job": "V1Job"}


def read(api, doc: dict, model: str):
    """``doc`` as the client reads a response body into ``model`` (its signature changed in v34)."""
    try:
        return api.deserialize(json.dumps(doc), model, "application/json")
    except TypeError:  # before v34: deserialize(response, response_type), the body in response.data
        return api.deserialize(type("Response", (), {"data": json.dumps(doc)})(), model)


def files(options=OPTIONS, **tables):
    spec, text = run_file(**tables)
    return export(spec, text, "k8s", options)


def objects(out) -> list[dict]:
    return [doc for name, text in out.items() if name.endswith(".yaml") for doc in yaml.safe_load_all(text)]


def containers(docs, kind):
    return [c for d in docs if d["kind"] == kind for c in d["spec"]["template"]["spec"]["containers"]]


def test_the_kubernetes_clients_models_read_every_object_whole():
    client = pytest.importorskip("kubernetes.client", reason="the kubernetes client is not installed "
                                                            "(pip install -e '.[test]')")
    api = client.ApiClient()
    out = files(ExportOptions(image="img:1", namespace="training"), syncer={"shards": 2},
                run={"platform": "gpu", "devices_per_learner": 8})
    docs = objects(out)
    assert sorted({d["kind"] for d in docs}) == sorted(MODELS)
    for doc in docs:
        model = read(api, doc, MODELS[doc["kind"]])
        assert api.sanitize_for_serialization(model) == doc  # nothing unknown, misspelled or mistyped
        assert doc["metadata"]["namespace"] == "training"
    # and the check can fail: a misspelled field does not survive the round trip
    job = next(d for d in docs if d["kind"] == "Job")
    job["spec"]["backofLimit"] = job["spec"].pop("backoffLimit")
    assert api.sanitize_for_serialization(read(api, job, "V1Job")) != job


def test_syncer_service_selects_every_shard_and_learners_dial_their_pods(parser):
    docs = objects(files(syncer={"shards": 2}))
    [service] = [d for d in docs if d["kind"] == "Service"]
    sets = [d for d in docs if d["kind"] == "StatefulSet"]
    assert [s["metadata"]["name"] for s in sets] == ["wd-syncer-0", "wd-syncer-1"]
    assert service["spec"]["clusterIP"] == "None" and [p["port"] for p in service["spec"]["ports"]] == [7070, 7071]
    for s, sts in enumerate(sets):
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert sts["spec"]["serviceName"] == service["metadata"]["name"] and sts["spec"]["replicas"] == 1
        [c] = sts["spec"]["template"]["spec"]["containers"]
        args = parse(parser, c["command"] + c["args"])
        assert (args.command, args.shard, args.port, args.config) == ("syncer", s, 7070, "/etc/wan-diloco/run/run.toml")
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert sorted(j["metadata"]["name"] for j in jobs) == [f"wd-learner-{m}" for m in range(5)]
    for job in jobs:
        [c] = job["spec"]["template"]["spec"]["containers"]
        args = parse(parser, c["command"] + c["args"])
        assert args.command == "learner" and job["metadata"]["name"] == f"wd-learner-{args.id}"
        # a StatefulSet's pod is <set>-0, named under its Service
        assert args.syncer == "wd-syncer-0-0.wd-syncer:7070,wd-syncer-1-0.wd-syncer:7070"
        secret = next(v["secret"]["secretName"] for v in job["spec"]["template"]["spec"]["volumes"] if "secret" in v)
        token = next(e for e in c["env"] if e["name"] == "WAN_DILOCO_TOKEN")["valueFrom"]["secretKeyRef"]
        assert secret == token["name"] == f"wd-learner-{args.id}"  # its own credentials, no one else's


def test_each_region_file_holds_its_learners_and_the_run_file():
    out = files()
    spec, text = run_file()
    for region, ids in (("us-east-1", [0, 2, 4]), ("eu-west-1", [1, 3])):
        docs = list(yaml.safe_load_all(out[f"region-{region}.yaml"]))
        [cm] = [d for d in docs if d["kind"] == "ConfigMap"]
        assert cm["data"]["run.toml"] == text and tomllib.loads(cm["data"]["run.toml"])["run"]["learners"] == 5
        assert [d["metadata"]["name"] for d in docs if d["kind"] == "Job"] == [f"wd-learner-{m}" for m in ids]


def test_tls_files_come_from_the_secret_through_the_environment():
    docs = objects(files(run={"platform": "gpu", "devices_per_learner": 2}))
    for c in containers(docs, "Job") + containers(docs, "StatefulSet"):
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["WAN_DILOCO_TLS_CERT"] == "/etc/wan-diloco/tls/tls.crt"
        assert env["WAN_DILOCO_TLS_KEY"] == "/etc/wan-diloco/tls/tls.key"
        assert env["WAN_DILOCO_TLS_CA"] == "/etc/wan-diloco/tls/ca.crt"
        assert {"name": "tls", "mountPath": "/etc/wan-diloco/tls", "readOnly": True} in c["volumeMounts"]
    assert all(c["resources"] == {"limits": {"nvidia.com/gpu": "2"}} for c in containers(docs, "Job"))
    assert not any("resources" in c for c in containers(docs, "StatefulSet"))


def test_secrets_are_placeholders_a_process_refuses_until_filled():
    docs = list(yaml.safe_load_all(files()["secrets.yaml"]))
    assert [d["metadata"]["name"] for d in docs] == ["wd-syncer"] + [f"wd-learner-{m}" for m in (0, 2, 4, 1, 3)]
    for d in docs:
        assert set(d["stringData"]) == {"token", "tls.crt", "tls.key", "ca.crt"}
        assert all(v.startswith("FILL IN: the contents of ") for v in d["stringData"].values())
        with pytest.raises(ConfigError):  # an unfilled token is no token
            check_token(d["stringData"]["token"], "WAN_DILOCO_TOKEN")


def test_launch_script_makes_the_secrets_from_files_then_applies_in_order():
    script = files(ExportOptions(image="img:1", namespace="training"))["launch.sh"]
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert "--syncer-host wd-syncer-0-0.wd-syncer --syncer-host wd-syncer" in script  # the run file's server_name too
    assert ("kubectl -n training create secret generic wd-learner-3 --from-file=token=tokens/learner-3.token "
            "--from-file=tls.crt=tls/learner-3.pem --from-file=tls.key=tls/learner-3.key") in script
    order = [script.index(s) for s in ("wan-diloco certs", "create secret", "apply -f syncer.yaml",
                                       "apply -f region-us-east-1.yaml")]
    assert order == sorted(order)


@pytest.mark.parametrize("options, tables, needle", [
    (ExportOptions(), {}, "--image: required for k8s"),
    (OPTIONS, {"run": {"platform": "gpu"}}, "run.devices_per_learner: run.platform is \"gpu\""),
])
def test_what_kubernetes_cannot_guess_is_asked_for(options, tables, needle):
    with pytest.raises(ConfigError) as e:
        files(options, **tables)
    assert needle in str(e.value)


def test_launch_script_runs_in_order(fakes):
    calls = fakes(files(ExportOptions(image="img:1", namespace="training"))["launch.sh"])
    steps = [" ".join(c["argv"]) for c in calls]
    assert steps[5].startswith("wan-diloco certs --dir tls")  # after the 5 learners' tokens
    secrets = [i for i, s in enumerate(steps) if s.startswith("kubectl -n training create secret generic")]
    assert len(secrets) == 6 and max(secrets) < steps.index("kubectl -n training apply -f syncer.yaml")
    assert steps[-2:] == ["kubectl -n training apply -f region-us-east-1.yaml",
                          "kubectl -n training apply -f region-eu-west-1.yaml"]


def test_the_direct_stripes_port_is_served_and_opened_when_the_run_file_sets_one():
    docs = objects(files(transport={"direct_port": 7072}))
    [service] = [d for d in docs if d["kind"] == "Service"]
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("grpc", 7070), ("direct", 7072),
                                                                           ("status", 7071)]
    [sts] = [d for d in docs if d["kind"] == "StatefulSet"]
    [c] = sts["spec"]["template"]["spec"]["containers"]
    assert {"name": "direct", "containerPort": 7072} in c["ports"]
