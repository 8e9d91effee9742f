"""`KVBridgeConnector`: vLLM's KV connector interface, routed to the scheduler-side or worker-side half.

Everything here is translation; the logic lives in `scheduler_side`, `worker_side` and the runtimes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvbridge.core.config import BridgeConfig
from kvbridge.vllm.metadata import KVBridgeMetadata, KVBridgeWorkerMetadata
from kvbridge.vllm.stats import KVBridgePromMetrics, KVBridgeStats
from kvbridge.vllm.vllm_facts import check_state_layout

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _log_like_vllm() -> None:
    """kvbridge's log lines go where vLLM's go (vLLM configures only its own logger)."""
    root = logging.getLogger("kvbridge")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s.%(msecs)03d [kvbridge] %(message)s", "%m-%d %H:%M:%S")
        )
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.P2P  # loaded tokens came from another vLLM instance (vLLM's per-source hits)

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        config = BridgeConfig.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config)
        # refuses, at startup, a KV cache or layout kvbridge cannot move (ConfigError naming it)
        check_state_layout(vllm_config, config, kv_cache_config)
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from kvbridge.vllm.scheduler_side import SchedulerSide

            self._scheduler = SchedulerSide(vllm_config, config, kv_cache_config)
        else:
            from kvbridge.vllm.worker_side import WorkerSide

            self._worker = WorkerSide(vllm_config, config, kv_cache_config)

    # -- scheduler side --------------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """A model with state (Mamba): a remote-decode request computes all but its last prompt token here."""
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVBridgeMetadata:
        meta = self._scheduler.build_connector_meta()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' own news (`KVBridgeWorkerMetadata`): prefill engines one of them found gone or unreachable
        go to every worker with the next step's metadata."""
        news = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(news, KVBridgeWorkerMetadata) and news.dead and self._scheduler is not None:
            self._scheduler.tell_workers_dead(news.dead)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV-cache manager (SupportsHMA): every KV-cache group's blocks of the finished request."""
        return self._scheduler.request_finished_all_groups(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """A load writes the request's own blocks of every group (kvbridge refuses groups vLLM does not transfer)."""
        kv_cache_config = getattr(self, "_kv_cache_config", None)
        return tuple(kv_cache_config.transfer_group_ids) if kv_cache_config is not None else (0,)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict) -> None:
        """Handshakes go over kvbridge's own side channel, per worker; nothing to merge here. Idempotent: vLLM 0.33
        calls it again after a wake-up, and it keeps nothing."""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No (asked by vLLM 0.33, which then refuses to start with sleep mode on): sleep frees and remaps the KV
        memory that kvbridge's workers registered with NIXL and whose addresses their peers hold."""
        return False

    def build_connector_worker_meta(self) -> KVBridgeWorkerMetadata | None:
        dead = self._worker.take_dead_news() if self._worker is not None else {}
        return KVBridgeWorkerMetadata(dead) if dead else None

    def get_finished_count(self) -> int | None:
        return None  # every worker of every stage reports each id once

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The `kv_layout` of kv_connector_extra_config ("HND" keeps a block's heads together on GPU, so a
        decode worker of another TP size reads one run per block); None keeps vLLM's default."""
        return BridgeConfig.from_extra(vllm_config.kv_transfer_config.kv_connector_extra_config).kv_layout

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats(data=data) if data is not None else KVBridgeStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVBridgePromMetrics:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side -------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBridgeMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._worker.transfer_results()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, KVBridgeMetadata) and meta.idle
        sending, recving, failed = self._worker.transfer_results(wait=idle)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        part = self._worker if self._worker is not None else self._scheduler
        return part.take_stats() if part is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()
