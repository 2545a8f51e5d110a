"""The deployment a run file describes, and the refusals of a run file that could not run across machines."""
import pytest

from wan_diloco.config import ConfigError
from wan_diloco.export import ExportOptions, export
from wan_diloco.export.common import DEFAULT_PORT, command, deployment

from .helpers import parse, run_file


def test_regions_take_learners_round_robin_or_as_listed():
    spec, _ = run_file()
    dep = deployment(spec, ExportOptions())
    assert dep.regions == {"us-east-1": (0, 2, 4), "eu-west-1": (1, 3)}
    assert dep.syncer_region == "us-east-1" and dep.port == 7070 and dep.shards == 1
    spec, _ = run_file(regions={"names": ["a", "b", "c"], "learners": ["b", "b", "a", "b", "a"], "syncer": "c"})
    dep = deployment(spec, ExportOptions())
    assert dep.regions == {"a": (2, 4), "b": (0, 1, 3)}  # c runs only the syncer: no learner file for it
    assert dep.syncer_region == "c"


def test_port_is_the_flag_then_the_run_file_then_the_default():
    spec, _ = run_file(run={"port": 0})
    assert deployment(spec, ExportOptions()).port == DEFAULT_PORT
    assert deployment(spec, ExportOptions(port=9000)).port == 9000
    spec, _ = run_file()
    assert deployment(spec, ExportOptions()).port == 7070


def test_command_lines_parse_with_our_own_parser(parser):
    spec, _ = run_file(syncer={"shards": 2})
    dep = deployment(spec, ExportOptions())
    args = parse(parser, dep.syncer_argv("/x/run.toml", 1))
    assert (args.command, args.config, args.port, args.shard, args.plain) == ("syncer", "/x/run.toml", 7070, 1, True)
    args = parse(parser, dep.learner_argv("/x/run.toml", "3", "a:7070,b:7070"))
    assert (args.command, args.id, args.syncer, args.plain) == ("learner", 3, "a:7070,b:7070", True)


def test_command_quotes_words_and_lets_variables_expand():
    line = command(["wan-diloco", "learner", "--config", "my run.toml", "--id", "$ID"], {"A": "$(cat t)"})
    assert line == "A=\"$(cat t)\" wan-diloco learner --config 'my run.toml' --id \"$ID\""


@pytest.mark.parametrize("tables, options, needle", [
    ({"run": {"host": "127.0.0.1"}}, {}, "run.host: '127.0.0.1' is loopback"),
    ({"run": {"token": "secret-token-1"}}, {}, "run.token: set in the run file"),
    ({"run": {"run_id": ""}, "syncer": {"shards": 2}}, {}, "run.run_id: syncer.shards > 1 needs one run id"),
    ({"learner": {"hosts": 2, "num_fragments": 2}}, {}, "learner.hosts: 2"),
    ({}, {"syncer_hosts": ("a", "b")}, "--syncer-host: give one per syncer shard (1"),
    ({}, {"name": "Bad_Name"}, "--name: 'Bad_Name' must be"),
    ({}, {"time": "tomorrow"}, "--time: 'tomorrow' is not an sbatch time"),
    ({}, {"storage": "lots"}, "--storage: 'lots' is not a volume size"),
    ({}, {"port": 70000}, "--port: port 70000 is outside"),
])
def test_a_run_that_cannot_run_across_machines_is_one_line_naming_why(tables, options, needle):
    spec, text = run_file(**tables)
    for engine in ("skypilot", "slurm", "k8s"):
        with pytest.raises(ConfigError) as e:
            export(spec, text, engine, ExportOptions(cloud="aws", image="img", **options))
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_engine_suggests_the_near_one():
    spec, text = run_file()
    with pytest.raises(ConfigError, match=r"engine: unknown 'skypiolt'; did you mean `skypilot`\?"):
        export(spec, text, "skypiolt")


def test_every_export_carries_the_run_file_verbatim():
    spec, text = run_file()
    for engine in ("skypilot", "slurm", "k8s"):
        files = export(spec, text, engine, ExportOptions(cloud="aws", image="img"))
        assert files["run.toml"] == text and "launch.sh" in files
