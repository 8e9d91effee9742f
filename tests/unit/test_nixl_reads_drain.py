"""Nothing is reported done or failed while a READ may still write (issue 14, item 4).

A unit test of ordering in `runtime.nixl_reads.NixlReads`: its transport is replaced by a fake that records every
call, so the test decides when NIXL accepts a release and when a READ's DMA ends. The real NIXL behaviour this
models: releasing an unfinished READ asks NIXL to cancel it, and NIXL may refuse (`NixlTransport.release` raises,
the memory may still be written); a post that fails may leave its request with NIXL (`TransferError.transfer`).
The oracle: a load is reported (loaded or failed) only after every READ it posted was released, and a READ still
in flight is never released. Each scenario is also run against a variant of NixlReads that reports at once, to
show the oracle notices.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvbridge.core.config import BridgeConfig
from kvbridge.core.descriptors import Descriptors
from kvbridge.core.errors import TransferError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.load import Load, LoadJob
from kvbridge.runtime.nixl_reader import NixlReader
from kvbridge.runtime.nixl_reads import NixlReads
from kvbridge.transport.nixl import Transfer
from kvbridge.wire import messages as wire

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
RANKS = (WorkerRank(0, 0), WorkerRank(0, 1))  # a prefill engine of tp=2: one READ from each worker


class FakeTransport:
    """What NixlReads calls on NixlTransport, with the test deciding the outcomes. `events` logs, in order:
    ("post", i), ("post-failed", i), ("release-refused", i), ("released", i), ("release-in-flight", i)."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(prepared_lists=False)
        self.ucx_env: dict[str, str] = {}
        self.events: list[tuple[str, int]] = []
        self.transfers: list[Transfer] = []
        self.dma_done: set[int] = set()  # READs whose DMA has ended (the test sets this)
        self.refuse_release: dict[int, int] = {}  # READ -> how many more releases NIXL refuses
        self.fail_post: dict[int, bool] = {}  # READ -> fails to post (True: and NIXL keeps its request)
        self.held: set[int] = set()  # READs NIXL took: posted, or failed to post and kept
        self.peers: set[str] = set()  # no agent loaded: a failed load is not fenced (test_nixl_reads_flush is)

    def read(self, agent, descriptors, local, remote, notification) -> Transfer:
        i = len(self.transfers)
        transfer = Transfer(agent, descriptors.nbytes, len(descriptors), notification, time.monotonic())
        self.transfers.append(transfer)
        if i in self.fail_post:
            self.events.append(("post-failed", i))
            error = TransferError(f"NIXL refused to post READ {i}")
            if self.fail_post[i]:  # as NixlTransport._discard: the request could not be released
                error.transfer = transfer
                self.held.add(i)
            else:
                transfer.state = "RELEASED"
            raise error
        self.events.append(("post", i))
        self.held.add(i)
        return transfer

    def poll(self, transfer: Transfer) -> bool:
        i = self.transfers.index(transfer)
        if i in self.dma_done and transfer.state == "PROC":
            transfer.state = "DONE"
        return transfer.state != "PROC"

    def release(self, transfer: Transfer) -> None:
        i = self.transfers.index(transfer)
        if transfer.state == "RELEASED":
            return
        if self.refuse_release.get(i, 0) > 0:
            self.refuse_release[i] -= 1
            self.events.append(("release-refused", i))
            raise TransferError(f"NIXL refused to release READ {i}")
        if i not in self.dma_done:  # NIXL cannot cancel a READ whose DMA runs (the real backend may refuse)
            self.events.append(("release-refused", i))
            raise TransferError(f"READ {i} is still in flight")
        transfer.state = "RELEASED"
        self.events.append(("released", i))


def make_reads(fake: FakeTransport, reports: list, cls: type[NixlReads] = NixlReads) -> NixlReads:
    memory = synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, 16, 1 << 20)
    identity = WorkerIdentity("d", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY)
    peers = SimpleNamespace(drop=lambda engine, error: None)

    def loaded(load: Load) -> None:
        reports.append(("loaded", len(fake.events)))

    def failed(load: Load, error: str) -> None:
        reports.append(("failed", len(fake.events)))

    reader = NixlReader(fake, identity, "DRAM")  # the fake in place of a NixlTransport
    tell = lambda *a: None  # noqa: E731
    return cls(identity, memory, BridgeConfig(), "DRAM", peers, loaded=loaded, failed=failed, tell=tell, reader=reader)


def make_load(reads: NixlReads, ranks=RANKS, timeout_s: float = 60.0) -> Load:
    one = np.array([0], dtype=np.int64)
    descs = {rank: Descriptors(one, one, np.array([64], dtype=np.int64), one, one) for rank in ranks}
    reads._descriptors = lambda load, engine: descs  # the plan's descriptors are not what this tests
    peers = {rank: SimpleNamespace(agent=f"prefill-tp{rank.tp}", memory=reads.memory) for rank in ranks}
    engine = SimpleNamespace(key=("p", "127.0.0.1", 1), peers=peers, layout=ParallelLayout(tp=len(ranks)))
    job = LoadJob("req", None, ((3,),), ((1,),))
    now = time.monotonic()
    return Load(job, now, now + timeout_s, engine=engine)


