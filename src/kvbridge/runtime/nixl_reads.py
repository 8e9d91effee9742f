"""A decode worker's NIXL path: post a load's READs, poll them, and report the load only once NIXL has let go of them.

Per engine: each prefill worker's NIXL agent, added by its handshake (`add_agent`) and removed when the engine is
reaped (`forget`). Per load: one READ per prefill worker read, each carrying the Notify that tells that worker the
request is done here; the workers of the engine that are not read are told through the notifier as soon as the
READs are posted. A READ whose release NIXL refuses (a status error does not mean the DMA stopped) is kept and
retried; its load is reported, done or failed, only once the release succeeds, so that no READ can still write
blocks the engine has given to another request.

The agent, its lock and the flush READs are a `NixlReader`, shared with the staged path (`staged_reads`); every
method takes its lock. What holds a failed load until nothing of it can still write (flush READs, silent workers,
the agent's renewal) is `read_fences`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvbridge.core.config import BridgeConfig
from kvbridge.core.descriptors import (
    Descriptors,
    block_lists,
    expand,
    group_descriptors,
    prefer_prepared,
)
from kvbridge.core.errors import IncompatiblePeerError, KVBridgeError, RequestParamsError, TransferError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import WorkerMemory
from kvbridge.core.segments import Segments
from kvbridge.core.token_runs import worker_token_descriptors
from kvbridge.core.topology import WorkerRank
from kvbridge.runtime.emulation import EmulationJudge
from kvbridge.runtime.load import Load, LoadJob
from kvbridge.runtime.nixl_reader import NixlReader
from kvbridge.runtime.peers import Engine, PeerBook
from kvbridge.runtime.prefill_worker import staging_copies, transport_config
from kvbridge.runtime.prepared_reads import PreparedRead, prepare, prepared_lists
from kvbridge.runtime.read_budget import FLOOR_BYTES_PER_S
from kvbridge.runtime.read_fences import ReadFences
from kvbridge.runtime.read_liveness import ReadLiveness
from kvbridge.runtime.staged_reads import StagedReads
from kvbridge.transport.nixl import NixlTransport
from kvbridge.transport.nixl_descriptors import MemType, Transfer
from kvbridge.transport.nixl_prepared import PreparedLists
from kvbridge.wire import messages as wire

logger = logging.getLogger(__name__)

_NO_SEGMENTS = Segments.concat([])  # a prefill worker this worker does not read

CLOSE_FLUSH_S = 5.0
"""At close, how long flush READs (see `NixlReads.forget`) are waited for before the agent goes anyway."""


class NixlReads(ReadFences):
    """One decode worker's NIXL agent and the READs it has in flight."""

    def __init__(
        self,
        identity: WorkerIdentity,
        memory: WorkerMemory,
        config: BridgeConfig,
        mem_type: MemType,
        peers: PeerBook,
        *,
        loaded: Callable[[Load], None],
        failed: Callable[[Load, str], None],
        tell: Callable[[wire.Message, LoadJob, tuple[WorkerRank, ...]], None],
        sealer=None,
        regions: Sequence = (),
        reader: NixlReader | None = None,
        liveness: ReadLiveness | None = None,
    ) -> None:
        """`loaded(load)` and `failed(load, error)` report a load to the decode worker; `tell(message, job, ranks)`
        queues a message for the notifier. `regions`: `memory`'s regions as tensors (GPU memory: the staged path
        stages in VRAM with torch copies; without them GPU memory has no staged path). `reader`: the NIXL agent to read
        with (default: a new one on this worker's transport settings). `liveness`: asks the prefill workers whose READs
        run long whether they are there (None: never asked, the load's deadline alone ends a silent one)."""
        self.identity = identity
        self.memory = memory
        self.config = config
        self.mem_type = mem_type
        self.peers = peers
        self.loaded = loaded
        self.failed = failed
        self.tell = tell
        self.liveness = liveness
        if reader is None:  # a kv_both worker also runs a PrefillWorker: agent names must differ
            transport = dataclasses.replace(transport_config(config, mem_type), prepared_lists=prepared_lists(config))
            reader = NixlReader(NixlTransport(identity.agent_name + "-reader", transport), identity, mem_type)
        self.reader = reader  # the transport and its lock (_active, _draining, ... are under it too)
        self._active: list[Load] = []  # READs posted
        self._draining: list[Load] = []  # READs done or failed whose release NIXL has not accepted yet
        # With prepared lists: per prefill agent, its prepared lists (None: NIXL refused them).
        self._prepared: dict[str, PreparedLists | None] = {}
        self.emulation = EmulationJudge(identity, mem_type, reader.transport)
        # Agents that may still have answers queued for us (a READ of theirs released unfinished), and those being
        # flushed before their removal: agent -> (its flush READ, deadline). See `forget`.
        self._unflushed: set[str] = set()
        self._flushing: dict[str, tuple[Transfer, float]] = {}
        self._fences: list = []  # read_fences.Fence  # failed loads waiting until nothing can still write their blocks
        # Agents whose READs only a new agent can fence, while a renewal waits (`_request_renewal`), and the loads
        # posted meanwhile, posted on the new agent.
        self._renewal: set[str] | None = None
        self._renewal_asked = 0.0  # when the pending renewal was asked for
        self._restart_after = 0.0  # after a failed restart of the agent: when to try again
        self._deferred: list[tuple[Load, wire.Notify]] = []
        # The staged path (staging configured): parts of loads read in large chunks, then scattered.
        tensors = staging_copies(mem_type, regions, memory)
        staged = tensors is not None and config.nixl_staging_bytes > 0 and self.memory.num_groups == 1
        self.staged = StagedReads(identity, memory, config, reader, sealer, regions=tensors) if staged else None

    def start(self) -> None:
        self.transport.start()
        self.transport.register(self.memory, self.mem_type)
        if self.staged is not None:
            with self.reader.lock:
                self.staged.start()

    def close(self) -> None:
        if self.staged is not None:
            self.staged.close()
        with self.reader.lock:
            self._flush_all(CLOSE_FLUSH_S)
            deferred, self._deferred = self._deferred, []
        for load, _ in deferred:  # never posted: nothing of them in flight
            self.failed(load, "the decode worker closed")
        self.transport.close()

    @property
    def transport(self) -> NixlTransport:
        return self.reader.transport

    @property
    def busy(self) -> bool:
        """Whether READs are posted or waiting for their release (read without the lock: a hint)."""
        return bool(self._active or self._draining or self._fences or self._renewal is not None)

    def holds(self, load: Load) -> bool:
        """Whether `load`'s READs are posted and being polled, or it waits for the agent's renewal to be posted."""
        with self.reader.lock:
            return load in self._active or any(load is waiting for waiting, _ in self._deferred)

    # -- per engine -------------------------------------------------------------------------------

    def add_agent(self, metadata: bytes, name: str) -> str:
        """Load a prefill worker's agent metadata (the peer book's handshake); returns the agent's name."""
        owner = self.peers.owner_of(name)
        if owner is not None:  # another engine at another address answers under the same name: never replace it
            raise IncompatiblePeerError("agent_name", f"{name} of the engine at {owner[1]}:{owner[2]}", name)
        with self.reader.lock:
            if self._renewal is not None and name in self._renewal:  # the renewal will drop that name
                raise TransferError(f"agent {name} waits for this worker's NIXL agent to be renewed; try again")
            if name in self.transport.peers:  # a restarted worker under the same name: its old agent goes
                self._forget_agent(name)
            return self.transport.add_peer(metadata)

    # -- per load ---------------------------------------------------------------------------------

    def post(self, load: Load, note: wire.Notify) -> None:
        """Post the load's READs, each carrying `note`; a failure drains what was posted, then reports it. While a
        renewal of the agent waits, the load waits too and is posted on the new agent."""
        with self.reader.lock:
            if self._renewal is not None:
                self._deferred.append((load, note))
            else:
                self._restart_if_closed()
                self._post(load, note)

    def _post(self, load: Load, note: wire.Notify) -> None:
        engine, job = load.engine, load.job
        try:
            descs = self._descriptors(load, engine)
        except KVBridgeError as exc:
            self._drain_and_fail(load, str(exc))
            return
        encoded = wire.encode(note)
        parts = self._staged_parts(load, engine, descs)
        load.nbytes = sum(r.nbytes for r in descs.values())
        load.descriptors = sum(len(r) for r in descs.values()) - sum(len(descs[p.rank]) - len(p) for p in parts)
        for rank, d in descs.items():
            if rank in {p.rank for p in parts}:
                continue
            peer = engine.peers[rank]
            try:
                if isinstance(d, Descriptors):
                    transfer = self.transport.read(peer.agent, d, self.memory, peer.memory, encoded)
                else:
                    transfer = self.transport.read_prepared(d.prepared, d.src_idx, d.dst_idx, encoded)
                load.transfers.append(transfer)
            except TransferError as exc:
                pending = getattr(exc, "transfer", None)
                if pending is not None:
                    load.transfers.append(pending)
                for part in parts:
                    self.staged.cancel(part)
                self._drain_and_fail(load, str(exc), broken=engine)
                return
        for part in parts:
            load.staged.append(part)
            self.staged.run(part, encoded)
        load.posted = time.monotonic()
        self.emulation.at_handshake(engine)
        others = tuple(r for r in engine.layout.workers() if r not in descs)
        if others:
            self.tell(note, job, others)
        self._active.append(load)

    def poll(self) -> None:
        """Report the loads whose READs are done (and released) or failed; retry the releases NIXL refused."""
        with self.reader.lock:
            self._poll()

    def poll_if_free(self) -> None:
        """`poll`, unless nothing is posted or another thread is at NIXL (the engine's thread must not wait)."""
        if self.busy and self.reader.lock.acquire(blocking=False):
            try:
                self._poll()
            finally:
                self.reader.lock.release()

    def _poll(self) -> None:
        if self.liveness is not None and (silent := self.liveness.verdicts()):
            self._fail_silent(silent)
        still = []
        for load in self._active:
            failed = next((p.error for p in load.staged if p.finished and p.error), "")
            if failed:
                self._drain_and_fail(load, failed)
                continue
            try:
                done = all(self.transport.poll(t) for t in load.transfers) and all(p.finished for p in load.staged)
            except Exception as exc:  # KVBridgeError from NIXL, or a bug: this load fails, the others go on
                if not isinstance(exc, KVBridgeError):
                    logger.exception("kvbridge decode %s: polling failed", self.identity)
                self._drain_and_fail(load, str(exc), broken=load.engine)
                continue
            if done:
                self._unflushed.difference_update(t.peer for t in load.transfers)  # answered after the old ones
                self.emulation.by_rate(load)
                if self._release_all(load):
                    self.loaded(load)
                else:  # done, but NIXL kept the handle: report once it lets go
                    self._draining.append(load)
            elif time.monotonic() > load.deadline:
                self._drain_and_fail(
                    load,
                    f"not done after {load.deadline - load.queued:.3g} s (transfer_timeout_s "
                    f"{self.config.transfer_timeout_s:g} s plus the bytes in flight at {FLOOR_BYTES_PER_S / 1e9:g} GB/s"
                    f"; {load.nbytes / 1e6:.0f} MB in this load)",
                )
            else:
                still.append(load)
                if self.liveness is not None:
                    self._ask_if_long(load)
        self._active = still
        draining = []
        for load in self._draining:
            if self._release_all(load):
                self._settle(load)
            else:
                draining.append(load)
        self._draining = draining
        if self._fences:
            self._check_fences()
        if self._flushing:
            self._finish_flushes()
        if self._renewal is not None and self._renewal_due():
            self._renew()

    def _release_all(self, load: Load) -> bool:
        ok = True
        for part in load.staged:  # a staged part stops at its next step and releases its own READ
            if not part.finished:
                part.cancelled = True
                ok = False
        for t in load.transfers:
            try:
                self.transport.release(t)
            except KVBridgeError as exc:
                logger.debug("kvbridge decode %s: %s (retrying)", self.identity, exc)
                ok = False
        return ok

    def _drain_and_fail(self, load: Load, error: str, broken: Engine | None = None) -> None:
        """Fail `load` once nothing of it can still write: READs are released first (retried if NIXL refuses)."""
        load.error = error
        load.unfinished = frozenset(t.peer for t in load.transfers if not t.done)
        self._unflushed.update(load.unfinished)
        if broken is not None and _peer_broken(error):
            self.peers.drop(broken, error)
        if self._release_all(load):
            self._settle(load)
        else:
            logger.warning("kvbridge decode %s: %s: a READ may still write; holding its blocks", self.identity, error)
            self._draining.append(load)

    def _settle(self, load: Load) -> None:
        """A load whose READs are all released: report it (failed if it has an error, else done). A failed load
        whose READs were still running is fenced first (`_fence`)."""
        load.unfinished |= frozenset(p.peer.agent for p in load.staged if p.unfenced)
        if load.error and load.unfinished:
            self._fence(load)
        elif load.error:
            self.failed(load, load.error)
        else:
            self.loaded(load)

    def _descriptors(self, load: Load, engine: Engine) -> dict:
        """Per prefill worker read: coalesced Descriptors, or a PreparedRead where prepared lists pay off."""
        job = load.job
        if not job.num_blocks:
            return {}
        sources = {rank: peer.memory for rank, peer in engine.peers.items()}
        groups = self.memory.num_groups
        if groups > 1 or (job.span is None and not self.transport.config.prepared_lists):
            reader = self.identity.rank
            descs = group_descriptors(
                engine.plan,
                reader,
                self.memory,
                sources,
                job.remote_blocks,
                job.local_blocks,
                group_segments=lambda group: engine.segments(reader, self.memory, group),
            )
            return {rank: d for rank, d in descs.items() if len(d)}
        remote, local = job.one_group()  # token spans and prepared lists: one group
        src_blocks = np.asarray(remote, dtype=np.int64)
        dst_blocks = np.asarray(local, dtype=np.int64)
        if job.span is not None:  # different block sizes: the span's tokens, never prepared lists
            for rank, memory in sources.items():
                if memory.layers[0].block_size != job.remote_block_size:
                    raise RequestParamsError(
                        f"remote_block_size {job.remote_block_size}, prefill worker {rank} has blocks of "
                        f"{memory.layers[0].block_size} tokens"
                    )
            descs = worker_token_descriptors(
                engine.plan, self.identity.rank, self.memory, sources, src_blocks, dst_blocks, job.span
            )
            return {rank: d for rank, d in descs.items() if len(d)}
        out: dict = {}
        for rank, segments in self._peer_segments(engine).items():
            if not len(segments):
                continue
            peer = engine.peers[rank]
            s_blocks, d_blocks = block_lists(src_blocks, dst_blocks, peer.memory, self.memory)
            if not s_blocks.size:
                continue
            prepared = (
                self._prepared_lists(peer.agent, segments, peer.memory)
                if prefer_prepared(segments, s_blocks, d_blocks)
                else None
            )
            if prepared is None:
                out[rank] = expand(segments, s_blocks, d_blocks).coalesced()
            else:
                src_idx, dst_idx = prepared.table.indices(s_blocks, d_blocks)
                out[rank] = PreparedRead(prepared, src_idx, dst_idx, prepared.table.nbytes(s_blocks.size))
        return out

    def _staged_parts(self, load: Load, engine: Engine, descs: dict) -> list:
        """The parts of the load to read through staging (their slots reserved), where the cost model says so."""
        if self.staged is None or not descs:
            return []
        remote, local = load.job.one_group()  # staging is made for one-group engines only
        src_blocks = np.asarray(remote, dtype=np.int64)
        dst_blocks = np.asarray(local, dtype=np.int64)
        segments = self._peer_segments(engine)
        parts = []
        for rank, d in descs.items():
            peer = engine.peers[rank]
            s_blocks, d_blocks = block_lists(src_blocks, dst_blocks, peer.memory, self.memory)
            emulated = engine.key[0] in self.emulation.emulated
            part = self.staged.consider(load, rank, peer, segments[rank], s_blocks, d_blocks, len(d), emulated)
            if part is not None:
                parts.append(part)
        return parts

    def _peer_segments(self, engine: Engine) -> dict[WorkerRank, Segments]:
        """Each prefill worker's segments (empty: not read) of a one-group engine (made once per engine)."""
        segments = engine.segments(self.identity.rank, self.memory)
        return {rank: segments.get(rank, _NO_SEGMENTS) for rank in engine.peers}

    def _prepared_lists(self, agent: str, segments: Segments, memory: WorkerMemory) -> PreparedLists | None:
        """The agent's prepared lists, made on first use; None (for good) if NIXL or the table's size refuses."""
        if agent not in self._prepared:
            self._prepared[agent] = prepare(self.transport, self.identity, agent, segments, memory, self.memory)
        return self._prepared[agent]


def _peer_broken(error: str) -> bool:
    """Whether an error says the peer itself is gone (not just this request's blocks or claim)."""
    text = error.lower()
    words = ("disconnect", "remote", "connection", "unreachable", "peer", "not_found", "not found")
    return any(word in text for word in words)
