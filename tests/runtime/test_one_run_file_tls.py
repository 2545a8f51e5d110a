"""One run file for every host (#27): a syncer and two learners read the same file, which says only
`[transport.tls] mutual = true`; each process names its own certificates (`wan-diloco certs`) by flags or
by $WAN_DILOCO_TLS_*, learner 0 is started with the command the syncer printed, and the run succeeds."""
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from wan_diloco.cli import build_parser, main
from wan_diloco.core import learner_node
from wan_diloco.host_tls import ENV
from wan_diloco.transport import derive_token

from .conftest import TOKEN, micro_config
from .helpers import alive, launch_env, wait_for

CLI = [sys.executable, "-m", "wan_diloco.cli"]


def start(args, out, env, cwd):
    return subprocess.Popen([*CLI, *args], stdout=open(out, "w"), stderr=subprocess.STDOUT, env=env, cwd=cwd,
                            start_new_session=True)


def events(path) -> list[dict]:
    """The JSON events among a process's whole output lines (a last one without its newline is half written)."""
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.startswith('{"')]


def learner_args(join: str, n: int) -> tuple[list[str], list[str]]:
    """The syncer's printed command for learner ``n``: (its VAR=value words, the `wan-diloco` arguments)."""
    words = shlex.split(join.replace("learner-N", f"learner-{n}").replace("--id N", f"--id {n}"))
    at = words.index("wan-diloco")
    return words[:at], words[at + 1:]


@pytest.mark.slow
def test_one_run_file_a_syncer_and_two_learners_with_tls_from_flags_and_environment(tmp_path, capsys):
    tls = tmp_path / "tls"
    assert main(["certs", "--dir", str(tls), "--syncer-host", "127.0.0.1", "--learners", "2"]) == 0
    capsys.readouterr()
    micro_config(tmp_path, learners=2, steps=16, token="", extra="[transport.tls]\nmutual = true\n",
                 run={"min_learners_to_start": 2}, checkpoint={"dir": str(tmp_path / "ckpt")})
    base = {k: v for k, v in launch_env().items() if k not in ENV.values()}
    procs = []
    try:
        # --plain: the events on stdout, and what a person reads (the join lines) on stderr, here one file.
        syncer = start(["syncer", "--config", "micro.toml", "--plain", "--tls-cert", str(tls / "syncer.pem"),
                        "--tls-key", str(tls / "syncer.key"), "--tls-ca", str(tls / "ca.pem")],
                       tmp_path / "syncer.out", {**base, "WAN_DILOCO_TOKEN": TOKEN}, tmp_path)
        procs.append(syncer)
        said = wait_for("the syncer's listening event", lambda: next(iter(events(tmp_path / "syncer.out")), None), 120)
        assert said["event"] == "listening" and said["dial"] == f"127.0.0.1:{said['port']}", said
        assert said["status_url"] == f"https://127.0.0.1:{said['status_port']}/"
        # Learner 0: exactly the printed command, its own token where the command takes it from.
        env_words, args = learner_args(said["join"], 0)
        assert env_words == ["WAN_DILOCO_TOKEN=$(cat learner-0.token)"]
        parsed = build_parser().parse_args(args)
        assert (parsed.syncer, parsed.id, parsed.tls_cert) == (said["dial"], 0, str(tls / "learner-0.pem"))
        own = lambda n: derive_token(TOKEN, learner_node(n))  # noqa: E731  (`wan-diloco token --learner n`)
        procs.append(start(args, tmp_path / "learner-0.out", {**base, "WAN_DILOCO_TOKEN": own(0)}, tmp_path))
        # Learner 1: the same run file, its files from the environment instead of flags.
        _, args = learner_args(said["join"], 1)
        cut = args.index("--tls-ca")
        files = {ENV["cert_file"]: str(tls / "learner-1.pem"), ENV["key_file"]: str(tls / "learner-1.key"),
                 ENV["ca_file"]: str(tls / "ca.pem")}
        procs.append(start(args[:cut], tmp_path / "learner-1.out", {**base, "WAN_DILOCO_TOKEN": own(1), **files},
                           tmp_path))
        deadline = time.monotonic() + 300
        codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
        logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.out")}
        # A learner exits 0 only when its final model equals the syncer's; one whose settings fingerprint
        # differed (host paths in it, say) would have been refused with exit 3.
        assert codes == [0, 0, 0], logs
        printed = (tmp_path / "syncer.out").read_text()
        assert f"syncer: listening on {said['dial']}\n" in printed and f"  {said['join']}\n" in printed, printed
        finals = [e for e in events(tmp_path / "syncer.out") if e["event"] == "final"]
        assert finals and sorted(finals[-1]["final_learners"]) == [0, 1], finals
        assert (tmp_path / "ckpt" / "params.safetensors").is_file()
    finally:
        for p in procs:
            if p.poll() is None or alive(p.pid):
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
