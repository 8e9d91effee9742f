"""The scheduler-side connector with vLLM's configs as plain namespaces (no server): a producer, and the params of
a request it finished."""

from __future__ import annotations

from types import SimpleNamespace

from kvbridge.core.config import BridgeConfig


def producer(hold_feed: bool = True, role: str = "producer"):
    """A prefill engine's scheduler side (pp=1, tp=1, block size 4, no key); `hold_feed`: its feed on or off;
    `role` "consumer": a decode engine's instead."""
    from kvbridge.vllm.scheduler_side import SchedulerSide

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
        kv_transfer_config=kv, parallel_config=parallel, cache_config=SimpleNamespace(block_size=4)
    )
    extra = {"keyless_exposes_kv_to_local_processes": True, "hold_feed": hold_feed}
    return SchedulerSide(config, BridgeConfig.from_extra(extra))


def finished(prefill, request_id: str = "p1", prompt=tuple(range(1, 9))):
    """`prefill.request_finished` of a remote-decode request that computed `prompt` in blocks 7 and 8."""
    from vllm.v1.request import RequestStatus

    req = SimpleNamespace(
        request_id=request_id,
        kv_transfer_params={"do_remote_decode": True},
        prompt_token_ids=list(prompt),
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
        num_computed_tokens=len(prompt),
    )
    return prefill.request_finished(req, [7, 8])
