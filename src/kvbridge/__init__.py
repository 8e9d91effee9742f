"""kvbridge: move LLM KV caches from prefill to decode instances over NIXL, for any DP x PP x TP layout pair.

The folders are the layers; each imports only from the floors below it (`tests/test_layers.py`):
    core/       pure: layouts, plans, memory and descriptor math, leases, config (no I/O, no torch)
    wire/       messages, kv_transfer_params and the ZMQ side channel        (core)
    transport/  NIXL, CUDA IPC and the gather kernel, torch tensors as memory  (core)
    runtime/    the prefill and decode worker runtimes and their threads     (core, wire, transport)
    vllm/       the KV connector: a thin translation to the runtimes         (all of the above)
    serving/    the `kvbridge` command: proxy, serve, server launcher, demo   (all of the above)
    testing/    harnesses for tests and benchmarks; nothing else imports it
This package re-exports the core's public names. Glossary: see `kvbridge.core.topology`.
"""

from kvbridge.core.descriptors import Descriptors, read_descriptors, worker_descriptors
from kvbridge.core.errors import (
    IncompatiblePeerError,
    KVBridgeError,
    LayoutError,
    ProtocolError,
    RequestParamsError,
    TransferError,
    TransferTimeout,
)
from kvbridge.core.memory import LayerKV, Region, WorkerMemory, layer_from_strides, synthesize_memory
from kvbridge.core.plan import Read, TransferPlan, make_plan
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank

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
