"""The worker-side half of the connector (one per vLLM worker process): a thin translation to the runtimes.

Prefill role: a `PrefillWorker` publishes this worker's KV and holds finished requests. Decode role: a
`DecodeWorker` reads requests' KV in its own thread. Each step only moves ids and jobs between vLLM and them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import ConfigError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.runtime.decode_worker import DecodeWorker
from kvbridge.runtime.prefill_worker import PrefillWorker
from kvbridge.transport.torch_memory import memory_from_tensors, physical_order, region_tensors
from kvbridge.vllm.metadata import KVBridgeMetadata
from kvbridge.vllm.stats import KVBridgeStats
from kvbridge.vllm.vllm_facts import engine_layout, geometry, worker_rank
from kvbridge.wire.auth import load_key

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


def share_regions(regions) -> tuple:
    """CUDA IPC handles of the KV regions, or () when they cannot be shared (e.g. PyTorch's expandable segments):
    decode workers then read through NIXL."""
    from kvbridge.transport.cuda_ipc import export_region

    try:
        return tuple(export_region(r) for r in regions)
    except Exception as exc:
        logger.warning("kvbridge: KV regions not shared through CUDA IPC (%s); readers will use NIXL", exc)
        return ()


def check_block_split(memory_blocks: list[int], config_blocks: int | None, block_size: int) -> None:
    """Refuse, at startup, KV tensors whose block count is not the KV-cache config's: vLLM 0.32 splits each
    manager block into kernel blocks when the attention backend's kernel block is smaller than --block-size
    (`group_kernel_blocks`), and reading manager block b as kernel block b would load another request's KV."""
    if config_blocks is None:
        return
    wrong = sorted({n for n in memory_blocks if n != config_blocks})
    if wrong:
        raise ConfigError(
            f"kvbridge: the KV cache tensors hold {wrong[0]} blocks but vLLM's KV-cache config has {config_blocks} "
            f"(the attention backend splits each {block_size}-token block into kernel blocks): unsupported; "
            "use a --block-size equal to the backend's kernel block size"
        )


class WorkerSide:
    def __init__(self, vllm_config: VllmConfig, config: BridgeConfig, kv_cache_config=None) -> None:
        kv = vllm_config.kv_transfer_config
        self.vllm_config = vllm_config
        self.config = config
        self.engine_id = str(kv.engine_id)
        self.is_producer = bool(kv.is_kv_producer)
        self.is_consumer = bool(kv.is_kv_consumer)
        self.key = load_key(config.auth_key, config.auth_key_file)
        self.prefill: PrefillWorker | None = None
        self.decode: DecodeWorker | None = None
        self.stats = KVBridgeStats()
        self.kv_cache_config = kv_cache_config
        self._aborted = self._refused = 0  # prefill lease totals already recorded

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        memory = memory_from_tensors(kv_caches, extract_layer_index)
        first = next(iter(kv_caches.values()))
        check_block_split(
            [lk.num_blocks for lk in memory.layers],
            getattr(self.kv_cache_config, "num_blocks", None),
            self.vllm_config.cache_config.block_size,
        )
        layout, dp_rank = engine_layout(self.vllm_config)
        identity = WorkerIdentity(
            self.engine_id,
            layout,
            dp_rank,
            worker_rank(),
            geometry(
                self.vllm_config,
                str(first.dtype).removeprefix("torch."),
                memory.layers[0].block_size,
                self.kv_cache_config,
            ),
            physical_order(memory),
        )
        mem_type = "VRAM" if first.is_cuda else "DRAM"
        logger.info(
            "kvbridge worker %s: %d layers %s, %s, regions %s",
            identity,
            len(memory.layers),
            memory.layer_ids(),
            identity.kv_layout,
            [(hex(r.addr), r.nbytes, r.device_id) for r in memory.regions],
        )
        regions = region_tensors(kv_caches, memory)
        if self.is_producer:
            ipc = share_regions(regions) if first.is_cuda and self.config.gpu_peer_copy == "auto" else ()
            self.prefill = PrefillWorker(identity, memory, self.config, mem_type, ipc=ipc, key=self.key).start()
        if self.is_consumer:
            self.decode = DecodeWorker(identity, memory, self.config, mem_type, regions, key=self.key).start()

    def start_load_kv(self, meta: KVBridgeMetadata) -> None:
        if self.decode is not None:
            for job in (*meta.loads, *meta.releases):
                self.decode.load(job)
        if self.prefill is not None:
            for request_id, block_ids, token, phash in meta.holds:
                self.prefill.hold(request_id, block_ids, token, phash)

    def transfer_results(self, wait: bool = False) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving); failed ids are in both receiving sets.

        `wait` (an idle step: nothing scheduled): with loads outstanding and none finished (decode), or requests
        held and none freed (prefill), wait up to `idle_wait_s` for one, rather than return at once. vLLM steps
        continuously while a load is pending or blocks are held; with the engine, its workers and their spinning
        waits ping-ponging through every core, other processes' threads (a prefill worker's side channel sharing
        a core) waited 15 s on the run queue (issue "Liveness")."""
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        if self.prefill is not None:
            # kv_both: the decode side's wait (below) covers the step
            sending, expired = self.prefill.finished(self.config.idle_wait_s if wait and self.decode is None else 0.0)
            self.stats.record_expired(expired)
            counts = self.prefill.lease_counts()
            self.stats.record_leases(counts["aborted"] - self._aborted, counts["refused"] - self._refused)
            self._aborted, self._refused = counts["aborted"], counts["refused"]
        if self.decode is not None:
            done, failed, stats = self.decode.results(self.config.idle_wait_s if wait else 0.0)
            recving = done | failed
            self.stats.record(stats)
        return sending, recving, failed

    def take_stats(self) -> KVBridgeStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KVBridgeStats()
        return out

    def shutdown(self) -> None:
        for runtime in (self.decode, self.prefill):
            if runtime is not None:
                runtime.close()
        self.decode = self.prefill = None
