"""End to end in real vLLM (CPU): the Mamba2 / attention hybrid of tests/test_e2e_mamba.py (tiny NemotronH,
`M*M*M*M*`, HMA on, prefix caching off) between two tp=2 servers.

kvbridge moves Mamba state only between equal TP sizes (no conv/SSM resharding: pp2 -> tp2 and tp2 -> pp2 are
refused at startup, tests/test_e2e_startup_refusals.py), so this is the pair with TP > 1: each decode TP rank
copies its own shard of every state page (conv state and SSM state split over the Mamba heads and groups) and of
the attention blocks (2 of the 4 KV heads) from the prefill worker of the same TP rank. A module of its own so that
its two servers (4 workers) run after test_e2e_mamba.py's three have stopped, not beside them:

    tp2a tp=2 (core 0)     tp2b tp=2 (core 1, check_prompt off: the negative control's decode)

The checks are test_e2e_mamba.py's: the decode server's greedy output equals its own aggregated output, every prompt
token but the last is `external_kv_transfer` and one per prompt `local_compute`, and the bytes moved are the
attention blocks of N-1 tokens plus one state page per Mamba layer (the two ranks' shards add up to the tp=1 page).
Negative control: the state after N tokens loaded for the prompt (the last token applied twice) changes the output.

With KVBRIDGE_TTFT_OUT=path (a file or a directory) the pair's PD and aggregated TTFT are written there as JSON.
"""

from __future__ import annotations

import pytest

from e2e_support import (
    SOURCE,
    Place,
    aggregated_leg,
    delta,
    disaggregated,
    layout_servers,
    prompts,
    ttft_row,
    write_ttft_report,
)
from kvbridge.serving.launcher import complete, metrics, running
from kvbridge.testing.tiny_models import build_tiny_nemotron_h
from test_e2e_mamba import BLOCK, MAX_TOKENS, PROMPT_LENGTHS, moved_bytes

pytestmark = pytest.mark.vllm

SERVERS = {"tp2a": Place(1, 2, "0|0"), "tp2b": Place(1, 2, "1|1", kv={"check_prompt": False})}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e-mamba-tp")


@pytest.fixture(scope="module")
def servers(root):
    model = build_tiny_nemotron_h(root / "nemotron-h")
    started = layout_servers(
        model,
        root,
        SERVERS,
        prefix="mamba-",
        args=("--no-enable-prefix-caching",),
        kv={"peer_tp": 2},
        max_model_len=1024,
    )
    with running(list(started.values())):
        yield started


@pytest.fixture(scope="module")
def batch():
    return prompts(20261201, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def aggregated(servers, batch):
    """The decode server's own greedy output for each prompt, no connector involved in the request."""
    out = [complete(servers["tp2b"].url, x, MAX_TOKENS, timeout=120)["choices"][0]["token_ids"] for x in batch]
    assert all(len(set(tokens)) > 1 for tokens in out), out  # not degenerate
    return out


@pytest.fixture(scope="module")
def ttft_log():
    rows: list[dict] = []
    yield rows
    write_ttft_report(
        rows,
        family="mamba2-tp",
        model="tiny NemotronH (M*M*M*M*: 4 Mamba2 + 4 attention layers), float32, HMA on, prefix caching off",
        prompt_tokens=list(PROMPT_LENGTHS),
        max_tokens=MAX_TOKENS,
    )


def test_every_worker_runs_a_state_group_beside_the_attention_group(servers):
    for s in servers.values():
        log = s.log_path.read_text(errors="replace")
        assert "Turning off hybrid kv cache manager" not in log
        lines = [x for x in log.splitlines() if "kvbridge worker" in x and "KV-cache groups" in x]
        assert len(lines) == 2 and all("2 KV-cache groups" in x for x in lines), lines


def test_mamba_tp2_to_tp2_output_equals_aggregated(servers, batch, aggregated, ttft_log):
    p, d = servers["tp2a"], servers["tp2b"]
    before = metrics(d.url)
    legs = [disaggregated(p, d, prompt, MAX_TOKENS) for prompt in batch]
    after = metrics(d.url)
    for prompt, want, leg in zip(batch, aggregated, legs, strict=True):
        state, attention = leg.params["remote_group_block_ids"]
        assert len(state) == 1 and len(attention) == -(-(len(prompt) - 1) // BLOCK), leg.params
        assert leg.params["remote_num_tokens"] == len(prompt) - 1  # the prefill computed N-1 tokens
        assert leg.params["remote_layout"].startswith("pp=1,tp=2"), leg.params
        assert leg.tokens == want, f"tp2 -> tp2 ({len(prompt)} tokens): {leg.tokens} != {want}"
    assert delta(before, after, SOURCE, source="external_kv_transfer") == sum(len(x) - 1 for x in batch)
    assert delta(before, after, SOURCE, source="local_compute") == len(batch), "only each prompt's last token"
    moved = delta(before, after, "vllm:kvbridge_bytes_total")
    assert moved == sum(moved_bytes(len(x)) for x in batch)
    alone = [aggregated_leg(d, prompt, MAX_TOKENS)[1] for prompt in batch]
    row = ttft_row(p, d, [x.ttft_s for x in legs], alone, equal_to_aggregated=len(batch), kv_bytes=moved)
    print(f"Mamba2 tp2 -> tp2: TTFT ms {row['ttft_ms']}, aggregated {row['aggregated_ttft_ms']}")
    ttft_log.append(row)


def test_mamba_tp_negative_control_the_last_token_applied_twice_changes_the_output(servers, batch, aggregated):
    """The oracle can fail with TP-sharded state too: the state after all N tokens (a prefill of the prompt plus
    one token) loaded for the prompt by a decode that does not check the params' prompt (tp2b) sees the last
    token twice."""
    p, d = servers["tp2a"], servers["tp2b"]
    prompt, want = batch[0], aggregated[0]
    assert -(-len(prompt) // BLOCK) == -(-(len(prompt) - 1) // BLOCK)  # the params' blocks fit the decode's N-1
    first = complete(p.url, [*prompt, 7], 1, kv_transfer_params={"do_remote_decode": True}, timeout=120)
    params = first["kv_transfer_params"]
    assert params["remote_num_tokens"] == len(prompt)
    before = metrics(d.url)
    tokens = complete(d.url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=120)["choices"][0]["token_ids"]
    assert delta(before, metrics(d.url), SOURCE, source="external_kv_transfer") == len(prompt) - 1
    assert tokens != want, "a state that saw the last prompt token twice must show in the output"
