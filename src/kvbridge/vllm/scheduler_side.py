"""The scheduler-side half of the connector (vLLM's engine-core process): request bookkeeping only.

Decode role: accept a prefill instance's kv_transfer_params (or fall back to a local prefill when they are
bad), ask vLLM for blocks, and queue one load per request for the workers. Prefill role: when a request
asked for remote decode finishes, keep its blocks and answer with where they are.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import RequestParamsError
from kvbridge.runtime.decode_worker import LoadJob
from kvbridge.vllm.metadata import KVBridgeMetadata
from kvbridge.vllm.vllm_facts import advertised_host, engine_layout
from kvbridge.wire.params import PrefillDone, parse_prefill_done, wants_remote_decode, wants_remote_prefill

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, config: BridgeConfig) -> None:
        kv = vllm_config.kv_transfer_config
        self.config = config
        self.engine_id = str(kv.engine_id)
        self.layout, self.dp_rank = engine_layout(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        self.is_producer = bool(kv.is_kv_producer)
        self.is_consumer = bool(kv.is_kv_consumer)
        self.host = advertised_host(config)
        self._meta = KVBridgeMetadata()
        self._sources: dict[str, PrefillDone] = {}  # parsed once per request, between match and alloc

    # -- decode role ---------------------------------------------------------------------------------

    def _source(self, request: Request) -> PrefillDone | None:
        """The request's validated prefill location, or None (then it is prefilled locally)."""
        params = request.kv_transfer_params
        if not (self.is_consumer and wants_remote_prefill(params)):
            return None
        cached = self._sources.get(request.request_id)
        if cached is not None:
            return cached
        try:
            source = parse_prefill_done(params)
        except RequestParamsError as exc:
            logger.warning("kvbridge: request %s prefills locally: %s", request.request_id, exc)
            params["do_remote_prefill"] = False
            return None
        needed = -(-len(request.prompt_token_ids or ()) // self.block_size)
        if len(source.remote_block_ids) < needed:
            logger.warning(
                "kvbridge: request %s prefills locally: remote_block_ids has %d blocks, the prompt needs %d",
                request.request_id,
                len(source.remote_block_ids),
                needed,
            )
            params["do_remote_prefill"] = False
            return None
        self._sources[request.request_id] = source
        return source

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if self._source(request) is None:
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        source = self._source(request)
        if source is None:
            return
        request.kv_transfer_params["do_remote_prefill"] = False  # one load per request
        self._sources.pop(request.request_id, None)
        block_ids = blocks.get_block_ids()[0]
        prompt = len(request.prompt_token_ids or ())
        first = (prompt - num_external_tokens) // self.block_size  # blocks already cached here
        last = -(-prompt // self.block_size)
        local = tuple(block_ids[first:last])
        remote = tuple(source.remote_block_ids[first:last])
        self._meta.loads.append(LoadJob(request.request_id, source, local, remote))

    # -- both roles ----------------------------------------------------------------------------------

    def build_connector_meta(self) -> KVBridgeMetadata:
        meta, self._meta = self._meta, KVBridgeMetadata()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if self.is_consumer and wants_remote_prefill(params):
            # Finished (aborted) before its load was scheduled: the prefill side still holds the blocks.
            source = self._source(request)
            self._sources.pop(request.request_id, None)
            params["do_remote_prefill"] = False
            if source is not None:
                self._meta.releases.append(LoadJob(request.request_id, source, (), (), report=False))
            return False, None
        if not (self.is_producer and wants_remote_decode(params)):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        if not block_ids:
            return False, None
        done = PrefillDone(
            remote_engine_id=self.engine_id,
            remote_request_id=request.request_id,
            remote_block_ids=list(block_ids),
            remote_host=self.host,
            remote_port=self.config.side_channel_port,
            remote_dp_rank=self.dp_rank,
            remote_layout=str(self.layout),
            remote_num_tokens=request.num_computed_tokens,
            tp_size=self.layout.tp,
            pp_size=self.layout.pp,
        )
        self._meta.holds.append((request.request_id, tuple(block_ids)))
        return True, done.to_dict()
