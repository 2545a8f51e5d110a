"""The credentials part of every `launch.sh`, run for real (`wan-diloco token` and `certs`): it makes
exactly the files the tasks mount and the Secrets are made from, and each learner's token is its own."""
import os
import re
import subprocess
import sys

import pytest
import yaml

from wan_diloco.export import ExportOptions, export

from .helpers import run_file


@pytest.mark.slow  # four wan-diloco start-ups: ~30 s on 2 loaded cores
def test_launch_makes_every_file_the_tasks_and_secrets_read(tmp_path):
    from wan_diloco.core import learner_node
    from wan_diloco.transport import derive_token

    spec, text = run_file(run={"learners": 2})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "wan-diloco").write_text(f'#!/bin/sh\nexec {sys.executable} -m wan_diloco.cli "$@"\n')
    (bin_dir / "wan-diloco").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("WAN_DILOCO_TOKEN", None)
    sky = tmp_path / "sky"
    sky.mkdir()
    out = export(spec, text, "skypilot", ExportOptions(cloud="aws"))
    for name, body in out.items():
        (sky / name).write_text(body)
    credentials = out["launch.sh"].split("# The syncer first")[0]
    subprocess.run(["bash", "-c", credentials], cwd=sky, env=env, check=True, timeout=300)

    needed = {src for name, body in out.items() if name.endswith(".yaml")
              for src in yaml.safe_load(body)["file_mounts"].values()}
    assert needed == {"run.toml", "token", "tls/ca.pem", "tls/syncer.pem", "tls/syncer.key", "tokens/learner-0.token",
                      "tokens/learner-1.token", "tls/learner-0.pem", "tls/learner-0.key", "tls/learner-1.pem",
                      "tls/learner-1.key"}
    assert all((sky / src).is_file() for src in needed)
    run_token = (sky / "token").read_text().strip()
    for m in range(2):
        assert (sky / f"tokens/learner-{m}.token").read_text().strip() == derive_token(run_token, learner_node(m))
    san = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(sky / "tls/syncer.pem")],
                         capture_output=True, text=True, check=True).stdout
    assert "DNS:wd-syncer" in san  # the name the run file's server_name makes the learners expect

    # k8s: the Secrets are made from files of the same names
    k8s = export(spec, text, "k8s", ExportOptions(image="img:1"))["launch.sh"]
    sources = set(re.findall(r"--from-file=[a-z.]+=(\S+)", k8s))
    assert sources and sources <= needed
