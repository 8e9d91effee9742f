"""The end-to-end check `make test` runs: prompts disaggregated from a prefill server with PP=2 to a decode server
with TP=2 (real vLLM, real NIXL between the processes), on the run's shared servers (`server_pool`: the pp2 and tp2
servers of `e2e_support.FOUR`, taken over from test_e2e_vllm.py when both run). The decode's greedy output equals
the prefill server's own, and every prompt token reached the decode through kvbridge, none computed there."""

from __future__ import annotations

import pytest

from kvbridge.serving.launcher import complete, metrics
from support.e2e_support import FOUR, SOURCE, delta, disaggregated, prompts, seed_of

pytestmark = [pytest.mark.vllm, pytest.mark.smoke]


@pytest.fixture(scope="module")
def pair(server_pool, tiny_model):
    with server_pool.layout(tiny_model, {name: FOUR[name] for name in ("pp2", "tp2")}) as servers:
        yield servers["pp2"], servers["tp2"]


def test_a_pp2_prefill_feeds_a_tp2_decode_the_aggregated_output(pair):
    prefill, decode = pair
    batch = prompts(seed_of("smoke", "pp2", "tp2"), (150, 260))
    before = metrics(decode.url)
    for prompt in batch:
        leg = disaggregated(prefill, decode, prompt)
        assert leg.params["remote_layout"].startswith(FOUR["pp2"].layout)
        assert leg.tokens == complete(prefill.url, prompt, 8)["choices"][0]["token_ids"]
    after = metrics(decode.url)
    assert delta(before, after, SOURCE, source="external_kv_transfer") == sum(len(p) for p in batch)
    assert delta(before, after, SOURCE, source="local_compute") == 0


def test_each_prefill_worker_takes_holds_from_the_schedulers_feed(pair):
    """Both pp2 workers subscribed to the hold feed the scheduler announced in the step metadata (wire/hold_feed.py),
    so holds reach them as requests finish, not a step or two later."""
    prefill, decode = pair
    disaggregated(prefill, decode, prompts(seed_of("smoke-feed"), (40,))[0])  # a step with metadata ran
    log = prefill.log_path.read_text(errors="replace")
    subscribed = {
        line.split("prefill worker ")[1].split(":")[0] for line in log.splitlines() if "scheduler's feed" in line
    }
    assert len(subscribed) == 2, log[-3000:]
