"""The scheduler side with different block sizes: the prefill publishes its block size, the decode queues a load of
the prompt's token span (only what its prefix cache lacks), and the equal-size job is what it always was."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvbridge.core.config import BridgeConfig
from kvbridge.core.token_runs import TokenSpan
from kvbridge.vllm.scheduler_side import SchedulerSide


def side(role: str, block_size: int) -> SchedulerSide:
    kv = SimpleNamespace(
        engine_id=f"engine-{role}",
        is_kv_producer=role == "producer",
        is_kv_consumer=role == "consumer",
        kv_load_failure_policy="fail",
    )
    parallel = SimpleNamespace(
        pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel_size=1, data_parallel_index=0
    )
    config = SimpleNamespace(
        kv_transfer_config=kv, parallel_config=parallel, cache_config=SimpleNamespace(block_size=block_size)
    )
    return SchedulerSide(config, BridgeConfig.from_extra({"keyless_exposes_kv_to_local_processes": True}))


def published(block_size: int, prompt: list[int]) -> dict:
    from vllm.v1.request import RequestStatus

    prefill = side("producer", block_size)
    req = SimpleNamespace(
        request_id="p1",
        kv_transfer_params={"do_remote_decode": True},
        prompt_token_ids=prompt,
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
        num_computed_tokens=len(prompt),
    )
    blocks = list(range(100, 100 + -(-len(prompt) // block_size)))
    delay, params = prefill.request_finished(req, blocks)
    assert delay and params["remote_block_size"] == block_size and params["remote_block_ids"] == blocks
    return params


def job(params: dict, block_size: int, prompt: list[int], local: list[int], cached_tokens: int):
    decode = side("consumer", block_size)
    dreq = SimpleNamespace(request_id="d1", kv_transfer_params=dict(params), prompt_token_ids=prompt)
    assert decode.get_num_new_matched_tokens(dreq, cached_tokens) == (len(prompt) - cached_tokens, True)
    decode.update_state_after_alloc(dreq, SimpleNamespace(get_block_ids=lambda: (local,)), len(prompt) - cached_tokens)
    (load,) = decode.build_connector_meta().loads
    return load


def test_equal_block_sizes_queue_the_block_pairs_as_before():
    prompt = list(range(1, 301))
    params = published(16, prompt)
    load = job(params, 16, prompt, list(range(200, 219)), 32)
    assert load.span is None and load.remote_block_size == 0
    assert load.local_blocks == (tuple(range(202, 219)),) and load.remote_blocks == (tuple(range(102, 119)),)


@pytest.mark.parametrize(
    ("src_bs", "dst_bs", "cached", "local", "remote", "span"),
    [
        (16, 128, 0, range(0, 3), range(0, 19), TokenSpan(300, 0, 0)),
        (16, 128, 128, range(1, 3), range(8, 19), TokenSpan(172, 0, 0)),  # decode caches its first block
        (128, 16, 32, range(2, 19), range(0, 3), TokenSpan(268, 32, 0)),  # mid prefill block
    ],
)
def test_different_block_sizes_queue_the_uncached_token_span(src_bs, dst_bs, cached, local, remote, span):
    prompt = list(range(1, 301))
    params = published(src_bs, prompt)
    mine = list(range(200, 200 + -(-300 // dst_bs)))
    load = job(params, dst_bs, prompt, mine, cached)
    assert load.span == span and load.remote_block_size == src_bs
    assert load.local_blocks == (tuple(mine[local.start : local.stop]),)
    assert load.remote_blocks == (tuple(params["remote_block_ids"][remote.start : remote.stop]),)


def test_a_block_count_that_does_not_fit_the_prefills_block_size_is_refused():
    prompt = list(range(1, 301))
    params = published(16, prompt)
    params["remote_block_ids"] = params["remote_block_ids"][:3]  # 3 blocks: what 128-token blocks would need
    decode = side("consumer", 128)
    dreq = SimpleNamespace(request_id="d1", kv_transfer_params=params, prompt_token_ids=prompt)
    decode.get_num_new_matched_tokens(dreq, 0)
    assert decode._refused["d1"].reason == "blocks"


def _peer(kind: str, block_size: int, page_format: str, kernel: str = ""):
    """A handshake request (decode) or reply (prefill) of one worker whose pages are of `page_format`."""
    import dataclasses

    from kvbridge.core.memory import WorkerMemory, synthesize_memory
    from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
    from kvbridge.wire import messages as wire

    geometry = KVGeometry(
        num_layers=2, num_kv_heads=2, head_size=32, dtype="float32", block_size=block_size, kernel=kernel
    )
    mem = synthesize_memory("LBHNC", geometry, range(2), 2, 8, 1 << 20)
    mem = WorkerMemory(
        mem.regions, tuple(dataclasses.replace(lk, page_format=page_format, itemsize=4) for lk in mem.layers)
    )
    layout, rank = ParallelLayout(), WorkerRank(0, 0)
    if kind == "request":
        return wire.HandshakeRequest.build("decode-0", layout, 0, rank, geometry, "LBHNC", mem)
    return wire.HandshakeReply.build("prefill-0", layout, 0, rank, geometry, "LBHNC", "agent", b"", mem)


def test_the_handshake_lets_block_sizes_differ_only_for_checked_page_formats():
    from kvbridge.core.errors import IncompatiblePeerError
    from kvbridge.core.memory import PAGE_CPU_ATTN, PAGE_ROWS
    from kvbridge.wire import messages as wire

    reply = _peer("reply", 16, PAGE_CPU_ATTN)
    assert wire.answer_handshake(reply, _peer("request", 128, PAGE_CPU_ATTN)) is reply
    assert wire.answer_handshake(reply, _peer("request", 16, PAGE_ROWS)) is reply  # equal sizes: pages copied whole
    for request in (
        _peer("request", 128, PAGE_ROWS),  # unnamed (older peers, unchecked backends)
        _peer("request", 128, "CPU_ATTN/amx"),
    ):
        refused = wire.answer_handshake(reply, request)
        assert refused == wire.HandshakeRefused(field="block_size", ours=16, theirs=128)
    quantized = _peer("reply", 16, PAGE_CPU_ATTN, kernel="CPU_ATTN/vec16")
    with pytest.raises(IncompatiblePeerError, match="block_size"):
        wire.check_compatible(quantized, _peer("request", 128, PAGE_CPU_ATTN, kernel="CPU_ATTN/vec16"))
