"""A claim that reaches a prefill worker before the request's hold waits for the hold, instead of being refused
and retried: it is answered when the hold comes, with every check the claim makes anyway (token, prompt hash,
blocks and their order), and refused as not held once its wait passed. The number kept waiting is bounded."""

from __future__ import annotations

import threading
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
from kvbridge.wire.auth import Sealer
from kvbridge.wire.keys import KeyRing, request_token
from kvbridge.wire.side_channel_client import exchange

pytestmark = pytest.mark.nixl

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
KEY = b"k" * 32
P = ("p", 0, 0, 0)


def make_prefill(key: bytes | None = None, **bounds) -> PrefillWorker:
    kv = torch.zeros(1 << 16, dtype=torch.uint8)
    memory = synthesize_memory("LBHNC", GEOMETRY, range(16), 2, 4, kv.data_ptr())
    config = BridgeConfig(side_channel_port=free_base_port(1), **bounds)
    identity = WorkerIdentity("p", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY)
    worker = PrefillWorker(identity, memory, config, key=key)
    worker._kv = kv  # the registered memory lives as long as the worker
    return worker.start()


def claim(request_id: str = "r", token: str = "tok", wait_s: float = 2.0, blocks=(1, 2)) -> wire.Claim:
    return wire.Claim(
        request_id=request_id,
        block_ids=blocks,
        engine_id="d",
        worker=wire.Worker(),
        token=token,
        prompt_hash="h",
        blocks_digest=blocks_digest(blocks),
        wait_s=wait_s,
    )


def ask(worker: PrefillWorker, message: wire.Claim, out: list, key: bytes | None = None) -> threading.Thread:
    """Send `message` on a thread of its own; its (answer, seconds) lands in `out`."""
    sealer = Sealer(key) if key else None

    def run() -> None:
        t0 = time.monotonic()
        answer = exchange("127.0.0.1", worker.port, message, timeout_s=5, retries=0, sealer=sealer, identity=P)
        out.append((answer, time.monotonic() - t0))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("key", [None, KEY], ids=["no-key", "sealed"])
