"""Frozen dataclass configs: one per component, loaded from TOML in one place.

Every component declares a frozen dataclass with defaults and a ``validate``
method; :func:`from_mapping` builds it from a TOML table, rejecting unknown
keys and wrong types with a :class:`ConfigError` that names the field.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or out of range."""


def require(ok: bool, field: str, message: str) -> None:
    """Raise ConfigError naming ``field`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{field}: {message}")


def did_you_mean(word: str, known: typing.Iterable[str]) -> str:
    """ "; did you mean `steps`?" when ``word`` is a near miss of one of ``known``, else ""."""
    close = difflib.get_close_matches(word, list(known), n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def _coerce(value: Any, typ: Any, field: str) -> Any:
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, field)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{field}: bad value {value!r}")
    if origin is typing.Literal:
        choices = typing.get_args(typ)
        require(value in choices, field, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if origin in (tuple, list):
        require(isinstance(value, (list, tuple)), field, f"must be a list, got {type(value).__name__}")
        args = typing.get_args(typ)
        elem = args[0] if args else Any
        return tuple(_coerce(v, elem, f"{field}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(typ):
        require(isinstance(value, Mapping), field, f"must be a table, got {type(value).__name__}")
        return from_mapping(typ, value, prefix=f"{field}.")
    if typ is Any:
        return value
    if typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        require(ok, field, f"must be a number, got {value!r}")
        # TOML spells nan and inf; no setting means either (an "off" value is spelled out per field).
        require(math.isfinite(value), field, f"must be a finite number, got {value!r}")
        return float(value)
    if typ is int:
        # TOML reads 2e6 as a float: a whole number is still a count (steps = 2e6), 2.5 is not.
        whole = isinstance(value, float) and math.isfinite(value) and value == int(value)
        require((isinstance(value, int) and not isinstance(value, bool)) or whole, field,
                f"must be an integer, got {value!r}")
        return int(value)
    if typ is bool:
        require(isinstance(value, bool), field, f"must be true or false, got {value!r}")
        return value
    if typ is str:
        require(isinstance(value, str), field, f"must be a string, got {value!r}")
        return value
    return value


def from_mapping(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and bad types raise ConfigError."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown field; known fields are {', '.join(sorted(fields))}"
            + did_you_mean(unknown[0], fields))
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as e:
            raise ConfigError(prefix + str(e)) from None
    return obj


def replace(obj: T, **changes: Any) -> T:
    """``dataclasses.replace`` followed by validation."""
    new = dataclasses.replace(obj, **changes)
    validate = getattr(new, "validate", None)
    if validate is not None:
        validate()
    return new


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; a missing or malformed file is a ConfigError naming it."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p}: not found")
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p}: invalid TOML: {e}") from None
