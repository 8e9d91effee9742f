"""Nothing is reported done or failed while a READ may still write.

A unit test of ordering in `runtime.nixl_reads.NixlReads`: its transport is replaced by a fake that records every
call, so the test decides when NIXL accepts a release and when a READ's DMA ends. The real NIXL behaviour this
models: releasing an unfinished READ asks NIXL to cancel it, and NIXL may refuse (`NixlTransport.release` raises,
the memory may still be written); a post that fails may leave its request with NIXL (`TransferError.transfer`).
The oracle: a load is reported (loaded or failed) only after every READ it posted was released, and a READ still
in flight is never released. Each scenario is also run against a variant of NixlReads that reports at once, to
show the oracle notices.
"""

from __future__ import annotations

import pytest

from kvbridge.runtime.nixl_reads import NixlReads
from support.nixl_reads_fakes import RANKS, FakeTransport, make_load, make_reads, note


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
