"""kvbridge: move LLM KV caches from prefill to decode instances over NIXL, for any DP x PP x TP layout pair.

The pure core (no vLLM, no NIXL): `topology` (layouts, layer and head splits), `plan` (who reads what from
whom), `memory` (where a worker's KV bytes are), `descriptors` (the byte runs of one request).
The shells: `transport` (NIXL), `side_channel` and `wire` (handshakes over ZMQ, msgspec messages), and the
vLLM connector. Glossary: see `kvbridge.topology`.
"""

from kvbridge.descriptors import Descriptors, read_descriptors, worker_descriptors
from kvbridge.errors import (
    IncompatiblePeerError,
    KVBridgeError,
    LayoutError,
    ProtocolError,
    RequestParamsError,
    TransferError,
    TransferTimeout,
)
from kvbridge.memory import LayerKV, Region, WorkerMemory, layer_from_strides, synthesize_memory
from kvbridge.plan import Read, TransferPlan, make_plan
from kvbridge.topology import KVGeometry, ParallelLayout, WorkerRank

__version__ = "0.1.0"

__all__ = [
    "Descriptors",
    "IncompatiblePeerError",
    "KVBridgeError",
    "KVGeometry",
    "LayerKV",
    "LayoutError",
    "ParallelLayout",
    "ProtocolError",
    "Read",
    "Region",
    "RequestParamsError",
    "TransferError",
    "TransferPlan",
    "TransferTimeout",
    "WorkerMemory",
    "WorkerRank",
    "layer_from_strides",
    "make_plan",
    "read_descriptors",
    "synthesize_memory",
    "worker_descriptors",
]
