"""The proxy's command line, generated from `ProxyConfig`: one flag per field (its name without a `_s` suffix,
dashes for underscores), typed from its annotation, defaulting to its default, with its docstring as help. Nothing
about a setting is written twice: a new field is a new flag.

    connect_timeout_s: float      ->  --connect-timeout S
    prefill: tuple[str, ...]      ->  --prefill URL (repeat, or comma-separated)
    auth_key_file: str | None     ->  --auth-key-file PATH
    some_switch: bool             ->  --some-switch / --no-some-switch
    routing: Literal["a", "b"]    ->  --routing {a,b}
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import itertools
from typing import Any

import msgspec

from kvbridge.serving.proxy.config import ProxyConfig

REPEATED = ("prefill", "decode")
"""Fields given once per backend (repeat the flag, or separate URLs by commas)."""


def flag(name: str) -> str:
    """The flag of field `name`: `connect_timeout_s` -> `--connect-timeout`."""
    return "--" + name.removesuffix("_s").replace("_", "-")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal after its annotation in the class body), whitespace collapsed."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for here, after in itertools.pairwise(body):
        if (
            isinstance(here, ast.AnnAssign)
            and isinstance(here.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[here.target.id] = " ".join(after.value.value.split())
    return docs


def add_config_arguments(p: argparse.ArgumentParser, cls: type = ProxyConfig) -> None:
    """One flag per field of `cls` (the loop this module is about)."""
    docs = field_docs(cls)
    for info in msgspec.inspect.type_info(cls).fields:
        help_text = docs.get(info.name, "").replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": info.name, "help": help_text}
        if info.required:
            kwargs.update(required=True)
        else:
            kwargs.update(default=info.default)
        kwargs.update(_kind(info.name, info.type))
        p.add_argument(flag(info.name), **kwargs)


def _kind(name: str, t: msgspec.inspect.Type) -> dict[str, Any]:
    """argparse's type, action, metavar and choices for a field of type `t`."""
    if name in REPEATED:
        return {"action": "append", "metavar": "URL"}
    if isinstance(t, msgspec.inspect.UnionType):  # X | None: the flag gives X
        t = next(x for x in t.types if not isinstance(x, msgspec.inspect.NoneType))
    if isinstance(t, msgspec.inspect.BoolType):
        return {"action": argparse.BooleanOptionalAction}
    if isinstance(t, msgspec.inspect.LiteralType):
        return {"choices": list(t.values)}
    if isinstance(t, msgspec.inspect.FloatType):
        return {"type": float, "metavar": "S" if name.endswith("_s") else "X"}
    if isinstance(t, msgspec.inspect.IntType):
        return {"type": int, "metavar": "N"}
    if isinstance(t, msgspec.inspect.StrType):
        return {"metavar": "PATH" if name.endswith("_file") else "TEXT"}
    raise TypeError(f"ProxyConfig.{name}: no flag for a field of type {t}")


def config_from_namespace(args: argparse.Namespace, cls: type = ProxyConfig) -> Any:
    """`cls` from the parsed flags (URLs split at commas)."""
    values = {}
    for info in msgspec.inspect.type_info(cls).fields:
        value = getattr(args, info.name)
        if info.name in REPEATED:
            value = tuple(u.strip() for v in value for u in v.split(",") if u.strip())
        values[info.name] = value
    return cls(**values)
