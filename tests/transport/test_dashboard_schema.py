"""The dashboard's expectations of /status against what the syncer really serves (#23 case 7), without a browser.

The page reads /status only through the schema in its ``<script type="application/json" id="status-schema">``
(``conform()``); here that schema is checked against ``SyncerService.status()`` of one shard and of a shard of
two, before any learner, mid-run, lost and back, after the final sync, and against shard 0's combined page
(``runtime.shard_status.aggregate``) with the other shard up and down, so that a renamed or retyped field fails
here in a second instead of as a blank panel on a real run. The merges (``history``) and the links are
checked by tests/runtime/test_dashboard_live.py, against real learners.
"""
from __future__ import annotations

import asyncio
import json
import re
from importlib import resources

import pytest

from wan_diloco import spec as rt
from wan_diloco.clock import VectorClock
from wan_diloco.core import Metadata
from wan_diloco.runtime import serde
from wan_diloco.runtime.shard_status import aggregate
from wan_diloco.runtime.syncer import SyncerService
from wan_diloco.transport import TransportMetrics, run
from wan_diloco.transport import status as status_module

from tests.conftest import write_micro


JSON_TYPES = {"number": (int, float), "string": str, "boolean": bool, "null": type(None), "array": list,
              "object": dict}


def page() -> str:
    return resources.files("wan_diloco.transport").joinpath("dashboard.html").read_text(encoding="utf-8")


def schema() -> dict:
    block = re.search(r'<script type="application/json" id="status-schema">(.*?)</script>', page(), re.S)
    assert block, "the dashboard has no status schema"
    return json.loads(block.group(1))


def script() -> str:
    (code,) = re.findall(r"<script>(.*?)</script>", page(), re.S)
    return code


def type_of(x) -> str:
    if isinstance(x, bool):  # a bool is an int in Python, not a number in JSON
        return "boolean"
    return next(name for name, t in JSON_TYPES.items() if isinstance(x, t))


def problems(value, spec, path="status") -> list[str]:
    """What the page's conform() would report for ``value``: the same rules, in Python."""
    if isinstance(spec, str):
        return [] if type_of(value) in spec.split("|") else [f"{path} is {type_of(value)}, expected {spec}"]
    if isinstance(spec, list):
        if not isinstance(value, list):
            return [f"{path} is {type_of(value)}, expected a list"]
        return [p for i, x in enumerate(value) for p in problems(x, spec[0], f"{path}[{i}]")]
    if "|" in spec:
        if any(not problems(value, alternative, path) for alternative in spec["|"]):
            return []
        return [f"{path} is {type_of(value)}, in none of the shapes expected"]
    if not isinstance(value, dict):
        return [f"{path} is {type_of(value)}, expected an object"]
    if "*" in spec:
        return [p for k, x in value.items() for p in problems(x, spec["*"], f"{path}.{k}")]
    out = []
    for key, sub in spec.items():
        name = key.rstrip("?")
        if name not in value:
            out += [] if key.endswith("?") else [f"{path}.{name} is missing"]
        else:
            out += problems(value[name], sub, f"{path}.{name}")
    return out


def served(status: dict) -> dict:
    """``status`` as the browser receives it: through the status server's JSON."""
    return json.loads(json.dumps(status_module._finite(status), allow_nan=False))


def service(tmp_path, shards=1, shard=0) -> SyncerService:
    path = tmp_path / f"run-{shards}-{shard}.toml"
    write_micro(path, run={"learners": 2, "batch_size": 16, "run_id": "schema-test",  # 16: the tokens posted
                           "token": "schema-token-0123456789"}, syncer={"shards": shards})
    return SyncerService(rt.load(path), TransportMetrics(), shard=shard)


def md(m, step, tokens, loss):
    return serde.to_frame(Metadata(learner=m, step=step, c_steps=(0, 0), c_tokens=(0, 0),
                                   clock=VectorClock({f"learner-{m}": step}), loss=loss, tokens=tokens))


def states(svc: SyncerService) -> dict[str, dict]:
    """``svc``'s /status at the moments the page meets: before any learner, mid-run (a learner without a
    loss), a learner lost and back, after the final sync."""
    clock = [svc.started_s]
    svc.now = lambda: clock[0]
    out = {"before any learner": served(svc.status())}

    async def main():
        await svc.on_metadata(md(0, 1, 0, 9.5))
        out["one learner"] = served(svc.status())
        await svc.on_metadata(md(1, 1, 0, None))
        clock[0] += 2
        await svc.on_metadata(md(0, 5, 4000, 7.25))
        await svc.on_metadata(md(1, 5, 4000, None))  # no loss to report (a NaN one is refused by serde)
        out["mid-run"] = served(svc.status())
        clock[0] += 25  # past liveness_timeout_s: learner 1 is lost
        await svc.on_metadata(md(0, 9, 9000, 6.0))
        svc.tick()
        out["a learner lost"] = served(svc.status())
        await svc.on_metadata(md(1, 9, 2000, 6.5))
        out["rejoined"] = served(svc.status())
        svc.final_done.set()
        out["after the final sync"] = served(svc.status())

    run(asyncio.wait_for(main(), 30))
    return out


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory) -> dict[str, dict]:
    return states(service(tmp_path_factory.mktemp("one-shard")))


