"""KVBridgeConnector against each supported vLLM's connector interface: the installed one (0.32, the only CPU wheel)
and 0.33, whose facts (read from its wheel's source by tests/support/vllm_interface_facts.py, nothing copied) are
committed as tests/unit/data/vllm-0.33.0-interface.json.

For each: every abstract method of `KVConnectorBase_V1` is implemented; every method kvbridge overrides that the base
also has keeps its kind (method, classmethod, property) and accepts the base's parameters in the base's order, its own
extra parameters having defaults; every `from vllm... import name` in src/kvbridge names something the release
defines. And what 0.33 asks of a connector that cannot follow sleep mode: `supports_sleep_mode` is False, and the
handshake-metadata hook (which 0.33 calls again after a wake-up) may be called again with nothing changed.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from support.vllm_interface_facts import BASE, class_facts, facts, kvbridge_imports

DATA = Path(__file__).parent / "data"
RELEASES = sorted(p.name.split("-")[1] for p in DATA.glob("vllm-*-interface.json"))


def installed_facts() -> dict:
    import vllm

    root = Path(vllm.__file__).parent.parent
    return facts(root, vllm.__version__)


@pytest.fixture(scope="module", params=["installed", *RELEASES])
def release(request) -> dict:
    if request.param == "installed":
        return installed_facts()
    return json.loads((DATA / f"vllm-{request.param}-interface.json").read_text())


def test_the_committed_facts_are_what_the_parser_reads():
    """The facts of the installed vLLM's base.py, read as the committed ones were, name its real abstract methods."""
    import vllm.distributed.kv_transfer.kv_connector.v1.base as base

    parsed = class_facts(Path(base.__file__).read_text())["KVConnectorBase_V1"]["methods"]
    assert {n for n, m in parsed.items() if m["abstract"]} == set(base.KVConnectorBase_V1.__abstractmethods__)
    assert Path(base.__file__).as_posix().endswith(BASE)
    assert "0.33.0" in RELEASES


def _kind(cls, name: str) -> str:
    static = inspect.getattr_static(cls, name)
    if isinstance(static, classmethod):
        return "classmethod"
    if isinstance(static, staticmethod):
        return "staticmethod"
    if isinstance(static, property):
        return "property"
    return "method"


def _ours(cls, name: str) -> list[list]:
    """Our method's parameters in the facts' form, `self`/`cls` included."""
    fn = inspect.getattr_static(cls, name)
    fn = fn.__func__ if isinstance(fn, classmethod | staticmethod) else fn.fget if isinstance(fn, property) else fn
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "positional",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.VAR_POSITIONAL: "var_positional",
        inspect.Parameter.KEYWORD_ONLY: "keyword_only",
        inspect.Parameter.VAR_KEYWORD: "var_keyword",
    }
    return [[p.name, kinds[p.kind], p.default is not p.empty] for p in inspect.signature(fn).parameters.values()]


def incompatibilities(base: list[list], ours: list[list]) -> list[str]:
    """What a call made as the base declares it could not do with ours (empty: compatible)."""
    problems = []
    positional = [p for p in base if p[1] == "positional"][1:]
    mine = [p for p in ours if p[1] == "positional"][1:]
    has = {k: any(p[1] == k for p in ours) for k in ("var_positional", "var_keyword")}
    for i, (name, _, default) in enumerate(positional):
        if i >= len(mine):
            if not has["var_positional"]:
                problems.append(f"parameter {i + 1} ({name}) is not accepted")
            continue
        if mine[i][0] != name and not has["var_keyword"]:
            problems.append(f"parameter {i + 1} is {mine[i][0]!r}, the base's is {name!r}")
        if default and not mine[i][2]:
            problems.append(f"{mine[i][0]} needs a default (the base's {name} has one)")
    for name, _, default in mine[len(positional) :]:
        if not default:
            problems.append(f"extra parameter {name} has no default")
    for name, kind, _ in base:
        if kind == "keyword_only" and not any(p[0] == name for p in ours) and not has["var_keyword"]:
            problems.append(f"keyword {name} is not accepted")
        if kind in has and not has[kind]:
            problems.append(f"the base takes *{name} ({kind}); ours does not")
    return problems


