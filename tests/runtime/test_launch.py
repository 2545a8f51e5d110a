"""``runtime.launch`` is the run's entry point and the one place callers import the launcher's names from:
every function and class of its parts (``launch_*``) is re-exported there, as the same object."""
import importlib
import inspect

from wan_diloco.runtime import launch

PARTS = ("cluster", "names", "prep", "stop", "summary")


def test_every_public_name_of_the_parts_is_reexported():
    for part in PARTS:
        module = importlib.import_module(f"wan_diloco.runtime.launch_{part}")
        own = [n for n, v in vars(module).items() if not n.startswith("_")
               and (inspect.isfunction(v) or inspect.isclass(v)) and v.__module__ == module.__name__]
        assert own, part
        for name in own:
            assert name in launch.__all__ and getattr(launch, name) is getattr(module, name), f"launch_{part}.{name}"
    assert all(hasattr(launch, name) for name in launch.__all__)
