"""End to end in real vLLM (CPU): the Mamba2 / attention hybrid of tests/e2e/test_e2e_mamba.py (tiny NemotronH,
`M*M*M*M*`, HMA on, prefix caching off) between two tp=2 servers.

kvbridge moves Mamba state only between equal TP sizes (no conv/SSM resharding: pp2 -> tp2 and tp2 -> pp2 are
refused at startup, tests/e2e/test_e2e_startup_refusals.py), so this is the pair with TP > 1: each decode TP rank
copies its own shard of every state page (conv state and SSM state split over the Mamba heads and groups) and of
the attention blocks (2 of the 4 KV heads) from the prefill worker of the same TP rank. A module of its own so that
its two servers (4 workers) run after test_e2e_mamba.py's three have stopped, not beside them:

    tp2a tp=2 (core 0)     tp2b tp=2 (core 1, check_prompt off: the negative control's decode)

The checks are test_e2e_mamba.py's (`support.mamba_checks`): the decode server's greedy output equals its own
aggregated output, every prompt token but the last is `external_kv_transfer` and one per prompt `local_compute`,
and the bytes moved are the attention blocks of N-1 tokens plus one state page per Mamba layer (the two ranks'
shards add up to the tp=1 page).
Negative control: the state after N tokens loaded for the prompt (the last token applied twice) changes the output.

With KVBRIDGE_TTFT_OUT=path (a file or a directory) the pair's PD and aggregated TTFT are written there as JSON.
"""

from __future__ import annotations

import pytest

from kvbridge.serving.launcher import complete, running
from kvbridge.testing.tiny_models import build_tiny_nemotron_h
from support.e2e_support import Place, layout_servers, prompts
from support.mamba_checks import MAX_TOKENS, PROMPT_LENGTHS, check_last_token_twice, check_pair

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


TTFT_REPORT = dict(
    family="mamba2-tp",
    model="tiny NemotronH (M*M*M*M*: 4 Mamba2 + 4 attention layers), float32, HMA on, prefix caching off",
    prompt_tokens=list(PROMPT_LENGTHS),
    max_tokens=MAX_TOKENS,
)
"""What this module's TTFT rows are written with (`ttft_log` in tests/e2e/conftest.py)."""


def test_every_worker_runs_a_state_group_beside_the_attention_group(servers):
    for s in servers.values():
        log = s.log_path.read_text(errors="replace")
        assert "Turning off hybrid kv cache manager" not in log
        lines = [x for x in log.splitlines() if "kvbridge worker" in x and "KV-cache groups" in x]
        assert len(lines) == 2 and all("2 KV-cache groups" in x for x in lines), lines


def test_mamba_tp2_to_tp2_output_equals_aggregated(servers, batch, aggregated, ttft_log):
    legs = check_pair(servers["tp2a"], servers["tp2b"], batch, aggregated, ttft_log)
    assert all(leg.params["remote_layout"].startswith("pp=1,tp=2") for leg in legs), [x.params for x in legs]


def test_mamba_tp_negative_control_the_last_token_applied_twice_changes_the_output(servers, batch, aggregated):
    """The oracle can fail with TP-sharded state too (`check_last_token_twice`; tp2b does not check the params'
    prompt)."""
    check_last_token_twice(servers["tp2a"], servers["tp2b"], batch[0], aggregated[0])
