"""The import rules of docs/architecture.md: each package imports only from layers below it.

Every ``import`` in the package counts, also those inside functions.
"""
import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "wan_diloco"

# Lowest first. Units in one set of the same layer may not import each other
# (the "parts" and the two drivers are independent); the foundation layers may.
LAYERS: list[tuple[set[str], bool]] = [  # (units, may units of this layer import each other)
    ({"config", "tree", "clock", "kernels"}, True),
    ({"model", "data", "data_sources", "data_batches", "train"}, True),
    ({"buffers", "fragments", "merge", "outer", "feedback", "shards", "tape"}, True),
    ({"core", "compression", "transport", "regions", "checkpoint"}, False),
    ({"planning"}, False),  # models the run: the schedule (fragments) and the codec's bit widths
    ({"spec"}, False),
    ({"host_tls"}, False),  # this host's TLS files over the run file's (flags, environment)
    ({"assemble"}, False),
    ({"sim", "runtime", "export"}, False),  # export: launch files of a run (reads spec)
    ({"api"}, False),  # the Python entry points over the drivers; the CLI prints what they return
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


def imports_of(name: str, path: Path | str) -> list[tuple[str, list[str], int]]:
    """(imported wan_diloco module, names taken from it, line) for every import in the file (or source text)."""
    tree = ast.parse(path if isinstance(path, str) else path.read_text())
    package = name if isinstance(path, Path) and path.name == "__init__.py" else name.rpartition(".")[0]
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


# ---- the drivers drive the core and nothing more (#24) ------------------------------------------
# runtime/ and sim/ feed the sans-IO core events and carry out its actions; a driver that reads a private
# name of the core, or writes a core object's attribute, has taken a protocol decision the core should own.

DRIVERS = sorted(m for m in ALL if unit_of(m) in ("runtime", "sim"))
CORE_NAME = re.compile(r"(^|_)cores?($|_)")  # core, cores, syncer_core, core_of: names a driver gives core objects


def chain(node: ast.AST) -> list[str]:
    """The names an expression is reached through, innermost last: ``self.core.state[k]`` -> [core, self]."""
    out = []
    while True:
        if isinstance(node, ast.Attribute):
            out.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Name):
            return out + [node.id]
        else:
            return out


def reaches_core(node: ast.AST) -> bool:
    return any(CORE_NAME.search(n) for n in chain(node))


