"""One field of a core message: its JSON form in a frame's ``meta`` and its validation, chosen by the
field's annotation (``runtime.serde`` applies it to every field of the table's dataclasses).

A new field type in the core fails at import (``schema``), not at the first message. A string field
may allow more than ``MAX_STR_CHARS`` with ``dataclasses.field(metadata={"max_chars": N})``.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import math
import re
import types
import typing
from typing import Any, Mapping, Union

import numpy as np

from wan_diloco.clock import VectorClock
from wan_diloco.core.messages import MAX_INT, MAX_STR_CHARS

ID = re.compile(r"0|[1-9][0-9]{0,17}")  # ASCII digits, no leading zeros: one spelling per id
# Fields with a slot of their own in the frame, or derived on decode: never in meta.
NOT_META = frozenset({"learner", "fragment", "delta", "update", "payload", "nbytes"})


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT


def _check_int(v: Any) -> int:
    if not is_int(v):
        raise ValueError(f"expected a non-negative integer, got {v!r}")
    return v


def _check_float(v: Any) -> float:
    # JSON writes 1.0 as 1.0, but accept an integer too: it is a number all the same.
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"expected a finite number, got {v!r}")
    return float(v)


def _check_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {v!r}")
    return v


def _check_str(v: Any, max_chars: int = MAX_STR_CHARS) -> str:
    if not isinstance(v, str) or len(v) > max_chars:
        raise ValueError(f"expected a string of at most {max_chars} characters, got {str(v)[:40]!r}")
    return v


def _check_ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not all(is_int(x) for x in v):
        raise ValueError(f"expected a list of non-negative integers, got {str(v)[:60]}")
    return tuple(v)


def _check_clock(v: Any) -> VectorClock:
    return VectorClock.from_dict(v)  # its ValueError names the bad entry


def _check_seconds_by_id(v: Any) -> dict[int, float]:
    if not isinstance(v, Mapping):
        raise ValueError(f"expected an object learner id -> seconds, got {type(v).__name__}")
    out = {}
    for k, s in v.items():
        # JSON keys are strings: "3" -> 3, one spelling per id (no sign, no leading zero).
        if not (isinstance(k, str) and ID.fullmatch(k)):
            raise ValueError(f"key {str(k)[:20]!r} is not a learner id")
        out[int(k)] = _check_float(s)
    return out


def plain(v: Any) -> Any:
    """numpy scalars (counters summed in numpy, say) as the Python numbers JSON takes."""
    return v.item() if isinstance(v, np.generic) else v


def _optional(check):
    return lambda v: None if v is None else check(v)


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    to_json: typing.Callable[[Any], Any]
    from_json: typing.Callable[[Any], Any]


def _seconds_to_json(m: Mapping) -> dict[str, Any]:
    return {str(plain(k)): plain(v) for k, v in m.items()}


# (annotation's origin, its arguments) -> (to JSON, from JSON with validation); keyed
# so that typing.Mapping and collections.abc.Mapping agree. A new field type in the
# core fails at import (below), not at the first message.
_CODECS: dict[tuple, tuple] = {
    (int, ()): (plain, _check_int),
    (float, ()): (plain, _check_float),
    (bool, ()): (plain, _check_bool),
    (str, ()): (plain, _check_str),
    (tuple, (int, ...)): (lambda t: [plain(x) for x in t], _check_ints),
    (VectorClock, ()): (VectorClock.to_dict, _check_clock),
    (collections.abc.Mapping, (int, float)): (_seconds_to_json, _check_seconds_by_id),
    (dict, (int, float)): (_seconds_to_json, _check_seconds_by_id),
}


def _field(name: str, hint: Any, max_chars: int = MAX_STR_CHARS) -> Field:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = _field(name, next(a for a in args if a is not type(None)), max_chars)
        return Field(name, _optional(inner.to_json), _optional(inner.from_json))
    if hint is str and max_chars != MAX_STR_CHARS:  # a longer string the table allows this field
        return Field(name, plain, lambda v: _check_str(v, max_chars))
    key = (origin or hint, args)
    if key not in _CODECS:
        raise TypeError(f"runtime.serde: no JSON form for field {name!r} of type {hint!r}")
    return Field(name, *_CODECS[key])


def schema(cls: type) -> tuple[Field, ...]:
    hints = typing.get_type_hints(cls)
    return tuple(_field(f.name, hints[f.name], f.metadata.get("max_chars", MAX_STR_CHARS))
                 for f in dataclasses.fields(cls) if f.name not in NOT_META)
