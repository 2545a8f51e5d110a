"""wan-diloco: Decoupled DiLoCo across regions joined by WAN links."""

__version__ = "0.1.0"


def load_params(path, like=None):
    """(parameters, info) of a params file a run wrote (``RUN_DIR/checkpoints/params.safetensors``):
    a flat name -> numpy dict, or ``like``'s structure given a template pytree. See
    ``wan_diloco.checkpoint.load_params``."""
    from wan_diloco.checkpoint import load_params as load

    return load(path, like)
