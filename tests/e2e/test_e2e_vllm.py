"""End to end in real vLLM (CPU): disaggregated prefill/decode across different layouts, through kvbridge.

The four `kv_both` servers of `e2e_support.FOUR` (pp2, pp1a, tp2, pp1b; a pair's two on different cores) come from
the run's server pool (started once; test_e2e_vllm_smoke.py, which runs next, reuses two of them). Each pair checks
that the decode server's greedy output equals a non-disaggregated run (the prefill server answering the same
prompt on its own), and that the decode server's metrics count every prompt token as transferred
(`external_kv_transfer`) and none as computed locally.

With KVBRIDGE_TTFT_OUT=path (a file or a directory) each pair's PD and aggregated TTFT are written there as JSON.
"""

from __future__ import annotations

import json
import os

import pytest

from kvbridge.serving.launcher import RequestFailed, complete, metrics
from support.e2e_support import (
    FOUR,
    SOURCE,
    delta,
    disaggregated,
    log_ttft,
    prefill_params,
    prompts,
    seed_of,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def servers(server_pool, tiny_model):
    # KVBRIDGE_E2E_EXTRA: more kv_connector_extra_config as JSON, e.g. the staged NIXL path:
    # '{"nixl_staging_bytes": 1048576, "nixl_staging_chunk_bytes": 65536, "nixl_staging": "always"}'
    extra = json.loads(os.environ.get("KVBRIDGE_E2E_EXTRA", "{}"))
    with server_pool.layout(tiny_model, FOUR, kv=extra) as started:
        yield started


TTFT_REPORT = dict(
    family="plain",
    model="tiny Qwen2 (4 layers, 4 KV heads x 32), float32, block 128",
    prompt_tokens=[150, 300],
    max_tokens=8,
    staged_extra=os.environ.get("KVBRIDGE_E2E_EXTRA", ""),
)
"""What this module's TTFT rows are written with (`ttft_log` in tests/e2e/conftest.py)."""


PAIRS = [
    ("pp2", "pp1a"),  # prefill PP=2 -> decode PP=1: vLLM's NixlConnector fails here
    ("pp1a", "pp2"),  # decode PP=2: NixlConnector refuses
    ("tp2", "pp1b"),  # TP=2 -> TP=1
    ("pp2", "tp2"),  # PP=2 -> TP=2
    ("tp2", "pp2"),  # TP=2 -> PP=2
]


@pytest.mark.parametrize(("prefill", "decode"), PAIRS)
def test_disaggregated_output_equals_aggregated(servers, ttft_log, prefill, decode):
    p, d = servers[prefill], servers[decode]
    batch = prompts(seed_of(prefill, decode), (150, 300))
    before = metrics(d.url)
    outputs = [disaggregated(p, d, prompt) for prompt in batch]
    after = metrics(d.url)
    for prompt, leg in zip(batch, outputs, strict=True):
        assert leg.params["remote_layout"].startswith(FOUR[prefill].layout)
        reference = complete(p.url, prompt, 8)["choices"][0]["token_ids"]
        assert leg.tokens == reference, f"{prefill} -> {decode}: disaggregated {leg.tokens} != aggregated {reference}"
    moved = delta(before, after, SOURCE, source="external_kv_transfer")
    computed = delta(before, after, SOURCE, source="local_compute")
    assert moved == sum(len(x) for x in batch), "the decode server did not load every prompt token through kvbridge"
    assert computed == 0, f"the decode server recomputed {computed} prompt tokens"
    pd_s = [x.ttft_s for x in outputs]
    log_ttft(ttft_log, f"plain {prefill} -> {decode}", p, d, batch, pd_s, 8, equal_to_aggregated=len(batch))


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
    assert delta(before, after, SOURCE, source="external_kv_transfer") == 0
    assert delta(before, after, SOURCE, source="local_compute") > 0


def test_reordered_blocks_are_refused_without_a_key(servers):
    """Keyless params with their block list reversed (without the digest check: HTTP 200, the KV of other
    positions, and that wrong KV then cached under the prompt by the decode's prefix cache): the prefill's claim
    check refuses them (the list's digest is not the one it published), so the request fails visibly (vLLM's
    default kv_load_failure_policy, "fail"), nothing is loaded, and a later plain request for the prompt is right.
    The negative controls of tests/e2e/test_e2e_fp8.py, _hma.py and _mla.py turn the check off on their prefill and
    show what such a load does to the output."""
    p, d = servers["pp2"], servers["pp1a"]
    (prompt,) = prompts(8, (300,))
    params = prefill_params(p, prompt)
    assert len(params["remote_block_ids"]) > 1
    before = metrics(d.url)
    edited = dict(params, remote_block_ids=params["remote_block_ids"][::-1])
    with pytest.raises(RequestFailed) as failed:
        complete(d.url, prompt, 8, kv_transfer_params=edited)
    assert failed.value.status >= 500
    after = metrics(d.url)
    assert delta(before, after, SOURCE, source="external_kv_transfer") == 0
    reference = complete(p.url, prompt, 8)["choices"][0]["token_ids"]
    assert complete(d.url, prompt, 8)["choices"][0]["token_ids"] == reference, "the decode cached wrong KV"
