"""A prefill worker holds a finished request as the scheduler finishes it, through the hold feed, without waiting
for a step's metadata: the decode's claim that follows the params is granted at once. A hold that then comes again
with the metadata changes nothing, also after the request was read and freed (it is reported finished once)."""

from __future__ import annotations

import time

import pytest

from kvbridge.core.leases import blocks_digest
from kvbridge.wire import messages as wire
from kvbridge.wire.hold_feed import HoldFeedReader, HoldNote
from kvbridge.wire.side_channel_client import exchange
from support.prefill_process import GEOMETRY
from support.prefill_workers import prefill_worker
from support.scheduler_sides import finished, producer

pytestmark = pytest.mark.nixl

P = ("p", 0, 0, 0)


def ask(worker, message: wire.Message) -> tuple[wire.Message, float]:
    t0 = time.monotonic()
    answer = exchange("127.0.0.1", worker.port, message, timeout_s=5, retries=0, identity=P)
    return answer, time.monotonic() - t0


def claim_of(params: dict, wait_s: float) -> wire.Claim:
    blocks = tuple(params["remote_block_ids"])
    return wire.Claim(
        request_id=params["remote_request_id"],
        block_ids=blocks,
        engine_id="d",
        worker=wire.Worker(),
        token=params["remote_token"],
        prompt_hash=params["remote_prompt_hash"],
        blocks_digest=blocks_digest(blocks),
        wait_s=wait_s,
    )


def subscribed(scheduler, worker) -> HoldFeedReader:
    """The worker's reader of the scheduler's feed, once it has joined (a warm-up note held)."""
    reader = HoldFeedReader.open(
        scheduler.feed.address,
        lambda n: worker.hold(n.request_id, n.groups, n.token, n.prompt_hash, n.finished_at, fed=True),
    )
    deadline = time.monotonic() + 3
    while not worker._leases.holds("warm-up") and time.monotonic() < deadline:
        scheduler.feed.send(HoldNote("warm-up", ((1,),), "w", "", time.monotonic()))
        time.sleep(0.01)
    assert worker._leases.holds("warm-up")
    return reader


@pytest.mark.parametrize("feed", [True, False], ids=["feed", "metadata-only"])
def test_a_claim_is_granted_before_any_step_brings_the_hold(feed):
    """The control (metadata only, no step here): the same claim waits its 0.5 s and is refused as not held."""
    scheduler = producer(hold_feed=feed)
    worker = prefill_worker(GEOMETRY)
    reader = subscribed(scheduler, worker) if feed else None
    try:
        _, params = finished(scheduler)
        answer, seconds = ask(worker, claim_of(params, wait_s=0.5))
        if feed:
            assert answer == wire.Ack(request_id="p1", epoch=worker.epoch)  # held: the control is refused
        else:
            assert isinstance(answer, wire.ErrorReply) and answer.reason == wire.Refusal.NOT_HELD
            assert seconds >= 0.45
    finally:
        if reader is not None:
            reader.close()
        worker.close()
        scheduler.close()


def test_a_hold_that_comes_again_changes_nothing():
    scheduler = producer()
    worker = prefill_worker(GEOMETRY)
    reader = subscribed(scheduler, worker)
    try:
        _, params = finished(scheduler)
        assert isinstance(ask(worker, claim_of(params, wait_s=0.5))[0], wire.Ack)
        (hold,) = scheduler.build_connector_meta().holds
        worker.hold(*hold)  # the metadata's copy, after the feed's and the claim: the claim stays granted
        assert worker._leases._entries["p1"].reader == "d"
        abort = wire.Abort(request_id="p1", engine_id="d", worker=wire.Worker(), token=params["remote_token"])
        assert isinstance(ask(worker, abort)[0], wire.Ack)
        reported = []
        deadline = time.monotonic() + 3
        while not reported and time.monotonic() < deadline:
            reported += [r for r in worker.finished()[0] if r == "p1"]
            time.sleep(0.01)
        assert reported == ["p1"]
        worker.hold(*hold)  # the metadata's copy after the release: not held again, not reported again
        assert not worker._leases.holds("p1")
        time.sleep(0.05)
        assert "p1" not in worker.finished()[0]
        # the control: a hold of the same id with another token is a new hold
        worker.hold("p1", hold[1], "another", hold[3], hold[4])
        assert worker._leases.holds("p1")
    finally:
        reader.close()
        worker.close()
        scheduler.close()


