#!/usr/bin/env python
"""Hostile-peer benchmark (#23): a real run with a compromised learner flooding the syncer, against the
same run without it.

Real processes on loopback (``runtime.launch.Cluster``): a syncer and learners 0 and 1 of a 3-learner
micro run (quorum 1, so learner 2's absence blocks nothing); learner 2's slot belongs to the attacker
(``bench.hostile_attack``), which holds learner 2's credential and sends ``--messages`` generated
messages (``bench.hostile_cases``: fields at and past every limit, declared senders that are not the
credential's, steps, clocks, versions, epochs, sizes, slow streams, no or wrong credentials). Then the
clean run: the same config and seed, no attacker.

Checks (``checks`` in the JSON, ``bench.hostile_report``; ``ok`` is their conjunction):
- ``attack_in_training``: every message was answered before the syncer's final sync;
- ``finished``: the syncer's final sync happened and every process of learners 0 and 1 exited 0;
- ``digests_equal``: both learners' final fragment digests equal the syncer's, no ``digest_mismatch``;
- ``loss_within_2pct``: final eval loss within 2 % of the clean run's;
- ``refusals_counted``: for every (rpc, status code) the attacker was refused with, /metrics counts at
  least as many (``refused_total{field}`` where the syncer has it, else the transport's
  ``transport_errors{rpc,code}``);
- ``nothing_taken_past_limit`` / ``no_impersonation_taken``: nothing that had to be refused was taken;
- ``honest_not_quarantined``: learners 0 and 1 are never quarantined (/status learner state, events);
- ``honest_state_untouched``: no honest learner ends at, or is seen by the syncer at, a step beyond
  what the honest learners trained (tokens / tokens per step) plus one sync period;
- ``clean_run_right``: the reference run itself finished with equal digests and untouched learners.

    python -m bench.chaos --hostile                 # 10,000 messages
    python -m bench.hostile --messages 500 --out /tmp/hostile.json
Writes bench/results/hostile.json after each run, and the attacker's rows (one per message) to
WORK/hostile/attack_rows.jsonl as they happen.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import hostile_attack  # noqa: E402
from bench.hostile_report import HONEST, analyze, quarantined_of, read_rows  # noqa: E402
from tests.micro import micro_document  # noqa: E402
from wan_diloco import spec as spec_lib  # noqa: E402
from wan_diloco.runtime.launch import Cluster, child_env, run_spec, write_config  # noqa: E402
from wan_diloco.transport.security import derive_token  # noqa: E402

STEP_S = 0.2
ATTACKER = 2
SYNCER_GRACE_S = 90.0  # the syncer ends final_timeout_s (20 s) after the learners' final fetches, at most
ATTACKER_GRACE_S = 60.0  # after the run: for the attacker's calls in flight to be answered (they time out in 10 s)



def _get(url: str, token: str) -> bytes:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read()


# ---- one run --------------------------------------------------------------------------------------

def make_config(steps: int, seed: int, per_learner: bool = True) -> spec_lib.RunSpec:
    """The run's config: per-learner tokens as ``launch`` hands them out (#23), or the shared token."""
    run = {"steps": steps, "batch_size": 8, "seed": seed, "eval_batches": 4, "eval_batch_size": 16,
           "report_every_s": 0.5, "min_step_s": STEP_S}
    if "min_learners_to_start" in {f.name for f in dataclasses.fields(spec_lib.RunConfig)}:
        # A start barrier (#23) must not wait for learner 2: its slot is the attacker's, never a learner.
        run["min_learners_to_start"] = len(HONEST)
    doc = micro_document(run=run, data={"max_bytes": 1048576}, learner={"tau": 2}, syncer={"quorum": 1},
                         train={"warmup_steps": 10},
                         transport={"retry_budget_s": 60.0, "per_learner_tokens": per_learner})
    return spec_lib.from_document(doc)


