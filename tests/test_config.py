import dataclasses
import re
from typing import Literal

import pytest

from wan_diloco.config import ConfigError, from_mapping, load_toml, require


@dataclasses.dataclass(frozen=True)
class Inner:
    rate_gbit_s: float = 1.0


@dataclasses.dataclass(frozen=True)
class Outer:
    name: str = "x"
    learners: int = 4
    mode: Literal["a", "b"] = "a"
    inner: Inner = Inner()
    speeds: tuple[float, ...] = ()

    def validate(self):
        require(self.learners >= 1, "learners", "must be >= 1")


def test_from_mapping_builds_nested_and_coerces():
    cfg = from_mapping(Outer, {"learners": 2, "inner": {"rate_gbit_s": 5}, "speeds": [1, 1.2]})
    assert cfg.learners == 2 and cfg.inner.rate_gbit_s == 5.0 and cfg.speeds == (1.0, 1.2)


def test_a_count_may_be_written_like_2e6():
    # TOML reads 2e6 as a float; a whole number is still a count, and comes out as an int.
    cfg = from_mapping(Outer, {"learners": 2e6})
    assert cfg.learners == 2_000_000 and type(cfg.learners) is int


@pytest.mark.parametrize(
    "data, field",
    [
        ({"learnerz": 2}, "learnerz"),
        ({"learners": "2"}, "learners"),
        ({"learners": 0}, "learners"),
        ({"mode": "c"}, "mode"),
        ({"inner": {"rate": 1}}, "inner.rate"),
        ({"learners": True}, "learners"),
        ({"learners": 2.5}, "learners"),
        ({"learners": float("inf")}, "learners"),
    ],
)
def test_bad_values_name_the_field(data, field):
    with pytest.raises(ConfigError, match="^" + re.escape(field) + ":"):
        from_mapping(Outer, data)


def test_load_toml_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_toml(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("x = = 1")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_toml(bad)
    bad.write_bytes(b"\xff\xfe not text")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_toml(bad)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_nan_and_inf_in_a_config_file_are_refused_naming_the_field(text):
    from wan_diloco import spec

    with pytest.raises(ConfigError, match=r"syncer\.outer\.lr: must be a finite number"):
        spec.from_document({"syncer": {"outer": {"lr": float(text)}}})
