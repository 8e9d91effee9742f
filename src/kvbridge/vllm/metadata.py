"""What the scheduler-side connector sends to every worker each step (pickled by vLLM: keep it small)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvbridge.runtime.decode_worker import LoadJob


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    """Decode side: requests whose KV to read now."""

    releases: list[LoadJob] = field(default_factory=list)
    """Decode side: requests gone before they read (aborted): only tell the prefill side to free."""

    holds: list[tuple[str, tuple[tuple[int, ...], ...], str, str, float]] = field(default_factory=list)
    """Prefill side: finished requests (id, block ids, token, prompt hash, when it finished: time.monotonic) whose
    blocks stay held for readers."""

    idle: bool = False
    """No tokens scheduled this step. vLLM steps continuously while loads are pending: on an idle step a decode
    worker waits briefly for a load to finish instead of answering at once (`idle_wait_s`)."""