def test_the_metadatas_copy_of_a_fed_hold_is_dropped_whatever_was_freed_since():
    """The worker remembers the holds the feed brought until their metadata copy comes, so that copy is dropped
    even when the request's entry has left the list of lately freed requests. The control: a hold the feed did not
    bring, freed and gone from that list, is held again by a copy that comes later."""
    scheduler = producer()
    worker = prefill_worker(GEOMETRY)
    reader = subscribed(scheduler, worker)
    try:
        worker._leases.max_freed = 1  # any other free evicts the request from the lately freed
        _, params = finished(scheduler)
        deadline = time.monotonic() + 3
        while not worker._leases.holds("p1") and time.monotonic() < deadline:
            time.sleep(0.005)
        holds = scheduler.build_connector_meta().holds
        fed = next(h for h in holds if h[0] == "p1")
        unfed = ("q1", fed[1], "tok-q", fed[3], time.monotonic())
        worker.hold(*unfed)  # the control's request: from the metadata only
        for request_id, token in (("p1", params["remote_token"]), ("q1", "tok-q"), ("warm-up", "w")):
            abort = wire.Abort(request_id=request_id, engine_id="d", worker=wire.Worker(), token=token)
            assert isinstance(ask(worker, abort)[0], wire.Ack)
        deadline = time.monotonic() + 3
        gone: set = set()
        while not {"p1", "q1"} <= gone and time.monotonic() < deadline:
            gone |= worker.finished()[0]
            time.sleep(0.01)
        assert not worker._leases.freed("p1", params["remote_token"])  # evicted from the lately freed
        worker.hold(*fed)
        worker.hold(*unfed)
        assert not worker._leases.holds("p1")
        assert worker._leases.holds("q1")  # the control
    finally:
        reader.close()
        worker.close()
        scheduler.close()


def test_the_feeds_copy_after_the_metadatas_is_dropped_whatever_was_freed_since():
    """The other order: the metadata's copy came first (the feed's was late), the request was read and freed, and
    then left the list of lately freed requests; the feed's copy, within its age, is still dropped (with the lately
    freed list alone it would be held again). And a feed copy older than its age is dropped."""
    worker = prefill_worker(GEOMETRY)
    try:
        worker._leases.max_freed = 1
        hold = ("p1", ((7, 8),), "tok", "h", time.monotonic())
        worker.hold(*hold)  # the metadata's copy
        for request_id, token in (("p1", "tok"), ("q1", "tok-q")):
            if request_id == "q1":
                worker.hold("q1", ((9,),), "tok-q", "h", time.monotonic())
            abort = wire.Abort(request_id=request_id, engine_id="d", worker=wire.Worker(), token=token)
            assert isinstance(ask(worker, abort)[0], wire.Ack)
        deadline = time.monotonic() + 3
        gone: set = set()
        while not {"p1", "q1"} <= gone and time.monotonic() < deadline:
            gone |= worker.finished()[0]
            time.sleep(0.01)
        assert gone >= {"p1", "q1"} and not worker._leases.freed("p1", "tok")  # evicted from the lately freed
        worker.hold(*hold, fed=True)
        assert not worker._leases.holds("p1")
        worker.hold("r1", ((5,),), "tok-r", "h", time.monotonic() - 5, fed=True)  # the control: too old
        assert not worker._leases.holds("r1")
    finally:
        worker.close()