def written_through_core(target: ast.AST) -> bool:
    """An assignment target that changes a core object: ``x.core.a = ``, ``x.core.d[k] = ``, ``cores[0].a = ``."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(written_through_core(t) for t in target.elts)
    if isinstance(target, ast.Starred):
        return written_through_core(target.value)
    if isinstance(target, ast.Attribute):  # ``self.core = SyncerCore(...)`` holds a core; it does not write one
        return reaches_core(target.value)
    if isinstance(target, ast.Subscript):  # ``self.cores[s] = core`` puts a core in the driver's own list
        return any(CORE_NAME.search(n) for n in chain(target.value)[1:])
    return False


def core_writes(text: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(text)):
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        out += [f"{node.lineno}: {ast.unparse(t)}" for t in targets if written_through_core(t)]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
                and node.args and (reaches_core(node.args[0]))):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(out, key=lambda found: int(found.partition(":")[0]))


def private_core_uses(name: str, text: str) -> list[str]:
    out = [f"{line}: from {target} import {', '.join(names)}" for target, names, line in imports_of(name, text)
           if unit_of(target) == "core" and any(n.startswith("_") and not n.startswith("__") for n in names)]
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and reaches_core(node.value)):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_driver_checks_see_what_they_look_for():
    # The checks above must catch each form they name (and pass the forms that are fine), or they prove nothing.
    src = ("from wan_diloco.core.syncer import _Pending, SyncerCore\n"
           "self.core = SyncerCore()\nself.core.step = 3\nself.syncer_core.state[k] = v\ncores[0].epoch += 1\n"
           "setattr(self.core, 'x', 1)\nx = self.core._pending\ny = self.core.on_tick(1.0)\nself.step = 2\n"
           "core_of(m).version, z = 1, 2\nself.cores[s] = SyncerCore()\n")
    assert core_writes(src) == ["3: self.core.step", "4: self.syncer_core.state[k]", "5: cores[0].epoch",
                                "6: setattr(self.core, 'x', 1)", "10: (core_of(m).version, z)"]
    assert private_core_uses("wan_diloco.runtime.probe", src) == [
        "1: from wan_diloco.core.syncer import _Pending, SyncerCore", "7: self.core._pending"]


@pytest.mark.parametrize("name", DRIVERS)
def test_drivers_use_no_private_core_names(name):
    assert not (found := private_core_uses(name, ALL[name].read_text())), f"{name} reaches into the core: {found}"



# A driver module reaches another module's object only through its public names: the helpers of
# ``runtime.learner_state`` call ``lrn.drain()``, never ``lrn._drain()``. ``self``/``cls``/``super()`` are the
# module's own object; the namedtuple API (``_replace``...) and ``os._exit`` are public despite the underscore.
PUBLIC_UNDERSCORED = {"_replace", "_asdict", "_fields", "_make", "_exit"}


def private_uses(text: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        owner = node.value
        own = (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or (
            isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super")
        if not own and node.attr not in PUBLIC_UNDERSCORED:
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(out, key=lambda found: int(found.partition(":")[0]))


def test_the_private_use_check_sees_what_it_looks_for():
    src = ("lrn._drain()\nself._drain()\ncls._x\nsuper()._env_of()\nu._replace(a=1)\nos._exit(1)\nx.y._z = 1\n")
    assert private_uses(src) == ["1: lrn._drain", "7: x.y._z"]


@pytest.mark.parametrize("name", DRIVERS)
def test_drivers_use_no_private_names_of_other_objects(name):
    assert not (found := private_uses(ALL[name].read_text())), f"{name} uses another object's private names: {found}"


@pytest.mark.parametrize("name", DRIVERS)
def test_drivers_write_no_core_attributes(name):
    assert not (found := core_writes(ALL[name].read_text())), f"{name} writes core state: {found}"


# ---- small modules (docs/DESIGN: one idea each, about 400 lines at most) ---------------------------
# A module may be longer when its docstring, or a comment above its first statement, says why in a line
# MARKER matches: "Over 400 lines: <why>" (or "Over ~400 lines: <why>").
MAX_LINES = 400
MARKER = re.compile(r"over ~?400 lines:", re.IGNORECASE)

def says_why_it_is_long(text: str) -> bool:
    tree = ast.parse(text)
    first = next((n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))),
                 None)
    top = text.splitlines()[: first.lineno - 1 if first else None]
    doc = ast.get_docstring(tree) or ""
    return bool(MARKER.search(doc)) or any(MARKER.search(line) for line in top if line.lstrip().startswith("#"))


def test_the_length_check_reads_the_marker():
    assert says_why_it_is_long('"""A table.\n\nOver 400 lines: the one wire table, kept whole."""\nx = 1\n')
    assert says_why_it_is_long("# over 400 lines: generated\nimport os\n")
    assert says_why_it_is_long("# Over ~400 lines: the run file in one place\nimport os\n")
    assert not says_why_it_is_long("import os\n# over 400 lines: too late, below the first statement\n")
    assert not says_why_it_is_long('"""A module."""\nx = 1\n')


@pytest.mark.parametrize("name", sorted(ALL))
def test_modules_are_small_or_say_why(name):
    text = ALL[name].read_text()
    lines = len(text.splitlines())
    assert lines <= MAX_LINES or says_why_it_is_long(text), \
        f"{name}: {lines} lines; split it, or say why at its top in a line with 'Over 400 lines: <why>'"