def conformance(cls, release: dict) -> list[str]:
    """What `cls` lacks or declares incompatibly against the release's KVConnectorBase_V1 (empty: conforms)."""
    methods = release["classes"]["KVConnectorBase_V1"]["methods"]
    abstract = sorted(name for name, m in methods.items() if m["abstract"])
    assert abstract, "no abstract methods found: the facts are not of KVConnectorBase_V1"
    problems = [f"abstract {name} is not implemented" for name in abstract if name not in vars(cls)]
    for name, m in methods.items():
        if (name.startswith("__") and name != "__init__") or name not in vars(cls):
            continue
        if _kind(cls, name) != m["kind"]:
            problems.append(f"{name} is a {_kind(cls, name)} here, a {m['kind']} in the base")
        elif m["kind"] != "property":
            problems += [f"{name}: {x}" for x in incompatibilities(m["params"], _ours(cls, name))]
    return problems


def test_every_abstract_method_is_implemented_with_a_compatible_signature(release):
    from kvbridge.vllm.connector import KVBridgeConnector

    assert conformance(KVBridgeConnector, release) == [], f"vLLM {release['vllm']}"


def test_negative_control_a_nonconforming_connector_is_caught():
    """The check can fail: a connector missing an abstract method, taking no **kwargs where the base passes them,
    a required extra parameter, or an instance method where the base has a classmethod."""
    from kvbridge.vllm.connector import KVBridgeConnector

    release = json.loads((DATA / f"vllm-{RELEASES[-1]}-interface.json").read_text())
    namespace = {k: v for k, v in vars(KVBridgeConnector).items() if k != "wait_for_save"}
    namespace["start_load_kv"] = lambda self, forward_context: None
    namespace["wait_for_layer_load"] = lambda self, layer_name, timeout: None
    namespace["get_required_kvcache_layout"] = lambda self, vllm_config: None
    broken = type("Broken", KVBridgeConnector.__bases__, namespace)
    assert sorted(conformance(broken, release)) == [
        "abstract wait_for_save is not implemented",
        "get_required_kvcache_layout is a method here, a classmethod in the base",
        "start_load_kv: the base takes *kwargs (var_keyword); ours does not",
        "wait_for_layer_load: extra parameter timeout has no default",
    ]


def test_mixins_kvbridge_subclasses_are_implemented(release):
    """E.g. `SupportsHMA` (request_finished_all_groups), if the connector declares it."""
    from kvbridge.vllm.connector import KVBridgeConnector

    for base in KVBridgeConnector.__mro__[1:]:
        facts_of = release["classes"].get(base.__name__)
        if facts_of is None or base.__name__ == "KVConnectorBase_V1":
            continue
        for name, m in facts_of["methods"].items():
            if m["abstract"]:
                assert name in vars(KVBridgeConnector), f"vLLM {release['vllm']}: {base.__name__}.{name} missing"
                assert not incompatibilities(m["params"], _ours(KVBridgeConnector, name)), name


def test_every_vllm_name_kvbridge_imports_exists(release):
    missing = []
    for module, names in sorted(kvbridge_imports().items()):
        if module not in release["modules"]:
            missing.append(f"{module} (not in the facts: regenerate them, see tests/support/vllm_interface_facts.py)")
            continue
        defined = release["modules"][module]
        if defined is None:
            missing.append(f"module {module}")
        elif defined != "*":
            missing += [f"{module}.{n}" for n in sorted(names) if n not in defined]
    assert not missing, f"vLLM {release['vllm']} lacks {missing}"


def test_sleep_mode_is_refused_and_the_handshake_hook_can_be_called_again():
    """vLLM 0.33 asks `supports_sleep_mode` before starting with sleep mode on, and refuses to start when it is
    False: kvbridge's peers hold NIXL registrations and addresses of the KV memory, which sleep frees and remaps.
    0.33 also calls `set_xfer_handshake_metadata_pp_aware` again after a wake-up: kvbridge's handshakes go over its
    own side channel, so the hook keeps nothing and any number of calls leave the connector as it was."""
    from kvbridge.vllm.connector import KVBridgeConnector

    assert KVBridgeConnector.supports_sleep_mode(SimpleNamespace(kv_connector_extra_config={})) is False
    assert KVBridgeConnector._cache_hit_source.value == "p2p"  # "subclasses must set" it (0.32 and 0.33)
    connector = object.__new__(KVBridgeConnector)
    before = dict(vars(connector))
    for _ in range(3):
        assert connector.set_xfer_handshake_metadata_pp_aware({(0, 0): object(), (1, 0): object()}) is None
    assert vars(connector) == before
