from .helpers import fakes, parser  # noqa: F401  (fixtures of every test here)
