"""The deployment one run file describes, as every engine's export needs it: the learners of each region
(ids in the run's own order), the syncer's shards and ports, and the command line of each process.

Every process reads the same run file; what differs per host (its token, its TLS files) comes from the
environment: ``$WAN_DILOCO_TOKEN`` and ``$WAN_DILOCO_TLS_CERT`` / ``_KEY`` / ``_CA``.
"""
from __future__ import annotations

import dataclasses
import re
import shlex

import yaml

from wan_diloco.config import ConfigError, require
from wan_diloco.spec import TOKEN_ENV, RunSpec
from wan_diloco.transport.security import check_port, is_loopback

ENGINES = ("skypilot", "slurm", "k8s")
DEFAULT_PORT = 7070  # the syncer's gRPC port when the run file leaves run.port at 0 (any free port)
TLS_ENV = ("WAN_DILOCO_TLS_CERT", "WAN_DILOCO_TLS_KEY", "WAN_DILOCO_TLS_CA")
RUN_FILE = "run.toml"  # the copy of the run file every export writes beside its own files
_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{2}){0,2}$")  # sbatch --time: [D-]HH[:MM[:SS]] or minutes


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """What the run file does not say about where it runs (the export's flags)."""

    name: str = "wd"  # prefix of every job, cluster and Kubernetes object
    port: int = 0  # the syncer's gRPC port; 0: run.port, or DEFAULT_PORT when that is 0 too
    syncer_hosts: tuple[str, ...] = ()  # the address learners dial per shard; empty: given at launch
    cloud: str = ""  # skypilot: the cloud whose regions regions.names are
    accelerators: str = ""  # skypilot: per learner node, e.g. "H100:8"
    image: str = ""  # skypilot (docker:IMG) and k8s: the container image with wan-diloco installed
    setup: str = "pip install wan-diloco"  # skypilot: how a node installs wan-diloco without --image
    time: str = "24:00:00"  # slurm: --time of every job
    namespace: str = ""  # k8s: the namespace of every object ("": kubectl's current one)
    storage: str = "100Gi"  # k8s: each syncer shard's volume (snapshots, final parameters)

    def validate(self) -> None:
        require(bool(re.fullmatch(r"[a-z]([a-z0-9-]{0,18}[a-z0-9])?", self.name)), "--name",
                f"{self.name!r} must be 1-20 of a-z 0-9 '-', starting with a letter (it names jobs and "
                "Kubernetes objects)")
        check_port(self.port, "--port")
        require(all(h and not any(c.isspace() or c in ",/" for c in h) for h in self.syncer_hosts),
                "--syncer-host", f"expected host names or addresses, got {list(self.syncer_hosts)}")
        require(bool(_SLURM_TIME.match(self.time)), "--time",
                f"{self.time!r} is not an sbatch time ([D-]HH:MM:SS, HH:MM or minutes)")
        require(bool(re.fullmatch(r"[1-9][0-9]*(Mi|Gi|Ti)", self.storage)), "--storage",
                f"{self.storage!r} is not a volume size like 100Gi")
        require(self.namespace == "" or bool(re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", self.namespace)),
                "--namespace", f"{self.namespace!r} is not a Kubernetes namespace name")


@dataclasses.dataclass(frozen=True)
class Deployment:
    """Who runs where, derived from a RunSpec and the export's options (:func:`deployment`)."""

    spec: RunSpec
    options: ExportOptions
    regions: dict[str, tuple[int, ...]]  # region -> its learners' ids, in id order; regions without any left out
    port: int
    shards: int

    @property
    def syncer_region(self) -> str:
        return self.spec.regions.syncer_region

    def syncer_addresses(self, hosts: list[str]) -> str:
        """The learners' ``--syncer`` value: every shard's HOST:PORT, in shard order."""
        return ",".join(f"{h}:{self.port}" for h in hosts)

    def syncer_argv(self, config: str, shard: int) -> list[str]:
        """Shard ``shard``'s command line (its token and TLS files from the environment)."""
        argv = ["wan-diloco", "syncer", "--config", config, "--port", str(self.port)]
        if self.shards > 1:
            argv += ["--shard", str(shard)]
        return argv + ["--plain"]

    def learner_argv(self, config: str, learner: str, syncer: str) -> list[str]:
        """A learner's command line; ``learner`` and ``syncer`` may be shell expansions ("$ID")."""
        return ["wan-diloco", "learner", "--config", config, "--id", learner, "--syncer", syncer, "--plain"]

    def job(self, what: str) -> str:
        """The name of a job, cluster or object: the prefix and ``what`` (a region, "syncer-0")."""
        return f"{self.options.name}-{what}"


def deployment(spec: RunSpec, options: ExportOptions) -> Deployment:
    """The deployment of ``spec``; ConfigError (one line, naming the key or flag) for a run file that cannot
    run across machines as written."""
    options.validate()
    require(not is_loopback(spec.run.host), "run.host",
            f"{spec.run.host!r} is loopback: learners on other hosts could not reach the syncer; "
            'set run.host = "0.0.0.0" in the run file')
    require(not spec.run.token, "run.token",
            "set in the run file, which every host gets (each learner host would hold the run's token): remove "
            "it; each exported process reads its own token from $WAN_DILOCO_TOKEN")
    require(spec.learner.hosts == 1, "learner.hosts",
            f"{spec.learner.hosts}: export writes one process per learner; start multi-host learners by hand "
            "(docs/operations.md, Multi-host learners)")
    shards = spec.syncer.shards
    require(shards == 1 or bool(spec.run.run_id), "run.run_id",
            "syncer.shards > 1 needs one run id set in the run file: every shard must serve the same run")
    require(not options.syncer_hosts or len(options.syncer_hosts) == shards, "--syncer-host",
            f"give one per syncer shard ({shards}, syncer.shards), got {len(options.syncer_hosts)}")
    port = options.port or spec.run.port or DEFAULT_PORT
    regions: dict[str, list[int]] = {}
    for m in range(spec.run.learners):
        regions.setdefault(spec.region(m), []).append(m)
    ordered = {r: tuple(regions[r]) for r in spec.regions.names if r in regions}
    return Deployment(spec, options, ordered, port, shards)


def command(argv: list[str], env: dict[str, str] | None = None) -> str:
    """``argv`` as one shell line, words quoted where needed; words starting with ``$`` expand (quoted)."""
    def word(w: str) -> str:
        return f'"{w}"' if w.startswith("$") else shlex.quote(w)

    prefix = [f"{k}={word(v)}" for k, v in (env or {}).items()]
    return " ".join(prefix + [word(w) for w in argv])


def learner_env(tls_dir: str, token_dir: str, learner: str) -> dict[str, str]:
    """The environment a learner process reads its own credentials from (files under the two folders)."""
    return {TOKEN_ENV: f'$(cat "{token_dir}/learner-{learner}.token")',
            **dict(zip(TLS_ENV, (f"{tls_dir}/learner-{learner}.pem", f"{tls_dir}/learner-{learner}.key",
                                 f"{tls_dir}/ca.pem")))}


def syncer_env(tls_dir: str, token_file: str) -> dict[str, str]:
    """The syncer's: the run's token and its own certificate."""
    return {TOKEN_ENV: f'$(cat "{token_file}")',
            **dict(zip(TLS_ENV, (f"{tls_dir}/syncer.pem", f"{tls_dir}/syncer.key", f"{tls_dir}/ca.pem")))}


def cert_hosts(dep: Deployment) -> list[str]:
    """The names the syncer's certificate carries: --syncer-host, else ``<name>-syncer`` (then the learners
    check that name, :func:`check_server_name`, whatever address they dial)."""
    return list(dep.options.syncer_hosts) or [dep.job("syncer")]


def check_server_name(dep: Deployment) -> None:
    """Without --syncer-host the syncer's address is known only at launch: its certificate names
    ``<name>-syncer`` and the run file must tell the learners to expect that name."""
    if dep.options.syncer_hosts:
        return
    tls, name = dep.spec.transport.tls, dep.job("syncer")
    require(tls is not None and tls.server_name == name, "transport.tls.server_name",
            f"the syncer's address is known only at launch, so its certificate names {name!r}: add "
            f'server_name = "{name}" under [transport.tls] in the run file (or give --syncer-host)')


def credentials_script(dep: Deployment, hosts: list[str] | None = None) -> str:
    """Shell lines that make, once, what the processes read from their environment: the run's token, each
    learner's own token (``wan-diloco token``) and the certificates (``wan-diloco certs``, naming the syncer as
    ``hosts`` and the run file's ``transport.tls.server_name``), in this folder."""
    names = hosts or cert_hosts(dep)
    tls = dep.spec.transport.tls
    if tls is not None and tls.server_name and tls.server_name not in names:
        names = names + [tls.server_name]  # the name learners expect, whatever address they dial
    hosts_flags = " ".join(f"--syncer-host {shlex.quote(h)}" for h in names)
    return "\n".join([
        "# Once: the run's token (it stays with the syncer), each learner's own, and the certificates.",
        "[ -f token ] || (umask 077 && openssl rand -hex 16 > token)",
        "mkdir -p tokens && chmod 700 tokens",
        f"for N in $(seq 0 {dep.spec.run.learners - 1}); do",
        f'  [ -f tokens/learner-$N.token ] || {{ WAN_DILOCO_TOKEN="$(cat token)" wan-diloco token --config {RUN_FILE} '
        "--learner $N > tokens/.learner-$N && mv tokens/.learner-$N tokens/learner-$N.token; }",
        "done",
        f"[ -d tls ] || wan-diloco certs --dir tls --learners {dep.spec.run.learners} {hosts_flags}",
    ])


def bad_engine(name: str) -> ConfigError:
    from wan_diloco.config import did_you_mean

    return ConfigError(f"engine: unknown {name!r}{did_you_mean(name, ENGINES)} (engines: {', '.join(ENGINES)})")


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (scripts) as YAML literal blocks, as people write them, not one escaped line."""


_Dumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def dump_yaml(*docs: dict) -> str:
    """``docs`` as one YAML stream (``---`` between documents), keys in the order given."""
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)
