"""The decode's book of prefill engines: an engine found gone is refused at once for dead_engine_s and connected
again after it; params issued before the worker read started (an earlier run) are refused. No sockets: the
handshake is never reached while an engine is known dead, and `_build` is replaced to count the probes."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import ParamsRefused, TransferError
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.peers import Engine, Peer, PeerBook, check_run, engine_key
from kvbridge.wire.params import PrefillDone

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
RANK = WorkerRank(0, 0)
MEMORY = synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, 8, 1 << 20)
POOL = ThreadPoolExecutor(1)  # the handshake pool (handshakes take the book's lock, so not inline)


def source(issued: float = 0.0) -> PrefillDone:
    return PrefillDone(
        remote_engine_id="p",
        remote_request_id="r",
        remote_block_ids=[1],
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_layout="pp=1,tp=1",
        remote_issued=issued,
    )


def engine(started: float) -> Engine:
    peer = Peer("agent", MEMORY, "epoch", started=started)
    return Engine(engine_key(source()), ParallelLayout(), {RANK: peer}, plan=None)


def book(dead_s: float) -> tuple[PeerBook, list[int]]:
    built: list[int] = []
    b = PeerBook(None, MEMORY, BridgeConfig(dead_engine_s=dead_s), POOL, add_agent=lambda m, n: n)

    def build(src, key):
        built.append(1)
        return engine(0.0)

    b._build = build
    return b, built


def test_an_engine_marked_dead_is_refused_without_connecting_until_dead_engine_s_passed():
    b, built = book(dead_s=0.3)
    first = b.connect(source())
    assert first.result(timeout=5) is not None and len(built) == 1
    b.mark_dead(first.result(), "refused")
    refused: Future = b.connect(source())
    with pytest.raises(TransferError, match="refused"):
        refused.result(timeout=0)
    assert len(built) == 1, "a dead engine was connected to"
    time.sleep(0.35)
    assert b.connect(source()).result(timeout=5) is not None and len(built) == 2  # the probe after dead_engine_s


def test_with_dead_engine_s_zero_every_load_connects_again():
    """Control of the test above: the refusal comes from the dead mark, not from anything else."""
    b, built = book(dead_s=0.0)
    b.mark_dead(b.connect(source()).result(timeout=5), "refused")
    assert b.connect(source()).result(timeout=5) is not None and len(built) == 2


def test_params_issued_before_the_worker_started_are_refused():
    started = 1_000_000.0
    with pytest.raises(ParamsRefused, match="earlier run") as refused:
        check_run(source(issued=started - 5), engine(started), (RANK,))
    assert refused.value.reason == "epoch"
    check_run(source(issued=started + 5), engine(started), (RANK,))  # this run's params
    check_run(source(issued=0.0), engine(started), (RANK,))  # an older prefill that does not say
    check_run(source(issued=started - 5), engine(0.0), (RANK,))  # a worker that does not say