def note() -> wire.Notify:
    return wire.Notify(request_id="req", engine_id="d", worker=wire.Worker(), expected=1, token="t")


def violations(fake: FakeTransport, reports: list) -> list[str]:
    """What the oracle finds wrong: a report before every posted READ was released, a second report, or a
    release of a READ whose DMA had not ended."""
    found = []
    if len(reports) > 1:
        found.append(f"reported {len(reports)} times: {reports}")
    for kind, at in reports:
        before = fake.events[:at]
        for i in sorted(fake.held):
            if ("released", i) not in before:
                found.append(f"{kind} reported while READ {i} was not released (events {before})")
    return found


# -- the scenarios: each returns (fake, reports) -------------------------------------------------------


def release_refused_twice(outcome: str, cls: type[NixlReads] = NixlReads):
    """(a) One READ ends (done, or past its deadline: timed out); NIXL refuses its release twice, then accepts."""
    fake, reports = FakeTransport(), []
    reads = make_reads(fake, reports, cls)
    load = make_load(reads, ranks=RANKS[:1], timeout_s=60.0 if outcome == "done" else 0.0)
    if outcome == "done":
        fake.dma_done.add(0)
    fake.refuse_release[0] = 2
    reads.post(load, note())
    for _ in range(4):
        reads.poll()
        if outcome == "timed out":
            fake.dma_done.add(0)  # the DMA of a timed-out READ ends some time later
    return fake, reports


def second_post_fails(keeps: bool, cls: type[NixlReads] = NixlReads):
    """(b) The second READ fails to post (`keeps`: NIXL kept its request) while the first is still in flight."""
    fake, reports = FakeTransport(), []
    reads = make_reads(fake, reports, cls)
    load = make_load(reads)
    fake.fail_post[1] = keeps
    if keeps:
        fake.refuse_release[1] = 1
    reads.post(load, note())
    for _ in range(3):  # the first READ's DMA still runs: nothing may be reported
        reads.poll()
        if cls is NixlReads:
            assert reports == [], f"failure reported while READ 0 was in flight: {fake.events}"
    fake.dma_done.update({0, 1})  # the DMA ends
    for _ in range(3):
        reads.poll()
    return fake, reports


@pytest.mark.parametrize("outcome", ["done", "timed out"])
def test_a_load_is_reported_only_once_nixl_released_its_read(outcome):
    fake, reports = release_refused_twice(outcome)
    expected = "loaded" if outcome == "done" else "failed"
    assert [kind for kind, _ in reports] == [expected]
    releases = [e for e in fake.events if e[0].startswith("release")]
    assert releases == [("release-refused", 0), ("release-refused", 0), ("released", 0)]
    assert violations(fake, reports) == []


@pytest.mark.parametrize("keeps", [False, True], ids=["post-released", "post-kept-by-nixl"])
def test_a_failed_post_is_reported_only_after_the_reads_posted_before_it_drained(keeps):
    fake, reports = second_post_fails(keeps)
    assert [kind for kind, _ in reports] == ["failed"]
    assert ("released", 0) in fake.events  # the first READ was waited for, never orphaned
    if keeps:
        assert ("released", 1) in fake.events  # and so was the request NIXL kept after the failed post
    assert violations(fake, reports) == []


# -- negative controls: a NixlReads that reports at once is caught ---------------------------------------


class ReportsAtOnce(NixlReads):
    """The bug item 4 is about: a failure is reported at once, and a refused release counts as released."""

    def _drain_and_fail(self, load, error, broken=None):
        load.error = error
        self._release_all(load)
        self._settle(load)

    def _release_all(self, load):
        super()._release_all(load)
        return True


def test_the_oracle_notices_a_load_reported_while_nixl_holds_its_read():
    fake, reports = release_refused_twice("done", ReportsAtOnce)
    assert reports and violations(fake, reports), (fake.events, reports)
    fake, reports = release_refused_twice("timed out", ReportsAtOnce)
    assert reports and violations(fake, reports), (fake.events, reports)


@pytest.mark.parametrize("keeps", [False, True], ids=["post-released", "post-kept-by-nixl"])
def test_the_oracle_notices_a_failure_reported_while_a_read_is_in_flight(keeps):
    fake, reports = second_post_fails(keeps, ReportsAtOnce)
    assert reports and violations(fake, reports), (fake.events, reports)


def test_the_oracle_notices_an_orphaned_read(monkeypatch):
    """A variant that forgets the pending request of a failed post (drops `error.transfer`) is caught too."""
    fake, reports = FakeTransport(), []
    reads = make_reads(fake, reports)
    load = make_load(reads)
    fake.fail_post[1] = True
    fake.refuse_release[1] = 1
    monkeypatch.setattr(load, "transfers", _Forgetful(load.transfers, forget=1))
    reads.post(load, note())
    fake.dma_done.update({0, 1})
    for _ in range(3):
        reads.poll()
    assert reports == [("failed", reports[0][1])]
    assert violations(fake, reports), (fake.events, reports)


class _Forgetful(list):
    """A load's transfer list that drops the `forget`-th transfer appended (the orphaning bug)."""

    def __init__(self, items, forget: int) -> None:
        super().__init__(items)
        self._n, self._forget = 0, forget

    def append(self, item) -> None:
        if self._n != self._forget:
            super().append(item)
        self._n += 1
