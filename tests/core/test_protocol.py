"""The message table: typed requests parse what a peer may ask for and refuse the rest by field."""
import pytest

from wan_diloco.core.protocol import ObjectRequest, ProtocolError


@pytest.mark.parametrize("name", ["fragment/0", "final/3", "donation/1", "position/0"])
def test_object_request_round_trips_its_name(name):
    assert ObjectRequest.parse(name, num_fragments=4, num_learners=2).name == name


@pytest.mark.parametrize("name", ["fragment/4", "donation/2", "position/01", "fragment/", "theta/0", "final/-1",
                                  "fragment/٣", "../fragment/0"])
def test_object_request_refuses_what_no_peer_may_ask(name):
    with pytest.raises(ProtocolError) as e:
        ObjectRequest.parse(name, num_fragments=4, num_learners=2)
    assert e.value.field == "object" and "expected fragment/P" in str(e.value)
