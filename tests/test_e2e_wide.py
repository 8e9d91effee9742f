"""The widest layouts of the grid in real vLLM: prefill PP=4 <-> decode TP=4 (tiny model: 4 layers, 4 KV heads).

PP=4 puts one layer on each stage; TP=4 one KV head on each rank, so every decode worker reads from every
prefill stage and every prefill stage serves four readers. Eight worker processes on two cores: slow, but the
outputs must still equal the aggregated run, with every prompt token transferred.
"""

from __future__ import annotations

import time

import pytest

from kvbridge.serving.launcher import VllmServer, complete, free_base_port, free_port, metric_sum, metrics, running
from kvbridge.serving.tiny_model import build_tiny_model
from test_e2e_vllm import SOURCE, disaggregated, kv_config, prompts, seed_of

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    model = build_tiny_model(root / "model")
    servers = {
        "pp4": VllmServer(
            model,
            port=free_port(),
            pp=4,
            cpu_bind="0|0|0|0",
            name="pp4",
            log_path=root / "pp4.log",
            kv_transfer_config=kv_config(free_base_port(4)),
        ),
        "tp4": VllmServer(
            model,
            port=free_port(),
            tp=4,
            cpu_bind="1|1|1|1",
            name="tp4",
            log_path=root / "tp4.log",
            kv_transfer_config=kv_config(free_base_port(4)),
        ),
    }
    with running(list(servers.values()), timeout=900):
        yield servers


@pytest.mark.parametrize(("prefill", "decode"), [("pp4", "tp4"), ("tp4", "pp4")])
def test_pp4_tp4(wide, prefill, decode):
    p, d = wide[prefill], wide[decode]
    batch = prompts(seed_of(prefill, decode, "wide"), (200, 330))
    before = metrics(d.url)
    for prompt in batch:
        t0 = time.monotonic()
        tokens, _params = disaggregated(p, d, prompt)
        assert tokens == complete(p.url, prompt, 8)["choices"][0]["token_ids"], f"{prefill} -> {decode}"
        print(f"\n{prefill} -> {decode}: {len(prompt)} tokens in {time.monotonic() - t0:.2f} s")
    after = metrics(d.url)
    moved = metric_sum(after, SOURCE, source="external_kv_transfer") - metric_sum(
        before, SOURCE, source="external_kv_transfer"
    )
    assert moved == sum(len(x) for x in batch)
