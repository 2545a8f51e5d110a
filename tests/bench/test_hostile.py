"""The hostile-peer harness (#23): its message generator, its readers of /metrics and /status, its
verdicts on made-up runs; and a short real run (a few hundred messages against learners 0 and 1)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import Counter

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import hostile_attack, hostile_cases as hc, hostile_report as report  # noqa: E402
from wan_diloco.runtime import serde  # noqa: E402
from wan_diloco.transport import messages as wire  # noqa: E402
from wan_diloco.transport.metrics import TransportMetrics  # noqa: E402

CTX = hc.Context(learners=3, steps=200, fragments=2)
LIVE = {"versions": [3, 3], "epoch": 1, "global_step": 40,
        "payloads": {k: b"p" * 16 for k in ("zero", "fragment_P", "huge", "truncated", "garbage", "donation0")}}
SCHEMA = {"messages", "refused_by_field", "quarantined", "final_eval_loss", "clean_eval_loss", "loss_ratio",
          "digests_equal", "checks", "ok"}
RIGHT = ("attack_in_training", "finished", "digests_equal", "refusals_counted", "nothing_taken_past_limit",
         "no_impersonation_taken", "honest_not_quarantined", "honest_state_untouched")


# ---- the generator --------------------------------------------------------------------------------

def test_a_short_run_covers_every_family_of_fields_senders_and_credentials():
    cases = list(hc.generate(CTX, 300, seed=0))
    assert len(cases) == 300 and [c.i for c in cases] == list(range(300))
    fields = {c.field for c in cases}
    for family in ("metadata.step", "metadata.clock", "metadata.epoch", "metadata.c_tokens", "metadata.tau",
                   "upload.base_version", "upload.epoch", "upload.due_step", "upload.clock", "upload.payload",
                   "upload.slow_stream", "wire.checksum", "wire.magic", "wire.header", "bulk.name", "bulk.offset",
                   "probe.bytes", "subscribe.sender"):
        assert family in fields, family
    assert {"learner-0", "learner-1", "learner-3", "syncer", ""} <= {c.sender for c in cases}
    assert {c.cred for c in cases} == {"own", "none", "wrong", "run"}
    assert {c.rpc for c in cases} == {"Metadata", "Upload", "Bulk", "Probe", "Subscribe", "SlowUpload"}
    # Anything declaring an honest learner, or without a valid credential, must be refused.
    assert all(c.expect == "refuse" for c in cases if c.impersonates or c.cred in ("none", "wrong"))
    assert all(c.expect == "refuse" for c in cases if c.limit == "past")


def test_the_stream_is_deterministic_for_a_seed_and_bounded_by_n():
    rows = lambda seed, n: [c.row() for c in hc.generate(CTX, n, seed)]  # noqa: E731
    assert rows(3, 400) == rows(3, 400)
    assert rows(3, 400) != rows(4, 400)
    assert len(rows(0, 10_000)) == 10_000 and len(rows(0, 7)) == 7


def test_values_at_a_limit_are_within_the_wire_schema_and_past_the_wire_limits_are_not():
    """The generator's labels are honest: an ``at`` metadata of learner-2 decodes (only the core may
    judge it), and every malformed-wire case is refused by the transport's own decoder."""
    cases = list(hc.generate(CTX, 300, seed=0))
    at = [c for c in cases if c.rpc == "Metadata" and c.limit in ("at", "valid") and not c.impersonates
          and c.cred == "own"]
    assert at
    for c in at:
        frame = wire.decode_message(c.build(LIVE))
        assert serde.metadata_from_frame(frame, CTX.learners).learner == hc.ATTACKER
    wire_cases = [c for c in cases if c.field.startswith("wire.")]
    assert len({c.value for c in wire_cases}) >= 10
    for c in wire_cases:
        data = c.build(LIVE)
        try:
            msg = wire.decode_message(data)
        except wire.MessageError:
            continue
        # Decodes as a message, but not one a Metadata call takes (an Ack, a frame with a payload...).
        assert not isinstance(msg, wire.Frame) or len(msg.payload) or msg.fragment, c.value
    past_step = next(c for c in cases if c.field == "metadata.step" and c.value == "2**63")
    with pytest.raises(wire.MessageError, match="step|2\\*\\*63|must be in"):
        serde.metadata_from_frame(wire.decode_message(past_step.build(LIVE)), CTX.learners)


