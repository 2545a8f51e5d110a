"""Durable state: snapshot parts, the snapshot store and the trained model's parameters.

Every file is a standard safetensors file (tensors plus a string map of
metadata) whose metadata names the format, its version and the kind of part,
and carries one XXH3 digest over the metadata and every tensor, so that a
torn, truncated or edited file is refused, never half-loaded. Files are
written to a temporary name, fsynced and renamed: a crash leaves the old file
or the new one, not a mix. No pickle anywhere.
"""
from .config import CheckpointConfig
from .format import CheckpointError, decode_state, describe_os_error, encode_state, load_state, save_state, write_atomic
from .params import load_params, params_file, read_init_params, read_params, save_params, tensor_specs
from .store import SnapshotStore

__all__ = [
    "CheckpointConfig", "CheckpointError", "SnapshotStore", "decode_state", "describe_os_error", "encode_state", "load_params",
    "load_state", "params_file", "read_init_params", "read_params", "save_params", "save_state", "tensor_specs", "write_atomic",
]
