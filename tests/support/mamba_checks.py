"""The Mamba2 / attention hybrid's end-to-end checks (tiny NemotronH, `M*M*M*M*`, HMA on, prefix caching off),
shared by the pairs of equal TP sizes (tests/e2e/test_e2e_mamba.py) and the TP=2 pair (test_e2e_mamba_tp.py): a
pair's output and bytes, and the negative control that applies the last prompt token twice."""

from __future__ import annotations

from kvbridge.serving.launcher import VllmServer, complete, metrics
from support.e2e_support import SOURCE, delta, disaggregated, log_ttft, prefill_params

BLOCK = 128  # the attention block vLLM picks on CPU; the Mamba page is padded to the attention page
PAGE_BYTES = 4 * BLOCK * 2 * 32 * 4  # one attention block of one layer: 4 KV heads x 128 tokens x (K+V 32) float32
MAMBA_LAYERS = ATTENTION_LAYERS = 4
# One Mamba2 layer's state at tp=1: conv (conv_kernel - 1 = 3) x (intermediate 256 + 2 groups' 4 x state 16 x 2)
# and SSM (8 heads, head_dim 32, state 16), float32.
STATE_BYTES = 3 * (8 * 32 + 2 * 4 * 16) * 4 + 8 * 32 * 16 * 4

PROMPT_LENGTHS = (200, 301)
MAX_TOKENS = 8


def decode(d: VllmServer, prompt: list[int], params: dict) -> list[int]:
    return complete(d.url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=120)["choices"][0]["token_ids"]


def moved_bytes(prompt_len: int) -> int:
    """One decode instance's bytes for a prompt: the attention blocks of N-1 tokens, one state page per Mamba layer."""
    return ATTENTION_LAYERS * -(-(prompt_len - 1) // BLOCK) * PAGE_BYTES + MAMBA_LAYERS * STATE_BYTES


def check_pair(p: VllmServer, d: VllmServer, batch: list[list[int]], want: list[list[int]], ttft_log: list) -> list:
    """PD over the pair equals `want` (the decode server's aggregated output) with N-1 tokens transferred, the last
    computed, the bytes exact; the pair's TTFT row goes to `ttft_log`. Returns the legs."""
    before = metrics(d.url)
    legs = [disaggregated(p, d, prompt, MAX_TOKENS) for prompt in batch]
    after = metrics(d.url)
    for prompt, tokens, leg in zip(batch, want, legs, strict=True):
        state, attention = leg.params["remote_group_block_ids"]
        assert len(state) == 1 and len(attention) == -(-(len(prompt) - 1) // BLOCK), leg.params
        assert leg.params["remote_num_tokens"] == len(prompt) - 1  # the prefill computed N-1 tokens
        assert leg.tokens == tokens, f"{p.name} -> {d.name} ({len(prompt)} tokens): {leg.tokens} != {tokens}"
    assert delta(before, after, SOURCE, source="external_kv_transfer") == sum(len(x) - 1 for x in batch)
    assert delta(before, after, SOURCE, source="local_compute") == len(batch), "only each prompt's last token"
    moved = delta(before, after, "vllm:kvbridge_bytes_total")
    assert moved == sum(moved_bytes(len(x)) for x in batch)
    pd_s = [x.ttft_s for x in legs]
    log_ttft(
        ttft_log,
        f"Mamba2 {p.name} -> {d.name}",
        p,
        d,
        batch,
        pd_s,
        MAX_TOKENS,
        equal_to_aggregated=len(batch),
        kv_bytes=moved,
    )
    return legs


def check_last_token_twice(p: VllmServer, d: VllmServer, prompt: list[int], want: list[int]) -> None:
    """The negative control: the state after all N tokens (a prefill of the prompt plus one token computes N)
    loaded for the prompt by a decode that does not check the params' prompt, which then computes token N on top
    of it: the state has seen the last token twice, and the output must show it."""
    assert -(-len(prompt) // BLOCK) == -(-(len(prompt) - 1) // BLOCK)  # the params' blocks fit the decode's N-1
    params = prefill_params(p, [*prompt, 7])
    assert params["remote_num_tokens"] == len(prompt)
    before = metrics(d.url)
    tokens = decode(d, prompt, params)
    assert delta(before, metrics(d.url), SOURCE, source="external_kv_transfer") == len(prompt) - 1
    assert tokens != want, "a state that saw the last prompt token twice must show in the output"
