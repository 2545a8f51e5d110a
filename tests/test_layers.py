"""The import rules of docs/architecture.md: each package imports only from layers below it.

Every ``import`` in the package counts, also those inside functions.
"""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "wan_diloco"

# Lowest first. Units in one set of the same layer may not import each other
# (the "parts" and the two drivers are independent); the foundation layers may.
LAYERS: list[tuple[set[str], bool]] = [  # (units, may units of this layer import each other)
    ({"config", "tree", "clock"}, True),
    ({"model", "data", "data_sources", "train"}, True),
    ({"fragments", "merge", "outer", "feedback", "shards", "tape"}, True),
    ({"core", "compression", "transport", "regions", "checkpoint"}, False),
    ({"planning"}, False),  # models the run: the schedule (fragments) and the codec's bit widths
    ({"spec"}, False),
    ({"assemble"}, False),
    ({"sim", "runtime"}, False),
    ({"cli"}, False),
]
RANK = {unit: i for i, (units, _) in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported wan_diloco module, names taken from it, line) for every import in the file."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("wan_diloco")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("wan_diloco"):
                out.append((target, [a.name for a in node.names], node.lineno))
    return out


ALL = modules()


def test_the_layer_table_covers_every_package_and_module():
    units = {unit_of(m) for m in ALL} - {"__init__"}
    assert units == set(RANK), f"not in LAYERS: {sorted(units - set(RANK))}; stale: {sorted(set(RANK) - units)}"


@pytest.mark.parametrize("name", sorted(ALL))
def test_imports_follow_the_layers(name):
    unit = unit_of(name)
    if unit == "__init__":
        return
    for target, names, line in imports_of(name, ALL[name]):
        other = unit_of(target)
        if other in (unit, "__init__"):
            continue
        same_layer_ok = LAYERS[RANK[unit]][1]
        ok = RANK[other] < RANK[unit] or (RANK[other] == RANK[unit] and same_layer_ok)
        assert ok, f"{name}:{line} imports {target}: {unit} (layer {RANK[unit]}) may not import {other} (layer {RANK[other]})"


@pytest.mark.parametrize("name", sorted(ALL))
def test_no_private_names_across_modules(name):
    for target, names, line in imports_of(name, ALL[name]):
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert not private, f"{name}:{line} takes private {private} from {target}"
    tree = ast.parse(ALL[name].read_text())
    aliases = {a.asname or a.name.split(".")[-1] for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
               for a in node.names if (getattr(node, "module", None) or a.name or "").startswith("wan_diloco")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            assert not (node.attr.startswith("_") and not node.attr.startswith("__")), \
                f"{name}:{node.lineno} reaches into {node.value.id}.{node.attr}"


def test_no_import_cycles():
    graph: dict[str, set[str]] = {}
    for name, path in ALL.items():
        edges = set()
        for target, names, _ in imports_of(name, path):
            # `from pkg import mod` depends on pkg.mod; `from pkg import obj` on pkg's __init__.
            subs = {f"{target}.{n}" for n in names if f"{target}.{n}" in ALL}
            edges |= subs or ({target} if target in ALL else set())
        graph[name] = edges - {name}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
