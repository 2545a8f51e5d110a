"""sim/donations.py: peer recovery in the simulator goes through the runtime's core pieces on both sides: the
syncer's Donations picks the donor, the donor's core.peer.Donor answers with SendState, its state travels as
donation parts on its own link, Donations reassembles them, the recipient installs them; a donor that dies or
stays silent is replaced as core.recovery decides. Micro runs as tests/sim/test_faults.py's.

The states are sent in parts of 128 KiB (transport.max_message_bytes // 2): about five per donation."""
import numpy as np

from wan_diloco.core.peer import NOBODY_HEALTHY
from wan_diloco.tape import Outage, SyncerOutage

from .test_faults import events, merges, run, spec

SMALL_PARTS = {"chunk_bytes": 64 << 10, "max_message_bytes": 256 << 10}


def cfg(**syncer):
    return spec().with_changes(transport=SMALL_PARTS, **({"syncer": syncer} if syncer else {}))


def the_donation(s, recipient):
    (asked, *_), (donated, *_) = events(s, "ask_donor", learner=recipient), events(s, "donated", recipient=recipient)
    return asked, donated


def test_the_recovered_optimizer_is_the_donors_as_of_its_donation_and_came_over_its_links():
    c = cfg()
    s, _ = run(c, [Outage(1, 5.0, 7.0)])
    asked, donated = the_donation(s, 1)
    (rec,) = events(s, "recovered", learner=1)
    # Donations chose learner 0 (same region, equally busy, most advanced or lowest id); it answered between two
    # of its steps, once it had seen the versions the recipient saw.
    assert asked["donor"] == donated["learner"] == rec["donor"] == 0
    assert asked["at_s"] > 7.0 and donated["at_s"] >= asked["at_s"] + c.simulate.rtt_s / 2
    assert rec["from_peer"] and rec["opt_digest"] == donated["opt_digest"] and rec["bytes"] == donated["bytes"]
    # The state crossed the donor's up link then the recipient's down link, both at the simulated bandwidth.
    link_s = donated["bytes"] * 8 / (c.simulate.bandwidth_gbit_s * 1e9)
    assert rec["at_s"] >= donated["at_s"] + 2 * link_s + c.simulate.rtt_s / 2
    assert s.donations.served == 1 and s.donations.received_bytes == donated["bytes"] and not s.donations.pending
    assert not events(s, "donation_refused")
    assert events(s, "learner_up", learner=1)[0]["at_s"] >= rec["at_s"]  # it trains once it holds the state


def test_a_donor_killed_mid_donation_is_replaced_by_the_next_one_deterministically():
    # Learner 0 sends its state at 7.5 s (a step boundary), about 0.53 MB in 5 parts that reach the syncer from
    # 7.54 s, 10 ms apart; killed at 7.555 s, two parts arrived and the rest die with it: Donations asks learner 2.
    c = cfg()
    tape = [Outage(1, 5.0, 7.0), Outage(0, 7.555, 30.0)]
    a, ra = run(c, tape)
    assert [e["donor"] for e in events(a, "ask_donor", learner=1)] == [0, 2]
    (first,) = events(a, "donated", learner=0, recipient=1)
    (second,) = events(a, "donated", learner=2, recipient=1)
    assert first["at_s"] < 7.555 and 0 < a.donations.received_bytes - second["bytes"] < first["bytes"]  # half way
    (rec,) = events(a, "recovered", learner=1)
    assert rec["donor"] == 2 and rec["opt_digest"] == second["opt_digest"] and rec["at_s"] > 7.555
    assert a.donations.replaced == 1 and a.donations.served == 1
    b, rb = run(c, tape)
    assert a.faults == b.faults and all(np.array_equal(ra.params[n], rb.params[n]) for n in ra.params)


def test_donors_silent_past_the_timeout_are_replaced_then_the_recipient_goes_on_from_the_global_parameters():
    # A 10 ms donor timeout checked every 20 ms: each donor is replaced before its state arrives, then there is
    # nobody left to ask (NoDonor), and the late parts are refused as a replaced donor's Upload is.
    c = cfg(donor_timeout_s=0.01).with_changes(run={"tick_s": 0.02})
    s, _ = run(c, [Outage(1, 5.0, 7.0)])
    assert [e["donor"] for e in events(s, "ask_donor", learner=1)] == [0, 2]
    assert not events(s, "recovered", learner=1) and s.donations.served == 0 and s.donations.replaced == 2
    (warning,) = [w["what"] for w in events(s, "warning", learner=1) if "no peer state" in w["what"]]
    assert "no peer state (no peer state: donors [0, 2] went away)" in warning
    assert NOBODY_HEALTHY not in warning  # so it did not ask again
    assert {e["learner"] for e in events(s, "donation_refused", recipient=1)} <= {0, 2}
    assert any(1 in c for t, _, c in merges(s) if t > 8.0)  # and it contributes again


def test_a_learner_back_while_the_syncer_is_down_goes_on_from_the_global_parameters_and_trains_on():
    s, _ = run(spec(), [SyncerOutage(9.0, 11.0), Outage(1, 8.0, 10.0)])
    assert not events(s, "ask_donor") and not events(s, "recovered")
    assert [w["what"] for w in events(s, "warning", learner=1) if "no peer state" in w["what"]] == [
        "no peer state (the syncer is down): going on from the global parameters with a fresh inner optimizer"]
    assert events(s, "learner_up", learner=1)[0]["at_s"] < 11.0
    assert any(1 in c for t, _, c in merges(s) if t > 11.0)  # it rejoined the resumed syncer and contributes
