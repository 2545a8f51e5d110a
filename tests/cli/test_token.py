"""`wan-diloco token --learner N`: learner N's own token, the one launch hands that learner, and only it on
stdout (for scripts); where it goes, on stderr."""
import pytest

from wan_diloco import spec as rt
from wan_diloco.cli import main
from wan_diloco.runtime.launch import Cluster
from wan_diloco.spec import TOKEN_ENV
from wan_diloco.transport import derive_token

from tests.conftest import MICRO_TOML


def test_a_learners_own_token_is_what_launch_hands_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)  # it would win over the file's
    path = tmp_path / "run.toml"
    path.write_text('[run]\nlearners = 2\ntoken = "the-run-token-0123"\n')
    assert main(["token", "--learner", "1", "--config", str(path)]) == 0
    out, err = capsys.readouterr()
    cluster = Cluster(rt.load(path), path, tmp_path / "run")
    assert out == derive_token("the-run-token-0123", "learner-1") + "\n" == cluster._env_of("learner-1")[TOKEN_ENV] + "\n"
    assert "$WAN_DILOCO_TOKEN" in err and "keep the run's token on the syncer's host" in err
    assert TOKEN_ENV not in cluster._own_token("syncer")  # the syncer keeps the run's
    with pytest.raises(SystemExit):
        main(["token", "--learner", "2", "--config", str(path)])


@pytest.mark.parametrize("toml, env, where", [('[run]\ntoken = "long-enough-token"\n', "short", TOKEN_ENV),
                                              ('[run]\ntoken = "tiny"\n', "", "run.token")])
def test_a_short_token_is_named_by_where_it_came_from(tmp_path, capsys, monkeypatch, toml, env, where):
    config = tmp_path / "run.toml"
    config.write_text(toml)
    monkeypatch.setenv(TOKEN_ENV, env)  # the variable wins over the file; empty, it is unset
    with pytest.raises(SystemExit) as e:
        main(["token", "--learner", "0", "--config", str(config)])
    assert e.value.code == 2
    assert capsys.readouterr().err == \
        f"wan-diloco token: error: {where}: must be a string of at least 8 non-space characters\n"


def test_the_launcher_names_a_short_variable_too(tmp_path, monkeypatch):
    from wan_diloco.config import ConfigError

    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(ConfigError, match=f"^{TOKEN_ENV}: must be"):
        Cluster(rt.load(None), tmp_path / "run.toml", tmp_path / "run")


def test_launch_refuses_a_short_variable_before_it_makes_the_run_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(SystemExit) as e:
        main(["launch", "--config", str(MICRO_TOML), "--run-dir", str(tmp_path / "run"), "--quiet"])
    assert e.value.code == 2
    assert f"{TOKEN_ENV}: must be a string of at least 8 non-space characters" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # no half-made run folder (config.toml and nothing else) left behind
