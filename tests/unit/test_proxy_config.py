"""`ProxyConfig` and the command line generated from it: every field is a flag with its docstring as help, every
flag reaches its field, and every bound refuses a value outside it naming the field and the value."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from kvbridge.core.errors import ConfigError
from kvbridge.serving.proxy import ProxyConfig, add_arguments, config_from_args
from kvbridge.serving.proxy.flags import field_docs, flag

FIELDS = msgspec.inspect.type_info(ProxyConfig).fields
URLS = ["--prefill", "http://p", "--decode", "http://d"]


def parse(argv: list[str]) -> ProxyConfig:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_every_field_has_a_docstring_and_a_flag_with_it_as_help():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    actions = {a.dest: a for a in parser._actions}
    docs = field_docs(ProxyConfig)
    for info in FIELDS:
        assert docs.get(info.name), f"{info.name} has no docstring"
        assert actions[info.name].option_strings[0] == flag(info.name)
        assert actions[info.name].help == docs[info.name].replace("%", "%%")


def test_the_defaults_are_the_config_defaults():
    assert parse(URLS) == ProxyConfig(prefill=("http://p",), decode=("http://d",))


def changed(info: msgspec.inspect.Field) -> tuple[str, object]:
    """A value other than the default, within the field's bounds, as a flag value and as the field's value."""
    t = info.type
    if isinstance(t, msgspec.inspect.UnionType):
        t = next(x for x in t.types if not isinstance(x, msgspec.inspect.NoneType))
    if isinstance(t, msgspec.inspect.BoolType):
        return "", not info.default
    if isinstance(t, msgspec.inspect.LiteralType):
        value = next(v for v in t.values if v != info.default)
        return str(value), value
    if isinstance(t, msgspec.inspect.StrType):
        return "/some/file", "/some/file"
    base = info.default if isinstance(info.default, int | float) else 1
    value = type(base)(base + 1) if t.le is None or base + 1 <= t.le else type(base)(base - 1)
    return str(value), value


@pytest.mark.parametrize("info", [f for f in FIELDS if not f.required], ids=lambda f: f.name)
def test_each_flag_reaches_its_field(info):
    text, value = changed(info)
    name = flag(info.name)
    if text == "":
        name = name if value else "--no-" + name[2:]
        argv = [name]
    else:
        argv = [name, text]
    got = parse([*URLS, *argv])
    assert getattr(got, info.name) == value
    others = {f.name: getattr(got, f.name) for f in FIELDS if f.name != info.name}
    default = ProxyConfig(prefill=("http://p",), decode=("http://d",))
    assert others == {f.name: getattr(default, f.name) for f in FIELDS if f.name != info.name}


BOUNDED = [f for f in FIELDS if isinstance(f.type, msgspec.inspect.IntType | msgspec.inspect.FloatType)]


@pytest.mark.parametrize("info", BOUNDED, ids=lambda f: f.name)
def test_a_value_outside_the_bounds_is_refused_naming_the_field(info):
    t = info.type
    low = t.ge if t.ge is not None else t.gt
    assert low is not None and t.le is not None, f"{info.name} has no floor or no ceiling"
    for bad in (low - 1, t.le * 2 + 1):
        with pytest.raises(ConfigError, match=rf"{info.name}: .*\(got {bad!r}\)"):
            ProxyConfig(prefill=("http://p",), decode=("http://d",), **{info.name: bad})
    assert getattr(ProxyConfig(prefill=("http://p",), decode=("http://d",), **{info.name: t.le}), info.name) == t.le


def test_urls_repeat_or_split_at_commas_and_none_is_refused():
    got = parse(["--prefill", "http://a,http://b", "--prefill", "http://c", "--decode", "http://d"])
    assert got.prefill == ("http://a", "http://b", "http://c")
    with pytest.raises(ConfigError, match="prefill"):
        ProxyConfig(prefill=(), decode=("http://d",))
    with pytest.raises(ConfigError, match="auth_key_file"):
        ProxyConfig(prefill=("http://p",), decode=("http://d",), auth_key_file="")
