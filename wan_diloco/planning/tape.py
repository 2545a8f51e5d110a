"""Moved to ``wan_diloco.tape`` (a pure piece the simulator reads too); re-exported for older imports."""
from wan_diloco.tape import KEYS, Fault, Outage, SyncerOutage, load_tape, merge_outages, parse_entry, parse_tape, save_tape, scale_tape  # noqa: F401,E501
