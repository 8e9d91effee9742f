"""What keeps a READ released unfinished from writing a decode's blocks after its load was reported: `ReadFences`,
the part of `NixlReads` that fences failed loads, asks silent prefill workers whether they are there, flushes
reaped agents and, as the fence of last resort, renews the decode worker's NIXL agent.

Why fences: NIXL's release of a READ that was still running does not stop UCX, whose data may land later (over tcp,
when a cut link comes back or a stopped prefill runs again), by when vLLM would have given the blocks to another
request or recomputed them. UCX answers one reader's READs from a peer in order, so a flush READ posted after them
is done only once every earlier one has landed or been dropped (`NixlReader.post_flush`). Where no flush READ can be
done (the prefill silent, or the flush past `transfer_timeout_s`), removing the prefill's agent is not enough (NIXL
1.5.1 closes the endpoint in UCX's flush mode): the decode's own agent is destroyed and started again
(`NixlTransport.renew`), and only then are the loads reported. docs/failures.md, "How a failure is detected", has the
measurements.

A mixin: it works on `NixlReads`' state (its reader, peers and load lists, all under `reader.lock`) and calls its
`_drain_and_fail`, `_release_all`, `_settle` and `_post`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

from kvbridge.core.errors import KVBridgeError
from kvbridge.core.memory import WorkerMemory
from kvbridge.runtime.load import Load
from kvbridge.runtime.peers import Engine
from kvbridge.runtime.read_liveness import Verdict
from kvbridge.transport.backoff import Backoff
from kvbridge.transport.nixl_descriptors import Transfer

logger = logging.getLogger(__name__)

RENEWAL_WAIT_S = 1.0
"""How long a renewal of the agent waits for READs on other prefill workers to finish before they fail too (new
loads wait for the renewal)."""


class ReadFences:
    """Fences, flushes, liveness verdicts and the agent's renewal, for `NixlReads` (see the module docstring)."""

    def forget(self, engine: Engine) -> None:
        """Remove the agents of a reaped engine (nothing of it in flight). An agent one of whose READs was released
        unfinished (after a timeout or a link cut) may still have its answers queued in UCX: closing the endpoint
        now can crash that prefill worker (UCX 1.23 over tcp, `NixlTransport.post_flush`), so it is removed only
        once a flush READ from it is done, or after `transfer_timeout_s` (`poll` checks)."""
        with self.reader.lock:
            for peer in engine.peers.values():
                if peer.agent in self._unflushed and peer.agent not in self._flushing:
                    self._start_flush(peer.agent, peer.memory)
                if peer.agent not in self._flushing:
                    self._forget_agent(peer.agent)

    def _start_flush(self, agent: str, memory: WorkerMemory) -> None:
        self._unflushed.discard(agent)
        flush = self.reader.post_flush(agent, memory)
        if flush is not None:
            self._flushing[agent] = (flush, time.monotonic() + self.config.transfer_timeout_s)

    def _finish_flushes(self) -> None:
        """Remove the agents whose flush READ is done, failed or past its deadline."""
        for agent, (flush, deadline) in list(self._flushing.items()):
            if self.reader.flushed(agent, flush) or time.monotonic() > deadline:
                self._forget_agent(agent)

    def _flush_all(self, timeout_s: float) -> None:
        """Before the agent closes: flush every agent that may still have answers queued, for up to `timeout_s`."""
        for peer in [p for e in self.peers.all_engines() for p in e.peers.values()]:
            if self._renewal is not None and peer.agent in self._renewal:
                continue  # silent: no flush will come; the agent is closed next
            if peer.agent in self._unflushed and peer.agent not in self._flushing:
                self._start_flush(peer.agent, peer.memory)
        deadline = time.monotonic() + timeout_s
        backoff = Backoff()
        while self._flushing and time.monotonic() < deadline:
            self._finish_flushes()
            backoff.sleep()
        for agent in list(self._flushing):
            self._forget_agent(agent)

    def _forget_agent(self, name: str) -> None:
        flushing = self._flushing.pop(name, None)
        if flushing is not None:
            with contextlib.suppress(KVBridgeError):
                self.transport.release(flushing[0])
        self._unflushed.discard(name)
        if self._renewal is not None and name in self._renewal:
            return  # kept until the renewal drops it: a fence waits on it, and removing it would not stop its READs
        if self.liveness is not None:
            self.liveness.forget(name)
        self._prepared.pop(name, None)
        with contextlib.suppress(KVBridgeError):
            self.transport.remove_peer(name)  # releases its prepared lists too

    # -- prefill workers silent while READs run ----------------------------------------------------

    def _ask_if_long(self, load: Load) -> None:
        """A load whose READs run past `read_liveness_s`: the workers they wait on are asked whether they are there
        (`ReadLiveness`; one question per worker at a time, on another thread)."""
        now = time.monotonic()
        if now - load.posted < self.liveness.interval_s:
            return
        running = _running_agents(load)
        for rank, peer in load.engine.peers.items():
            if peer.agent in running:
                self.liveness.due(peer.agent, load.job.source, rank, peer, now)

    def _fail_silent(self, silent: dict[str, Verdict]) -> None:
        """Workers found silent or gone while READs on them ran: as for a load past its deadline on them whose
        fence's flush READ cannot come (`_check_fences`), every load reading from them fails, their engines are
        known dead (`PeerBook.mark_dead`) and this worker's agent is renewed, so that nothing of those READs can
        land; the loads are reported once it is (`_renew`). A verdict on an agent a newer handshake replaced
        (another `Peer`) is ignored."""

        def verdicts_on(engine, agents) -> list[Verdict]:
            peers = engine.peers.values() if engine is not None else ()
            return [v for p in peers if p.agent in agents and (v := silent.get(p.agent)) is not None and v.peer is p]

        still, failing = [], []
        hit: dict[str, tuple[Engine, Verdict]] = {}  # agent -> an engine holding it, its verdict
        for load in self._active:
            found = verdicts_on(load.engine, {t.peer for t in load.transfers} | {p.peer.agent for p in load.staged})
            hit.update((v.peer.agent, (load.engine, v)) for v in found)
            if found:
                failing.append((load, found[0].why))
            else:
                still.append(load)
        for fence in self._fences:  # failed otherwise, waiting on a flush READ that cannot come
            hit.update((v.peer.agent, (fence.load.engine, v)) for v in verdicts_on(fence.load.engine, fence.flushes))
        if not hit:  # its READs finished meanwhile (it made progress) and no fence waits on it
            return
        self._active = still
        for load, why in failing:
            self._drain_and_fail(load, why)
        for engine, verdict in hit.values():
            logger.warning("kvbridge decode %s: %s", self.identity, verdict.why)
            self.peers.mark_dead(engine, verdict.why)
        self._request_renewal(set(hit), "a prefill worker was silent while READs from it ran")

    # -- renewing the agent: the fence of last resort -----------------------------------------------

    def _request_renewal(self, agents: set[str], why: str) -> None:
        """READs on `agents` may still be queued there and no flush READ can tell when they are over (their
        worker is silent, or a flush from it is past its deadline). Removing the agents would not stop them (NIXL
        1.5.1 closes an endpoint in UCX's flush mode: a READ queued on a stopped worker lands when it runs
        again); destroying our agent does (`NixlTransport.renew`). Loads still reading from `agents` fail now;
        loads reading from other agents get `RENEWAL_WAIT_S` to finish; new loads wait and are posted on the new
        agent; the failed loads are reported once the old agent is gone (`_renew`)."""
        if self._renewal is None:
            self._renewal = set()
            self._renewal_asked = time.monotonic()
            logger.warning(
                "kvbridge decode %s: %s (%s): renewing this worker's NIXL agent so that nothing of the READs "
                "left there can land; new loads wait for it",
                self.identity,
                why,
                ", ".join(sorted(agents)),
            )
        self._renewal |= agents
        self.reader.renewing |= agents
        still = []
        for load in self._active:
            if _running_agents(load) & agents:
                self._drain_and_fail(load, why)
            else:
                still.append(load)
        self._active = still

    def _renewal_due(self) -> bool:
        """Whether the renewal may run now: nothing in flight but READs on the agents it drops, or other READs
        still running `RENEWAL_WAIT_S` after it was asked for, which then fail too (fenced by the same renewal),
        so that the loads waiting for the new agent wait no longer than that."""
        if self._only_stale_in_flight():
            return True
        if time.monotonic() - self._renewal_asked < RENEWAL_WAIT_S:
            return False
        why = f"READs still running {RENEWAL_WAIT_S:g} s after this worker's NIXL agent had to be renewed"
        active, self._active = self._active, []
        for load in active:
            self._drain_and_fail(load, why)
        return True

    def _only_stale_in_flight(self) -> bool:
        """Whether every READ still held is on an agent the renewal drops (which it will end)."""
        if self._active:
            return False
        for load in self._draining:
            held = {t.peer for t in load.transfers if t.state != "RELEASED"}
            if (held | {p.peer.agent for p in load.staged if not p.finished}) - self._renewal:
                return False
        return True

    def _renew(self) -> None:
        """Nothing else in flight: destroy the agent, report the loads it fenced, start another without the silent
        agents, then post the loads that waited."""
        stale, self._renewal = (self._renewal or set()) | set(self._flushing), None  # reaped ones mid-flush too
        if self.liveness is not None:
            for agent in stale:
                self.liveness.forget(agent)
        self._prepared.clear()  # prepared lists belong to the old agent
        self._flushing.clear()  # what it had queued can land nowhere now
        self._unflushed.clear()
        self.reader.renewing.clear()
        t0 = time.monotonic()
        try:
            self.transport.retire(drop=stale)
        except Exception as exc:  # NIXL's agent outlived its close: nothing it had in flight can be called over
            logger.error(
                "kvbridge decode %s: %s; the blocks of %d failed loads stay held",
                self.identity,
                exc,
                len(self._fences) + len(self._draining),
            )
        else:
            self._report_fenced()
        self._restart(t0)
        deferred, self._deferred = self._deferred, []
        for load, note in deferred:
            try:
                self._post(load, note)
            except Exception as exc:  # a bug: this load fails, the others are still posted
                logger.exception("kvbridge decode %s: posting a load that waited for the renewal", self.identity)
                self._drain_and_fail(load, f"internal error posting after the agent's renewal: {exc}")

    def _report_fenced(self) -> None:
        """The old agent is gone: the loads it fenced are reported (failed, or done if NIXL only kept a handle)."""
        fences, self._fences = self._fences, []
        for fence in fences:
            self.failed(fence.load, fence.load.error)
        draining, self._draining = self._draining, []
        for load in draining:
            if not self._release_all(load):
                self._draining.append(load)  # a staged part still stopping: it will release its READ
            elif load.error:
                self.failed(load, load.error)
            else:
                self.loaded(load)

    def _restart(self, t0: float) -> None:
        """Start the new agent; on an error the transport stays closed (loads fail, saying so) and `_post` tries
        again (`_restart_if_closed`)."""
        try:
            self.transport.restart()
        except Exception as exc:
            logger.error("kvbridge decode %s: no new NIXL agent: %s", self.identity, exc)
            self._restart_after = time.monotonic() + 1.0
            return
        self._restart_after = 0.0
        logger.warning(
            "kvbridge decode %s: NIXL agent renewed as %s in %.0f ms",
            self.identity,
            self.transport.name,
            (time.monotonic() - t0) * 1e3,
        )

    def _restart_if_closed(self) -> None:
        """Before a post: a transport a failed restart left closed is started again, at most once a second."""
        if not self._restart_after or time.monotonic() < self._restart_after:
            return
        if self.transport.started:
            self._restart_after = 0.0
            return
        self._restart(time.monotonic())

    # -- fencing the late writes of released READs ------------------------------------------------

    def _fence(self, load: Load) -> None:
        """Report a failed load only once nothing can still write its blocks. NIXL's release of a READ that was
        still running does not stop UCX: over tcp its data lands when the link comes back (bench/ucx_cut_stress.py
        saw 155 of 440 READs released unfinished written after their release), and by then vLLM would have given
        the blocks to another request. UCX answers one reader's READs from a peer in order, so a flush READ posted
        now is done only after every earlier one has landed or been dropped; an endpoint that failed or was closed
        delivers nothing more. So: one flush READ per agent that had READs running; the load is reported when each
        is done or failed, or, past `transfer_timeout_s`, once this worker's agent is renewed (`_request_renewal`)."""
        flushes: dict[str, Transfer] = {}
        memory = {p.agent: p.memory for p in (load.engine.peers.values() if load.engine else ())}
        for agent in load.unfinished:
            if agent not in self.transport.peers or agent not in memory:
                continue  # removed: its endpoint is closed
            flush = self.reader.post_flush(agent, memory[agent])
            if flush is not None:
                flushes[agent] = flush
        if flushes:
            self._fences.append(Fence(load, flushes, time.monotonic() + self.config.transfer_timeout_s))
        else:
            self.failed(load, load.error)

    def _check_fences(self) -> None:
        still = []
        for fence in self._fences:
            for agent, flush in list(fence.flushes.items()):
                if self.reader.flushed(agent, flush):
                    del fence.flushes[agent]
                    self._unflushed.discard(agent)
                    with contextlib.suppress(KVBridgeError):
                        self.transport.release(flush)
            if fence.flushes and not fence.renewing and time.monotonic() > fence.deadline:
                fence.renewing = True
                if fence.load.engine is not None:
                    self.peers.drop(fence.load.engine, "a READ released unfinished could not be fenced")
                why = f"no flush READ done in {self.config.transfer_timeout_s:g} s after a failed load"
                self._request_renewal(set(fence.flushes), why)
            if fence.flushes:
                still.append(fence)
            else:
                self.failed(fence.load, fence.load.error)
        self._fences = still


@dataclasses.dataclass
class Fence:
    """A failed load whose blocks are held until a flush READ from each agent that was still writing is done."""

    load: Load
    flushes: dict[str, Transfer]
    deadline: float
    renewing: bool = False  # past its deadline: reported once the agent is renewed (`_renew`)


def _running_agents(load: Load) -> set[str]:
    """The prefill agents a load's READs (direct or staged) still run on."""
    return {t.peer for t in load.transfers if not t.done} | {p.peer.agent for p in load.staged if not p.finished}
