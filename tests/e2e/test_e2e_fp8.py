"""End to end in real vLLM (CPU): an FP8 KV cache (`--kv-cache-dtype fp8`) disaggregated across layouts.

vLLM's CPU attention backend stores an FP8 cache as uint8 pages (float8 e4m3 bytes, 1 byte per channel, a
quarter of the float32 model's pages) on x86 hosts with AVX-512 or AMX, for head sizes that are multiples of 32
(the tiny Qwen2's 32). kvbridge moves those pages as bytes; its handshake compares what decides how they are read:
the format (`dtype`: float8_e4m3fn or float8_e5m2, which the uint8 tensors do not say), the kernel variant
(`kernel`: backend and ISA, e.g. CPU_ATTN/vec) and each layer's k and v scale.

Five `kv_both` servers are started once for the module: the four of `e2e_support.FOUR` (pp2, pp1a, tp2, pp1b; a
pair's two on different cores) with `--kv-cache-dtype fp8`, and e5m2 (pp=1, core 1) with `fp8_e5m2`.

Each pair (pp1 -> pp1, pp2 -> tp2, tp2 -> pp2) checks that the decode server's greedy output equals the aggregated
FP8 server's (pp1a answering the prompt on its own), that the decode server counts every prompt token as
transferred (`external_kv_transfer`) and none as computed, and that it moved one byte per channel of each
(layer, KV head, block) once (`vllm:kvbridge_bytes_total`). Negative controls: the prompt's blocks loaded in the
wrong order change the output (the oracle can fail), and an e5m2 decode server is refused by an e4m3 prefill (by
the signed params' fingerprint, naming `kv_cache_dtype`) and prefills locally (`kv_load_failure_policy: recompute`).

With KVBRIDGE_TTFT_OUT=path (a file or a directory) the pairs' TTFT (prefill leg + decode leg to its first token)
and the decode server's aggregated TTFT are written there as JSON.
"""

from __future__ import annotations

import pytest

from kvbridge.serving.launcher import complete, metrics, running
from support.e2e_support import (
    FOUR,
    SOURCE,
    UNCHECKED,
    Place,
    delta,
    disaggregated,
    layout_servers,
    log_ttft,
    prompts,
)

pytestmark = pytest.mark.vllm

SERVERS = {
    **{name: p.but(args=("--kv-cache-dtype", "fp8")) for name, p in FOUR.items()},
    "e5m2": Place(1, 1, "1", ("--kv-cache-dtype", "fp8_e5m2")),
}
SERVERS["pp2"] = SERVERS["pp2"].but(kv=UNCHECKED)  # the negative control's prefill
PAIRS = [("pp1b", "pp1a"), ("pp2", "tp2"), ("tp2", "pp2")]
PROMPT_LENGTHS = (40, 150)  # 1 and 2 blocks, the last ones partial
BLOCK = 128
PAGE_BYTES = 4 * BLOCK * 4 * (32 + 32)  # one block of one layer: 4 KV heads x 128 tokens x (K 32 + V 32) x 1 byte
MAX_TOKENS = 8


def _has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512f" in f.read()
    except OSError:
        return False


if not _has_avx512():  # vLLM's CPU FP8 KV cache needs AVX-512 (or AMX, which implies it)
    pytestmark = [pytestmark, pytest.mark.skip(reason="vLLM's CPU FP8 KV cache needs x86 AVX-512")]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e-fp8")


@pytest.fixture(scope="module")
def servers(root, tiny_model):
    model = tiny_model
    started = layout_servers(
        model,
        root,
        SERVERS,
        prefix="fp8-",
        args=("--no-enable-prefix-caching",),
        kv={"policy": "recompute"},
        block_size=BLOCK,
    )
    with running(list(started.values())):
        yield started


