"""The ``[regions]`` table: which regions exist, where learners and the syncer live, and the links.

Every region reaches the syncer's region over one emulated WAN link with its
own rate, round-trip time, jitter and loss. Two non-syncer regions talk through
both of their links (the emulated network is a star around one router), which
matches the protocol: learners only ever talk to the syncer.

Example::

    [regions]
    names = ["us-east", "eu-west"]
    syncer = "us-east"              # default: the first name
    learners = ["us-east", "eu-west", "eu-west"]   # optional: region of learner m
    [regions.link]                  # default link for every region
    rate_gbit_s = 2.0
    rtt_ms = 60.0
    [regions.links.eu-west]         # per-region override (unset fields come from [regions.link])
    rtt_ms = 80.0
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from wan_diloco.config import ConfigError, from_mapping, require

# Region names become namespace names and appear in `ip` commands, so keep them
# to what every tool accepts unquoted.
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")


@dataclass(frozen=True)
class LinkConfig:
    """One region's WAN link to the syncer's region (both directions alike)."""

    rate_gbit_s: float = 2.0  # shaped rate, each direction
    rtt_ms: float = 60.0  # round trip; each direction gets half
    jitter_ms: float = 0.0  # +- per direction, uniform, packets stay in order
    loss_pct: float = 0.0  # per direction, per packet

    def validate(self) -> None:
        require(self.rate_gbit_s > 0, "rate_gbit_s", "must be > 0")
        require(self.rate_gbit_s <= 400, "rate_gbit_s", "must be <= 400")
        require(self.rtt_ms >= 0, "rtt_ms", "must be >= 0")
        require(self.jitter_ms >= 0, "jitter_ms", "must be >= 0")
        require(self.jitter_ms <= self.rtt_ms / 2, "jitter_ms", "must be <= rtt_ms / 2 (delays cannot go negative)")
        require(0 <= self.loss_pct < 100, "loss_pct", "must be in [0, 100)")

    @property
    def one_way_s(self) -> float:
        """Delay each direction adds, seconds."""
        return self.rtt_ms / 2000.0


@dataclass(frozen=True)
class RegionsConfig:
    """The ``[regions]`` table. Build it with :func:`regions_from_mapping`."""

    names: tuple[str, ...] = ("us-east", "eu-west")
    syncer: str = ""  # region of the syncer; "" means names[0]
    learners: tuple[str, ...] = ()  # region of learner m; empty means names[m % len(names)]
    link: LinkConfig = field(default_factory=LinkConfig)
    # Per-region overrides, keyed by region name. Filled by regions_from_mapping,
    # which merges each override onto `link`.
    links: Mapping[str, LinkConfig] = field(default_factory=dict)
    # TCP congestion control of the emulated hosts (the region namespaces); "" keeps the host's.
    congestion_control: str = "cubic"
    # Most a TCP connection of an emulated host may buffer (tcp_rmem/tcp_wmem max): 256 MB is a host
    # tuned for long fat links (5 Gbit/s x 100 ms is 62.5 MB); 4194304 is Linux's usual default.
    tcp_buffer_max_bytes: int = 256 << 20

    def validate(self) -> None:
        require(len(self.names) >= 1, "names", "need at least one region")
        require(self.congestion_control == "" or bool(re.fullmatch(r"[a-z0-9_]{1,15}", self.congestion_control)),
                "congestion_control", f"{self.congestion_control!r} is not a congestion control name (cubic, bbr, ...)")
        require(64 << 10 <= self.tcp_buffer_max_bytes <= 1 << 30, "tcp_buffer_max_bytes",
                f"must be in [65536, 1073741824], got {self.tcp_buffer_max_bytes}")
        for i, n in enumerate(self.names):
            require(bool(_NAME.match(n)), f"names[{i}]",
                    f"{n!r} must be lowercase letters, digits and '-', at most 31 characters, not starting with '-'")
        require(len(set(self.names)) == len(self.names), "names", "must not repeat a name")
        require(len(self.names) <= 200, "names", "at most 200 regions")
        require(self.syncer == "" or self.syncer in self.names, "syncer",
                f"{self.syncer!r} is not one of names {list(self.names)}")
        for i, r in enumerate(self.learners):
            require(r in self.names, f"learners[{i}]", f"{r!r} is not one of names {list(self.names)}")
        for n in self.links:
            require(n in self.names, f"links.{n}", f"{n!r} is not one of names {list(self.names)}")
            require(n != self.syncer_region, f"links.{n}", "the syncer's region has no WAN link to itself")

    @property
    def syncer_region(self) -> str:
        """The region the syncer runs in."""
        return self.syncer or self.names[0]

    @property
    def remote(self) -> tuple[str, ...]:
        """Regions other than the syncer's, in order: each has one WAN link."""
        return tuple(n for n in self.names if n != self.syncer_region)

    def link_of(self, region: str) -> LinkConfig:
        """The link from ``region`` to the syncer's region."""
        if region not in self.names:
            raise KeyError(f"unknown region {region!r}; regions are {list(self.names)}")
        if region == self.syncer_region:
            raise KeyError(f"{region!r} is the syncer's region and has no WAN link")
        return self.links.get(region, self.link)

    def region_of(self, learner: int) -> str:
        """Region of learner ``learner`` (explicit list if given, else round-robin)."""
        require(learner >= 0, "learner", "must be >= 0")
        if self.learners:
            require(learner < len(self.learners), "learners",
                    f"lists {len(self.learners)} learners, asked for learner {learner}")
            return self.learners[learner]
        return self.names[learner % len(self.names)]


def regions_from_mapping(data: Mapping[str, Any], prefix: str = "regions.") -> RegionsConfig:
    """Build :class:`RegionsConfig` from a ``[regions]`` TOML table; errors name the field."""
    require(isinstance(data, Mapping), prefix.rstrip("."), "must be a table")
    data = dict(data)
    raw_links = data.pop("links", {})
    require(isinstance(raw_links, Mapping), f"{prefix}links", "must be a table of region -> link")
    base = from_mapping(RegionsConfig, data, prefix=prefix)
    links: dict[str, LinkConfig] = {}
    for name, table in raw_links.items():
        require(isinstance(table, Mapping), f"{prefix}links.{name}", "must be a table")
        # Unknown keys and bad types are caught here, before merging.
        unknown = sorted(set(table) - {f.name for f in dataclasses.fields(LinkConfig)})
        require(not unknown, f"{prefix}links.{name}.{unknown[0] if unknown else ''}",
                f"unknown field; known fields are {', '.join(f.name for f in dataclasses.fields(LinkConfig))}")
        merged = {**dataclasses.asdict(base.link), **table}
        links[name] = from_mapping(LinkConfig, merged, prefix=f"{prefix}links.{name}.")
    cfg = dataclasses.replace(base, links=links)
    try:
        cfg.validate()
    except ConfigError as e:
        raise ConfigError(prefix + str(e)) from None
    return cfg
