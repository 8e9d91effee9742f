"""A decode without a key followed any client-supplied `remote_host`, so params posted
straight to it made it connect to an address the client chose and trust what answered there (another user's KV
read through a fake side channel; SSRF). Without a key it now refuses a non-loopback remote_host before any
connection (ParamsRefused "address", counted in vllm:kvbridge_rejected_params_total); loopback keeps working.
SchedulerSide with vLLM's configs as plain namespaces: no server, no connection."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kvbridge.core.config import BridgeConfig
from kvbridge.wire.params import prompt_hash

PROMPT = list(range(1, 41))


def decode_side(extra: dict | None = None):
    from kvbridge.vllm import scheduler_side

    kv = SimpleNamespace(engine_id="engine-d", is_kv_producer=False, is_kv_consumer=True, kv_load_failure_policy="fail")
    parallel = SimpleNamespace(
        pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel_size=1, data_parallel_index=0
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=kv, parallel_config=parallel, cache_config=SimpleNamespace(block_size=16)
    )
    return scheduler_side.SchedulerSide(
        vllm_config, BridgeConfig.from_extra(extra or {"keyless_exposes_kv_to_local_processes": True})
    )


def params(host: str) -> dict:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_request_id": f"r-{host}",
        "remote_block_ids": [1, 2, 3],
        "remote_host": host,
        "remote_port": 5600,
        "remote_layout": "pp=1,tp=1",
        "remote_num_tokens": len(PROMPT),
        "remote_prompt_hash": prompt_hash(PROMPT),
    }


def ask(decode, host: str, request_id: str):
    req = SimpleNamespace(request_id=request_id, kv_transfer_params=params(host), prompt_token_ids=PROMPT)
    return decode.get_num_new_matched_tokens(req, 0)


@pytest.mark.parametrize("host", ["10.1.2.3", "127.0.0.3.evil.example", "example.com", "::ffff:10.0.0.1"])
def test_a_keyless_decode_refuses_a_non_loopback_remote_host(host):
    decode = decode_side()
    ask(decode, host, "d1")
    assert decode._refused["d1"].reason == "address"  # under policy fail: the request fails, nothing is read
    assert decode.take_stats().data["rejected_params"] == {"address": 1}


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.3", "localhost", "::1"])
def test_a_keyless_decode_still_reads_from_loopback(host):
    """Negative control: the same params naming a loopback prefill are taken (what keyless tests rely on)."""
    decode = decode_side()
    assert ask(decode, host, "d1") == (len(PROMPT), True)
    assert "d1" not in decode._refused


def test_a_keyed_decode_does_not_refuse_by_address():
    """With a key the signature is what is checked (these unsigned params fail on it, not on the address)."""
    decode = decode_side({"auth_key": "k" * 32})
    ask(decode, "10.1.2.3", "d1")
    assert decode._refused["d1"].reason != "address"


def test_a_keyless_consumer_warns_once(caplog, monkeypatch):
    from kvbridge.vllm import scheduler_side

    monkeypatch.setattr(scheduler_side, "_warned_keyless", [])
    with caplog.at_level(logging.WARNING, logger="kvbridge.vllm.scheduler_side"):
        decode_side()
        decode_side()
    assert sum("no auth key" in r.getMessage() for r in caplog.records) == 1


def test_a_connector_without_a_key_needs_the_flag_naming_what_it_exposes():
    """Keyless only behind `keyless_exposes_kv_to_local_processes`, whose docs say what it exposes: without a key and
    without the flag the connector refuses to start, naming both; the control: the flag (the default of these tests)
    or a key."""
    from kvbridge.core.errors import ConfigError

    with pytest.raises(ConfigError, match="no auth_key_file is set and keyless_exposes_kv_to_local_processes is false"):
        decode_side({"lease_s": 30.0})
    assert decode_side({"keyless_exposes_kv_to_local_processes": True}).key is None
    assert decode_side({"auth_key": "k" * 32}).key is not None


def test_kvbridge_serve_passes_the_flag_only_with_keyless_exposes_kv_to_local_processes(tmp_path, monkeypatch):
    import argparse

    from kvbridge.serving import serve

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    base = ["--role", "decode", "--model", "m", "--platform", "cpu"]
    keyless = serve.spec_from_args(parser.parse_args([*base, "--keyless-exposes-kv-to-local-processes"])).extra_config()
    keyed = serve.spec_from_args(parser.parse_args(base)).extra_config()
    assert keyless.get("keyless_exposes_kv_to_local_processes") is True and "auth_key_file" not in keyless
    assert "keyless_exposes_kv_to_local_processes" not in keyed and keyed["auth_key_file"]
