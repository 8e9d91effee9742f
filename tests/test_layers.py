"""The folders are the layers: each package imports only from its own floor and those below.

Read from the source (ast), so that imports inside functions and under TYPE_CHECKING count too. The core imports
nothing outside the standard library, numpy and msgspec.
"""

from __future__ import annotations

import ast
import graphlib
import shutil
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "kvbridge"

# package -> packages of kvbridge it may import (besides itself)
ALLOWED = {
    "core": set(),
    "wire": {"core"},
    "transport": {"core"},
    "runtime": {"core", "wire", "transport"},
    "vllm": {"core", "wire", "transport", "runtime"},
    "serving": {"core", "wire", "transport", "runtime", "vllm"},
    "testing": {"core", "wire", "transport", "runtime", "vllm", "serving"},
    "": {"core"},  # kvbridge/__init__.py re-exports the core
}
CORE_THIRD_PARTY = {"msgspec", "numpy"}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """The dotted name of the module at `path` in the package at `root` ("kvbridge.core.plan")."""
    rel = path.relative_to(root.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _import_statements(path: Path, root: Path) -> list[tuple[str, list[str], bool]]:
    """Per import statement in `path`: the module it names (relative imports resolved to absolute names), the names
    it imports from that module (`from m import a, b`: ["a", "b"]; `import m`: []), and whether it is relative."""
    own = module_name(path, root).split(".")
    package = own if path.name == "__init__.py" else own[:-1]
    statements = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            statements += [(alias.name, [], False) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 >= len(package):
                    raise ValueError(f"{path}: a relative import above the top package (level {node.level})")
                base = ".".join(package[: len(package) - (node.level - 1)])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            statements.append((module, [alias.name for alias in node.names], bool(node.level and not node.module)))
    return statements


def imports(path: Path, root: Path = PACKAGE) -> list[str]:
    """Every module name `path` imports, relative imports (`from ..vllm import x`) resolved to absolute names."""
    names = []
    for module, aliases, bare_relative in _import_statements(path, root):
        names.append(module)
        if module == "kvbridge" or bare_relative:  # `from kvbridge import x`, `from .. import x`
            names += [f"{module}.{alias}" for alias in aliases]
    return names


def package_of(path: Path, root: Path = PACKAGE) -> str:
    rel = path.relative_to(root)
    return rel.parts[0] if len(rel.parts) > 1 else ""


def wrong_imports(path: Path, own_layer: str, root: Path = PACKAGE) -> list[str]:
    """The kvbridge modules `path` (in layer `own_layer`) imports from a higher or sideways layer."""
    wrong = []
    for name in imports(path, root):
        parts = name.split(".")
        if parts[0] != "kvbridge" or len(parts) < 2:
            continue
        target = parts[1]
        if target != own_layer and target not in ALLOWED[own_layer]:
            wrong.append(name)
    return wrong


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_in_a_layer():
    assert {package_of(p) for p in MODULES} <= set(ALLOWED)
    loose = [p.name for p in MODULES if package_of(p) == "" and p.name != "__init__.py"]
    assert loose == [], f"modules outside the layer folders: {loose}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    own = package_of(path)
    wrong = wrong_imports(path, own)
    assert wrong == [], f"{path.relative_to(PACKAGE)} ({own or 'kvbridge'}) imports upward or sideways: {wrong}"


@pytest.mark.parametrize("path", sorted((PACKAGE / "core").glob("*.py")), ids=lambda p: p.name)
def test_core_is_pure(path):
    outside = [
        name
        for name in imports(path)
        if name.split(".")[0] not in sys.stdlib_module_names | CORE_THIRD_PARTY
        and not name.startswith(("kvbridge.core", "__future__"))
    ]
    assert outside == [], f"core/{path.name} imports {outside}"
    io = {"socket", "subprocess", "threading", "os", "zmq", "urllib", "http"}
    assert not {n.split(".")[0] for n in imports(path)} & io, f"core/{path.name} does I/O"


def test_relative_imports_are_resolved(tmp_path):
    root = tmp_path / "kvbridge"
    (root / "runtime").mkdir(parents=True)
    mod = root / "runtime" / "m.py"
    mod.write_text("from . import load\nfrom .load import Load\nfrom ..core import plan\nfrom .. import wire\n")
    assert imports(mod, root) == [
        "kvbridge.runtime",
        "kvbridge.runtime.load",
        "kvbridge.runtime.load",
        "kvbridge.core",
        "kvbridge",
        "kvbridge.wire",
    ]
    (root / "runtime" / "__init__.py").write_text("from .load import Load\n")
    assert imports(root / "runtime" / "__init__.py", root) == ["kvbridge.runtime.load"]
    mod.write_text("from ... import x\n")
    with pytest.raises(ValueError, match="above the top package"):
        imports(mod, root)


def test_the_check_notices_an_upward_import(tmp_path):
    """Negative control: in a copy of the package, a core module importing the runtime (absolute) and the vLLM
    adapter (relative) is caught, both imports, and it is the only module reported."""
    root = tmp_path / "kvbridge"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    bad = root / "core" / "bad.py"
    bad.write_text(
        "from kvbridge.runtime.decode_worker import DecodeWorker\n"
        "def f():\n"
        "    from ..vllm import connector\n"
        "    from .. import serving\n"
    )
    assert wrong_imports(bad, "core", root) == ["kvbridge.runtime.decode_worker", "kvbridge.vllm", "kvbridge.serving"]
    reported = {
        str(p.relative_to(root)) for p in sorted(root.rglob("*.py")) if wrong_imports(p, package_of(p, root), root)
    }
    assert reported == {"core/bad.py"}


# -- the import graph of modules has no cycle --------------------------------------------------------------------


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the kvbridge modules it imports, anywhere in its source (under TYPE_CHECKING and inside functions
    too). `from a.b import c` points at the module a.b.c where there is one (a submodule), else at a.b."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for module, aliases, _ in _import_statements(path, root):
            submodules = {f"{module}.{alias}" for alias in aliases} & paths.keys()
            targets |= submodules
            if len(submodules) < len(aliases) or not aliases:  # a name from the module, or `import module`
                targets.add(module)
        graph[name] = (targets & paths.keys()) - {name}
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """A cycle of imports in `graph` (its modules in order, the first repeated at the end), or [] if none."""
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        return list(reversed(exc.args[1]))
    return []


def test_the_modules_import_each_other_without_a_cycle():
    graph = import_graph()
    assert "kvbridge.runtime.staged_reads" in graph
    assert import_cycle(graph) == []


def test_the_cycle_check_notices_a_cycle(tmp_path):
    """Negative controls: a synthetic cycle is caught, and so is one put back into a copy of the package (the staged
    path importing the direct one under TYPE_CHECKING, which imports it at run time)."""
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) in (
        ["a", "b", "c", "a"],
        ["b", "c", "a", "b"],
        ["c", "a", "b", "c"],
    )
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) == []
    root = tmp_path / "kvbridge"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    staged = root / "runtime" / "staged_reads.py"
    staged.write_text(
        staged.read_text() + "\nif TYPE_CHECKING:\n    from kvbridge.runtime.nixl_reads import NixlReads  # noqa\n"
    )
    cycle = import_cycle(import_graph(root))
    assert set(cycle) == {"kvbridge.runtime.nixl_reads", "kvbridge.runtime.staged_reads"}, cycle


def test_a_submodule_imported_from_its_package_points_at_the_submodule(tmp_path):
    """`from kvbridge.serving.proxy import fanout` in proxy/app.py points at proxy/fanout.py, not at the package's
    __init__ (which imports app.py): no cycle is reported where Python has none."""
    root = tmp_path / "kvbridge"
    (root / "serving" / "proxy").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "serving" / "__init__.py").write_text("")
    (root / "serving" / "proxy" / "__init__.py").write_text("from kvbridge.serving.proxy.app import App\n")
    (root / "serving" / "proxy" / "fanout.py").write_text("X = 1\n")
    (root / "serving" / "proxy" / "app.py").write_text(
        "from kvbridge.serving.proxy import fanout\nfrom . import fanout as f2\nclass App: ...\n"
    )
    graph = import_graph(root)
    assert graph["kvbridge.serving.proxy.app"] == {"kvbridge.serving.proxy.fanout"}
    assert import_cycle(graph) == []
    (root / "serving" / "proxy" / "fanout.py").write_text("from kvbridge.serving.proxy import App\n")
    assert import_cycle(import_graph(root)) != []
