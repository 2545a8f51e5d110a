import os

# Tests run on CPU; keep XLA from grabbing every core's worth of threads per process.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The canonical micro run: tests import these from here (or tests/runtime/conftest.py), benchmarks from tests/micro.py.
from tests.micro import (MICRO_TOML, TOKEN, merge, micro_config, micro_document, micro_model,  # noqa: E402,F401
                         micro_spec, micro_toml, write_micro)
