"""Data parallelism on both sides in real vLLM: a prefill server with DP=2 and a decode server with DP=2.

vLLM runs each DP rank of a dense model as its own engine (engine id suffixed `_dp<rank>`); the prefill
response names its rank (`remote_dp_rank`) and the decode side derives that engine's side-channel ports.
Prefill requests are sent concurrently so both prefill engines serve some; decode requests are concurrent too.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

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

pytestmark = pytest.mark.vllm


def kv(role: str) -> dict:
    return kvbridge_config(role, side_channel_port=free_base_port(2))


def test_dp2_prefill_to_dp2_decode(tmp_path, tiny_model):
    model = tiny_model
    dp2 = ["--data-parallel-size", "2"]
    prefill = VllmServer(
        model,
        port=free_port(),
        kv_transfer_config=kv("kv_producer"),
        cpu_bind="0|0",
        extra_args=dp2,
        name="prefill-dp2",
        log_path=tmp_path / "prefill.log",
    )
    decode = VllmServer(
        model,
        port=free_port(),
        kv_transfer_config=kv("kv_consumer"),
        cpu_bind="1|1",
        extra_args=dp2,
        name="decode-dp2",
        log_path=tmp_path / "decode.log",
    )
    with running((prefill, decode)), ThreadPoolExecutor(8) as pool:
        rng = random.Random(3)
        prompts = [[rng.randrange(1, 1000) for _ in range(140 + 25 * i)] for i in range(8)]
        firsts = list(
            pool.map(lambda p: complete(prefill.url, p, 1, kv_transfer_params={"do_remote_decode": True}), prompts)
        )
        params = [f["kv_transfer_params"] for f in firsts]
        assert {p["remote_dp_rank"] for p in params} == {0, 1}, "both prefill DP engines should have served"
        before = metrics(decode.url)
        outputs = list(
            pool.map(
                lambda pp: complete(decode.url, pp[0], 8, kv_transfer_params=pp[1])["choices"][0]["token_ids"],
                zip(prompts, params, strict=True),
            )
        )
        after = metrics(decode.url)
        for prompt, tokens in zip(prompts, outputs, strict=True):
            assert tokens == complete(prefill.url, prompt, 8)["choices"][0]["token_ids"]
        source = "vllm:prompt_tokens_by_source_total"
        moved = metric_sum(after, source, source="external_kv_transfer") - metric_sum(
            before, source, source="external_kv_transfer"
        )
        assert moved == sum(len(p) for p in prompts)
