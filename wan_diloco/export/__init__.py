"""Launch files for SkyPilot, Slurm and Kubernetes from one run file (``wan-diloco export``).

:func:`export` is pure: it returns ``{relative path: text}``, the CLI writes them. Every file runs the same
run file (a copy, ``run.toml``, is among them) and takes each host's token and TLS files from the
environment.
"""
from __future__ import annotations

from wan_diloco.export.common import ENGINES, RUN_FILE, ExportOptions, bad_engine, deployment
from wan_diloco.spec import RunSpec

__all__ = ["ENGINES", "ExportOptions", "export"]


def export(spec: RunSpec, run_file: str, engine: str, options: ExportOptions = ExportOptions()) -> dict[str, str]:
    """The files that launch ``spec`` on ``engine`` ("skypilot", "slurm" or "k8s"), by relative path;
    ``run_file`` is the run file's text, copied verbatim. ConfigError (one line) for anything that could not
    run as written."""
    if engine not in ENGINES:
        raise bad_engine(engine)
    dep = deployment(spec, options)
    if engine == "skypilot":
        from wan_diloco.export import skypilot

        out = skypilot.files(dep)
    elif engine == "slurm":
        from wan_diloco.export import slurm

        out = slurm.files(dep)
    else:
        from wan_diloco.export import k8s

        out = k8s.files(dep, run_file)
    return {RUN_FILE: run_file, **out}
