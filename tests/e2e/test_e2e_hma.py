"""End to end in real vLLM (CPU): a sliding-window hybrid with vLLM's hybrid KV-cache manager (HMA) on.

The model is a tiny Llama whose layers alternate sliding-window (window 64) and full attention. kvbridge is
`SupportsHMA`, so vLLM keeps HMA on: the KV cache is two groups (sliding layers 0 and 2, full layers 1 and 3)
aliasing one pool, each with its own block table per request; a sliding-window group holds only the blocks its
window still needs (null block 0 in place of the others). Prompts of 300 and 457 tokens at block 32 are 10 and
15 blocks; the sliding group holds 3 of them. Each layer is copied with its own group's blocks, the sliding
layers only their in-window blocks.

The four `kv_both` servers of `e2e_support.FOUR` (pp2, pp1a, tp2, pp1b; a pair's two on different cores) are
started once for the module; pp1b with prefix caching on (the others off). Every request carries a `cache_salt`
naming its check (both legs of a disaggregated one: kvbridge binds its params to the salt), so that no check hits
blocks another one left in pp1b's prefix cache unless it means to.

Each pair checks that the decode server's greedy output equals its own aggregated output, that it counts every
prompt token as transferred (`external_kv_transfer`) and none as computed, and that it moved exactly the in-window
blocks of the sliding layers and every block of the full layers (`vllm:kvbridge_bytes_total`). The same checks
run on prompts at and around the window and block boundaries (63, 64, 65 = window - 1, window, window + 1;
95, 96, 97 = 3 blocks - 1, + 0, + 1; 127, 128), on pp1 -> pp1 and pp2 -> tp2: 95 and 127 are lengths whose window
starts at a block's first token. Prefix caching on the decode side (tp2 -> pp1b): a second request extending the
first one's prompt hits its full blocks in pp1b's prefix cache (both groups), loads only the rest, and its output is
still pp1b's aggregated one. Negative controls: the sliding group's blocks loaded in the wrong order change the
output; params that lack a block the decode's window needs are refused
(`vllm:kvbridge_rejected_params_total{reason="blocks"}`), never read.

With KVBRIDGE_TTFT_OUT=path (a file or a directory) each pair's PD and aggregated TTFT are written there as JSON.

With KVBRIDGE_HMA_MEMORY=1 an aggregated server with HMA off is started too and the KV-cache capacity vLLM logs
with HMA on and off is printed (the figures are in the README).
"""

from __future__ import annotations

import contextlib
import os
import re

import pytest

