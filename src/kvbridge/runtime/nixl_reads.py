"""A decode worker's NIXL path: post a load's READs, poll them, and report the load only once NIXL has let go of them.

Per engine: each prefill worker's NIXL agent, added by its handshake (`add_agent`) and removed when the engine is
reaped (`forget`). Per load: one READ per prefill worker read, each carrying the Notify that tells that worker the
request is done here; the workers of the engine that are not read are told through the notifier as soon as the
READs are posted. A READ whose release NIXL refuses (a status error does not mean the DMA stopped) is kept and
retried; its load is reported, done or failed, only once the release succeeds, so that no READ can still write
blocks the engine has given to another request.

One lock serialises every NIXL call (the transfer thread, the engine's `results()` calls, handshakes on control
threads); each method takes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvbridge.core.config import BridgeConfig
from kvbridge.core.descriptors import (
    Descriptors,
    PreparedTable,
    block_lists,
    expand,
    group_descriptors,
    prefer_prepared,
)
from kvbridge.core.errors import IncompatiblePeerError, KVBridgeError, RequestParamsError, TransferError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.leases import MAX_READ_S
from kvbridge.core.memory import WorkerMemory
from kvbridge.core.segments import Segments, worker_segments
from kvbridge.core.token_runs import worker_token_descriptors
from kvbridge.core.topology import WorkerRank
from kvbridge.runtime.load import Load, LoadJob
from kvbridge.runtime.peers import Engine, PeerBook
from kvbridge.runtime.prefill_worker import staging_copies, transport_config
from kvbridge.runtime.staged_reads import StagedReads
from kvbridge.transport.nixl import Backoff, MemType, NixlTransport, PreparedLists, Transfer
from kvbridge.wire import messages as wire

logger = logging.getLogger(__name__)

FLOOR_BYTES_PER_S = 0.1e9
"""The slowest rate a load's bytes are assumed to move at when its deadline is set: below the 0.2-0.5 GB/s that
UCX's software emulation of GPU memory reaches on one GPU (docs/benchmarks/gpu-worker-runtime.md), so that a slow
transport gives slow loads, not failed ones."""

MAX_EXTRA_S = 300.0
"""The most a load's bytes add to `transfer_timeout_s` (a stuck load still fails in bounded time)."""

SLOW_GPU_BYTES_PER_S = 2e9
"""A READ of GPU memory below this rate is not a GPU transport: UCX is emulating it (logged once per engine)."""

SLOW_CHECK_MIN_BYTES = 32 << 20
"""Loads smaller than this are too short to judge a transport's rate by."""

CLOSE_FLUSH_S = 5.0
"""At close, how long flush READs (see `NixlReads.forget`) are waited for before the agent goes anyway."""


def block_bytes(memory: WorkerMemory) -> int:
    """Bytes one block carries into this worker (every layer, plane and head it holds)."""
    return sum(layer.page_bytes for layer in memory.layers)


class ReadBudget:
    """How long a load may take: `transfer_timeout_s` plus the bytes in flight at this worker when it is queued
    (its own and those of the loads queued before it and not yet reported, which share the link) at
    `floor_bytes_per_s`, the extra capped at `max_extra_s` and the whole at the prefill side's longest pin
    (`core.leases.MAX_READ_S`). The claim's `read_timeout_s` is what is left of it, so the prefill side pins the
    request as long. Thread-safe; `end` for every job `begin` counted (unknown jobs are ignored)."""

    def __init__(
        self,
        config: BridgeConfig,
        bytes_per_block: int,
        floor_bytes_per_s: float = FLOOR_BYTES_PER_S,
        max_extra_s: float = MAX_EXTRA_S,
    ) -> None:
        self.config = config
        self.bytes_per_block = bytes_per_block
        self.floor_bytes_per_s = floor_bytes_per_s
        self.max_extra_s = max_extra_s
        self._lock = threading.Lock()
        self._bytes: dict[int, int] = {}  # id(job) -> bytes, for jobs queued and not yet reported
        self._total = 0

    def seconds(self, nbytes: int) -> float:
        """The budget of a load when `nbytes` are in flight, its own included."""
        extra = min(nbytes / self.floor_bytes_per_s, self.max_extra_s) if self.floor_bytes_per_s > 0 else 0.0
        return min(self.config.transfer_timeout_s + extra, MAX_READ_S)

    def begin(self, job: LoadJob) -> float:
        """Count a job that will be read (`LoadJob.reads`) and has blocks; returns its budget in seconds."""
        nbytes = job.num_blocks * self.bytes_per_block
        if not (job.reads and nbytes):
            return self.config.transfer_timeout_s
        with self._lock:
            self._total += nbytes
            self._bytes[id(job)] = nbytes
            in_flight = self._total
        return self.seconds(in_flight)

    def end(self, job: LoadJob) -> None:
        with self._lock:
            self._total -= self._bytes.pop(id(job), 0)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._total


