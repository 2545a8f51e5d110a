"""Emulated WAN regions on one Linux machine: topology, namespaces + shaping, measurements.

``topology`` is the ``[regions]`` table; ``emulator`` builds it out of network
namespaces (needs root); ``forwarder`` is the user-space delay/loss stage for
kernels without netem; ``measure`` checks RTT and rate between regions.
"""
from wan_diloco.regions.emulator import Emulator, EmulatorError, teardown_leftovers
from wan_diloco.regions.topology import LinkConfig, RegionsConfig, regions_from_mapping

__all__ = ["Emulator", "EmulatorError", "teardown_leftovers", "LinkConfig", "RegionsConfig", "regions_from_mapping"]
