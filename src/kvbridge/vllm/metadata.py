"""What the scheduler-side connector sends to every worker each step (pickled by vLLM: keep it small)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

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

    hold_feed: str = ""
    """Prefill side: the address of the scheduler's hold feed (`wire.hold_feed`), where holds come as requests
    finish, before the metadata brings them; "" for none."""

    dead: dict[tuple, str] = field(default_factory=dict)
    """Decode side: prefill engines (key -> why) a worker of this instance found gone or unreachable: every worker
    fails its loads in flight from them at once and knows them dead (`DecodeWorker.engine_down`)."""

    idle: bool = False
    """No tokens scheduled this step. vLLM steps continuously while loads are pending or KV is held: on an idle step
    a worker waits briefly (`idle_wait_s`) instead of answering at once: its decode side while it has loads
    outstanding (for one to finish), else its prefill side (for a read of the KV it holds to end)."""


@dataclass
class KVBridgeWorkerMetadata(KVConnectorWorkerMetadata):
    """What a worker tells the scheduler-side connector each step (vLLM aggregates every worker's)."""

    dead: dict[tuple, str] = field(default_factory=dict)
    """Prefill engines (key -> why) this worker found gone or unreachable: the scheduler passes them to every
    worker in the next step's metadata, so that a worker whose reads from one are still waiting for their stall
    bound ends them at once."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVBridgeWorkerMetadata):
            return KVBridgeWorkerMetadata({**self.dead, **other.dead})
        return self
