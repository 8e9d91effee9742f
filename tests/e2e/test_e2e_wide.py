"""The widest layouts of the grid in real vLLM: prefill PP=4 <-> decode TP=4 (tiny model: 4 layers, 4 KV heads).

PP=4 puts one layer on each stage; TP=4 one KV head on each rank, so every decode worker reads from every
prefill stage and every prefill stage serves four readers. Eight worker processes on two cores: slow, but the
outputs must still equal the aggregated run, with every prompt token transferred.
"""

from __future__ import annotations

import time

import pytest

from kvbridge.serving.launcher import complete, metrics
from support.e2e_support import SOURCE, Place, delta, disaggregated, prompts, seed_of

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def wide(server_pool, tiny_model):
    places = {"pp4": Place(4, 1, "0|0|0|0"), "tp4": Place(1, 4, "1|1|1|1")}
    with server_pool.layout(tiny_model, places, timeout=900) as servers:
        yield servers


@pytest.mark.parametrize(("prefill", "decode"), [("pp4", "tp4"), ("tp4", "pp4")])
def test_pp4_and_tp4_give_the_aggregated_output(wide, prefill, decode):
    p, d = wide[prefill], wide[decode]
    batch = prompts(seed_of(prefill, decode, "wide"), (200, 330))
    before = metrics(d.url)
    for prompt in batch:
        t0 = time.monotonic()
        tokens = disaggregated(p, d, prompt).tokens
        assert tokens == complete(p.url, prompt, 8)["choices"][0]["token_ids"], f"{prefill} -> {decode}"
        print(f"\n{prefill} -> {decode}: {len(prompt)} tokens in {time.monotonic() - t0:.2f} s")
    assert delta(before, metrics(d.url), SOURCE, source="external_kv_transfer") == sum(len(x) for x in batch)
