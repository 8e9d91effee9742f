"""End to end in real vLLM (CPU): disaggregated prefill/decode across different layouts, through kvbridge.

Four servers are started once for the module, each `kv_both` (it can prefill for others and decode from
others), so every pair below reuses them:

    pp2  pp=2 (workers on core 0)     pp1a pp=1 (core 1)     tp2  tp=2 (core 1)     pp1b pp=1 (core 0)

A pair's prefill and decode servers sit on different cores: while a prefill server holds a request's blocks
vLLM steps it continuously and its workers spin, which on a 2-core machine would starve a decode server
sharing the core. Each pair checks that the decode server's greedy output equals a non-disaggregated run
(the prefill server answering the same prompt on its own), and that the decode server's metrics count every
prompt token as transferred (`external_kv_transfer`) and none as computed locally.
"""

from __future__ import annotations

import json
import os
import random
import time
import zlib

import pytest

from kvbridge.serving.launcher import (
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

pytestmark = pytest.mark.vllm

SERVERS = {
    # name: (pp, tp, cores of its workers)
    "pp2": (2, 1, "0|0"),
    "pp1a": (1, 1, "1"),
    "tp2": (1, 2, "1|1"),
    "pp1b": (1, 1, "0"),
}
SOURCE = "vllm:prompt_tokens_by_source_total"


def kv_config(base_port: int, lease_s: float = 30.0) -> dict:
    # KVBRIDGE_E2E_EXTRA: more kv_connector_extra_config as JSON, e.g. the staged NIXL path:
    # '{"nixl_staging_bytes": 1048576, "nixl_staging_chunk_bytes": 65536, "nixl_staging": "always"}'
    extra = json.loads(os.environ.get("KVBRIDGE_E2E_EXTRA", "{}"))
    return kvbridge_config("kv_both", side_channel_port=base_port, lease_s=lease_s, **extra)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    model = build_tiny_model(root / "model")
    started = {
        name: VllmServer(
            model,
            port=free_port(),
            pp=pp,
            tp=tp,
            cpu_bind=cores,
            kv_transfer_config=kv_config(free_base_port(pp * tp)),
            name=name,
            log_path=root / f"{name}.log",
        )
        for name, (pp, tp, cores) in SERVERS.items()
    }
    with running(list(started.values())):
        yield started


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(n)] for n in lengths]


def seed_of(*names: str) -> int:
    """A seed per parameter set, the same on every run (str hash() changes with PYTHONHASHSEED)."""
    return zlib.crc32(" -> ".join(names).encode()) % 10_000


def disaggregated(prefill: VllmServer, decode: VllmServer, prompt: list[int], max_tokens: int = 8) -> tuple[list, dict]:
    first = complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True}, timeout=120)
    params = first["kv_transfer_params"]
    assert params and params["do_remote_prefill"] is True, first
    second = complete(decode.url, prompt, max_tokens, kv_transfer_params=params, timeout=120)
    return second["choices"][0]["token_ids"], params


PAIRS = [
    ("pp2", "pp1a"),  # prefill PP=2 -> decode PP=1: vLLM's NixlConnector fails here
    ("pp1a", "pp2"),  # decode PP=2: NixlConnector refuses
    ("tp2", "pp1b"),  # TP=2 -> TP=1
    ("pp2", "tp2"),  # PP=2 -> TP=2
    ("tp2", "pp2"),  # TP=2 -> PP=2
]


@pytest.mark.parametrize(("prefill", "decode"), PAIRS)
def test_disaggregated_output_equals_aggregated(servers, prefill, decode):
    p, d = servers[prefill], servers[decode]
    batch = prompts(seed_of(prefill, decode), (150, 300))
    before = metrics(d.url)
    outputs = []
    for prompt in batch:
        t0 = time.monotonic()
        tokens, params = disaggregated(p, d, prompt)
        outputs.append((tokens, time.monotonic() - t0, params))
    after = metrics(d.url)
    for prompt, (tokens, _, params) in zip(batch, outputs, strict=True):
        assert params["remote_layout"].startswith(f"pp={SERVERS[prefill][0]},tp={SERVERS[prefill][1]}")
        reference = complete(p.url, prompt, 8)["choices"][0]["token_ids"]
        assert tokens == reference, f"{prefill} -> {decode}: disaggregated {tokens} != aggregated {reference}"
    moved = metric_sum(after, SOURCE, source="external_kv_transfer") - metric_sum(
        before, SOURCE, source="external_kv_transfer"
    )
    computed = metric_sum(after, SOURCE, source="local_compute") - metric_sum(before, SOURCE, source="local_compute")
    assert moved == sum(len(x) for x in batch), "the decode server did not load every prompt token through kvbridge"
    assert computed == 0, f"the decode server recomputed {computed} prompt tokens"


def test_bad_params_fall_back_to_local_prefill(servers):
    """A decode request whose kv_transfer_params are wrong is prefilled locally, with the right output."""
    p, d = servers["pp2"], servers["pp1a"]
    (prompt,) = prompts(7, (200,))
    good = complete(p.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    bad = dict(good, remote_block_ids="not a list")
    before = metrics(d.url)
    tokens = complete(d.url, prompt, 8, kv_transfer_params=bad)["choices"][0]["token_ids"]
    after = metrics(d.url)
    assert tokens == complete(p.url, prompt, 8)["choices"][0]["token_ids"]
    assert metric_sum(after, SOURCE, source="external_kv_transfer") == metric_sum(
        before, SOURCE, source="external_kv_transfer"
    )
    assert metric_sum(after, SOURCE, source="local_compute") > metric_sum(before, SOURCE, source="local_compute")
