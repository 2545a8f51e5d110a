"""Counts on the command line: 2e6 wherever a whole number is asked for (#14)."""
import argparse
import re

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


# ---- a learner of several processes (learner.hosts): flags that disagree are one line, exit code 2 ----

@pytest.mark.parametrize("flags, hosts, says", [
    (["--num-processes", "2", "--coordinator", "127.0.0.1:7711"], 1, "process-id: required: this learner has 2 processes"),
    (["--process-id", "1"], 2, "coordinator: required: this learner has 2 processes"),
    (["--process-id", "2", "--num-processes", "2", "--coordinator", "127.0.0.1:7711"], 1, "process-id: must be in 0..1"),
    (["--process-id", "-1", "--coordinator", "127.0.0.1:7711"], 2, "process-id: must be in 0..1"),
    (["--process-id", "1", "--num-processes", "2", "--coordinator", "hosta"], 1, "coordinator: .*expected host:port"),
    (["--process-id", "1", "--num-processes", "2", "--coordinator", "hosta:0"], 1, "coordinator: .*fixed port"),
    (["--process-id", "0", "--num-processes", "3", "--coordinator", "127.0.0.1:7711"], 2,
     "num-processes: 3, but the config says learner.hosts = 2"),
    (["--num-processes", "0"], 1, "num-processes: must be >= 1"),
    (["--process-id", "1"], 1, "process-id: must be 0 for a learner of one process"),
    (["--coordinator", "127.0.0.1:7711"], 1, "coordinator: only for a learner of several processes"),
])
def test_a_multi_process_learners_flags_are_checked(tmp_path, capsys, flags, hosts, says):
    config = tmp_path / "run.toml"
    config.write_text(f"[learner]\nhosts = {hosts}\n")
    with pytest.raises(SystemExit) as e:
        main(["learner", "--config", str(config), "--id", "0", "--syncer", "127.0.0.1:1", "--no-table", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(f"^wan-diloco learner: error: {says}", err), err


def test_num_processes_sets_learner_hosts():
    from wan_diloco import spec
    from wan_diloco.cli import build_parser
    from wan_diloco.cli.learner import multihost_config

    args = build_parser().parse_args(["learner", "--id", "0", "--syncer", "s:1", "--process-id", "1",
                                      "--num-processes", "2", "--coordinator", " 10.0.0.1:7711 "])
    cfg, mcfg = multihost_config(args, spec.from_document({}))
    assert cfg.learner.hosts == 2 and (mcfg.process_id, mcfg.num_processes, mcfg.coordinator) == (1, 2, "10.0.0.1:7711")
    assert not mcfg.leader
    one = build_parser().parse_args(["learner", "--id", "0", "--syncer", "s:1"])
    assert multihost_config(one, spec.from_document({}))[1] is None
