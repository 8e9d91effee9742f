"""docs/configuration.md, generated from the configuration classes' field docstrings, so that it cannot drift.

    python -m kvbridge.serving.config_docs docs/configuration.md      # (re)write the page
    python -m kvbridge.serving.config_docs                            # print it
    python -m kvbridge.serving.config_docs --check docs/configuration.md   # exit 1 if the page differs

Each field's type, bounds and default come from the class itself (`msgspec.inspect`: the msgspec `Meta`
constraints of `BridgeConfig` and of any other class that has them); its text is the string literal written under
the field in the class body (read with `ast`, as Sphinx reads attribute docstrings). A field without one is an
error: every configuration field is documented where it is declared.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvbridge.core.config import BridgeConfig
from kvbridge.serving.proxy.config import ProxyConfig

COMMAND = "python -m kvbridge.serving.config_docs docs/configuration.md"


@dataclass(frozen=True)
class Section:
    cls: type
    title: str
    intro: str


SECTIONS = (
    Section(
        BridgeConfig,
        "`kv_connector_extra_config` (the connector: `kvbridge.core.config.BridgeConfig`)",
        "The connector's settings, given in vLLM's `--kv-transfer-config` as `kv_connector_extra_config` (or with "
        "`kvbridge serve --kv-extra KEY=VALUE`), the same keys on prefill and decode instances. Unknown keys and "
        "values out of their bounds are refused at start-up with one line naming the key. vLLM's own "
        '`"kv_load_failure_policy"` (`recompute` or `fail`) sits beside it in the kv-transfer-config.',
    ),
    Section(
        ProxyConfig,
        "`kvbridge proxy` (`kvbridge.serving.proxy.config.ProxyConfig`)",
        "The proxy's settings; `kvbridge proxy --help` names the command-line flag of each.",
    ),
)


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each annotated field of `cls`'s body, whitespace collapsed per paragraph."""
    tree = ast.parse(inspect.getsource(cls))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
    docs = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = _one_paragraph(after.value.value)
    return docs


def _one_paragraph(text: str) -> str:
    return " ".join(inspect.cleandoc(text).split())


def _type(t: Any) -> str:
    match t:
        case msgspec.inspect.UnionType(types=types):
            return " or ".join(_type(x) for x in types)
        case msgspec.inspect.LiteralType(values=values):
            return " or ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in values)
        case msgspec.inspect.VarTupleType(item_type=item):
            return f"list of {_type(item)}"
        case msgspec.inspect.NoneType():
            return "null"
    return {
        msgspec.inspect.StrType: "string",
        msgspec.inspect.IntType: "integer",
        msgspec.inspect.FloatType: "number",
        msgspec.inspect.BoolType: "boolean",
    }.get(type(t), type(t).__name__)


def _bounds(t: Any) -> str:
    if isinstance(t, msgspec.inspect.UnionType):
        return "; ".join(b for b in (_bounds(x) for x in t.types) if b)
    signs = (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"))
    found = [(sign, getattr(t, name, None)) for name, sign in signs]
    return ", ".join(f"{sign} {_number(value)}" for sign, value in found if value is not None)


def _number(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 16 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _default(name: str, field: Any) -> str:
    if field.required:
        return "required"
    value = field.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if name.endswith("_bytes") and isinstance(value, int):
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value and value % size == 0:
                return f"`{value}` ({value // size} {unit})"
    return f"`{_number(value)}`"


def _cell(text: str) -> str:
    """Text for a table cell: `|` escaped everywhere, `*` outside code spans (dp*pp*tp is not emphasis)."""
    parts = text.split("`")
    parts[::2] = [part.replace("*", "\\*") for part in parts[::2]]
    return re.sub(r"(?<!\\)\|", r"\\|", "`".join(parts))


def section_markdown(section: Section) -> list[str]:
    docs = field_docs(section.cls)
    info = msgspec.inspect.type_info(section.cls)
    missing = [f.name for f in info.fields if f.name not in docs]
    if missing:
        raise ValueError(f"{section.cls.__name__}: fields without a docstring: {', '.join(missing)}")
    lines = [f"## {section.title}", "", section.intro, "", "| key | type | default | bounds | meaning |"]
    lines.append("|---|---|---|---|---|")
    for f in info.fields:
        cells = (f"`{f.name}`", _type(f.type), _default(f.name, f), _bounds(f.type) or "–", docs[f.name])
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def render() -> str:
    lines = [
        "# Configuration",
        "",
        f"Generated from the field docstrings of the configuration classes by `{COMMAND}`; do not edit by hand",
        "(`tests/unit/test_config_docs.py` fails when this page differs from the code).",
        "",
    ]
    for section in SECTIONS:
        lines += [*section_markdown(section), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.serving.config_docs", description=__doc__.split("\n")[0])
    parser.add_argument("path", nargs="?", type=Path, help="write the page here (default: print it)")
    parser.add_argument("--check", action="store_true", help="exit 1 if PATH differs from the generated page")
    args = parser.parse_args(argv)
    page = render()
    if args.path is None:
        sys.stdout.write(page)
        return 0
    if args.check:
        current = args.path.read_text(encoding="utf-8") if args.path.exists() else ""
        if current != page:
            print(f"{args.path} is out of date; regenerate it with: {COMMAND}", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(page, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
