"""A prefill worker's staging slots through its real side channel (and its real NIXL agent): a Stage is served only
under this reader's claim, and a session's slots come back on abort and on the claim's expiry.

The clock is the worker's own (passed in), so expiry needs no sleeping.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.leases import blocks_digest
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.prefill_worker import PrefillWorker
from kvbridge.serving.launcher import free_base_port
from kvbridge.wire import messages as wire
from kvbridge.wire.side_channel_client import SideChannelClient

pytestmark = pytest.mark.nixl

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
BLOCKS = 16
BLOCK_IDS = (3, 7, 11)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def prefill():
    clock = Clock()
    config = BridgeConfig(
        side_channel_port=free_base_port(1),
        handshake_timeout_s=2.0,
        nixl_staging_bytes=1 << 18,
        nixl_staging_chunk_bytes=1 << 16,  # four slots
    )
    kv = torch.randn(1 << 14)
    memory = synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, BLOCKS, kv.data_ptr())
    worker = PrefillWorker(
        WorkerIdentity("p", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY), memory, config, clock=clock
    ).start()
    client = SideChannelClient(timeout_s=2.0, retries=1)
    try:
        yield worker, client, clock, memory
    finally:
        client.close()
        worker.close()


def finished_within(worker: PrefillWorker, ids: set[str], within_s: float) -> tuple[set[str], int]:
    """What `finished` reports until `ids` are in it or `within_s` passed: a call made while the worker's own
    thread is making progress (with the clock read before the test moved it) reports nothing new."""
    got, expired = set(), 0
    deadline = time.monotonic() + within_s
    while not ids <= got and time.monotonic() < deadline:
        new, n = worker.finished(0.05)
        got, expired = got | new, expired + n
    return got, expired


def slots_back(worker: PrefillWorker, within_s: float) -> bool:
    """Whether every staging session ended and every slot came back within `within_s` of rounds of progress (a
    slot comes back once the gather that filled it is done)."""
    stager = worker.stager
    deadline = time.monotonic() + within_s
    while (stager.sessions or stager.free_slots < stager.num_slots) and time.monotonic() < deadline:
        worker.finished(0.05)
    return stager.sessions == 0 and stager.free_slots == stager.num_slots


def ask(client, worker, message):
    return client.exchange_all([("127.0.0.1", worker.port)], message)[0]


def claim(request_id: str, token: str = "t", read_s: float = 10.0) -> wire.Claim:
    return wire.Claim(
        request_id=request_id,
        block_ids=BLOCK_IDS,
        engine_id="d",
        worker=wire.Worker(),
        token=token,
        prompt_hash="h",
        read_timeout_s=read_s,
        blocks_digest=blocks_digest(BLOCK_IDS),  # the request is held with exactly these blocks, in this order
    )


def stage(memory, request_id: str, token: str = "t") -> wire.Stage:
    lk = memory.layers[0]
    return wire.Stage(
        request_id=request_id,
        engine_id="d",
        worker=wire.Worker(),
        token=token,
        block_ids=BLOCK_IDS,
        src_addr=(lk.addr,),
        block_stride=(lk.block_stride,),
        length=(lk.block_stride,),
        chunk_bytes=lk.block_stride,  # one block per chunk: three chunks, two slots
    )


def test_a_stage_needs_this_readers_claim(prefill):
    worker, client, _, memory = prefill
    worker.hold("r", (BLOCK_IDS,), "t", "h")
    unclaimed = ask(client, worker, stage(memory, "r"))
    assert isinstance(unclaimed, wire.ErrorReply) and unclaimed.reason is wire.Refusal.NOT_CLAIMED, unclaimed
    assert isinstance(ask(client, worker, claim("r")), wire.Ack)
    forged = ask(client, worker, stage(memory, "r", token="x"))
    assert isinstance(forged, wire.ErrorReply) and forged.reason is wire.Refusal.NOT_CLAIMED, forged
    staged = ask(client, worker, stage(memory, "r"))
    assert isinstance(staged, wire.Staged) and staged.chunks == 3, staged
    # the chunk holds block 3's bytes of layer 0, gathered from the KV
    lk = memory.layers[0]
    kv = worker.stager._views.rows(lk.addr, lk.block_stride, lk.block_stride, BLOCKS)
    got = worker.stager.buffer[staged.offset : staged.offset + staged.nbytes]
    assert bytes(got) == bytes(kv[3])


def test_abort_gives_the_slots_back(prefill):
    worker, client, _, memory = prefill
    worker.hold("r", (BLOCK_IDS,), "t", "h")
    assert isinstance(ask(client, worker, claim("r")), wire.Ack)
    assert isinstance(ask(client, worker, stage(memory, "r")), wire.Staged)
    stager = worker.stager
    assert stager.sessions == 1 and stager.free_slots == stager.num_slots - 2
    assert isinstance(
        ask(client, worker, wire.Abort(request_id="r", engine_id="d", worker=wire.Worker(), token="t")), wire.Ack
    )
    assert slots_back(worker, 5.0)


def test_the_claims_expiry_gives_the_slots_back(prefill):
    worker, client, clock, memory = prefill
    worker.hold("r", (BLOCK_IDS,), "t", "h")
    assert isinstance(ask(client, worker, claim("r", read_s=1.0)), wire.Ack)
    assert isinstance(ask(client, worker, stage(memory, "r")), wire.Staged)
    stager = worker.stager
    worker.finished()
    assert stager.sessions == 1  # still pinned
    clock.now += 1.0 + 5.0 + 0.1  # the pin (read_s, at least 1 s) plus READ_MARGIN_S
    ids, expired = finished_within(worker, {"r"}, 5.0)
    assert ids == {"r"} and expired == 1
    assert slots_back(worker, 5.0)
    late = ask(client, worker, stage(memory, "r"))  # nothing is gathered for an expired request
    assert isinstance(late, wire.ErrorReply), late
