"""A prefill worker in the test's own process, over a small host buffer of KV (zeros), on a side-channel port of
its own: what the NIXL-level security and bounds tests talk to."""

from __future__ import annotations

from typing import Any

import torch

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.prefill_worker import PrefillWorker
from kvbridge.serving.launcher import free_base_port

KV_BYTES = 1 << 16


def prefill_worker(
    geometry: KVGeometry,
    key: bytes | None = None,
    *,
    engine_id: str = "p",
    layers: range | list[int] = range(2),
    num_blocks: int = 16,
    port: int = 0,
    start: bool = True,
    **config: Any,
) -> PrefillWorker:
    """A PrefillWorker (engine `engine_id`, layout pp=1 tp=1, rank 0) holding `layers` of `geometry` (two heads,
    `num_blocks` blocks) in a zeroed buffer that lives as long as the worker; `key`: its deployment key; `config`:
    more BridgeConfig fields (`side_channel_port` is `port`, or a free one). Started unless `start` is False (the
    caller then starts and closes it)."""
    kv = torch.zeros(KV_BYTES, dtype=torch.uint8)
    memory = synthesize_memory("LBHNC", geometry, list(layers), 2, num_blocks, kv.data_ptr())
    settings = BridgeConfig(side_channel_port=port or free_base_port(1), **config)
    identity = WorkerIdentity(engine_id, ParallelLayout(), 0, WorkerRank(0, 0), geometry)
    worker = PrefillWorker(identity, memory, settings, key=key)
    worker._kv = kv  # the registered memory lives as long as the worker
    return worker.start() if start else worker
