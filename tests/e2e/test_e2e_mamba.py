"""End to end in real vLLM (CPU): a Mamba2 / attention hybrid (tiny NemotronH, `M*M*M*M*`: Mamba2 layers 0, 2, 4,
6 and attention layers 1, 3, 5, 7), vLLM's hybrid KV-cache manager on, prefix caching off (`mamba_cache_mode`
"none": one running-state block per request).

The cache is two KV-cache groups aliasing one pool: the Mamba layers' state pages (conv state + SSM state, opaque
bytes padded to the attention page) and the attention layers' KV blocks. A Mamba state covers every token it has
seen, and vLLM's decode recomputes the last prompt token after a load, so the prefill computes N-1 of a prompt's N
tokens (kvbridge drops the last one when the request arrives) and the decode loads those N-1 and computes the
last: each state page is copied whole, from the prefill worker of the same TP rank, whatever the PP sizes.

Three `kv_both` kvbridge servers are started once for the module, a pair's two servers on different cores:

    pp2  pp=2 (core 0)     pp1a pp=1 (core 1)     pp1b pp=1 (core 0, check_prompt off: the negative control)

Each pair checks that the decode server's greedy output equals its own aggregated output, that every prompt token
but the last is counted as transferred (`external_kv_transfer`) and one per prompt computed, and the bytes moved
(`vllm:kvbridge_bytes_total`): every attention block of N-1 tokens plus one state page per Mamba layer. Negative
control: the state of N tokens (a prefill of the prompt plus one token) loaded for the prompt, so that the decode
applies the last token to it a second time, changes the output. pp2->tp2 and tp2->pp2 cannot run: kvbridge moves
Mamba state only between equal TP sizes (a tp=2 server told its peers are tp=1 is refused at startup:
tests/e2e/test_e2e_startup_refusals.py); tp2 -> tp2 is tests/e2e/test_e2e_mamba_tp.py.

With KVBRIDGE_TTFT_OUT=path (a file or a directory) each pair's PD and aggregated TTFT are written there as JSON.
"""

from __future__ import annotations

import random

import pytest

from kvbridge.serving.launcher import (
    VllmServer,
    complete,
    free_base_port,
    free_port,
    kvbridge_config,
    running,
)
from kvbridge.testing.tiny_models import build_tiny_nemotron_h
from support.e2e_support import prefill_params
from support.mamba_checks import MAX_TOKENS, PROMPT_LENGTHS, check_last_token_twice, check_pair, decode

pytestmark = pytest.mark.vllm

SERVERS = {
    # name: (pp, cores of its workers, check_prompt)
    "pp2": (2, "0|0", True),
    "pp1a": (1, "1", True),
    "pp1b": (1, "0", False),
}
PAIRS = [
    ("pp1a", "pp1b"),  # pp1 -> pp1
    ("pp2", "pp1a"),  # pp2 -> pp1
    ("pp1a", "pp2"),  # pp1 -> pp2
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e-mamba")


@pytest.fixture(scope="module")
def model(root):
    return build_tiny_nemotron_h(root / "nemotron-h")


@pytest.fixture(scope="module")
def batch():
    rng = random.Random(20261201)
    return [[rng.randrange(1, 1000) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def servers(root, model):
    started = {
        name: VllmServer(
            model,
            port=free_port(),
            pp=pp,
            cpu_bind=cores,
            max_model_len=1024,
            extra_args=("--no-enable-prefix-caching",),
            kv_transfer_config=kvbridge_config(
                "kv_both", side_channel_port=free_base_port(pp), lease_s=30.0, peer_tp=1, check_prompt=check
            ),
            name=f"mamba-{name}",
            log_path=root / f"{name}.log",
        )
        for name, (pp, cores, check) in SERVERS.items()
    }
    with running(list(started.values())):
        yield started


@pytest.fixture(scope="module")
def aggregated(servers, batch):
    """Each server's own greedy output for each prompt, no connector involved in the request."""
    out = {
        name: [complete(s.url, x, MAX_TOKENS, timeout=120)["choices"][0]["token_ids"] for x in batch]
        for name, s in servers.items()
    }
    assert all(len(set(tokens)) > 1 for outputs in out.values() for tokens in outputs), out  # not degenerate
    return out


TTFT_REPORT = dict(
    family="mamba2",
    model="tiny NemotronH (M*M*M*M*: 4 Mamba2 + 4 attention layers), float32, HMA on, prefix caching off",
    prompt_tokens=list(PROMPT_LENGTHS),
    max_tokens=MAX_TOKENS,
)
"""What this module's TTFT rows are written with (`ttft_log` in tests/e2e/conftest.py)."""


def test_the_servers_run_a_state_group_beside_the_attention_group(servers):
    for s in servers.values():
        log = s.log_path.read_text(errors="replace")
        assert "Turning off hybrid kv cache manager" not in log
        lines = [x for x in log.splitlines() if "kvbridge worker" in x and "KV-cache groups" in x]
        assert lines and all("2 KV-cache groups" in x for x in lines), lines


@pytest.mark.parametrize(("prefill_name", "decode_name"), PAIRS)
def test_mamba_disaggregated_output_equals_aggregated(servers, batch, aggregated, ttft_log, prefill_name, decode_name):
    check_pair(servers[prefill_name], servers[decode_name], batch, aggregated[decode_name], ttft_log)


def test_mamba_negative_control_the_last_token_applied_twice_changes_the_output(servers, batch, aggregated):
    """The oracle can fail (`check_last_token_twice`, pp1a -> pp1b, whose decode does not check the params'
    prompt); the same decode with the N-1 state gives the aggregated output."""
    p, d = servers["pp1a"], servers["pp1b"]
    prompt, want = batch[0], aggregated["pp1b"][0]
    check_last_token_twice(p, d, prompt, want)
    assert decode(d, prompt, prefill_params(p, prompt)) == want
