"""wan-diloco: Decoupled DiLoCo across regions joined by WAN links.

The Python API (docs/api.md): :class:`RunSpec` (``RunSpec.load(path)``, ``RunSpec.from_dict(d)``),
:func:`simulate`, :func:`launch`, :func:`plan`, :func:`load_params` and :func:`read_params`. They are
imported on first use, so ``import wan_diloco`` stays light (no JAX until a name is used).
"""

__version__ = "0.1.0"

# public name -> the module that defines it (wan_diloco.api re-exports the spec's and the checkpoint's)
_API = {name: "wan_diloco.api" for name in ("RunSpec", "RunResult", "SimResult", "PlanResult", "launch", "simulate",
                                            "plan", "load_params", "read_params")}

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'wan_diloco' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})
