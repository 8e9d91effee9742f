"""End to end in real vLLM (CPU): prefill and decode with different block sizes, both directions.

Two `kv_both` servers of the tiny Qwen2 (4 KV heads x 32, float32, CPU_ATTN's vec kernel): `small` with blocks of
32 tokens (pp=1) and `large` with blocks of 128 (tp=2). (CPU_ATTN takes multiples of 32 only: vLLM 0.32 refuses
16 with "No common block size for 16"; tests/unit/test_token_runs.py covers 16 and other ratios against vLLM's own
vec16 cache writer.) kvbridge maps token ranges,
not block ids (`core.token_runs`): each prompt token is copied from its prefill block and offset to its decode
block and offset, where CPU_ATTN's pages keep it (K channel-major, V token-major).

With KVBRIDGE_TTFT_OUT=path (a file or a directory) each direction's PD and aggregated TTFT are written there.

Each direction checks that the decode server's greedy output equals its own aggregated output and that it counts
every prompt token as transferred (`external_kv_transfer`), none computed, and that exactly the prompt's tokens
moved (`vllm:kvbridge_bytes_total`). Prompts of 150 and 300 tokens end inside a block on both sides. Negative
control: the prefill's block ids shifted by one in the params (a wrong token -> block mapping: the first block's
tokens twice, the last block's lost), from a prefill whose claims do not bind the block order (`check_blocks` off;
the default refuses such params), change the output. (A mere rotation does not: the last prompt token attends to
every cached token, and the keys carry their positions (RoPE), so the order the cache holds whole tokens in is
invisible but for the last block's unused tail.)

MLA is not run here: vLLM's CPU MLA backend forces block 16 on every server (no AMX on these machines), so its
block sizes cannot differ; tests/unit/test_token_runs.py covers its geometry.
"""

from __future__ import annotations

import pytest

from kvbridge.serving.launcher import complete, metrics, running
from support.e2e_support import (
    SOURCE,
    UNCHECKED,
    Place,
    delta,
    disaggregated,
    layout_servers,
    log_ttft,
    prefill_params,
    prompts,
)

pytestmark = pytest.mark.vllm

BLOCK = {"small": 32, "large": 128}
SERVERS = {  # the two never share a core; small is the negative control's prefill (its claims bind no block order)
    "small": Place(1, 1, "1", ("--block-size", "32"), kv=UNCHECKED),
    "large": Place(1, 2, "0|0", ("--block-size", "128")),
}
PROMPT_LENGTHS = (150, 300)
MAX_TOKENS = 8
TOKEN_BYTES = 4 * 4 * (32 + 32) * 4  # one token of every layer: 4 layers x 4 KV heads x (K 32 + V 32) float32


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("e2e-block-sizes")
    started = layout_servers(tiny_model, root, SERVERS, "bs-", ("--no-enable-prefix-caching",))
    with running(list(started.values())):
        yield started


@pytest.fixture(scope="module")
def batch():
    return prompts(20261216, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def aggregated(servers, batch):
    return {
        name: [complete(s.url, x, MAX_TOKENS, timeout=120)["choices"][0]["token_ids"] for x in batch]
        for name, s in servers.items()
    }


TTFT_REPORT = dict(
    family="block-sizes",
    model="tiny Qwen2 (4 layers, 4 KV heads x 32), float32; small: block 32, pp=1; large: block 128, tp=2",
    prompt_tokens=list(PROMPT_LENGTHS),
    max_tokens=MAX_TOKENS,
)
"""What this module's TTFT rows are written with (`ttft_log` in tests/e2e/conftest.py)."""


def decode(d, prompt: list[int], params: dict) -> list[int]:
    return complete(d.url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=120)["choices"][0]["token_ids"]


def test_the_servers_name_cpu_attn_pages(servers):
    """Both run with the block sizes asked, and kvbridge (this tree's, PYTHONPATH included) names CPU_ATTN pages."""
    for name, s in servers.items():
        log = s.log_path.read_text(errors="replace")
        assert f"blocks of {BLOCK[name]} tokens" in log and "pages 'cpu_attn'" in log, name


@pytest.mark.parametrize(("prefill_name", "decode_name"), [("small", "large"), ("large", "small")])
def test_different_block_sizes_output_equals_aggregated(
    servers, batch, aggregated, ttft_log, prefill_name, decode_name
):
    p, d = servers[prefill_name], servers[decode_name]
    before = metrics(d.url)
    legs = [disaggregated(p, d, prompt, MAX_TOKENS) for prompt in batch]
    after = metrics(d.url)
    for prompt, want, leg in zip(batch, aggregated[decode_name], legs, strict=True):
        assert leg.params["remote_block_size"] == BLOCK[prefill_name]
        assert len(leg.params["remote_block_ids"]) >= -(-len(prompt) // BLOCK[prefill_name])
        assert leg.tokens == want, f"{prefill_name} -> {decode_name} ({len(prompt)} tokens): {leg.tokens} != {want}"
    moved = delta(before, after, SOURCE, source="external_kv_transfer")
    computed = delta(before, after, SOURCE, source="local_compute")
    assert moved == sum(map(len, batch)) and computed == 0, (moved, computed)
    # exactly the prompt's tokens, once per (layer, KV head): not the unused tails of the last blocks
    nbytes = delta(before, after, "vllm:kvbridge_bytes_total")
    assert nbytes == TOKEN_BYTES * sum(map(len, batch)), nbytes
    log_ttft(
        ttft_log,
        f"block sizes {prefill_name} -> {decode_name}",
        p,
        d,
        batch,
        [x.ttft_s for x in legs],
        MAX_TOKENS,
        equal_to_aggregated=len(batch),
        kv_bytes=nbytes,
        blocks=f"{BLOCK[prefill_name]} -> {BLOCK[decode_name]}",
    )


def test_negative_control_a_wrong_token_to_block_mapping_changes_the_output(servers, batch, aggregated):
    p, d = servers["small"], servers["large"]
    prompt, want = batch[1], aggregated["large"][1]
    params = prefill_params(p, prompt)
    ids = params["remote_block_ids"][: -(-len(prompt) // BLOCK["small"])]
    params["remote_block_ids"] = ids[:1] + ids[:-1]  # tokens 0-31 twice, the prompt's last 32 lost
    before = metrics(d.url)
    tokens = decode(d, prompt, params)
    moved = delta(before, metrics(d.url), SOURCE, source="external_kv_transfer")
    assert moved == len(prompt)
    assert tokens != want, "KV loaded from the wrong blocks must show in the output"
