"""The worker-side half of the connector (one per vLLM worker process): a thin translation to the runtimes.

Prefill role: a `PrefillWorker` publishes this worker's KV and holds finished requests. Decode role: a
`DecodeWorker` reads requests' KV in its own thread. Each step only moves ids and jobs between vLLM and them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import ConfigError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import LayerKV, Region, WorkerMemory
from kvbridge.runtime.decode_worker import DecodeWorker
from kvbridge.runtime.prefill_worker import PrefillWorker
from kvbridge.runtime.prepared_reads import prepared_lists
from kvbridge.transport.torch_memory import memory_from_tensors, physical_order, region_tensors
from kvbridge.vllm.fingerprint import model_fingerprint
from kvbridge.vllm.metadata import KVBridgeMetadata
from kvbridge.vllm.stats import KVBridgeStats
from kvbridge.vllm.vllm_facts import engine_layout, geometry, page_format, state_groups, worker_rank
from kvbridge.wire.hold_feed import HoldFeedReader, HoldNote
from kvbridge.wire.keys import load_keys

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


def grouped_memory(kv_caches: dict, kv_cache_config, layer_index, state: tuple[int, ...] = ()) -> WorkerMemory:
    """The worker's KV memory, each layer with its KV-cache group from vLLM's KV-cache config.

    One group: `memory_from_tensors` as it always was. Several (vLLM's hybrid KV-cache manager): the groups'
    tensors alias one pool (layer i of every group shares bytes), so layers are taken group by group from the
    config's layer names, never de-duplicated by address; ConfigError for a KV tensor of no group. The layers of
    the groups in `state` (Mamba) are state layers (`LayerKV.state`)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    if len(groups) <= 1:
        return memory_from_tensors(kv_caches, layer_index)
    regions: list[Region] = []
    layers: list[LayerKV] = []
    named: set[str] = set()
    for index, group in enumerate(groups):
        names = [n for n in group.layer_names if n in kv_caches]
        named.update(names)
        if not names:
            continue
        part = memory_from_tensors({n: kv_caches[n] for n in names}, layer_index)
        if len(part.layers) != len(names):
            raise ConfigError(f"kvbridge: layers of KV-cache group {index} share KV tensors: unsupported")
        for lk in part.layers:
            region = part.regions[lk.region]
            if region not in regions:
                regions.append(region)
            layers.append(dataclasses.replace(lk, region=regions.index(region), group=index, state=index in state))
    stray = sorted(set(kv_caches) - named)
    if stray:
        raise ConfigError(f"kvbridge: KV tensors of layers in no KV-cache group: {stray[:3]}")
    return WorkerMemory(tuple(regions), tuple(sorted(layers, key=lambda lk: lk.layer)), num_groups=len(groups))


def with_page_format(memory: WorkerMemory, page_format: str, itemsize: int) -> WorkerMemory:
    """`memory` with every layer's page format and element size (`core.token_runs`)."""
    layers = tuple(dataclasses.replace(lk, page_format=page_format, itemsize=itemsize) for lk in memory.layers)
    return WorkerMemory(memory.regions, layers, num_groups=memory.num_groups)


class WorkerSide:
    def __init__(self, vllm_config: VllmConfig, config: BridgeConfig, kv_cache_config=None) -> None:
        kv = vllm_config.kv_transfer_config
        self.vllm_config = vllm_config
        self.config = config
        self.engine_id = str(kv.engine_id)
        self.is_producer = bool(kv.is_kv_producer)
        self.is_consumer = bool(kv.is_kv_consumer)
        self.key = load_keys(config.auth_key, config.auth_key_file, config.auth_accepted_key_files)
        config.check_auth(self.key is not None)
        self.prefill: PrefillWorker | None = None
        self.decode: DecodeWorker | None = None
        self.stats = KVBridgeStats()
        self.kv_cache_config = kv_cache_config
        self._aborted = self._refused = 0  # prefill lease totals already recorded
        self._feed: HoldFeedReader | None = None
        self._feed_address = ""  # the hold feed subscribed to, or tried and not on this host

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        state = state_groups(self.kv_cache_config)
        memory = grouped_memory(kv_caches, self.kv_cache_config, extract_layer_index, state)
        memory = with_page_format(memory, page_format(self.vllm_config), next(iter(kv_caches.values())).element_size())
        if memory.num_groups > 1 and prepared_lists(self.config):
            raise ConfigError(
                "kvbridge: NIXL prepared descriptor lists (nixl_prepared_lists / KVBRIDGE_NIXL_PREPARED_LISTS) are "
                f"unsupported with {memory.num_groups} KV-cache groups (vLLM's hybrid KV-cache manager)"
            )
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
                next(lk for lk in memory.layers if not lk.state).block_size,
                self.kv_cache_config,
            ),
            physical_order(memory),
            model_fingerprint(self.vllm_config),
        )
        mem_type = "VRAM" if first.is_cuda else "DRAM"
        logger.info(
            "kvbridge worker %s: %d layers %s, %d blocks of %d tokens, %d KV-cache groups, %s, pages %r, regions %s",
            identity,
            len(memory.layers),
            memory.layer_ids(),
            memory.num_blocks,
            memory.layers[0].block_size,
            memory.num_groups,
            identity.kv_layout,
            memory.layers[0].page_format,
            [(hex(r.addr), r.nbytes, r.device_id) for r in memory.regions],
        )
        regions = region_tensors(kv_caches, memory)
        if self.is_producer:
            # the CUDA IPC gather kernel takes one block list for all layers: several KV-cache groups read via NIXL
            ipc_ok = first.is_cuda and self.config.gpu_peer_copy == "auto" and memory.num_groups == 1
            ipc = share_regions(regions) if ipc_ok else ()
            self.prefill = PrefillWorker(
                identity, memory, self.config, mem_type, ipc=ipc, key=self.key, regions=regions
            ).start()
        if self.is_consumer:
            self.decode = DecodeWorker(identity, memory, self.config, mem_type, regions, key=self.key).start()

    def start_load_kv(self, meta: KVBridgeMetadata) -> None:
        if self.decode is not None:
            for key, why in meta.dead.items():  # before the new loads: those naming it fail at once
                self.decode.engine_down(key, why)
            for job in (*meta.loads, *meta.releases):
                self.decode.load(job)
        if self.prefill is not None:
            if meta.hold_feed and meta.hold_feed != self._feed_address:
                self._subscribe(meta.hold_feed)
            for request_id, block_ids, token, phash, finished_at in meta.holds:
                self.prefill.hold(request_id, block_ids, token, phash, finished_at)

    def _subscribe(self, address: str) -> None:
        """Take holds from the scheduler's feed as requests finish (`wire.hold_feed`); the metadata still brings
        each (a hold that comes twice is held once)."""
        if self._feed is not None:
            self._feed.close()
        self._feed_address = address
        prefill = self.prefill

        def on_note(note: HoldNote) -> None:
            prefill.hold(note.request_id, note.groups, note.token, note.prompt_hash, note.finished_at, fed=True)

        rank = self.prefill.identity.rank
        self._feed = HoldFeedReader.open(address, on_note, name=f"kvbridge-holds-{rank}")
        if self._feed is not None:
            logger.info("kvbridge prefill worker %s: holds come from the scheduler's feed %s", rank, address)
        else:
            logger.info("kvbridge prefill worker %s: holds come with the step metadata only", rank)

    def transfer_results(self, wait: bool = False) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving); failed ids are in both receiving sets.

        `wait` (an idle step: nothing scheduled): with loads outstanding and none finished (decode), or requests
        held and none freed (prefill), wait up to `idle_wait_s` for one, rather than return at once. vLLM steps
        continuously while a load is pending or blocks are held; with the engine, its workers and their spinning
        waits ping-ponging through every core, other processes' threads (a prefill worker's side channel sharing
        a core) waited 15 s on the run queue (docs/benchmarks/shared-cores.md)."""
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        idle_s = self.config.idle_wait_s if wait else 0.0
        # One side waits (kv_both has both): the decode side while it has loads outstanding, else the prefill side
        # (which returns at once unless it holds requests). The other side's news waits for the next step.
        decode_waits = idle_s > 0 and self.decode is not None and self.decode.loads_outstanding()
        if self.prefill is not None:
            sending, expired = self.prefill.finished(0.0 if decode_waits else idle_s)
            self.stats.record_expired(expired)
            counts = self.prefill.lease_counts()
            self.stats.record_leases(counts["aborted"] - self._aborted, counts["refused"] - self._refused)
            self.stats.record_holds(self.prefill.take_phases())
            self._aborted, self._refused = counts["aborted"], counts["refused"]
        if self.decode is not None:
            done, failed, stats = self.decode.results(idle_s if decode_waits else 0.0)
            recving = done | failed
            self.stats.record(stats)
        return sending, recving, failed

    def take_dead_news(self) -> dict[tuple, str]:
        """Prefill engines this worker found gone or unreachable since the last step (for the scheduler)."""
        return self.decode.take_dead_news() if self.decode is not None else {}

    def take_stats(self) -> KVBridgeStats | None:
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, KVBridgeStats()
        return out

    def shutdown(self) -> None:
        if self._feed is not None:
            self._feed.close()
            self._feed = None
        for runtime in (self.decode, self.prefill):
            if runtime is not None:
                runtime.close()
        self.decode = self.prefill = None