from kvbridge.core.groups import CacheGroup
from kvbridge.serving.launcher import complete, metrics, running
from kvbridge.testing.tiny_models import build_tiny_sliding_llama
from support.e2e_support import (
    FOUR,
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

NUM_LAYERS = 4
WINDOW = 64
BLOCK = 32
PAGE_BYTES = 4 * BLOCK * 2 * 32 * 4  # one block of one layer: 4 KV heads x 32 tokens x (K 32 + V 32) float32
SLIDING, FULL = CacheGroup(BLOCK, WINDOW), CacheGroup(BLOCK)
PAIRS = [
    ("pp1a", "pp1b"),  # pp1 -> pp1
    ("pp2", "tp2"),  # pp2 -> tp2
    ("tp2", "pp2"),  # tp2 -> pp2
    ("tp2", "pp1b"),  # tp2 -> tp1
    ("pp2", "pp1a"),  # pp2 -> pp1
]
# Longer than the window: the sliding group holds 3 of 10 and 3 of 15 blocks. Lengths whose window starts at a
# block's first token ((n - WINDOW + 1) % BLOCK == 0: 95, 127) are among BOUNDARY_LENGTHS.
PROMPT_LENGTHS = (300, 457)
# At and around the window and block boundaries, on two pairs: 95 and 127 are such lengths (window 64, block 32).
BOUNDARY_LENGTHS = (63, 64, 65, 95, 96, 97, 127, 128)
BOUNDARY_PAIRS = [("pp1a", "pp1b"), ("pp2", "tp2")]
MAX_TOKENS = 8
ARGS = ("--no-enable-prefix-caching",)
SERVER = {"block_size": BLOCK, "max_model_len": 1024}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e-hma")


@pytest.fixture(scope="module")
def model(root):
    return build_tiny_sliding_llama(root / "model", num_layers=NUM_LAYERS, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def batch():
    return prompts(20261201, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def servers(root, model):
    places = {
        **FOUR,
        "pp2": FOUR["pp2"].but(kv=UNCHECKED),  # the negative control's prefill
        "pp1b": FOUR["pp1b"].but(args=("--enable-prefix-caching",)),  # the prefix-cache check's decode
    }
    started = layout_servers(model, root, places, prefix="hma-", args=ARGS, **SERVER)
    with running(list(started.values())):
        yield started


@pytest.fixture(scope="module")
def aggregated(servers, batch):
    """Each server's own greedy output for each prompt, no connector involved in the request."""
    return {name: [answer(s, x, "aggregated") for x in batch] for name, s in servers.items()}


TTFT_REPORT = dict(
    family="hma",
    model=f"tiny Llama, {NUM_LAYERS} layers alternating sliding (window {WINDOW}) / full, float32, block {BLOCK}",
    prompt_tokens=list(PROMPT_LENGTHS),
    max_tokens=MAX_TOKENS,
)
"""What this module's TTFT rows are written with (`ttft_log` in tests/e2e/conftest.py)."""


def answer(s, prompt: list[int], salt: str) -> list[int]:
    """The server's own greedy output (no connector in the request)."""
    return complete(s.url, prompt, MAX_TOKENS, timeout=120, cache_salt=salt)["choices"][0]["token_ids"]


def decode(d, prompt: list[int], params: dict, salt: str) -> list[int]:
    reply = complete(d.url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=120, cache_salt=salt)
    return reply["choices"][0]["token_ids"]


def check_published(params: dict, prompt: list[int]) -> None:
    """Only the in-window blocks of the sliding group are published, every block of the full group."""
    sliding, full = params["remote_group_block_ids"]
    assert params["remote_block_ids"] == []
    assert len(sliding) == SLIDING.live_blocks(len(prompt)) <= FULL.num_blocks(len(prompt)) == len(full), params
    assert 0 not in sliding + full


def pages(n: int, cached: int = 0) -> int:
    """Pages one decode instance reads for a prompt of `n` tokens with `cached` of them in its prefix cache: two
    sliding layers x their in-window blocks + two full layers x every block, from the first uncached block on."""
    return sum(2 * (g.num_blocks(n) - max(g.first_block(cached), g.skipped_blocks(n))) for g in (SLIDING, FULL))


def test_the_servers_run_two_kv_cache_groups(servers):
    """HMA is on (kvbridge is SupportsHMA) and the KV cache is the two groups."""
    for s in servers.values():
        log = s.log_path.read_text(errors="replace")
        assert "Turning off hybrid kv cache manager" not in log and "Hybrid KV cache manager is disabled" not in log


@pytest.mark.parametrize(("prefill_name", "decode_name"), PAIRS)
def test_hma_disaggregated_output_equals_aggregated(servers, batch, aggregated, ttft_log, prefill_name, decode_name):
    p, d = servers[prefill_name], servers[decode_name]
    salt = f"{prefill_name}-{decode_name}"
    before = metrics(d.url)
    legs = [disaggregated(p, d, prompt, MAX_TOKENS, cache_salt=salt) for prompt in batch]
    after = metrics(d.url)
    for prompt, want, leg in zip(batch, aggregated[decode_name], legs, strict=True):
        check_published(leg.params, prompt)
        assert SLIDING.live_blocks(len(prompt)) < FULL.num_blocks(len(prompt))  # longer than the window
        assert leg.tokens == want, f"{prefill_name} -> {decode_name} ({len(prompt)} tokens): {leg.tokens} != {want}"
    assert delta(before, after, SOURCE, source="external_kv_transfer") == sum(map(len, batch))
    assert delta(before, after, SOURCE, source="local_compute") == 0, "the decode server recomputed prompt tokens"
    kv_bytes = sum(pages(len(x)) for x in batch) * PAGE_BYTES
    assert delta(before, after, "vllm:kvbridge_bytes_total") == kv_bytes
    log_ttft(
        ttft_log,
        f"HMA {prefill_name} -> {decode_name}",
        p,
        d,
        batch,
        [x.ttft_s for x in legs],
        MAX_TOKENS,
        fields={"cache_salt": f"alone-{salt}"},
        equal_to_aggregated=len(batch),
        kv_bytes=kv_bytes,
    )


@pytest.mark.parametrize(("prefill_name", "decode_name"), BOUNDARY_PAIRS)
def test_hma_prompts_at_window_and_block_boundaries(servers, prefill_name, decode_name):
    p, d = servers[prefill_name], servers[decode_name]
    salt = f"boundary-{prefill_name}-{decode_name}"
    batch = prompts(20261202, BOUNDARY_LENGTHS)
    want = [answer(d, x, f"aggregated-{salt}") for x in batch]
    before = metrics(d.url)
    results = []
    for prompt in batch:
        params = prefill_params(p, prompt, cache_salt=salt)
        check_published(params, prompt)
        results.append(decode(d, prompt, params, salt))
    after = metrics(d.url)
    wrong = [len(x) for x, got, w in zip(batch, results, want, strict=True) if got != w]
    assert not wrong, f"{prefill_name} -> {decode_name}: outputs differ from the aggregated ones at lengths {wrong}"
    assert delta(before, after, SOURCE, source="external_kv_transfer") == sum(map(len, batch))
    assert delta(before, after, SOURCE, source="local_compute") == 0, "the decode server recomputed prompt tokens"
    assert delta(before, after, "vllm:kvbridge_bytes_total") == sum(pages(len(x)) for x in batch) * PAGE_BYTES


def test_hma_decode_prefix_cache_hits_load_only_the_rest(servers):
    """A follow-up request (the first prompt + 60 tokens) through tp2 -> pp1b: pp1b's prefix cache holds the first
    request's full blocks (9 blocks of 32 tokens: the full group's, and the sliding group's in-window 7 and 8), so vLLM
    counts 288 tokens as local hits (both groups must hit: a sliding group needs its window's blocks) and
    kvbridge loads only blocks 9-11 of both groups; the output is pp1b's own for the longer prompt."""
    p, d = servers["tp2"], servers["pp1b"]
    (first,) = prompts(20261203, (300,))
    second = first + prompts(20261204, (60,))[0]
    hit = len(first) // BLOCK * BLOCK
    want = answer(d, second, "prefix-aggregated")
    disaggregated(p, d, first, MAX_TOKENS, cache_salt="prefix")
    before = metrics(d.url)
    leg = disaggregated(p, d, second, MAX_TOKENS, cache_salt="prefix")
    after = metrics(d.url)
    assert delta(before, after, SOURCE, source="local_cache_hit") == hit, "no hit in the decode's prefix cache"
    assert delta(before, after, SOURCE, source="external_kv_transfer") == len(second) - hit
    assert delta(before, after, SOURCE, source="local_compute") == 0
    assert delta(before, after, "vllm:kvbridge_bytes_total") == pages(len(second), hit) * PAGE_BYTES
    assert leg.tokens == want, f"with {hit} tokens from the decode's prefix cache: {leg.tokens} != {want}"


def test_hma_negative_control_sliding_blocks_in_the_wrong_order_change_the_output(servers, batch, aggregated):
    """The oracle can fail: the sliding group's in-window blocks rotated, from a prefill server whose claims do not
    bind the block order (`check_blocks` off; the default refuses such params), so each sliding layer's window
    holds its tokens at the wrong positions."""
    p, d = servers["pp2"], servers["pp1a"]
    prompt, want = batch[0], aggregated["pp1a"][0]
    params = prefill_params(p, prompt, cache_salt="rotated")
    sliding, full = params["remote_group_block_ids"]
    params["remote_group_block_ids"] = [sliding[1:] + sliding[:1], full]
    before = metrics(d.url)
    tokens = decode(d, prompt, params, "rotated")
    assert delta(before, metrics(d.url), SOURCE, source="external_kv_transfer") == len(prompt)
    assert tokens != want, "sliding-window KV loaded into the wrong blocks must show in the output"


def test_hma_params_missing_an_in_window_block_are_refused(servers, batch):
    """A sliding group's list that lacks a block the decode's window needs is refused before any read."""
    p, d = servers["pp1a"], servers["pp1b"]
    prompt = batch[1]
    params = prefill_params(p, prompt, cache_salt="missing")
    sliding, full = params["remote_group_block_ids"]
    params["remote_group_block_ids"] = [sliding[1:], full]
    before = metrics(d.url)
    with contextlib.suppress(Exception):  # kv_load_failure_policy "fail": the request fails; what counts is below
        decode(d, prompt, params, "missing")
    after = metrics(d.url)
    assert delta(before, after, "vllm:kvbridge_rejected_params_total", reason="blocks") == 1
    assert delta(before, after, "vllm:kvbridge_bytes_total") == 0
    complete(p.url, prompt, 1, timeout=60)  # the prefill server is fine (its lease frees the blocks)


def kv_capacity(log: str) -> tuple[int, float]:
    """(KV cache size in tokens, maximum concurrency) from vLLM's start-up log."""
    m = re.search(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x", log)
    assert m, "vLLM logged no KV cache size"
    return int(m.group(1).replace(",", "")), float(m.group(2))


@pytest.mark.skipif(os.environ.get("KVBRIDGE_HMA_MEMORY") != "1", reason="set KVBRIDGE_HMA_MEMORY=1 to measure")
def test_hma_kv_memory_against_hma_off(root, model):
    """Two kvbridge servers with the same model, block size and KV memory (1 GiB), HMA on (the default now) and off
    (`--disable-hybrid-kv-cache-manager`), max_model_len 4096 and 512 batched tokens: vLLM's logged capacity
    (its worst case per request: every block of the full group, a window plus a batch for the sliding group)."""
    places = {"on": Place(1, 1, "0"), "off": Place(1, 1, "1", ("--disable-hybrid-kv-cache-manager",))}
    args = (*ARGS, "--max-num-batched-tokens", "512")
    started = layout_servers(model, root, places, prefix="hma-mem-", args=args, block_size=BLOCK, max_model_len=4096)
    with running(list(started.values())):
        pass
    got = {name: kv_capacity(s.log_path.read_text(errors="replace")) for name, s in started.items()}
    for name, s in started.items():
        for line in s.log_path.read_text(errors="replace").splitlines():
            if "KV cache size" in line or "kvbridge worker" in line:
                print(f"HMA {name}: {line.strip()[:260]}")
    print(f"HMA on: {got['on'][0]} tokens, {got['on'][1]}x; HMA off: {got['off'][0]} tokens, {got['off'][1]}x")
    assert got["on"][1] > 1.5 * got["off"][1]
