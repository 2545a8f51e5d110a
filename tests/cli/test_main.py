"""The `wan-diloco` command itself (wan_diloco/cli/__init__.py): --version and near-miss names (#27)."""
import re
import subprocess
import sys

import pytest

import wan_diloco
from wan_diloco.cli import main


def test_version_prints_the_packages_version_without_loading_jax(capsys):
    # `python -m wan_diloco.cli --version`, then whether it loaded JAX (each command's module does: 20-40 s
    # of imports on a loaded machine, for a line that needs none of it).
    code = ("import runpy, sys\nsys.argv = ['wan-diloco', '--version']\ntry:\n"
            "    runpy.run_module('wan_diloco.cli', run_name='__main__')\n"
            "except SystemExit as e:\n    print('jax' in sys.modules, e.code)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    line = f"wan-diloco {wan_diloco.__version__}\n"
    assert done.stdout == line + "False 0\n"
    with pytest.raises(SystemExit) as e:
        main(["-V"])
    assert e.value.code == 0 and capsys.readouterr().out == line


def test_an_unknown_command_suggests_the_near_one(capsys):
    with pytest.raises(SystemExit) as e:
        main(["simulat", "--json", "x.json"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "error: unknown command 'simulat'; did you mean `simulate`? (commands: simulate, bandwidth" in err


def test_an_unknown_command_far_from_any_lists_them_without_a_guess(capsys):
    with pytest.raises(SystemExit):
        main(["xyzzy"])
    err = capsys.readouterr().err
    assert "unknown command 'xyzzy' (commands:" in err and "did you mean" not in err


@pytest.mark.parametrize("toml, says", [
    ("[run]\nstep = 10\n", "run.step: unknown field; known fields are .*; did you mean `steps`\\?"),
    ("[runn]\nsteps = 10\n", "runn: unknown table; known tables are .*; did you mean `run`\\?"),
    ("[run]\nzzzzzz = 1\n", "run.zzzzzz: unknown field; known fields are [a-z_, ]*$"),
    ("[run]\neval_every = 5\n", "run.eval_every: renamed; write run.eval_every_steps instead"),
])
def test_an_unknown_config_key_suggests_the_near_one(tmp_path, capsys, toml, says):
    config = tmp_path / "run.toml"
    config.write_text(toml)
    with pytest.raises(SystemExit) as e:
        main(["plan", "--config", str(config), "--step-time", "0.1"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    assert re.search(f"^wan-diloco plan: error: {says}", err), err
