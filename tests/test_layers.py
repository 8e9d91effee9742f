"""The folders are the layers: each package imports only from its own floor and those below.

Read from the source (ast), so that imports inside functions and under TYPE_CHECKING count too. The core imports
nothing outside the standard library, numpy and msgspec.
"""

from __future__ import annotations

import ast
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


def imports(path: Path, root: Path = PACKAGE) -> list[str]:
    """Every module name `path` imports, relative imports (`from ..vllm import x`) resolved to absolute names."""
    own = module_name(path, root).split(".")
    package = own if path.name == "__init__.py" else own[:-1]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 >= len(package):
                    raise ValueError(f"{path}: a relative import above the top package (level {node.level})")
                base = ".".join(package[: len(package) - (node.level - 1)])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            names.append(module)
            if module == "kvbridge" or (node.level and not node.module):  # `from kvbridge import x`, `from .. import x`
                names += [f"{module}.{alias.name}" for alias in node.names]
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
