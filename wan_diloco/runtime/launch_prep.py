"""What the processes of a launched run read: the run's config with a run id, its snapshots under the
run folder and no token (``run_spec``), written owner-only (``write_config``); under an emulated WAN
the syncer's emulated address and a CA made for the run (``emulated_spec``), and each child's region
(``region_of``: whose network namespace it runs in)."""
from __future__ import annotations

import secrets
from pathlib import Path

from wan_diloco import spec as spec_lib
from wan_diloco.regions import Emulator
from wan_diloco.runtime.launch_names import is_syncer, learner_of
from wan_diloco.spec import RunSpec
from wan_diloco.transport.dev_certs import make_dev_certs


def run_spec(cfg: RunSpec, rdir: Path) -> RunSpec:
    """What the processes of a launched run read (``RUN_DIR/config.toml``): a run id, snapshots under
    the run folder (``checkpoints``, or a relative ``checkpoint.dir`` taken relative to it), a start barrier of every
    learner (unless ``run.min_learners_to_start`` says otherwise), and no token (children
    get it in their environment; a file would leak it)."""
    changes: dict = {"run": {"token": "", "run_id": cfg.run.run_id or f"{rdir.name}-{secrets.token_hex(4)}",
                             # the start barrier: every learner of the run unless the config says how many
                             "min_learners_to_start": cfg.run.min_learners_to_start or cfg.run.learners}}
    if not Path(cfg.checkpoint.dir or "checkpoints").is_absolute():
        changes["checkpoint"] = {"dir": str((rdir / (cfg.checkpoint.dir or "checkpoints")).resolve())}
    return cfg.with_changes(**changes)


def write_config(path: Path, cfg: RunSpec) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(spec_lib.dumps(cfg))


def region_of(cfg: RunSpec, name: str) -> str:
    """The region child ``name`` runs in: the syncer's (every shard) or its learner's."""
    return cfg.regions.syncer_region if is_syncer(name) else cfg.region(learner_of(name))


def emulated_spec(cfg: RunSpec, emu: Emulator, tls_dir: Path) -> RunSpec:
    """``cfg`` with the syncer on its region's emulated address and TLS from a CA made for this run."""
    host = emu.address_of(cfg.regions.syncer_region)
    certs = make_dev_certs(tls_dir, hosts=(host,))
    # One file for every process: the syncer reads cert and key, learners the CA.
    tls = {"cert_file": certs["server"].cert_file, "key_file": certs["server"].key_file,
           "ca_file": certs["client"].ca_file}
    return cfg.with_changes(run={"host": host}, transport={"tls": tls})