def test_verdicts_name_what_should_have_been_refused():
    cases = list(hc.generate(CTX, 300, seed=0))
    poison = next(c for c in cases if c.field == "metadata.step" and c.value == "steps" and not c.impersonates)
    as_honest = next(c for c in cases if c.sender == "learner-0" and c.rpc == "Metadata" and c.cred == "own")
    assert hostile_attack.verdict(poison, poison.expect, "OK") == "taken_past_limit"
    assert hostile_attack.verdict(as_honest, as_honest.expect, "OK") == "impersonation_taken"
    assert hostile_attack.verdict(as_honest, as_honest.expect, "PERMISSION_DENIED") == "refused"
    slow = next(c for c in cases if c.rpc == "SlowUpload" and c.sender.startswith("mallory"))
    # Held until the attacker gave up: the invented sender had a slot all along.
    assert hostile_attack.verdict(slow, slow.expect, "INVALID_ARGUMENT", "upload ended mid-message after 27 bytes") \
        == "impersonation_taken"
    assert hostile_attack.verdict(slow, slow.expect, "UNAUTHENTICATED", "wrong token") == "refused"
    # With a shared token the run's token is learner-2's own credential: a valid message is no violation.
    run_valid = next(c for c in cases if c.cred == "run" and not c.impersonates)
    assert hostile_attack.expected(run_valid, per_learner=False) == "either"
    assert hostile_attack.expected(run_valid, per_learner=True) == "refuse"


# ---- reading the syncer ---------------------------------------------------------------------------

def test_refusals_are_read_by_field_when_the_syncer_counts_them_and_by_status_code_otherwise():
    metrics = TransportMetrics()
    metrics.error("Metadata", "INVALID_ARGUMENT")
    metrics.error("Metadata", "INVALID_ARGUMENT")
    metrics.error("Upload", "RESOURCE_EXHAUSTED")
    today = report.refusals(metrics.render().decode())
    assert today == {"refused_total": None, "identity_refused_total": None,
                     "transport_errors": {"Metadata/INVALID_ARGUMENT": 2, "Upload/RESOURCE_EXHAUSTED": 1}}
    refused = Counter("refused", "Refusals by field", ["field"], namespace="wan_diloco", registry=metrics.registry)
    refused.labels("metadata.step").inc(3)
    refused.labels("clock").inc()
    Counter("identity_refused", "Declared sender is not the credential's", namespace="wan_diloco",
            registry=metrics.registry).inc(4)
    later = report.refusals(metrics.render().decode())
    assert later["refused_total"] == {"metadata.step": 3, "clock": 1}
    assert later["identity_refused_total"] == 4 and later["transport_errors"] == today["transport_errors"]


def test_quarantined_learners_are_read_from_their_state_or_the_events():
    status = {"learners": {"0": {"state": "alive"}, "1": {"state": "quarantined"}, "2": {"alive": True}},
              "events": [{"kind": "warning", "what": "learner 2 quarantined for 60 s: outer gradient too large"},
                         {"kind": "warning", "what": "merge of fragment 0 refused"}]}
    assert report.quarantined_of(status) == {1, 2}
    assert report.quarantined_of({"learners": {}, "events": []}) == set()


# ---- the verdict on made-up runs ------------------------------------------------------------------

TPS = 256


def made_up_run(steps=(168, 168), loss=2.5, view=None, quarantined=(), digests=("a", "b"), exit_code=0,
                jumped=0) -> dict:
    """Two honest learners' finals; learner 0 counts ``jumped`` steps it never trained."""
    finals = {f"learner-{m}": {"steps": s + (jumped if m == 0 else 0), "tokens": s * TPS, "final_eval_loss": loss,
                               "digests": list(digests), "digest_mismatch": []} for m, s in enumerate(steps)}
    metrics = TransportMetrics()
    metrics.error("Metadata", "INVALID_ARGUMENT")
    text = metrics.render().decode()
    return {"finals": finals, "syncer_final": {"digests": ["a", "b"], "t": 100.0},
            "exit_codes": {"syncer": 0, "learner-0": exit_code, "learner-1": 0}, "errors": [],
            "max_view_step": view or {"0": steps[0], "1": steps[1]}, "quarantined": list(quarantined),
            "metrics": text, "metrics_after_attack": text, "status": {"rejected": 1}, "attack_exit": 0, "wall_s": 60.0}


