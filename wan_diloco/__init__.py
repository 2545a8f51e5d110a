"""wan-diloco: Decoupled DiLoCo across regions joined by WAN links."""

__version__ = "0.1.0"
