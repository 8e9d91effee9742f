"""The folders are the layers: each package imports only from its own floor and those below.

Read from the source (ast), so that imports inside functions and under TYPE_CHECKING count too. The core imports
nothing outside the standard library, numpy and msgspec.
"""

from __future__ import annotations

import ast
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


def imports(path: Path) -> list[str]:
    """Every absolute module name `path` imports."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            if node.module == "kvbridge":
                names += [f"kvbridge.{alias.name}" for alias in node.names]
    return names


def package_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else ""


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_in_a_layer():
    assert {package_of(p) for p in MODULES} <= set(ALLOWED)
    loose = [p.name for p in MODULES if package_of(p) == "" and p.name != "__init__.py"]
    assert loose == [], f"modules outside the layer folders: {loose}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    own = package_of(path)
    wrong = []
    for name in imports(path):
        parts = name.split(".")
        if parts[0] != "kvbridge" or len(parts) < 2:
            continue
        target = parts[1]
        if target != own and target not in ALLOWED[own]:
            wrong.append(name)
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


def test_the_check_notices_an_upward_import(tmp_path):
    """Negative control: a core module importing the runtime is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from kvbridge.runtime.decode_worker import DecodeWorker\n")
    assert "kvbridge.runtime.decode_worker" in imports(bad)
    assert "runtime" not in ALLOWED["core"]
