"""The worker runtimes' side-channel duties with a real PrefillWorker (real NIXL agent, real ZMQ side channel)."""

from __future__ import annotations

import time

import pytest
import torch

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.prefill_worker import PrefillWorker
from kvbridge.serving.launcher import free_base_port
from kvbridge.wire import messages as wire
from kvbridge.wire.side_channel import exchange, fetch_handshake

pytestmark = pytest.mark.nixl

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)


@pytest.fixture
def prefill():
    layout = ParallelLayout()
    kv = torch.zeros(1 << 16, dtype=torch.uint8)
    memory = synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, 16, kv.data_ptr())
    config = BridgeConfig(side_channel_port=free_base_port(1), lease_s=30)
    worker = PrefillWorker(WorkerIdentity("p", layout, 0, WorkerRank(0, 0), GEOMETRY), memory, config).start()
    try:
        yield worker
    finally:
        worker.close()


def wait_finished(worker: PrefillWorker, timeout: float = 10.0) -> tuple[set[str], int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ids, expired = worker.finished()
        if ids:
            return ids, expired
        time.sleep(0.01)
    return set(), 0


def test_a_side_channel_notification_frees_a_held_request_at_once(prefill):
    """What a CUDA IPC reader sends after its kernel: acknowledged, and the blocks are freed, not expired."""
    prefill.hold("req-1", (3, 4))
    note = wire.Notify(request_id="req-1", engine_id="d", worker=wire.Worker(), expected=1)
    assert isinstance(exchange("127.0.0.1", prefill.port, note, timeout_s=5), wire.Ack)
    assert exchange("127.0.0.1", prefill.port, note, timeout_s=5) == wire.Ack(request_id="req-1")  # repeat: no-op
    assert wait_finished(prefill) == ({"req-1"}, 0)


def test_a_request_waits_for_every_expected_reader(prefill):
    prefill.hold("req-2", (1,))
    for tp in range(2):
        note = wire.Notify(request_id="req-2", engine_id="d", worker=wire.Worker(tp=tp), expected=2)
        assert prefill.finished() == (set(), 0)
        assert isinstance(exchange("127.0.0.1", prefill.port, note, timeout_s=5), wire.Ack)
    assert wait_finished(prefill) == ({"req-2"}, 0)


def test_a_cpu_worker_shares_no_cuda_ipc_handles(prefill):
    request = wire.HandshakeRequest.build(
        "d",
        ParallelLayout(),
        0,
        WorkerRank(0, 0),
        GEOMETRY,
        "LBHNC",
        synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, 16, 1 << 20),
        target=(0, WorkerRank(0, 0)),
    )
    reply = fetch_handshake("127.0.0.1", prefill.port, request, timeout_s=5)
    assert reply.ipc == () and reply.host_id