def run_once(cfg, rdir: Path, attack: dict | None, note, timeout_s: float) -> dict:
    """Learners 0 and 1 (and, with ``attack``, the attacker) against one syncer until the run ends.

    Returns the processes' exit codes, the learners' and the syncer's final events, the highest step
    the syncer showed for each learner, the last /status and /metrics read, and who was seen quarantined."""
    rdir.mkdir(parents=True, exist_ok=True)
    cfg = run_spec(cfg, rdir)
    write_config(rdir / "config.toml", cfg)
    token = secrets.token_urlsafe(24)
    out: dict = {"run_dir": str(rdir), "per_learner_tokens": cfg.transport.per_learner_tokens, "exit_codes": {},
                 "finals": {}, "syncer_final": None, "max_view_step": {}, "quarantined": [], "status": None,
                 "metrics": None, "metrics_after_attack": None, "errors": [], "attack_exit": None}
    t0, procs = time.monotonic(), {}
    events = open(rdir / "metrics.jsonl", "w")
    try:
        with Cluster(cfg, rdir / "config.toml", rdir, token=token) as cluster:
            _drive(cluster, cfg, rdir, token, attack, note, timeout_s, out, events, procs)
            out["exit_codes"] = {n: c.exit_code for n, c in cluster.children.items()}
    finally:
        events.close()
        if "attacker" in procs:
            out["attack_exit"] = stop_attacker(procs["attacker"], (rdir / "attack_rows.jsonl.go").exists(),
                                               out["errors"])
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def _drive(cluster: Cluster, cfg, rdir: Path, token: str, attack: dict | None, note, timeout_s: float, out: dict,
           events, procs: dict) -> None:
    cluster.start_syncer()
    status_url = f"http://127.0.0.1:{cluster.status_port}"
    go = rdir / "attack_rows.jsonl.go"
    attacker = None
    if attack is not None:  # it prepares (imports, payloads) while the learners start
        attacker = procs["attacker"] = start_attacker(cluster, cfg, rdir, token, cfg.transport.per_learner_tokens,
                                                      attack, status_url)
    for m in HONEST:
        cluster.start_learner(m)
    started: set[int] = set()
    quarantined: set[int] = set()
    next_poll, deadline, learners_gone = 0.0, time.monotonic() + timeout_s, 0.0
    while True:
        while not cluster.events.empty():
            name, e = cluster.events.get_nowait()
            if "pid" not in e:  # the reader's own exit marker
                continue
            events.write(json.dumps({"source": name, **e}) + "\n")
            if e.get("event") == "start" and name.startswith("learner-"):
                started.add(int(name.split("-")[1]))
            if e.get("event") == "final":
                if name == "syncer":
                    out["syncer_final"] = e
                else:
                    out["finals"][name] = e
        if attacker is not None and not go.exists() and started >= set(HONEST):
            try:
                if ready(attacker, rdir):
                    go.touch()
                    note(f"learners 0 and 1 train; attack: {attack['messages']} messages at {attack['rate']:g}/s")
            except RuntimeError as e:  # the report says so; the run is stopped, nothing was attacked
                out["errors"].append(str(e))
                return
        if time.monotonic() > next_poll and cluster.status_port:
            next_poll = time.monotonic() + 1.0
            try:
                status = json.loads(_get(status_url + "/status", token))
                out["status"] = status
                out["metrics"] = _get(status_url + "/metrics", token).decode()
                quarantined |= quarantined_of(status)
                for m, info in (status.get("learners") or {}).items():
                    out["max_view_step"][m] = max(out["max_view_step"].get(m, 0), info.get("step") or 0)
                if attacker is not None and attacker.poll() is not None and out["metrics_after_attack"] is None:
                    out["metrics_after_attack"] = out["metrics"]
            except OSError:
                pass
            out["quarantined"] = sorted(quarantined)
        codes = {n: c.exit_code for n, c in cluster.children.items()}
        if all(codes.get(f"learner-{m}") is not None for m in HONEST):
            if codes.get("syncer") is not None:
                return
            learners_gone = learners_gone or time.monotonic()
            if time.monotonic() - learners_gone > SYNCER_GRACE_S:
                out["errors"].append(f"the syncer was still running {SYNCER_GRACE_S:g} s after the learners exited")
                return
        if time.monotonic() > deadline:
            out["errors"].append(f"timed out after {timeout_s:.0f} s")
            return
        time.sleep(0.1)


def stop_attacker(attacker: subprocess.Popen, went: bool, errors: list[str]) -> int:
    """Its exit code: waited for a while if it was attacking (its last answers are on their way), killed
    at once if it never got the go (it would wait for ever)."""
    try:
        attacker.wait(ATTACKER_GRACE_S if went else 0.1)
    except subprocess.TimeoutExpired:
        attacker.kill()
        attacker.wait()
        errors.append("the attacker was still running when the run ended; killed" if went else
                      "the learners never all trained: the attack did not start")
    return attacker.returncode


