"""Facts about a vLLM release's connector interface, read from its source with `ast` (nothing is imported or copied):
for tests/unit/test_vllm_compat.py, which checks KVBridgeConnector against them.

    python tests/support/vllm_interface_facts.py vllm-0.33.0-...whl > tests/data/vllm-0.33.0-interface.json

(`pip download 'vllm==0.33.*' --no-deps` fetches the wheel; a vLLM tree's directory works too.) The facts are
- `classes`: for the classes of `kv_connector/v1/base.py`, each method's kind (method, classmethod, staticmethod,
  property), whether it is abstract, and its parameters (name, kind, whether it has a default);
- `modules`: for each vLLM module kvbridge imports from (found in src/kvbridge), the names it defines at top level
  (functions, classes, assignments, imports, submodules), or "*" when it re-exports with a star import.
"""

from __future__ import annotations

import ast
import json
import sys
import zipfile
from pathlib import Path

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
SRC = Path(__file__).resolve().parents[2] / "src" / "kvbridge"


class Tree:
    """The files of a vLLM wheel or source tree, by path relative to the directory holding `vllm/`."""

    def __init__(self, where: str | Path) -> None:
        where = Path(where)
        if where.is_file():
            self._zip: zipfile.ZipFile | None = zipfile.ZipFile(where)
            self._names = set(self._zip.namelist())
            self.root = None
        else:
            self._zip = None
            self.root = where if (where / "vllm").is_dir() else where.parent
            self._names = {str(p.relative_to(self.root)) for p in (self.root / "vllm").rglob("*.py")}

    def has(self, path: str) -> bool:
        return path in self._names

    def read(self, path: str) -> str:
        if self._zip is not None:
            return self._zip.read(path).decode()
        return (self.root / path).read_text()

    def submodules(self, package: str) -> list[str]:
        prefix = package.replace(".", "/") + "/"
        out = set()
        for name in self._names:
            if name.startswith(prefix):
                head = name[len(prefix) :].split("/")[0]
                out.add(head.removesuffix(".py"))
        return sorted(x for x in out if x and x != "__init__" and not x.startswith("__"))

    def module_path(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for path in (f"{base}.py", f"{base}/__init__.py"):
            if self.has(path):
                return path
        return None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[list]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    out = [[p.arg, "positional", d] for p, d in zip(positional, defaults, strict=True)]
    if a.vararg:
        out.append([a.vararg.arg, "var_positional", False])
    out += [[p.arg, "keyword_only", d is not None] for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg:
        out.append([a.kwarg.arg, "var_keyword", False])
    return out


def _decorators(fn) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        node = d.func if isinstance(d, ast.Call) else d
        names.add(node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", ""))
    return names


def class_facts(source: str) -> dict:
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        methods = {}
        for fn in node.body:
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            decorators = _decorators(fn)
            kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decorators), "method")
            if "setter" in decorators:
                continue
            methods[fn.name] = {"kind": kind, "abstract": "abstractmethod" in decorators, "params": _params(fn)}
        out[node.name] = {"bases": [ast.unparse(b) for b in node.bases], "methods": methods}
    return out


def top_level_names(source: str) -> list[str] | str:
    names = _names(ast.parse(source).body)
    return names if names == "*" else sorted(names)


def _names(body: list[ast.stmt]) -> set[str] | str:
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    return "*"
                names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.If | ast.Try):  # TYPE_CHECKING blocks, guarded imports
            parts = [node.body, node.orelse] + ([h.body for h in node.handlers] if isinstance(node, ast.Try) else [])
            for part in parts:
                inner = _names(part)
                if inner == "*":
                    return "*"
                names |= inner
    return names


def kvbridge_imports(src: Path = SRC) -> dict[str, set[str]]:
    """{vLLM module: names kvbridge imports from it}, from every `from vllm... import ...` in src/kvbridge."""
    out: dict[str, set[str]] = {}
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                out.setdefault(node.module, set()).update(a.name for a in node.names)
    return out


def facts(where: str | Path, version: str) -> dict:
    tree = Tree(where)
    modules = {}
    for module in sorted(kvbridge_imports()):
        path = tree.module_path(module)
        if path is None:
            modules[module] = None
            continue
        names = top_level_names(tree.read(path))
        if names != "*" and path.endswith("__init__.py"):
            names = sorted(set(names) | set(tree.submodules(module)))
        modules[module] = names
    return {"vllm": version, "classes": class_facts(tree.read(BASE)), "modules": modules}


def main(argv: list[str]) -> int:
    where = argv[1]
    version = Path(where).name.split("-")[1] if Path(where).is_file() else "source"
    json.dump(facts(where, version), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
