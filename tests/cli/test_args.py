"""Counts on the command line: 2e6 wherever a whole number is asked for (#14)."""
import argparse

import pytest

from wan_diloco.cli import main
from wan_diloco.cli.args import count


@pytest.mark.parametrize("text, want", [("2e6", 2_000_000), ("2_000", 2000), ("7", 7), ("1.5e3", 1500), ("0", 0)])
def test_counts_may_be_written_in_any_of_the_usual_ways(text, want):
    assert count(text) == want and type(count(text)) is int


@pytest.mark.parametrize("text, why", [("2.5", "whole number"), ("inf", "whole number"), ("nan", "whole number"),
                                       ("two", "expected a number"), ("", "expected a number")])
def test_what_is_not_a_count_is_refused_naming_it(text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        count(text)


@pytest.mark.parametrize("argv", [
    ["bandwidth", "--preset", "1b", "--sync-every", "1e2", "--datacenters", "2e0"],
    ["goodput", "--chips", "2048", "--slice-chips", "1.28e2", "--system", "decoupled", "--learners", "2e0", "--days", "1"],
])
def test_the_planning_commands_take_counts_like_2e6(argv, capsys):
    assert main(argv) == 0, capsys.readouterr()
