"""`wan-diloco export`: writes the files and says what to run next; refuses, writing nothing, a bad engine,
a folder in use and a run file that cannot run across machines."""
import stat

import pytest

from wan_diloco.cli import main

RUN = """[run]
learners = 2
host = "0.0.0.0"
port = 7070

[regions]
names = ["us-east-1", "eu-west-1"]

[transport.tls]
server_name = "wd-syncer"
"""


def export(capsys, *argv):
    try:
        code = main(["export", *argv])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr()


def test_writes_the_files_owner_only_and_says_what_next(tmp_path, capsys):
    config = tmp_path / "my-run.toml"
    config.write_text(RUN)
    out = tmp_path / "launch"
    code, io = export(capsys, "slurm", "--config", str(config), "--out", str(out))
    assert code == 0, io.err
    names = sorted(p.name for p in out.iterdir())
    assert names == ["launch.sh", "region-eu-west-1.sbatch", "region-us-east-1.sbatch", "run.toml", "syncer.sbatch"]
    assert io.out.splitlines()[:-1] == [str(out / n) for n in
                                        ["run.toml", "syncer.sbatch", "region-us-east-1.sbatch",
                                         "region-eu-west-1.sbatch", "launch.sh"]]
    assert io.out.splitlines()[-1].startswith(f"next: bash {out / 'launch.sh'}")
    assert "note: run.min_learners_to_start is 0" in io.err and "set it to 2 (run.learners)" in io.err
    assert (out / "run.toml").read_text() == RUN
    assert stat.S_IMODE((out / "launch.sh").stat().st_mode) == 0o700
    assert stat.S_IMODE((out / "run.toml").stat().st_mode) == 0o600

    # a folder in use is refused, untouched; --force writes into it
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_text() for p in out.iterdir()}
    code, io = export(capsys, "k8s", "--config", str(config), "--out", str(out), "--image", "img:1")
    assert code == 2 and f"--out: {out} exists and is not empty; pass --force" in io.err
    assert {p.name: p.read_text() for p in out.iterdir()} == before
    code, io = export(capsys, "k8s", "--config", str(config), "--out", str(out), "--image", "img:1", "--force")
    assert code == 0 and (out / "secrets.yaml").exists() and (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("argv, says", [
    (["slurn"], "error: engine: unknown 'slurn'; did you mean `slurm`? (engines: skypilot, slurm, k8s)"),
    (["skypilot"], "error: --cloud: required for skypilot"),
])
def test_a_mistake_is_one_line_and_writes_nothing(tmp_path, capsys, argv, says):
    config = tmp_path / "run.toml"
    config.write_text(RUN)
    code, io = export(capsys, *argv, "--config", str(config), "--out", str(tmp_path / "out"))
    assert code == 2 and says in io.err and len(io.err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
