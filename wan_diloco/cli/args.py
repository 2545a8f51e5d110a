"""Argument types shared by the subcommands."""
from __future__ import annotations

import argparse
import math


def count(text: str) -> int:
    """A whole number that may be written like 2e6, 2_000_000 or 2000000 (token budgets, chips, steps)."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(value)
