"""A decode worker's staged NIXL path: read a prefill worker's part of a load as a few large chunks, then scatter.

Chosen per (load, prefill worker) by `core.staging.StageCostModel` from the part's bytes and its coalesced
descriptor count, where both sides have staging buffers (`nixl_staging_bytes`) and this worker has free slots (else
the part is read directly, as before). With KV in host memory the buffer is host memory and the scatters numpy/torch
CPU copies (`transport.host_copy`); with KV in GPU memory (`regions`: the KV regions as tensors) the buffer is VRAM
on that GPU and the scatters torch copies there (`transport.device_copy`), and the prefill worker gathers on its
GPU the same way. A part runs on a driver thread of its own:

    for chunk k:  Stage(k, released=k) over the side channel  -> the prefill worker gathers chunk k (it gathered
                  it ahead while chunk k-1 was read) and answers where it is (`Staged`)
                  wait for the scatter of chunk k - DEPTH (the slot's previous chunk)
                  READ it (one descriptor) into this worker's slot k % DEPTH; the last READ carries the Notify
                  poll until done, release; scatter the slot into the KV blocks on the scatter pool (it runs while
                  chunk k+1 is staged and read)

The part holds its slots (registered once, bounded) until every READ of it is released; it reports done only after
its last scatter, failed only once no READ of it can still write (a release NIXL refuses is retried), so the load
(`nixl_reads`) is never reported while a DMA or a copy may still write its blocks. The claim made before the load
was posted pins the request on the prefill side for the whole part.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import numpy as np

from kvbridge.core.config import BridgeConfig
from kvbridge.core.descriptors import Descriptors, expand
from kvbridge.core.errors import KVBridgeError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import Region, WorkerMemory
from kvbridge.core.segments import Segments
from kvbridge.core.staging import StageCostModel, StageLayout, cost_model
from kvbridge.core.topology import WorkerRank
from kvbridge.runtime.nixl_reader import NixlReader
from kvbridge.runtime.peers import Peer, address
from kvbridge.runtime.staging import DEPTH
from kvbridge.transport import device_copy, host_copy
from kvbridge.transport.backoff import Backoff
from kvbridge.transport.nixl_descriptors import Transfer
from kvbridge.wire import messages as wire
from kvbridge.wire.affinity import unpin_this_thread
from kvbridge.wire.auth import Sealer
from kvbridge.wire.side_channel_client import ThreadClients

if TYPE_CHECKING:
    from kvbridge.runtime.load import Load

logger = logging.getLogger(__name__)


class StagedPart:
    """One prefill worker's part of a load, read staged. `finished` once nothing of it can still write."""

    def __init__(self, load: Load, rank: WorkerRank, peer: Peer, segments: Segments, s_blocks, d_blocks, layout):
        self.load, self.rank, self.peer = load, rank, peer
        self.segments = segments
        self.s_blocks, self.d_blocks = s_blocks, d_blocks
        self.layout: StageLayout = layout
        self.chunks = layout.chunks()
        self.sizes = layout.chunk_sizes()
        self.slots: list[int] = []
        self.error = ""
        self.finished = False
        self.cancelled = False
        self.reads = 0  # READs posted (one descriptor each)
        self.unfenced = False  # a READ of it released unfinished, and no flush READ from its agent done after it

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def __len__(self) -> int:
        return len(self.chunks)