ROWS = [{"rpc": "Metadata", "field": "metadata.step", "value": "steps", "code": "INVALID_ARGUMENT",
         "verdict": "refused", "t": 50.0},
        {"rpc": "Metadata", "field": "metadata", "value": "valid", "code": "OK", "verdict": "taken", "t": 51.0}]


def test_a_right_run_passes_every_check():
    out = report.analyze(made_up_run(), made_up_run(loss=2.49), ROWS, TPS)
    assert SCHEMA <= set(out) and out["ok"], out["checks"]
    assert out["refused_by_field"] == {"metadata.step": 1} and out["messages"] == 2
    assert out["loss_ratio"] == pytest.approx(2.5 / 2.49, rel=1e-4) and out["digests_equal"]


@pytest.mark.parametrize("run, rows, check", [
    (made_up_run(jumped=2232), ROWS, "honest_state_untouched"),  # issue case 1: 168 steps trained, 2400 counted
    (made_up_run(view={"0": 2400, "1": 168}), ROWS, "honest_state_untouched"),  # the syncer saw a step never trained
    (made_up_run(quarantined=(0,)), ROWS, "honest_not_quarantined"),
    (made_up_run(digests=("a", "c")), ROWS, "digests_equal"),
    (made_up_run(exit_code=4), ROWS, "finished"),
    (made_up_run(loss=2.6), ROWS, "loss_within_2pct"),
    (made_up_run(), ROWS + [{"rpc": "Metadata", "field": "metadata", "value": "valid", "code": "OK",
                             "verdict": "impersonation_taken"}], "no_impersonation_taken"),
    (made_up_run(), ROWS + [{"rpc": "Metadata", "field": "metadata.clock", "value": "syncer 2**53", "code": "OK",
                             "verdict": "taken_past_limit"}], "nothing_taken_past_limit"),
    # Refused twice by the server's word, counted once on /metrics.
    (made_up_run(), ROWS + [dict(ROWS[0])], "refusals_counted"),
    # Sent after the final sync: it tested nothing of the training.
    (made_up_run(), ROWS + [{**ROWS[1], "t": 101.0}], "attack_in_training"),
    # The syncer was gone before the attack ended: what /metrics counted is not known.
    ({**made_up_run(), "metrics_after_attack": None}, ROWS, "refusals_counted"),
])
def test_each_wrong_outcome_fails_its_check(run, rows, check):
    out = report.analyze(run, made_up_run(), rows, TPS)
    assert not out["checks"][check] and not out["ok"]
    assert [k for k, v in out["checks"].items() if not v] == [check]


# ---- a real run -----------------------------------------------------------------------------------

def test_a_short_hostile_run_ends_right(tmp_path):
    """300 messages at 100/s against learners 0 and 1 of a 3-learner micro run, no clean run (the loss
    check is the slow test's): every process exits 0, digests agree, every refusal is on /metrics,
    nothing that had to be refused was taken, the honest learners are neither quarantined nor moved."""
    out, work = tmp_path / "hostile.json", tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "bench.chaos", "--hostile", "--messages", "300", "--rate", "100",
                           "--steps", "64", "--no-clean", "--out", str(out), "--work", str(work)],
                          cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert SCHEMA <= set(doc) and doc["messages"] == 300
    rows = (work / "hostile" / "attack_rows.jsonl").read_text().splitlines()
    assert len(rows) == 300 and {json.loads(r)["rpc"] for r in rows} >= {"Metadata", "Upload", "Bulk", "Subscribe"}
    failed = [k for k in RIGHT if not doc["checks"][k]]
    assert not failed, (failed, doc["taken_that_should_be_refused"][:10], doc["honest_state_touched"],
                        doc["undercounted"], doc["quarantined"])
    assert proc.returncode == 1 and doc["clean_eval_loss"] is None  # no clean run: no loss ratio, not ok


@pytest.mark.slow  # two runs of ~1 min each on 2 cores
def test_a_hostile_run_trains_as_well_as_a_clean_one(tmp_path):
    out = tmp_path / "hostile.json"
    proc = subprocess.run([sys.executable, "-m", "bench.chaos", "--hostile", "--messages", "1000", "--rate", "100",
                           "--out", str(out), "--work", str(tmp_path / "work")],
                          cwd=ROOT, timeout=1200, capture_output=True, text=True)
    doc = json.loads(out.read_text())
    assert doc["ok"] and proc.returncode == 0, (doc["checks"], doc["taken_that_should_be_refused"][:10])
    assert abs(doc["loss_ratio"] - 1) <= 0.02 and doc["checks"]["clean_run_right"]