def test_a_claim_before_its_hold_is_granted_when_the_hold_comes(key):
    worker = make_prefill(key)
    try:
        out: list = []
        thread = ask(worker, claim(), out, key)
        time.sleep(0.3)  # the claim is waiting on the worker now
        assert not out
        held_at = time.monotonic()
        worker.hold("r", ((1, 2),), token="tok", prompt_hash="h", finished_at=held_at - 0.01)
        thread.join(5)
        answer, _ = out[0]
        assert answer == wire.Ack(request_id="r", epoch=worker.epoch)
        assert time.monotonic() - held_at < 0.2  # answered at the hold, not at a poll
        abort = wire.Abort(request_id="r", engine_id="d", worker=wire.Worker(), token="tok")
        sealer = Sealer(key) if key else None
        assert isinstance(exchange("127.0.0.1", worker.port, abort, timeout_s=5, sealer=sealer, identity=P), wire.Ack)
        deadline = time.monotonic() + 5
        while "r" not in worker.finished()[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        (hold, claimed, _released), *_ = worker.take_phases()
        assert 0.005 < hold < 0.1 and claimed < 0.05  # finished -> held; held -> claim answered (it was waiting)
    finally:
        worker.close()


def test_a_waiting_claim_gets_every_check_of_a_claim():
    """Waiting gives nothing away: a claim with a wrong token, or other blocks, is refused when the hold comes,
    with the reason a claim after the hold gets."""
    worker = make_prefill()
    try:
        out: list = []
        threads = [ask(worker, claim(token="guess"), out), ask(worker, claim(blocks=(2, 1)), out)]
        time.sleep(0.3)
        worker.hold("r", ((1, 2),), token="tok", prompt_hash="h")
        for thread in threads:
            thread.join(5)
        reasons = sorted(a.reason.value for a, _ in out)
        assert reasons == ["mismatch", "not_held"]
        assert all(isinstance(a, wire.ErrorReply) for a, _ in out)
        # the control: the right claim after the hold is granted
        assert isinstance(exchange("127.0.0.1", worker.port, claim(), timeout_s=5), wire.Ack)
    finally:
        worker.close()


def test_a_claim_whose_hold_never_comes_is_refused_as_not_held_after_its_wait():
    worker = make_prefill()
    try:
        out: list = []
        ask(worker, claim(wait_s=0.3), out).join(5)
        answer, took = out[0]
        assert isinstance(answer, wire.ErrorReply) and answer.reason is wire.Refusal.NOT_HELD
        assert 0.25 < took < 1.0
        assert worker.lease_counts()["refused"] == 1
    finally:
        worker.close()


@pytest.mark.parametrize("kept", [0, 1])
def test_the_waiting_claims_are_bounded(kept):
    """Beyond `max_waiting_claims` a claim of an unknown request is refused at once (a forged flood costs at most
    that many entries); 0 turns waiting off."""
    worker = make_prefill(max_waiting_claims=kept)
    try:
        out: list = []
        first = ask(worker, claim("a", wait_s=1.0), out)
        time.sleep(0.2)
        second: list = []
        ask(worker, claim("b", wait_s=1.0), second).join(5)
        answer, took = second[0]
        assert answer.reason is wire.Refusal.NOT_HELD and took < 0.2  # refused at once
        first.join(5)
        assert out[0][1] > 0.9 if kept else out[0][1] < 0.2
    finally:
        worker.close()


def test_the_block_ids_of_waiting_claims_are_bounded(monkeypatch):
    """A few claims of the largest frames must not keep gigabytes: beyond MAX_WAITING_BLOCK_IDS block ids in all,
    a claim of an unknown request is answered at once; the ids come back once a claim is answered."""
    from kvbridge.runtime import waiting_claims

    monkeypatch.setattr(waiting_claims, "MAX_WAITING_BLOCK_IDS", 3)
    worker = make_prefill()
    try:
        out: list = []
        first = ask(worker, claim("a", wait_s=0.5, blocks=(1, 2)), out)
        time.sleep(0.2)
        second: list = []
        ask(worker, claim("b", wait_s=0.5, blocks=(1, 2)), second).join(5)  # 2 + 2 ids > 3: at once
        assert second[0][0].reason is wire.Refusal.NOT_HELD and second[0][1] < 0.2
        first.join(5)
        assert out[0][1] > 0.4  # the first waited
        third: list = []
        ask(worker, claim("c", wait_s=0.3, blocks=(1, 2)), third).join(5)  # the first's ids were given back
        assert third[0][1] > 0.25
    finally:
        worker.close()


@pytest.mark.parametrize("how", ["aborted", "read"])
def test_a_claim_of_a_freed_request_is_refused_at_once(how):
    """A request held here and freed (aborted, or read by all its readers) will not be held again: a claim of it
    with its token is refused as not held at once instead of waiting out its wait; one without the token waits as
    for a request never held. The control: a claim that comes before its request's hold still waits and is
    granted when the hold comes."""
    worker = make_prefill()
    try:
        worker.hold("r", ((1, 2),), token="tok", prompt_hash="h")
        free = (
            wire.Abort(request_id="r", engine_id="d", worker=wire.Worker(), token="tok")
            if how == "aborted"
            else wire.Notify(request_id="r", engine_id="d", worker=wire.Worker(), token="tok")
        )
        assert isinstance(exchange("127.0.0.1", worker.port, free, timeout_s=5), wire.Ack)
        deadline = time.monotonic() + 5
        while "r" not in worker.finished()[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        out: list = []
        ask(worker, claim("r", wait_s=2.0), out).join(5)
        answer, took = out[0]
        assert isinstance(answer, wire.ErrorReply) and answer.reason is wire.Refusal.NOT_HELD
        assert answer.final  # the reader stops asking: no claim window brings a freed request back
        assert took < 0.2  # not the claim's 2 s wait
        guess: list = []
        ask(worker, claim("r", token="guess", wait_s=0.3), guess).join(5)
        assert guess[0][0].reason is wire.Refusal.NOT_HELD and not guess[0][0].final
        assert guess[0][1] > 0.25  # without the token: as a request never held, nothing said of this one
        control: list = []
        thread = ask(worker, claim("s", wait_s=2.0), control)
        time.sleep(0.3)
        assert not control  # waiting for its hold
        worker.hold("s", ((1, 2),), token="tok", prompt_hash="h")
        thread.join(5)
        assert control[0][0] == wire.Ack(request_id="s", epoch=worker.epoch)
    finally:
        worker.close()


@pytest.mark.parametrize("key", [None, KEY], ids=["no-key", "sealed"])
def test_an_abort_before_its_hold_frees_the_request_when_the_hold_comes(key):
    """A decode gives up on a request whose hold has not reached this worker yet (the scheduler's feed was late):
    the abort is taken, and the hold, when it comes, frees the request at once rather than at its lease. The
    control: the same hold without the abort stays held."""
    worker = make_prefill(key)
    sealer = Sealer(key) if key else None
    token = request_token(KeyRing.of(key), "p", "r", b"\0" * 8) if key else "tok"
    try:
        abort = wire.Abort(request_id="r", engine_id="d", worker=wire.Worker(), token=token)
        assert isinstance(exchange("127.0.0.1", worker.port, abort, timeout_s=5, sealer=sealer, identity=P), wire.Ack)
        worker.hold("r", ((1, 2),), token=token, prompt_hash="h")
        worker.hold("control", ((3,),), token=token, prompt_hash="h")
        deadline = time.monotonic() + 5
        freed: set[str] = set()
        while "r" not in freed and time.monotonic() < deadline:
            freed |= worker.finished(0.05)[0]
        assert "r" in freed
        end = time.monotonic() + 0.5  # the control, polled as long again: held without an abort
        while time.monotonic() < end:
            freed |= worker.finished(0.05)[0]
        assert "control" not in freed
        assert worker.lease_counts()["aborted"] == 1
    finally:
        worker.close()
