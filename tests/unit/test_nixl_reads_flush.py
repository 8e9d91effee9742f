"""A READ released unfinished: its load is reported failed, and its agent removed, only after a flush READ from
that agent is done (issues 14 and 18).

A unit test of ordering in `runtime.nixl_reads.NixlReads`, with the recording fake of `support.nixl_reads_fakes`. Why:
NIXL's release does not stop UCX's GET: its data lands once the link is back, into blocks vLLM has given to another
request if the failed load was reported at once; and UCX 1.23 over tcp can crash a prefill worker (SIGSEGV in
ucp_worker_discard_uct_ep -> uct_tcp_ep_pending_purge) when the decode closes the endpoint while the prefill still
has answers to released READs queued, e.g. after a link cut (bench/ucx_cut_stress.py). The oracles: no failure
reported, no `remove_peer` of such an agent and no close of the transport before a flush READ from it was posted
and done (or its deadline passed). Variants that report or remove at once (the code before) are caught.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from kvbridge.core.config import BridgeConfig
from kvbridge.runtime.nixl_reads import NixlReads
from support.nixl_reads_fakes import RANKS, FakeTransport, make_load, make_reads, note

AGENT = "prefill-tp0"


class FlushFake(FakeTransport):
    """FakeTransport with one agent loaded, the flush READs' DMA times, and ("closed", 0) at close."""

    def __init__(self) -> None:
        super().__init__()
        self.peers = {AGENT}
        self.flushed_at: dict[int, int] = {}  # flush READ -> the event count when its DMA ended

    def close(self) -> None:
        self.events.append(("closed", 0))


def cut_load(cls: type[NixlReads] = NixlReads, timeout_s: float = 60.0):
    """A load whose one READ times out while the link is cut (its DMA ends later, as UCX's GET does once the
    link is back), then is released: the fence's flush READ (transfer 1) is posted, not done. Returns
    (fake, reads, engine, reports)."""
    fake, reports = FlushFake(), []
    reads = make_reads(fake, reports, cls)
    reads.config = BridgeConfig(transfer_timeout_s=timeout_s)
    load = make_load(reads, ranks=RANKS[:1], timeout_s=0.0)
    reads.peers = SimpleNamespace(drop=lambda engine, error: None, all_engines=lambda: [load.engine])
    reads.post(load, note())
    reads.poll()  # past its deadline: failed, its release refused while the DMA runs
    fake.dma_done.add(0)
    reads.poll()
    return fake, reads, load.engine, reports


def removed_before_flushed(fake: FlushFake) -> list[str]:
    """What the oracle finds wrong: the agent removed (or the transport closed) before a flush READ from it was
    done, that is before the test ended that flush's DMA."""
    found = []
    for at, (kind, what) in enumerate(fake.events):
        if kind not in ("removed", "closed"):
            continue
        flushes = [i for k, i in fake.events[:at] if k == "flush"]
        if not flushes:
            found.append(f"{kind} {what} with no flush READ before it (events {fake.events})")
        elif not any(i in fake.flushed_at and fake.flushed_at[i] <= at for i in flushes):
            found.append(f"{kind} {what} while its flush READ was still in flight (events {fake.events})")
    return found


def end_flushes(fake: FlushFake) -> None:
    """The flush READs' DMA ends now (recorded against the event count, for the oracle)."""
    for kind, i in fake.events:
        if kind == "flush" and i not in fake.dma_done:
            fake.dma_done.add(i)
            fake.flushed_at[i] = len(fake.events)


def test_a_failed_load_whose_read_was_running_is_reported_only_after_a_flush_read_is_done():
    fake, reads, _, reports = cut_load()
    assert ("flush", 1) in fake.events and reports == [], "reported while a released READ may still write"
    for _ in range(3):
        reads.poll()
    assert reports == []
    end_flushes(fake)
    reads.poll()
    assert [kind for kind, _ in reports] == ["failed"] and ("released", 1) in fake.events


class ReportsAtOnce(NixlReads):
    """The code before the fence: a failed load is reported as soon as NIXL accepted its READs' release."""

    def _settle(self, load):
        if load.error:
            self.failed(load, load.error)
        else:
            self.loaded(load)


def test_the_oracle_notices_a_failed_load_reported_while_a_released_read_may_write():
    fake, _, _, reports = cut_load(ReportsAtOnce)
    assert [kind for kind, _ in reports] == ["failed"] and not any(k == "flush" for k, _ in fake.events)


