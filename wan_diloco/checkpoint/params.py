"""The trained model's parameters as a plain safetensors file other frameworks can read too; and the
parameters a run starts from (``[model] init``): a file a run wrote, a run's folder, or a plain
safetensors file from elsewhere with the same tensor names.

Tensor names are the flat flax paths (``tree.flatten``, e.g. ``block_0/attn/qkv/kernel``).
"""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from wan_diloco import tree

from .format import FORMAT, CheckpointError, decode_state, load_state, read_header, save_state

KIND = "params"
NAME = "params.safetensors"  # in a checkpoint folder (checkpoint.dir; a launched run's RUN_DIR/checkpoints)
Specs = Mapping[str, tuple[tuple[int, ...], str]]  # tensor name -> (shape, dtype name)
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_LISTED = 5  # names an error lists before "and N more"


def save_params(path: str | Path, params: Any, info: Mapping[str, Any] | None = None) -> int:
    """Write a parameter pytree (or an already flat name -> array mapping); returns bytes written."""
    flat = dict(params) if isinstance(params, Mapping) and all(
        isinstance(v, np.ndarray) for v in params.values()) else tree.flatten(params)
    return save_state(path, {n: np.asarray(v) for n, v in flat.items()}, dict(info or {}), KIND)


def load_params(path: str | Path, like: Any = None) -> Any:
    """The parameters in a file written by a run (``RUN_DIR/checkpoints/params.safetensors``): a flat
    name -> numpy array dict, or ``like``'s structure given a template pytree (:func:`read_params`,
    without the info)."""
    return read_params(path, like)[0]


def read_params(path: str | Path, like: Any = None) -> tuple[Any, dict[str, Any]]:
    """(parameters, info) from a file written by a run (``RUN_DIR/checkpoints/params.safetensors``).

    Without ``like`` the parameters are a flat name -> numpy array dict; with a
    template pytree (e.g. ``model.init_params(cfg, key)``) they come back in its
    structure, after checking every name and shape. ``info`` holds the run id,
    the fragment versions and the model config the file was written with.
    """
    flat, info = load_state(path, KIND)
    if like is None:
        return flat, info
    check_params({n: (a.shape, a.dtype.name) for n, a in flat.items()}, tensor_specs(like), str(path), dtypes=False)
    return tree.unflatten(flat, like), info


def tensor_specs(like: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, dtype name) of a parameter pytree (arrays or ``jax.ShapeDtypeStruct`` leaves)."""
    return {n: (tuple(np.shape(a)), np.dtype(a.dtype).name) for n, a in tree.flatten(like).items()}


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return ", ".join(repr(n) for n in names[:_LISTED]) + more


def _tensors(n: int) -> str:
    return f"{n} tensor{'s' * (n != 1)}"


def check_params(found: Specs, want: Specs, what: str, dtypes: bool = True) -> None:
    """CheckpointError, one line naming up to five tensors of a kind, unless ``found`` has exactly
    ``want``'s tensors with their shapes (and, with ``dtypes``, their dtypes)."""
    missing = [n for n in want if n not in found]
    extra = sorted(n for n in found if n not in want)
    said = ([f"{_tensors(len(missing))} of the model missing: {_listed(missing)}"] if missing else []) + (
        [f"{_tensors(len(extra))} the model does not have: {_listed(extra)}"] if extra else [])
    if said:
        raise CheckpointError(f"{what}: {'; '.join(said)} (another model, or other tensor names?)")
    bad = [f"tensor {n!r} has shape {tuple(found[n][0])}, the model wants {tuple(want[n][0])}"
           for n in want if tuple(found[n][0]) != tuple(want[n][0])]
    if dtypes:
        bad += [f"tensor {n!r} is {found[n][1]}, the model wants {want[n][1]}"
                for n in want if found[n][1] != want[n][1]]
    if bad:
        more = f"; and {len(bad) - _LISTED} more" if len(bad) > _LISTED else ""
        raise CheckpointError(f"{what}: {'; '.join(bad[:_LISTED])}{more}")


def params_file(path: str | Path) -> Path:
    """The parameter file ``path`` names, absolute: the file itself, or in a folder its ``params.safetensors``
    (a checkpoint folder), ``checkpoints/params.safetensors`` (a launched run's folder, where the
    launcher also joins a sharded syncer's parts) or the one in the ``checkpoint.dir`` its
    ``config.toml`` names. CheckpointError when there is none."""
    p = Path(path).expanduser()
    if p.is_file():
        return p.resolve()
    if not p.is_dir():
        raise CheckpointError(f"{path}: no such file or folder")
    folders = [p, p / "checkpoints"]
    try:
        named = tomllib.loads((p / "config.toml").read_text()).get("checkpoint", {}).get("dir")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, AttributeError):
        named = None  # no run config here: the usual places only
    if isinstance(named, str) and named:
        folders.append(p / named)  # an absolute dir replaces p
    for folder in folders:
        if (folder / NAME).is_file():
            return (folder / NAME).resolve()
    parts = [f for folder in folders for f in sorted(folder.glob("params.shard-*.safetensors"))]
    hint = f"; {parts[0].parent} holds syncer shards' parts, not joined into one" if parts else ""
    raise CheckpointError(f"{path}: a folder with no parameter file (looked for "
                          f"{', '.join(str(f / NAME) for f in folders)}){hint}")


def read_init_params(path: str | Path, want: Specs) -> dict[str, np.ndarray]:
    """Name -> array of a safetensors file holding exactly ``want``'s tensors (``tensor_specs``), all
    finite: a file a run wrote (its digest verified) or a plain one. Names, shapes and dtypes are
    checked from the header, before a tensor is read. CheckpointError says what is wrong."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: {e.strerror or e}") from None
    header = read_header(data, str(path))
    found = {n: (tuple(h.get("shape", ())), _SAFETENSORS_DTYPES.get(h.get("dtype"), str(h.get("dtype")).lower()))
             for n, h in header.items() if n != "__metadata__" and isinstance(h, dict)}
    check_params(found, want, str(path))
    meta = header.get("__metadata__")
    if isinstance(meta, dict) and meta.get("format") == FORMAT:
        flat, _ = decode_state(data, KIND, what=str(path))
    else:
        from safetensors import SafetensorError
        from safetensors.numpy import load

        try:
            flat = load(data)
        except (SafetensorError, ValueError, TypeError, KeyError) as e:
            raise CheckpointError(f"{path}: not a safetensors file: {e}") from None
    bad = [n for n, a in flat.items() if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all()]
    if bad:
        raise CheckpointError(f"{path}: non-finite values (NaN or inf) in {_tensors(len(bad))}: {_listed(bad)}")
    return flat


def join_params(parts: list[Path], out: Path) -> Path:
    """One parameter file from files holding disjoint tensors of one model (the syncer shards' finals):
    their tensors together, and the first file's info with every file's fragment digests."""
    flat: dict[str, np.ndarray] = {}
    info: dict[str, Any] = {}
    for path in parts:
        tensors, part_info = read_params(path)
        twice = sorted(set(tensors) & set(flat))
        if twice:
            raise CheckpointError(f"{path}: tensor {twice[0]!r} is in another part too (not one model's shards?)")
        flat.update(tensors)
        if not info:
            info = {k: v for k, v in part_info.items() if k not in ("shard", "owned")}
        digests = info.get("digests")
        for p, d in enumerate(part_info.get("digests") or []):
            if d is not None and digests is not None and p < len(digests):
                digests[p] = d
    save_params(out, flat, info)
    return out