def ready(attacker: subprocess.Popen, rdir: Path) -> bool:
    """The attacker has built its payloads and waits for the go; RuntimeError if it died first."""
    if (rdir / "attack_rows.jsonl.ready").exists():
        return True
    if attacker.poll() is not None:
        raise RuntimeError(f"the attacker exited with code {attacker.returncode} before it was ready; "
                           f"see {rdir / 'attacker.log'}")
    return False


def start_attacker(cluster: Cluster, cfg, rdir: Path, token: str, per_learner: bool, attack: dict,
                   status_url: str) -> subprocess.Popen:
    own = derive_token(token, f"learner-{ATTACKER}") if per_learner else token
    env = {**child_env(token), hostile_attack.OWN_TOKEN_ENV: own, hostile_attack.RUN_TOKEN_ENV: token}
    args = [sys.executable, "-m", "bench.hostile_attack", "--config", str(rdir / "config.toml"),
            "--target", f"127.0.0.1:{cluster.syncer_port}", "--status", status_url,
            "--messages", str(attack["messages"]), "--rate", str(attack["rate"]), "--seed", str(attack["seed"]),
            "--rows", str(rdir / "attack_rows.jsonl")] + (["--per-learner"] if per_learner else [])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    log = open(rdir / "attacker.log", "ab")
    try:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


def save(out: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=10_000, help="generated messages (default 10,000)")
    ap.add_argument("--rate", type=float, default=200.0, help="attacker messages a second")
    ap.add_argument("--seed", type=int, default=0, help="the run's seed and the generator's")
    ap.add_argument("--steps", type=int, default=0,
                    help="step budget (default: long enough for the attack at --rate, plus a margin)")
    ap.add_argument("--shared-token", action="store_true",
                    help="one token for every learner (transport.per_learner_tokens = false): any holder may speak "
                         "for any learner, so no_impersonation_taken is expected to fail")
    ap.add_argument("--no-clean", action="store_true", help="skip the clean run (no loss ratio)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "hostile.json")
    ap.add_argument("--work", type=Path, help="run folders (default: a new temporary folder, kept)")
    args = ap.parse_args(argv)
    if args.messages < 1 or args.rate <= 0:
        ap.error("--messages must be >= 1 and --rate > 0")
    t_bench = time.monotonic()
    attack_s = args.messages / args.rate
    # Training outlasts the attack with room to spare: the attacker may fall behind its rate on a busy host.
    steps = args.steps or int(math.ceil((1.5 * attack_s + 30.0) / STEP_S / 8) * 8)
    cfg = make_config(steps, args.seed, per_learner=not args.shared_token)
    work = args.work or Path(tempfile.mkdtemp(prefix="wdl-hostile-"))
    timeout_s = attack_s * 3 + steps * STEP_S * 4 + 300
    note = lambda line: print(f"[{time.monotonic() - t_bench:7.1f} s] {line}", flush=True)  # noqa: E731
    attack = {"messages": args.messages, "rate": args.rate, "seed": args.seed}
    tps = cfg.run.batch_size * cfg.model.seq_len
    config = {"steps": steps, "step_s": STEP_S, "learners": 3, "honest": list(HONEST), "attacker": ATTACKER,
              "quorum": cfg.syncer.quorum, "rate": args.rate, "seed": args.seed, "transport": "loopback"}

    note(f"hostile run: {steps} steps, {args.messages} messages -> {work / 'hostile'}")
    hostile = run_once(cfg, work / "hostile", attack, note, timeout_s)
    rows = read_rows(work / "hostile" / "attack_rows.jsonl")
    about = {"config": config, "per_learner_tokens": hostile["per_learner_tokens"], "work": str(work),
             "host": platform.machine()}
    out = {**analyze(hostile, None, rows, tps, args.messages), **about, "partial": "the clean run has not run yet"}
    save(out, args.out)  # a failure later keeps what was measured
    clean = None
    if not args.no_clean:
        note(f"clean run of the same config and seed -> {work / 'clean'}")
        clean = run_once(cfg, work / "clean", None, note, timeout_s)
    out = {**analyze(hostile, clean, rows, tps, args.messages), **about,
           "bench_wall_s": round(time.monotonic() - t_bench, 1)}
    if clean is not None:
        out["clean"] = {"exit_codes": clean["exit_codes"], "errors": clean["errors"], "wall_s": clean["wall_s"]}
    save(out, args.out)
    print(json.dumps({k: out[k] for k in ("messages", "quarantined", "final_eval_loss", "clean_eval_loss",
                                          "loss_ratio", "digests_equal", "ok", "checks")}, indent=1))
    print(f"wrote {args.out}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
