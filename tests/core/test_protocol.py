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


# ---- the one versioned message table ------------------------------------------------------------

import dataclasses  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

from wan_diloco.core import messages  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def test_every_message_class_is_in_the_table_with_every_field_described():
    classes = {v for v in vars(messages).values() if isinstance(v, type) and dataclasses.is_dataclass(v)
               and v.__module__ == messages.__name__ and v is not messages.MessageSpec}
    assert classes == set(messages.KIND_OF)  # no message outside the table
    for spec in messages.MESSAGES:
        assert spec.sender in ("learner", "syncer") and spec.rpc in ("Metadata", "Upload", "Subscribe", "Bulk")
        assert list(spec.fields) == [f.name for f in dataclasses.fields(spec.cls)], spec.kind
        assert all(text.strip() for text in spec.fields.values()), spec.kind
    assert len(messages.BY_KIND) == len(messages.MESSAGES)  # kinds are unique


def test_the_protocol_document_describes_every_message_and_field_of_the_table():
    doc = DOC.read_text()
    for spec in messages.MESSAGES:
        heading = f"#### `{spec.kind}`: {spec.cls.__name__}"
        assert heading in doc, heading
        section = doc.split(heading, 1)[1].split("\n#", 1)[0]
        described = re.findall(r"^\| `(\w+)` \|", section, re.M)
        assert described == list(spec.fields), spec.kind
        assert f"| `{spec.kind}` | {spec.cls.__name__} | {spec.sender} |" in doc  # who may send it
    assert re.search(rf"\| protocol version \|.*\| {messages.PROTOCOL_VERSION} \|", doc)


def test_the_architecture_page_links_the_protocol_document():
    assert "(protocol.md)" in (DOC.parent / "architecture.md").read_text()