@pytest.fixture(scope="module")
def batch():
    return prompts(20261201, PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def aggregated(servers, batch):
    """The aggregated FP8 server's greedy output for each prompt (pp1a on its own, no kv_transfer_params)."""
    return [complete(servers["pp1a"].url, prompt, MAX_TOKENS)["choices"][0]["token_ids"] for prompt in batch]


TTFT_REPORT = dict(
    family="fp8",
    model="tiny Qwen2 (4 layers, 4 KV heads x 32), float32 weights, --kv-cache-dtype fp8 (e4m3)",
    prompt_tokens=list(PROMPT_LENGTHS),
    max_tokens=MAX_TOKENS,
)
"""What this module's TTFT rows are written with (`ttft_log` in tests/e2e/conftest.py)."""


def fp8_leg(p, d, prompt, edit=None):
    leg = disaggregated(p, d, prompt, MAX_TOKENS, edit)
    return leg.tokens, leg.params, leg.ttft_s


def test_every_worker_read_its_fp8_kernel_and_scales(servers):
    """The handshake's `kernel` and scales come from the running vLLM workers (one log line per worker)."""
    for name, server in servers.items():
        lines = [x for x in server.log_path.read_text().splitlines() if "kvbridge: FP8 KV cache: kernel" in x]
        pp, tp = SERVERS[name].pp, SERVERS[name].tp
        assert len(lines) == pp * tp, f"{name}: {lines}"
        assert all("CPU_ATTN/" in x and "[(1.0, 1.0)]" in x for x in lines), lines


@pytest.mark.parametrize(("prefill", "decode"), PAIRS)
def test_fp8_disaggregated_output_equals_aggregated(servers, batch, aggregated, ttft_log, prefill, decode):
    p, d = servers[prefill], servers[decode]
    before = metrics(d.url)
    results = [fp8_leg(p, d, prompt) for prompt in batch]
    after = metrics(d.url)
    for prompt, want, (tokens, params, _) in zip(batch, aggregated, results, strict=True):
        assert params["remote_layout"].startswith(SERVERS[prefill].layout)
        assert tokens == want, f"{prefill} -> {decode} ({len(prompt)} tokens): disaggregated {tokens} != {want}"
    moved = delta(before, after, SOURCE, source="external_kv_transfer")
    assert moved == sum(map(len, batch)), "the decode server did not load every prompt token through kvbridge"
    assert delta(before, after, SOURCE, source="local_compute") == 0, "the decode server recomputed prompt tokens"
    # vLLM's hits by cache tier: kvbridge's are "p2p" (from another instance), not "external_unspecified"
    assert delta(before, after, "vllm:prompt_tokens_cached_by_source_total", source="p2p") == moved
    # FP8 pages moved as bytes, 1 per channel (a quarter of the float32 model's): each (layer, KV head, block) once
    moved_bytes = delta(before, after, "vllm:kvbridge_bytes_total")
    assert moved_bytes == sum(-(-len(prompt) // BLOCK) for prompt in batch) * PAGE_BYTES
    pd_s = [r[2] for r in results]
    log_ttft(
        ttft_log,
        f"FP8 {prefill} -> {decode}",
        p,
        d,
        batch,
        pd_s,
        MAX_TOKENS,
        equal_to_aggregated=len(batch),
        kv_bytes=moved_bytes,
    )


def test_fp8_negative_control_the_wrong_blocks_change_the_output(servers, batch, aggregated):
    """The oracle can fail: the prompt's blocks loaded in reverse order (from a prefill server whose claims do not
    bind the block order: `check_blocks` off) are counted as transferred, and the output is not the aggregated
    one."""
    p, d = servers["pp2"], servers["tp2"]
    prompt, want = batch[1], aggregated[1]
    before = metrics(d.url)
    tokens, params, _ = fp8_leg(p, d, prompt, lambda x: dict(x, remote_block_ids=x["remote_block_ids"][::-1]))
    after = metrics(d.url)
    assert len(params["remote_block_ids"]) > 1
    assert delta(before, after, SOURCE, source="external_kv_transfer") == len(prompt)
    assert tokens != want, "KV loaded into the wrong blocks must show in the output"


def test_an_e5m2_decode_is_refused_by_an_e4m3_prefill_naming_the_cache_dtype(servers, batch):
    """Both caches are uint8 tensors of one shape: only the model fingerprint's kv_cache_dtype part (in the signed
    params) and the handshake's `dtype` tell e4m3 bytes from e5m2. The load is refused, the decode server prefills
    the prompt itself (policy recompute) and its log names the part that differs."""
    p, d = servers["pp1b"], servers["e5m2"]
    prompt = batch[0]
    before = metrics(d.url)
    tokens, _, _ = fp8_leg(p, d, prompt)
    after = metrics(d.url)
    assert len(tokens) == MAX_TOKENS
    assert delta(before, after, SOURCE, source="external_kv_transfer") == 0
    assert delta(before, after, SOURCE, source="local_compute") == len(prompt)
    lines = d.log_path.read_text().splitlines()
    refusals = [x for x in lines if "remote_model" in x or "incompatible peer" in x]
    assert refusals, d.log_tail()
    for line in refusals:  # refused by the params (naming the parts) or, without a fingerprint, by the handshake
        parts = line.partition("differs from this instance's in ")[2].partition(" (")[0]
        assert "kv_cache_dtype" in parts.split(", ") or (
            "incompatible peer: dtype" in line and "float8_e5m2" in line and "float8_e4m3fn" in line
        ), line
