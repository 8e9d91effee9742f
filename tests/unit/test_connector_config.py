"""The connector's startup-time answers to vLLM, from `kv_connector_extra_config`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import ConfigError

pytest.importorskip("vllm")
from kvbridge.vllm.connector import KVBridgeConnector


def vllm_config(extra: dict) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra))


def test_kv_layout_is_what_vllm_is_asked_for():
    assert KVBridgeConnector.get_required_kvcache_layout(vllm_config({"kv_layout": "HND"})) == "HND"
    assert KVBridgeConnector.get_required_kvcache_layout(vllm_config({})) is None


def test_a_bad_kv_layout_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="kv_layout"):
        KVBridgeConnector.get_required_kvcache_layout(vllm_config({"kv_layout": "sideways"}))


def test_kv_both_needs_a_lease_longer_than_the_transfer_timeout():
    with pytest.raises(ConfigError, match=r"lease_s .* must exceed transfer_timeout_s"):
        BridgeConfig(lease_s=20, transfer_timeout_s=20).check_role(producer=True, consumer=True)
    BridgeConfig(lease_s=20, transfer_timeout_s=20).check_role(producer=True, consumer=False)  # a prefill only
    BridgeConfig().check_role(producer=True, consumer=True)  # the defaults agree


def test_the_keyless_flags_old_name_is_refused_naming_the_new_one():
    with pytest.raises(ConfigError, match="keyless_exposes_kv_to_local_processes"):
        BridgeConfig.from_extra({"insecure_no_auth": True})
    config = BridgeConfig.from_extra({"keyless_exposes_kv_to_local_processes": True})
    assert config.keyless_exposes_kv_to_local_processes