class StagedReads:
    def __init__(
        self,
        identity: WorkerIdentity,
        memory: WorkerMemory,
        config: BridgeConfig,
        reader: NixlReader,
        sealer: Sealer | None,
        model: StageCostModel | None = None,
        regions: Sequence = (),
    ) -> None:
        """`reader`: the agent (and its lock) the direct READs use too. `regions`: `memory`'s regions as tensors for
        GPU memory (torch copies on their device); empty: host."""
        self.identity = identity
        self.memory = memory
        self.config = config
        self.reader = reader
        self.sealer = sealer
        self.model = model  # None: chosen per peer by its path (`core.staging.cost_model`)
        self.slot_bytes = config.nixl_staging_chunk_bytes
        self.num_slots = config.nixl_staging_bytes // self.slot_bytes if config.nixl_staging_bytes else 0
        self.buffer = None  # np.ndarray (host) or torch.Tensor (device), from start()
        self.region: Region | None = None
        self._tensors = tuple(regions)
        self.mem_type = "VRAM" if self._tensors and self._tensors[0].is_cuda else "DRAM"
        self._views = None
        self._scatter = device_copy.scatter if self._tensors else host_copy.scatter
        self._lock = threading.Lock()
        self._free: list[int] = []
        self.retired: list[int] = []  # slots a READ released unfinished may still write: never reused
        self._pool: ThreadPoolExecutor | None = None
        self._clients = ThreadClients(
            timeout_s=config.handshake_timeout_s,
            retries=config.handshake_retries,
            sealer=sealer,
            max_sockets=config.side_channel_sockets_per_thread,
            max_answer_bytes=config.side_channel_max_answer_bytes,
            link_timeout_s=config.link_timeout_s,
        )
        self._running: set[StagedPart] = set()
        self._announced: set[str] = set()  # prefill agents whose first staged read was logged
        self.staged_parts = 0  # totals, for tests and benches
        self.fallbacks = 0

    @property
    def enabled(self) -> bool:
        return self.num_slots >= 1

    def start(self) -> None:
        """Allocate and register the staging buffer (the caller holds the reader's lock), start the drivers' pool."""
        if not self.enabled:
            return
        nbytes = self.num_slots * self.slot_bytes
        if self._tensors:
            self.buffer, self.region = device_copy.staging_buffer(nbytes, self._tensors[0])
            self._views = device_copy.DeviceViews(self.memory.regions, self._tensors)
        else:
            self.buffer = np.zeros(nbytes, dtype=np.uint8)
            self.region = Region(self.buffer.ctypes.data, self.buffer.nbytes, 0)
            self._views = host_copy.HostViews(self.memory.regions)
        self.reader.transport.register(WorkerMemory((self.region,), ()), self.mem_type)
        self._free = list(range(self.num_slots))
        self._pool = ThreadPoolExecutor(
            max(1, self.num_slots // DEPTH), thread_name_prefix="kvbridge-staged", initializer=unpin_this_thread
        )
        self._scatters = ThreadPoolExecutor(
            max(1, self.num_slots // DEPTH), thread_name_prefix="kvbridge-scatter", initializer=unpin_this_thread
        )

    def close(self) -> None:
        """Stop the running parts at their next step (each releases its READ first), then the pools."""
        with self._lock:
            running = list(self._running)
        for part in running:
            part.cancelled = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=False)
            self._scatters.shutdown(wait=True, cancel_futures=False)
        self._clients.close()

    # -- choosing -----------------------------------------------------------------------------------

    def consider(
        self,
        load: Load,
        rank: WorkerRank,
        peer: Peer,
        segments: Segments,
        s_blocks,
        d_blocks,
        descriptors: int,
        emulated: bool = False,
    ) -> StagedPart | None:
        """A part to read staged (its slots reserved), or None: read it directly. `emulated`: the peer's READs
        were found emulated by UCX (GPU memory; the cost model then takes that path's constants)."""
        if not self.enabled or peer.staging is None or not peer.staging_slot_bytes or not len(segments):
            return None
        chunk = min(self.slot_bytes, peer.staging_slot_bytes)
        nbytes = segments.block_bytes * len(s_blocks)
        model = self.model or cost_model(
            peer.same_host, self.reader.transport.ucx_env.get("UCX_TLS"), self.mem_type, emulated
        )
        if self.config.nixl_staging != "always" and not model.prefers_staged(nbytes, descriptors, chunk):
            return None
        try:
            layout = StageLayout(segments.length, len(s_blocks), chunk)
        except ValueError:
            return None
        part = StagedPart(load, rank, peer, segments, s_blocks, d_blocks, layout)
        want = min(DEPTH, len(part.chunks))
        with self._lock:
            if len(self._free) < want:
                self.fallbacks += 1
                return None
            part.slots = [self._free.pop() for _ in range(want)]
            first = peer.agent not in self._announced
            if len(self._announced) >= 4096:  # bounded: a long-lived decode meets many prefill engines
                self._announced.clear()
            self._announced.add(peer.agent)
        if first:  # once per prefill agent: which path its reads take is worth a line
            logger.info(
                "kvbridge decode %s: staged NIXL reads (%s) from %s (%d B in %d chunks for %d descriptors direct)",
                self.identity,
                self.mem_type,
                peer.agent,
                nbytes,
                len(part.chunks),
                descriptors,
            )
        return part

    def cancel(self, part: StagedPart) -> None:
        """Never started (the load failed before): give its slots back."""
        self._give_back(part)
        part.finished = True

    def run(self, part: StagedPart, note: bytes) -> None:
        """Start the part's driver; `note` (the encoded Notify) rides on its last READ."""
        self.staged_parts += 1
        with self._lock:
            self._running.add(part)
        self._pool.submit(self._drive, part, note)

    # -- the driver -----------------------------------------------------------------------------------

    def _drive(self, part: StagedPart, note: bytes) -> None:
        try:
            self._chunks(part, note)
        except Exception as exc:  # the part fails; nothing of it is in flight here (see _read)
            if not isinstance(exc, KVBridgeError):
                logger.exception("kvbridge decode %s: staged read failed", self.identity)
            part.error = part.error or f"staged read from {part.rank}: {exc}"
        finally:
            self._give_back(part)
            with self._lock:
                self._running.discard(part)
            part.finished = True

    def _chunks(self, part: StagedPart, note: bytes) -> None:
        """Every chunk in order; the scatter of chunk k runs (on the scatter pool) while chunk k+1 is staged and
        read into the other slot. Returns or raises only once no scatter of the part is running."""
        scatters: dict[int, Future] = {}
        try:
            self._chunks_in_order(part, note, scatters)
        finally:
            wait(list(scatters.values()))
        for future in scatters.values():
            future.result()  # a failed scatter fails the part

    def _chunks_in_order(self, part: StagedPart, note: bytes, scatters: dict[int, Future]) -> None:
        load, seg = part.load, part.segments
        source = load.job.source
        target = address(source, part.rank)
        worker = wire.Worker.from_core(self.identity.dp_rank, self.identity.rank)
        for k, pieces in enumerate(part.chunks):
            if part.cancelled or time.monotonic() > load.deadline:
                raise KVBridgeError(f"staged read stopped at chunk {k} of {len(part.chunks)} (deadline or failure)")
            first = k == 0
            msg = wire.Stage(
                request_id=source.remote_request_id,
                engine_id=self.identity.engine_id,
                worker=worker,
                token=source.remote_token,
                block_ids=tuple(part.s_blocks.tolist()),
                src_addr=tuple(seg.src_addr.tolist()) if first else (),
                block_stride=tuple(seg.src_block_stride.tolist()) if first else (),
                length=tuple(seg.length.tolist()) if first else (),
                chunk_bytes=part.layout.chunk_bytes,
                chunk=k,
                released=k,
            )
            answer = self._clients.get().exchange_all([target], msg)[0]
            if isinstance(answer, Exception):
                raise answer
            if first and isinstance(answer, wire.ErrorReply) and answer.reason is wire.Refusal.BUSY:
                self.fallbacks += 1  # the prefill worker's slots are taken: read this part directly
                self._direct(part, note)
                return
            if not isinstance(answer, wire.Staged):
                text = answer.message if isinstance(answer, wire.ErrorReply) else repr(answer)
                raise KVBridgeError(f"prefill worker {part.rank} refused to stage chunk {k}: {text}")
            if answer.chunk != k or answer.chunks != len(part.chunks) or answer.nbytes != part.sizes[k]:
                raise KVBridgeError(
                    f"prefill worker {part.rank} staged chunk {answer.chunk} of {answer.chunks} ({answer.nbytes} B), "
                    f"expected {k} of {len(part.chunks)} ({part.sizes[k]} B)"
                )
            slot = part.slots[k % len(part.slots)] * self.slot_bytes
            previous = scatters.pop(k - len(part.slots), None)  # the slot's last chunk must be scattered first
            if previous is not None:
                previous.result()
            last = k == len(part.chunks) - 1
            self._read(part, answer.offset, slot, answer.nbytes, note if last else b"")
            chunk = self.buffer[slot : slot + answer.nbytes]
            views, d_blocks = self._views, part.d_blocks
            scatters[k] = self._scatters.submit(
                self._scatter, views, seg.dst_addr, seg.dst_block_stride, seg.length, d_blocks, pieces, chunk
            )

    def _read(self, part: StagedPart, remote_offset: int, local_offset: int, nbytes: int, note: bytes) -> None:
        """One READ of a staged chunk, polled to its end and released; on any error it is released before this
        raises (retried while NIXL refuses: the slot is not reused while the DMA may write it)."""
        staging = part.peer.staging
        values = (staging.addr + remote_offset, self.region.addr + local_offset, nbytes, 0, 0)
        descs = Descriptors(*(np.array([v], dtype=np.int64) for v in values))
        self._poll(part, descs, (self.region,), (staging,), note)

    def _poll(self, part: StagedPart, descs: Descriptors, local, remote, note: bytes) -> None:
        nbytes = descs.nbytes
        reader, transport = self.reader, self.reader.transport
        with reader.lock:
            transfer: Transfer = transport.read(part.peer.agent, descs, local, remote, note)
        part.reads += 1
        backoff = Backoff(first_s=20e-6, cap_s=1e-3)
        try:
            while True:
                with reader.lock:
                    if transport.poll(transfer):
                        break
                if part.cancelled or time.monotonic() > part.load.deadline:
                    raise KVBridgeError(f"staged READ of {nbytes} B from {part.rank} not done by the load's deadline")
                backoff.sleep()
        finally:
            running = not transfer.done
            self._release(transfer)
            if running:
                self._fence(part)

    def _fence(self, part: StagedPart) -> None:
        """After a READ was released unfinished: NIXL's release does not stop UCX's GET (its data may land later,
        `read_fences`), so before the part's slots or KV blocks are reused, wait for a flush READ from the same agent
        (UCX answers one reader's READs in order). None done within transfer_timeout_s, or the agent waiting for a
        renewal: the part is `unfenced`: its slots are retired, and the load's own fence renews the agent before its
        blocks go back."""
        reader, agent = self.reader, part.peer.agent
        with reader.lock:
            flush = reader.post_flush(agent, part.peer.memory)
        if flush is None:
            return  # the endpoint has failed: it delivers nothing more
        deadline = time.monotonic() + self.config.transfer_timeout_s
        backoff = Backoff(first_s=1e-3, cap_s=0.05)
        try:
            while time.monotonic() < deadline:
                with reader.lock:
                    if reader.flushed(agent, flush):
                        return
                    if agent in reader.renewing:  # silent: no flush will come, the agent's renewal fences it
                        break
                backoff.sleep()
            part.unfenced = True
            logger.warning(
                "kvbridge decode %s: no flush READ from %s done in %g s after a staged READ was released unfinished: "
                "its %d staging slots are retired",
                self.identity,
                part.peer.agent,
                self.config.transfer_timeout_s,
                len(part.slots),
            )
        finally:
            with contextlib.suppress(KVBridgeError), reader.lock:
                reader.transport.release(flush)

    def _direct(self, part: StagedPart, note: bytes) -> None:
        """The part read the direct way (coalesced descriptors), polled and released here."""
        descs = expand(part.segments, part.s_blocks, part.d_blocks).coalesced()
        self._poll(part, descs, self.memory, part.peer.memory, note)

    def _release(self, transfer: Transfer) -> None:
        backoff = Backoff(first_s=1e-3, cap_s=0.1)
        while True:
            try:
                with self.reader.lock:
                    self.reader.transport.release(transfer)
                return
            except KVBridgeError as exc:
                logger.warning("kvbridge decode %s: %s (retrying: the slot stays held)", self.identity, exc)
                backoff.sleep()

    def _give_back(self, part: StagedPart) -> None:
        with self._lock:
            (self.retired if part.unfenced else self._free).extend(part.slots)
            part.slots = []