class NixlReads:
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
    ) -> None:
        """`loaded(load)` and `failed(load, error)` report a load to the decode worker; `tell(message, job, ranks)`
        queues a message for the notifier. `regions`: `memory`'s regions as tensors (GPU memory: the staged path
        stages in VRAM with torch copies; without them GPU memory has no staged path)."""
        self.identity = identity
        self.memory = memory
        self.config = config
        self.mem_type = mem_type
        self.peers = peers
        self.loaded = loaded
        self.failed = failed
        self.tell = tell
        # A kv_both worker also runs a PrefillWorker: agent names must differ.
        transport = dataclasses.replace(transport_config(config, mem_type), prepared_lists=prepared_lists(config))
        self.transport = NixlTransport(identity.agent_name + "-reader", transport)
        self._lock = threading.Lock()  # the transport, _active and _draining: one caller at a time
        self._active: list[Load] = []  # READs posted
        self._draining: list[Load] = []  # READs done or failed whose release NIXL has not accepted yet
        # With prepared lists: per prefill agent, its segments and its prepared lists (None: NIXL refused them).
        self._segments: dict[str, Segments] = {}
        self._prepared: dict[str, PreparedLists | None] = {}
        self._judged: set[str] = set()  # engine ids whose transport has been judged (one log line each)
        self._emulated: set[str] = set()  # engine ids judged emulated (the staged path's cost model follows)
        # Agents that may still have answers queued for us (a READ of theirs released unfinished), and those being
        # flushed before their removal: agent -> (its flush READ, deadline). See `forget`.
        self._unflushed: set[str] = set()
        self._flushing: dict[str, tuple[Transfer, float]] = {}
        self._fences: list[Fence] = []  # failed loads waiting until nothing can still write their blocks
        # The staged path (staging configured): parts of loads read in large chunks, then scattered.
        tensors = staging_copies(mem_type, regions, memory)
        staged = tensors is not None and config.nixl_staging_bytes > 0 and self.memory.num_groups == 1
        self.staged = StagedReads(identity, memory, config, self, sealer, regions=tensors) if staged else None

    def start(self) -> None:
        self.transport.start()
        self.transport.register(self.memory, self.mem_type)
        if self.staged is not None:
            with self._lock:
                self.staged.start()

    def close(self) -> None:
        if self.staged is not None:
            self.staged.close()
        with self._lock:
            self._flush_all(CLOSE_FLUSH_S)
        self.transport.close()

    @property
    def busy(self) -> bool:
        """Whether READs are posted or waiting for their release (read without the lock: a hint)."""
        return bool(self._active or self._draining or self._fences)

    def holds(self, load: Load) -> bool:
        """Whether `load`'s READs are posted and being polled."""
        with self._lock:
            return load in self._active

    # -- per engine -------------------------------------------------------------------------------

    def add_agent(self, metadata: bytes, name: str) -> str:
        """Load a prefill worker's agent metadata (the peer book's handshake); returns the agent's name."""
        owner = self.peers.owner_of(name)
        if owner is not None:  # another engine at another address answers under the same name: never replace it
            raise IncompatiblePeerError("agent_name", f"{name} of the engine at {owner[1]}:{owner[2]}", name)
        with self._lock:
            if name in self.transport.peers:  # a restarted worker under the same name: its old agent goes
                self._forget_agent(name)
            return self.transport.add_peer(metadata)

    def forget(self, engine: Engine) -> None:
        """Remove the agents of a reaped engine (nothing of it in flight). An agent one of whose READs was released
        unfinished (after a timeout or a link cut) may still have its answers queued in UCX: closing the endpoint
        now can crash that prefill worker (UCX 1.23 over tcp, `NixlTransport.post_flush`), so it is removed only
        once a flush READ from it is done, or after `transfer_timeout_s` (`poll` checks)."""
        with self._lock:
            for peer in engine.peers.values():
                if peer.agent in self._unflushed and peer.agent not in self._flushing:
                    self._start_flush(peer.agent, peer.memory)
                if peer.agent not in self._flushing:
                    self._forget_agent(peer.agent)

    def _start_flush(self, agent: str, memory: WorkerMemory) -> None:
        self._unflushed.discard(agent)
        flush = self._post_flush(agent, memory)
        if flush is not None:
            self._flushing[agent] = (flush, time.monotonic() + self.config.transfer_timeout_s)

    def _post_flush(self, agent: str, memory: WorkerMemory) -> Transfer | None:
        """A flush READ from `agent` (`NixlTransport.post_flush`), or None if its endpoint has failed already (it
        delivers nothing more: nothing left to wait for)."""
        try:
            return self.transport.post_flush(agent, memory.regions[0], self.mem_type)
        except KVBridgeError as exc:
            logger.debug("kvbridge decode %s: no flush READ from %s: %s", self.identity, agent, exc)
            return None

    def _flushed(self, agent: str, flush: Transfer) -> bool:
        """Whether nothing more can arrive from `agent` before `flush`: it is done or failed, or the agent is gone."""
        try:
            return agent not in self.transport.peers or self.transport.poll(flush)
        except KVBridgeError:
            return True

    def _finish_flushes(self) -> None:
        """Remove the agents whose flush READ is done, failed or past its deadline."""
        for agent, (flush, deadline) in list(self._flushing.items()):
            if self._flushed(agent, flush) or time.monotonic() > deadline:
                self._forget_agent(agent)

    def _flush_all(self, timeout_s: float) -> None:
        """Before the agent closes: flush every agent that may still have answers queued, for up to `timeout_s`."""
        for peer in [p for e in self.peers.all_engines() for p in e.peers.values()]:
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
        self._segments.pop(name, None)
        self._prepared.pop(name, None)
        with contextlib.suppress(KVBridgeError):
            self.transport.remove_peer(name)  # releases its prepared lists too

    # -- per load ---------------------------------------------------------------------------------

    def post(self, load: Load, note: wire.Notify) -> None:
        """Post the load's READs, each carrying `note`; a failure drains what was posted, then reports it."""
        engine, job = load.engine, load.job
        with self._lock:
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
            self._judge_at_handshake(engine)
            others = tuple(r for r in engine.layout.workers() if r not in descs)
            if others:
                self.tell(note, job, others)
            self._active.append(load)

    def poll(self) -> None:
        """Report the loads whose READs are done (and released) or failed; retry the releases NIXL refused."""
        with self._lock:
            self._poll()

    def poll_if_free(self) -> None:
        """`poll`, unless nothing is posted or another thread is at NIXL (the engine's thread must not wait)."""
        if self.busy and self._lock.acquire(blocking=False):
            try:
                self._poll()
            finally:
                self._lock.release()

    def _poll(self) -> None:
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
                self._judge_rate(load)
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

    # -- telling a transport UCX can only emulate ---------------------------------------------------

    def _judge_at_handshake(self, engine: Engine) -> None:
        """On an engine's first READs (right after its handshake): GPU memory with no CUDA transport in UCX_TLS
        can only be emulated by UCX (staged through host memory over tcp); say so once."""
        engine_id = engine.key[0]
        if self.mem_type != "VRAM" or engine_id in self._judged:
            return
        reason = emulation_reason(self.mem_type, self.transport.ucx_env.get("UCX_TLS"))
        if reason:
            self._judged.add(engine_id)
            self._emulated.add(engine_id)
            logger.warning(
                "kvbridge decode %s: NIXL from prefill engine %s: %s; loads will be slow (their deadlines allow %g "
                "GB/s), not failed",
                self.identity,
                engine_id,
                reason,
                FLOOR_BYTES_PER_S / 1e9,
            )

    def _judge_rate(self, load: Load) -> None:
        """On an engine's first READs of GPU memory large enough to tell: a rate no GPU transport has means UCX is
        emulating the path in software (two processes on one GPU get no cuda_ipc lane); say so once."""
        engine = load.engine
        if self.mem_type != "VRAM" or engine is None or engine.key[0] in self._judged or not load.posted:
            return
        if load.nbytes < SLOW_CHECK_MIN_BYTES:
            return
        self._judged.add(engine.key[0])
        seconds = max(time.monotonic() - load.posted, 1e-9)
        rate = load.nbytes / seconds
        if rate >= SLOW_GPU_BYTES_PER_S:
            return
        self._emulated.add(engine.key[0])
        same_host = all(p.same_host for p in engine.peers.values())
        logger.warning(
            "kvbridge decode %s: NIXL READs of GPU memory from prefill engine %s run at %.2f GB/s (%.0f MB in %.2f s)"
            ": UCX is emulating the GPU path in software (%s; UCX_PROTO_INFO=y shows 'software emulation'); loads "
            "stay correct but slow (deadlines allow %g GB/s)%s",
            self.identity,
            engine.key[0],
            rate / 1e9,
            load.nbytes / 1e6,
            seconds,
            "on one host: two processes on one GPU get no cuda_ipc lane" if same_host else "no GPU-capable lane",
            FLOOR_BYTES_PER_S / 1e9,
            "; the CUDA IPC path (gpu_peer_copy='auto', the default) avoids NIXL on one host" if same_host else "",
        )

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

    # -- fencing the late writes of released READs ------------------------------------------------

    def _fence(self, load: Load) -> None:
        """Report a failed load only once nothing can still write its blocks. NIXL's release of a READ that was
        still running does not stop UCX: over tcp its data lands when the link comes back (bench/ucx_cut_stress.py
        saw 155 of 440 READs released unfinished written after their release), and by then vLLM would have given
        the blocks to another request. UCX answers one reader's READs from a peer in order, so a flush READ posted
        now is done only after every earlier one has landed or been dropped; an endpoint that failed or was closed
        delivers nothing more. So: one flush READ per agent that had READs running; the load is reported when each
        is done or failed, or, past `transfer_timeout_s`, once those agents are removed (their endpoints closed)."""
        flushes: dict[str, Transfer] = {}
        memory = {p.agent: p.memory for p in (load.engine.peers.values() if load.engine else ())}
        for agent in load.unfinished:
            if agent not in self.transport.peers or agent not in memory:
                continue  # removed: its endpoint is closed
            flush = self._post_flush(agent, memory[agent])
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
                if self._flushed(agent, flush):
                    del fence.flushes[agent]
                    self._unflushed.discard(agent)
                    with contextlib.suppress(KVBridgeError):
                        self.transport.release(flush)
            if fence.flushes and time.monotonic() > fence.deadline:
                logger.warning(
                    "kvbridge decode %s: no flush READ from %s done in %g s after a failed load: closing those "
                    "endpoints before its blocks are given back",
                    self.identity,
                    ", ".join(sorted(fence.flushes)),
                    self.config.transfer_timeout_s,
                )
                if fence.load.engine is not None:
                    self.peers.drop(fence.load.engine, "a READ released unfinished could not be fenced")
                for agent in list(fence.flushes):
                    self._forget_agent(agent)
                fence.flushes.clear()
            if fence.flushes:
                still.append(fence)
            else:
                self.failed(fence.load, fence.load.error)
        self._fences = still

    def _descriptors(self, load: Load, engine: Engine) -> dict:
        """Per prefill worker read: coalesced Descriptors, or a PreparedRead where prepared lists pay off."""
        job = load.job
        if not job.num_blocks:
            return {}
        sources = {rank: peer.memory for rank, peer in engine.peers.items()}
        if self.memory.num_groups > 1 or (job.span is None and not self.transport.config.prepared_lists):
            descs = group_descriptors(
                engine.plan, self.identity.rank, self.memory, sources, job.remote_blocks, job.local_blocks
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
        for rank, segments in self._peer_segments(engine, sources).items():
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
        sources = {rank: peer.memory for rank, peer in engine.peers.items()}
        segments = self._peer_segments(engine, sources)
        parts = []
        for rank, d in descs.items():
            peer = engine.peers[rank]
            s_blocks, d_blocks = block_lists(src_blocks, dst_blocks, peer.memory, self.memory)
            emulated = engine.key[0] in self._emulated
            part = self.staged.consider(load, rank, peer, segments[rank], s_blocks, d_blocks, len(d), emulated)
            if part is not None:
                parts.append(part)
        return parts

    def _peer_segments(self, engine: Engine, sources: dict[WorkerRank, WorkerMemory]) -> dict[WorkerRank, Segments]:
        """Each prefill worker's segments (empty: not read), computed once per agent."""
        agents = {rank: peer.agent for rank, peer in engine.peers.items()}
        if not all(agent in self._segments for agent in agents.values()):
            segments = worker_segments(engine.plan, self.identity.rank, self.memory, sources)
            for rank, agent in agents.items():
                self._segments[agent] = segments.get(rank, Segments.concat([]))
        return {rank: self._segments[agent] for rank, agent in agents.items()}

    def _prepared_lists(self, agent: str, segments: Segments, memory: WorkerMemory) -> PreparedLists | None:
        """The agent's prepared lists, made on first use; None (for good) if NIXL or the table's size refuses."""
        if agent in self._prepared:
            return self._prepared[agent]
        prepared = None
        t0 = time.perf_counter()
        try:
            table = PreparedTable(segments, memory.num_blocks, self.memory.num_blocks)
            prepared = self.transport.prepare(agent, table, self.memory, memory)
        except (ValueError, KVBridgeError) as exc:
            logger.warning(
                "kvbridge decode %s: no prepared descriptor lists for %s (%s): per-request descriptors",
                self.identity,
                agent,
                exc,
            )
        else:
            logger.info(
                "kvbridge decode %s: prepared %d + %d descriptors for %s in %.1f ms",
                self.identity,
                table.src_entries,
                table.dst_entries,
                agent,
                1e3 * (time.perf_counter() - t0),
            )
        self._prepared[agent] = prepared
        return prepared


class PreparedRead:
    """One prefill worker's part of a load, named by index in that worker's prepared lists."""

    __slots__ = ("dst_idx", "nbytes", "prepared", "src_idx")

    def __init__(self, prepared: PreparedLists, src_idx: np.ndarray, dst_idx: np.ndarray, nbytes: int) -> None:
        self.prepared, self.src_idx, self.dst_idx, self.nbytes = prepared, src_idx, dst_idx, nbytes

    def __len__(self) -> int:
        return len(self.src_idx)


PREPARED_LISTS_ENV = "KVBRIDGE_NIXL_PREPARED_LISTS"


@dataclasses.dataclass
class Fence:
    """A failed load whose blocks are held until a flush READ from each agent that was still writing is done."""

    load: Load
    flushes: dict[str, Transfer]
    deadline: float


def prepared_lists(config: BridgeConfig) -> bool:
    """Whether the decode worker's READs use prepared descriptor lists: `config.nixl_prepared_lists` when set,
    else the environment's KVBRIDGE_NIXL_PREPARED_LISTS ("1": on); off by default."""
    if config.nixl_prepared_lists is not None:
        return config.nixl_prepared_lists
    return os.environ.get(PREPARED_LISTS_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def emulation_reason(mem_type: MemType, ucx_tls: str | None) -> str:
    """Why UCX can only emulate READs of `mem_type` with transports `ucx_tls` (the UCX_TLS in effect; None or
    empty: UCX's own choice), or "" when nothing says so before a READ has run."""
    if mem_type != "VRAM" or not ucx_tls:
        return ""
    if ucx_tls.startswith("^"):  # "all but these": UCX may still have a GPU lane
        return ""
    names = [t.strip().lower() for t in ucx_tls.split(",") if t.strip()]
    gpu = ("all", "gdr_copy", "rc", "rc_x", "rc_v", "rc_mlx5", "dc", "dc_x", "dc_mlx5", "ib")
    if not any(t.startswith("cuda") or t in gpu for t in names):
        return f"UCX_TLS={ucx_tls} names no GPU transport: UCX can only emulate GPU memory (staged over tcp)"
    return ""


def _peer_broken(error: str) -> bool:
    """Whether an error says the peer itself is gone (not just this request's blocks or claim)."""
    text = error.lower()
    words = ("disconnect", "remote", "connection", "unreachable", "peer", "not_found", "not found")
    return any(word in text for word in words)
