"""One state file: safetensors with our metadata and a digest over everything (see the package docstring).

Metadata keys (all strings, as safetensors wants): ``format`` (FORMAT),
``format_version``, ``kind`` (what the file holds, e.g. ``syncer``), ``info``
(a JSON object: counters, ids, config echo) and ``digest``: XXH3-64 (hex) of
the info text and, in name order, every tensor's name, dtype, shape and bytes.
"""
from __future__ import annotations

import errno
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import xxhash

FORMAT = "wan-diloco-state"
FORMAT_VERSION = 1
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit: a header claiming more is not a state file
DTYPES = frozenset({"float32", "float64", "float16", "int32", "int64", "uint32", "uint8", "int8", "bool"})


class CheckpointError(ValueError):
    """A state file is missing, torn, corrupt, of another format or version, or not what was asked for."""


def _digest(info_text: str, tensors: Mapping[str, np.ndarray]) -> str:
    h = xxhash.xxh3_64(info_text.encode())
    for name in sorted(tensors):
        a = np.asarray(tensors[name], order="C")
        h.update(f"\0{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(memoryview(a).cast("B") if a.size else b"")
    return h.hexdigest()


def encode_state(tensors: Mapping[str, Any], info: Mapping[str, Any], kind: str) -> bytes:
    """The bytes of a state file holding ``tensors`` (numpy or jax arrays) and ``info`` (JSON-able)."""
    from safetensors.numpy import save

    arrays = {}
    for name, value in tensors.items():
        a = np.asarray(value, order="C")
        if a.dtype.name not in DTYPES:
            raise CheckpointError(f"tensor {name!r}: dtype {a.dtype} cannot be stored")
        arrays[name] = a
    info_text = json.dumps(info, sort_keys=True, allow_nan=False)
    meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "kind": kind, "info": info_text,
            "digest": _digest(info_text, arrays)}
    return save(arrays, metadata=meta)


def read_header(data: bytes, what: str) -> dict[str, Any]:
    """The JSON header of a safetensors file's bytes (tensor name -> dtype, shape, offsets; ``__metadata__``)."""
    if len(data) < 8:
        raise CheckpointError(f"{what}: truncated ({len(data)} bytes)")
    (hlen,) = struct.unpack_from("<Q", data)
    if hlen > MAX_HEADER_BYTES or 8 + hlen > len(data):
        raise CheckpointError(f"{what}: header length {hlen} does not fit the file ({len(data)} bytes): truncated?")
    try:
        header = json.loads(data[8 : 8 + hlen])
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{what}: header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{what}: header is not a JSON object")
    return header


def decode_state(data: bytes | bytearray | memoryview, kind: str | None = None,
                 what: str = "state file") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(tensors, info) of a state file; CheckpointError names what is wrong (nothing is returned half)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    data = bytes(data)
    header = read_header(data, what)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{what}: not a wan-diloco state file")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise CheckpointError(f"{what}: format version {meta.get('format_version')!r}; this build reads {FORMAT_VERSION}")
    if kind is not None and meta.get("kind") != kind:
        raise CheckpointError(f"{what}: holds {meta.get('kind')!r}, expected {kind!r}")
    try:
        tensors = load(data)
    except (SafetensorError, ValueError, TypeError) as e:
        raise CheckpointError(f"{what}: {e}") from None
    info_text = meta.get("info")
    if not isinstance(info_text, str) or _digest(info_text, tensors) != meta.get("digest"):
        raise CheckpointError(f"{what}: digest mismatch: the file is corrupt")
    info = json.loads(info_text)
    if not isinstance(info, dict):
        raise CheckpointError(f"{what}: info is not a JSON object")
    return tensors, info


# Tests only: while the file this names exists, every write fails as a full disk does (ENOSPC), so a
# test can fill and free a "disk" of a running process without root or a tmpfs.
FAULT_ENV = "WAN_DILOCO_TEST_DISK_FULL_WHILE"


def _injected_fault(path: Path) -> None:
    flag = os.environ.get(FAULT_ENV)
    if flag and os.path.exists(flag):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def describe_os_error(e: BaseException) -> str:
    """``[Errno 28] No space left on device`` (the caller names the path), else the error's text."""
    if isinstance(e, OSError) and e.errno is not None and e.strerror:
        return f"[Errno {e.errno}] {e.strerror}"
    return str(e)


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the new one: temp, fsync, rename."""
    path = Path(path)
    _injected_fault(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)  # the rename itself must survive a power cut
    finally:
        os.close(dfd)


def save_state(path: str | Path, tensors: Mapping[str, Any], info: Mapping[str, Any], kind: str) -> int:
    """Encode and write atomically; returns the file's size in bytes."""
    data = encode_state(tensors, info, kind)
    write_atomic(path, data)
    return len(data)


def load_state(path: str | Path, kind: str | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read and verify a state file (``decode_state``); a missing file is a CheckpointError too."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path}: {e.strerror or e}") from None
    return decode_state(data, kind, what=str(path))
