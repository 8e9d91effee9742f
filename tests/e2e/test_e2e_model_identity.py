"""Model identity against real vLLM servers: two tiny models of equal geometry (Qwen2, 4 layers, 4 KV heads of 32)
whose weights differ (other seeds), as in a rolling update. A decode serving the other weights refuses the
prefill's KV: by the signed params' fingerprint before connecting, and at the handshake, naming the
fingerprint's part that differs, when the params name none; the decode serving the same model loads it.

Three servers, one key file: a prefill of model A (core 0), decodes of models A and B (core 1), both with
`kv_load_failure_policy=fail`, so a refusal is a failed request rather than a silent recompute.
"""

from __future__ import annotations

import random
import time

import msgspec
import pytest

from kvbridge.serving.launcher import (
    RequestFailed,
    VllmServer,
    complete,
    free_base_port,
    free_port,
    kvbridge_config,
    metric_sum,
    metrics,
    running,
)
from kvbridge.serving.tiny_model import build_tiny_model
from kvbridge.wire.params import parse_prefill_done

pytestmark = pytest.mark.vllm

KEY = b"model-identity-test-key-0123456789ab"
SOURCE = "vllm:prompt_tokens_by_source_total"
REJECTED = "vllm:kvbridge_rejected_params_total"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("model-identity")
    model_a = build_tiny_model(root / "model-a", seed=0)
    model_b = build_tiny_model(root / "model-b", seed=1)
    key_file = root / "key"
    key_file.write_bytes(KEY)

    def server(name: str, model, role: str, core: str, **extra) -> VllmServer:
        return VllmServer(
            model,
            port=free_port(),
            cpu_bind=core,
            kv_transfer_config=kvbridge_config(
                role, side_channel_port=free_base_port(1), auth_key_file=str(key_file), **extra
            ),
            name=name,
            log_path=root / f"{name}.log",
        )

    group = (
        server("prefill-a", model_a, "kv_producer", "0", lease_s=20.0),
        server("decode-a", model_a, "kv_consumer", "1", policy="fail", handshake_timeout_s=2.0),
        server("decode-b", model_b, "kv_consumer", "1", policy="fail", handshake_timeout_s=2.0),
    )
    with running(group):
        yield {s.name: s for s in group}


def prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def prefill_params(servers, tokens: list[int]) -> dict:
    reply = complete(servers["prefill-a"].url, tokens, 1, kv_transfer_params={"do_remote_decode": True})
    return reply["kv_transfer_params"]


def tokens_of(url: str, tokens: list[int], params: dict | None = None, n: int = 8) -> list[int]:
    return complete(url, tokens, n, kv_transfer_params=params)["choices"][0]["token_ids"]


def moved(url: str) -> float:
    return metric_sum(metrics(url), SOURCE, source="external_kv_transfer")


def rejected(url: str, reason: str) -> float:
    return sum(v for s, v in metrics(url).items() if s.startswith(REJECTED + "{") and f'reason="{reason}"' in s)


def log_text(server: VllmServer) -> str:
    return server.log_path.read_text(errors="replace") if server.log_path and server.log_path.exists() else ""


def test_the_same_model_loads_the_prefills_kv(servers):
    """The control: equal fingerprints, the KV is loaded and the tokens are the prefill model's."""
    decode = servers["decode-a"]
    tokens = prompt(1)
    params = prefill_params(servers, tokens)
    parts = params["remote_model"].split(".")  # one 8-hex digest per fingerprint part
    assert len(parts) == 5 and all(len(part) == 8 for part in parts), params["remote_model"]
    before = moved(decode.url)
    assert tokens_of(decode.url, tokens, params) == tokens_of(servers["prefill-a"].url, tokens)
    assert moved(decode.url) > before


def test_the_two_models_really_differ(servers):
    """The oracle: the same prompt continues differently on models A and B, so KV of A read by B would be wrong."""
    tokens = prompt(2)
    assert tokens_of(servers["decode-b"].url, tokens) != tokens_of(servers["prefill-a"].url, tokens)


def test_other_weights_are_refused_by_the_signed_params(servers):
    decode = servers["decode-b"]
    tokens = prompt(3)
    params = prefill_params(servers, tokens)
    before, loaded = rejected(decode.url, "model"), moved(decode.url)
    with pytest.raises(RequestFailed):
        tokens_of(decode.url, tokens, params)
    deadline = time.monotonic() + 10
    while rejected(decode.url, "model") < before + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rejected(decode.url, "model") == before + 1
    assert moved(decode.url) == loaded, "no KV may be loaded for a refused request"


def test_other_weights_are_refused_at_the_handshake_naming_the_fingerprint(servers):
    """Params that name no fingerprint (re-signed with the key, as an older prefill's would be): decode B connects,
    and the handshake refuses the prefill naming model_fingerprint and its weights part. The control: decode A
    takes the same params."""
    decode = servers["decode-b"]
    tokens = prompt(4)
    done = msgspec.structs.replace(parse_prefill_done(prefill_params(servers, tokens)), remote_model="")
    unnamed = done.signed(KEY).to_dict()
    loaded = moved(decode.url)
    with pytest.raises(RequestFailed):
        tokens_of(decode.url, tokens, unnamed)
    deadline = time.monotonic() + 10
    while "model_fingerprint" not in log_text(decode) and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = [line for line in log_text(decode).splitlines() if "model_fingerprint" in line]
    assert lines and "weights" in lines[0], lines[:2]
    assert "config" not in lines[0].split("model_fingerprint", 1)[1]  # equal geometry and config: only weights differ
    assert moved(decode.url) == loaded
    control = msgspec.structs.replace(parse_prefill_done(prefill_params(servers, tokens)), remote_model="")
    assert tokens_of(servers["decode-a"].url, tokens, control.signed(KEY).to_dict()) == tokens_of(
        servers["prefill-a"].url, tokens
    )