def test_a_fence_whose_flush_never_completes_renews_the_agent_before_reporting():
    """Removing the agent would not do: NIXL closes its endpoint in flush mode (tests/nixl/test_nixl_renew.py)."""
    fake, reads, _, reports = cut_load(timeout_s=0.05)
    reads.poll()
    assert reports == [] and not any(kind == "renewed" for kind, _ in fake.events)
    time.sleep(0.1)
    reads.poll()
    assert [kind for kind, _ in reports] == ["failed"], fake.events
    assert reports[0][1] > fake.events.index(("renewed", (AGENT,)))  # reported after the renewal
    assert ("removed", AGENT) not in fake.events and AGENT not in fake.peers


def test_a_reaped_agent_with_a_released_read_is_removed_once_its_flush_read_is_done():
    fake, reads, engine, _ = cut_load()
    reads.forget(engine)
    assert ("flush", 2) in fake.events and ("removed", AGENT) not in fake.events
    for _ in range(3):
        reads.poll()
    assert ("removed", AGENT) not in fake.events, "removed while the flush READ was in flight"
    end_flushes(fake)
    reads.poll()
    assert ("removed", AGENT) in fake.events and ("released", 2) in fake.events
    assert removed_before_flushed(fake) == []


def test_a_flush_read_that_never_completes_keeps_a_reaped_agent_only_until_its_deadline():
    fake, reads, engine, reports = cut_load(timeout_s=0.05)
    reads.forget(engine)
    reads.poll()
    assert AGENT in fake.peers and reports == []
    time.sleep(0.1)
    reads.poll()
    assert AGENT not in fake.peers and ("renewed", (AGENT,)) in fake.events  # a peer gone for good is not kept
    assert ("removed", AGENT) not in fake.events  # never removed first: its fence would look done
    assert [kind for kind, _ in reports] == ["failed"]


def test_at_close_an_agent_with_a_released_read_is_flushed_first():
    fake, reads, _, _ = cut_load()
    real_poll = fake.poll

    def poll(transfer):  # the flush's DMA ends after a few polls, as over a link that just came back
        if transfer is fake.transfers[-1] and len([e for e in fake.events if e[0] == "polled"]) >= 3:
            end_flushes(fake)
        fake.events.append(("polled", 0))
        return real_poll(transfer)

    fake.poll = poll
    reads.close()
    assert ("flush", 1) in fake.events and fake.events[-1] == ("closed", 0)
    assert removed_before_flushed(fake) == []


def test_an_agent_whose_reads_all_completed_is_removed_at_once():
    fake, reports = FlushFake(), []
    reads = make_reads(fake, reports)
    load = make_load(reads, ranks=RANKS[:1])
    fake.dma_done.add(0)
    reads.post(load, note())
    reads.poll()
    assert [kind for kind, _ in reports] == ["loaded"]
    reads.forget(load.engine)
    assert fake.events[-1] == ("removed", AGENT) and not any(k == "flush" for k, _ in fake.events)


class RemovesAtOnce(NixlReads):
    """The code before: a reaped engine's agents are removed at once."""

    def forget(self, engine):
        with self.reader.lock:
            for peer in engine.peers.values():
                self._forget_agent(peer.agent)


def test_the_oracle_notices_an_agent_removed_while_its_answers_may_be_queued():
    fake, reads, engine, _ = cut_load(RemovesAtOnce)
    reads.forget(engine)
    assert removed_before_flushed(fake), fake.events


def test_a_failed_load_with_an_unfenced_staged_part_is_fenced_before_it_is_reported():
    """A staged part whose READ was released unfinished and whose own flush did not complete (`unfenced`,
    runtime/staged_reads.py) may still write KV blocks: its agent is flushed by the load's fence too."""
    fake, reports = FlushFake(), []
    reads = make_reads(fake, reports)
    load = make_load(reads, ranks=RANKS[:1])
    reads.peers = SimpleNamespace(drop=lambda engine, error: None, all_engines=lambda: [load.engine])
    part = SimpleNamespace(finished=False, error="", unfenced=False, peer=SimpleNamespace(agent=AGENT))
    load.staged = [part]
    fake.dma_done.add(0)
    reads.post(load, note())
    reads.poll()  # the direct READ is done; the staged part still runs
    assert reports == [] and load.transfers[0].done
    part.finished, part.error, part.unfenced = True, "staged read failed", True
    reads.poll()
    assert reports == [] and ("flush", 1) in fake.events, (fake.events, reports)
    end_flushes(fake)
    reads.poll()
    assert [kind for kind, _ in reports] == ["failed"]