def test_every_status_one_syncer_serves_is_what_the_page_expects(one_shard):
    spec = schema()
    seen = one_shard
    for moment, st in seen.items():
        assert problems(st, spec) == [], moment
        assert st["shards"] == 1 and isinstance(st["learners"]["0"], dict), moment
    # The states really differ where the page must cope: nobody, a lost learner, no loss, the end.
    assert seen["before any learner"]["learners"]["0"]["alive"] is None
    assert seen["a learner lost"]["learners"]["1"]["alive"] is False
    assert seen["mid-run"]["learners"]["1"]["loss"] is None
    assert seen["after the final sync"]["final_done"] is True


def test_every_status_of_a_sharded_run_is_what_the_page_expects(tmp_path):
    spec = schema()
    shard0, shard1 = states(service(tmp_path, 2, 0)), states(service(tmp_path, 2, 1))
    for moment in shard0:
        assert problems(shard1[moment], spec) == [], ("shard 1's own page", moment)
        up = served(aggregate(shard0[moment], {1: shard1[moment]}))
        assert problems(up, spec) == [], ("shard 0's page", moment)
        assert [r["reachable"] for r in up["shards"]] == [True, True]
        down = served(aggregate(shard0[moment], {1: "ClientConnectorError from http://127.0.0.1:1: refused"}))
        assert problems(down, spec) == [], ("shard 0's page, shard 1 down", moment)
        assert [r["reachable"] for r in down["shards"]] == [True, False]


CONTRACT = {  # fields other parts of the syncer add (#23), in the shapes agreed on; absent is fine too
    "refused": {"metadata.step": 3, "clock": 1},
    "storage": {"dir": "/ckpt", "ok": False, "failures": 4, "last_error": "[Errno 28] No space left on device",
                "free_bytes": 0},
    "barrier": {"need": 2, "joined": [0], "waiting_for": [1], "started": False},
}


def test_the_fields_agreed_on_for_other_parts_fit_the_schema_and_a_wrong_one_is_reported(one_shard):
    spec = schema()
    st = one_shard["mid-run"]
    states_ = {m: {**lr, "state": "quarantined"} for m, lr in st["learners"].items()}
    with_contract = {**st, **CONTRACT, "learners": states_}
    assert problems(with_contract, spec) == []
    # The checker (and the page, which follows the same rules) notices renames and retypes.
    assert problems({**st, "shards": "1"}, spec) == ["status.shards is string, in none of the shapes expected"]
    assert problems({**st, "storage": {**CONTRACT["storage"], "free_bytes": "0"}}, spec) == [
        "status.storage.free_bytes is string, expected number|null"]
    renamed = {k: v for k, v in st.items() if k != "versions"}
    assert problems(renamed, spec) == ["status.versions is missing"]


# The script's names for parts of /status (the conformed view ``v``) and where in the schema each lives.
VIEWS = {"v": [], "lr": ["learners", "*"], "ln": ["links", "*"], "sr": ["shards", "|", 1, 0],
         "mg": ["history", 0], "ev": ["events", 0], "sto": ["storage?"], "bar": ["barrier?"]}


def test_the_script_reads_nothing_the_schema_does_not_name():
    spec, code = schema(), script()
    read = set(re.findall(r"\b(v|lr|ln|sr|mg|ev|sto|bar)\.([A-Za-z_]\w*)", code))
    assert len(read) > 40, read  # the pattern still finds the page's reads
    for var, field in sorted(read):
        node = spec
        for step in VIEWS[var]:
            node = node[step]
        names = {k.rstrip("?") for k in node}
        assert field in names, f"the page reads {var}.{field}, which its status schema does not name"
    # And the raw /status object only goes through conform().
    assert re.findall(r"\bs\.\w+", code.split("async function poll()")[0]) == []


@pytest.mark.parametrize("var", sorted(VIEWS))
def test_every_view_name_is_used(var):
    # A renamed variable would silently escape the check above.
    assert re.search(rf"\b{var}\.[a-z_]", script()), var
