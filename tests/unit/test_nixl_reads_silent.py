"""A prefill worker found silent while READs on it run: `NixlReads` fails the loads reading from it, marks its engine
dead and renews its own agent, reporting each load only after the renewal; loads from other workers finish first,
and loads queued meanwhile are posted on the new agent.

A unit test of `runtime.nixl_reads.NixlReads` with the recording fake of `support.nixl_reads_fakes` and a stand-in
for `runtime.read_liveness.ReadLiveness` (the test hands the verdicts). The real processes are in
tests/nixl/test_peer_failures.py. Oracles: the failure is reported after ("renewed", agents), never before; a load
whose READs run within read_liveness_s asks nothing; a verdict on a replaced worker fails nothing. Negative control:
without the liveness check the same load is still in flight.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from kvbridge.runtime import read_fences
from kvbridge.runtime.read_liveness import Verdict
from support.nixl_reads_fakes import RANKS, FakeTransport, make_load, make_reads, note

AGENT = "prefill-tp0"


class SilentFake(FakeTransport):
    """FakeTransport with one agent loaded. Removing it leaves its READs' DMA running, as NIXL 1.5.1's flush-mode
    close does: only the renewal ends it."""

    def __init__(self) -> None:
        super().__init__()
        self.peers = {AGENT}


class Liveness:
    """What NixlReads calls on ReadLiveness: `due` is recorded, `verdicts` hands what the test put in `pending`."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.asked: list[str] = []
        self.pending: dict[str, Verdict] = {}
        self.forgotten: list[str] = []

    def due(self, agent, source, rank, peer, now) -> None:
        self.asked.append(agent)

    def verdicts(self) -> dict[str, Verdict]:
        out, self.pending = self.pending, {}
        return out

    def forget(self, agent) -> None:
        self.forgotten.append(agent)


def running_load(liveness: Liveness | None, ran_s: float):
    """A load with one READ from AGENT, posted `ran_s` ago and not done. Returns (fake, reads, load, reports,
    engines marked dead)."""
    fake, reports, dead = SilentFake(), [], []
    reads = make_reads(fake, reports)
    reads.liveness = liveness
    load = make_load(reads, ranks=RANKS[:1])
    reads.peers = SimpleNamespace(
        drop=lambda engine, why: None, mark_dead=lambda engine, why: dead.append(engine), all_engines=lambda: []
    )
    reads.post(load, note())
    load.posted -= ran_s
    return fake, reads, load, reports, dead


def test_a_silent_worker_fails_its_loads_once_the_agent_is_renewed():
    liveness = Liveness()
    fake, reads, load, reports, dead = running_load(liveness, ran_s=1.0)
    reads.poll()
    assert liveness.asked == [AGENT] and not reports
    liveness.pending = {AGENT: Verdict(load.engine.peers[RANKS[0]], "silent")}
    reads.poll()
    reads.poll()
    assert [kind for kind, _ in reports] == ["failed"], (reports, fake.events)
    renewed = fake.events.index(("renewed", (AGENT,)))
    assert reports[0][1] > renewed, fake.events  # reported after the renewal
    assert ("removed", AGENT) not in fake.events  # removal alone would not stop its READs
    assert dead == [load.engine] and AGENT in liveness.forgotten
    assert not reads.busy


def test_a_renewal_waits_for_the_loads_of_other_workers_and_posts_the_loads_queued_meanwhile():
    liveness = Liveness()
    fake, reads, silent_load, reports, _ = running_load(liveness, ran_s=1.0)
    other = make_load(reads, ranks=RANKS[1:])  # from prefill-tp1, which answers
    fake.peers.add("prefill-tp1")
    reads.post(other, note())
    liveness.pending = {AGENT: Verdict(silent_load.engine.peers[RANKS[0]], "silent")}
    reads.poll()
    assert not reports and not any(kind == "renewed" for kind, _ in fake.events)  # the other load runs
    queued = make_load(reads, ranks=RANKS[1:])
    posted = len([e for e in fake.events if e[0] == "post"])
    reads.post(queued, note())
    assert len([e for e in fake.events if e[0] == "post"]) == posted  # waits for the new agent
    assert reads.holds(queued)  # held while it waits: the decode worker must not fail it itself
    fake.dma_done.add(1)  # the other load's READ lands
    reads.poll()
    kinds = [kind for kind, _ in reports]
    assert kinds == ["loaded", "failed"], (reports, fake.events)
    renewed = fake.events.index(("renewed", (AGENT,)))
    assert reports[0][1] <= renewed < reports[1][1]  # the other load before, the silent one after the renewal
    assert fake.events[renewed + 1] == ("restarted", ())  # the new agent, then the queued load posted on it
    assert fake.events[renewed + 2][0] == "post" and reads.holds(queued)


def test_a_load_within_read_liveness_s_asks_nothing():
    liveness = Liveness()
    _, reads, _, reports, _ = running_load(liveness, ran_s=0.0)
    reads.poll()
    assert liveness.asked == [] and not reports


def test_a_verdict_on_a_replaced_worker_fails_nothing():
    """A newer handshake of the same agent name is another Peer: the old one's verdict must not fail its loads."""
    liveness = Liveness()
    fake, reads, load, reports, dead = running_load(liveness, ran_s=1.0)
    old = SimpleNamespace(agent=AGENT, memory=reads.memory)
    liveness.pending = {AGENT: Verdict(old, "silent")}
    reads.poll()
    assert not reports and not dead and ("removed", AGENT) not in fake.events
    assert reads.holds(load)


def test_without_the_liveness_check_the_load_stays_in_flight():
    """Negative control: the same load, no ReadLiveness: nothing ends it before its deadline."""
    fake, reads, load, reports, _ = running_load(None, ran_s=1.0)
    reads.poll()
    assert not reports and reads.holds(load) and ("removed", AGENT) not in fake.events


def test_a_renewal_fails_the_loads_of_other_workers_still_running_after_its_wait(monkeypatch):
    """A load on another worker that does not finish within RENEWAL_WAIT_S fails too, fenced by the same renewal:
    the loads waiting for the new agent wait no longer. Control: before the wait the renewal waits for it."""
    monkeypatch.setattr(read_fences, "RENEWAL_WAIT_S", 0.05)
    liveness = Liveness()
    fake, reads, silent_load, reports, _ = running_load(liveness, ran_s=1.0)
    other = make_load(reads, ranks=RANKS[1:])
    fake.peers.add("prefill-tp1")
    reads.post(other, note())
    liveness.pending = {AGENT: Verdict(silent_load.engine.peers[RANKS[0]], "silent")}
    reads.poll()
    assert not reports and reads.holds(other)  # within the wait: kept
    time.sleep(0.06)
    reads.poll()
    assert [kind for kind, _ in reports] == ["failed", "failed"], (reports, fake.events)
    renewed = fake.events.index(("renewed", (AGENT,)))
    assert all(at > renewed for _, at in reports)  # both reported after the renewal
    assert "prefill-tp1" in fake.peers  # a worker that answered is kept: no new handshake
