"""A prefill worker's side of the staged NIXL path: a registered, bounded staging buffer and the readers' sessions.

A reader whose blocks are scattered in small runs asks (`wire.Stage`, after its claim was granted) for its part of a
request chunk by chunk; each chunk is gathered into a slot of the staging buffer, which the reader then READs as one
descriptor. The buffer is allocated and registered once, at start (`staging_bytes`, cut into slots of
`slot_bytes`): nothing a peer sends allocates more. A session (one reader's part of one request) takes up to
`DEPTH` slots, all at its first chunk or none (the reader then reads directly); chunk k lives in slot k % DEPTH, so
chunk k + 1 is gathered (by the gather thread, right after chunk k is handed out) while chunk k is read, and chunk
k + DEPTH only once the reader says chunk k is read (`released`).

With KV in GPU memory (`tensors`: the KV regions as tensors) the buffer is VRAM and the gathers are torch copies on
that GPU (`transport.device_copy`); in host memory, numpy/torch CPU copies (`transport.host_copy`). Everything
else is the same.

A session ends, its slots free, when its reader's notification arrives (carried by its last READ, so every chunk
was read), when the request leaves the lease book (all readers done, aborted, expired), or when its claim's pin
lapses. Gathering checks that the request is claimed by this reader with these blocks (`LeaseBook.reading`, by the
caller) and that every run lies in this worker's registered memory (`core.staging.runs_inside`): a peer can have
gathered only bytes it could READ directly.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbridge.core.memory import Region, WorkerMemory
from kvbridge.core.staging import Piece, StageLayout, runs_inside
from kvbridge.transport import device_copy, host_copy
from kvbridge.wire import messages as wire
from kvbridge.wire.affinity import unpin_this_thread

logger = logging.getLogger(__name__)

DEPTH = 2
"""Slots per session: one being read, one being gathered."""

MAX_CHUNKS = 1 << 16
"""The most chunks one session's part may take (its chunk table is kept while it is read)."""


@dataclass(eq=False)
class _Session:
    key: tuple[str, str, str]  # (request id, reader engine, reader worker)
    addr: np.ndarray
    block_stride: np.ndarray
    length: np.ndarray
    blocks: np.ndarray
    chunks: list[list[Piece]]
    sizes: list[int]
    slots: list[int]
    until: float
    gathered: int = 0  # chunks [0, gathered) have been gathered (each into slot k % DEPTH)
    released: int = 0  # chunks [0, released) are read by the reader
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class Stager:
    def __init__(self, memory: WorkerMemory, staging_bytes: int, slot_bytes: int, tensors: Sequence = ()) -> None:
        """`tensors`: `memory`'s regions as tensors (GPU memory: the buffer and the gathers on their device);
        empty: host memory."""
        if slot_bytes <= 0 or staging_bytes < slot_bytes:
            raise ValueError(f"staging of {staging_bytes} bytes has no slot of {slot_bytes} bytes")
        self.memory = memory
        self.slot_bytes = slot_bytes
        self.num_slots = staging_bytes // slot_bytes
        self.buffer = None  # np.ndarray (host) or torch.Tensor (device), from start()
        self.region: Region | None = None
        self._tensors = tuple(tensors)
        if self._tensors:
            self._views = device_copy.DeviceViews(memory.regions, self._tensors)
            self._gather = device_copy.gather
        else:
            self._views = host_copy.HostViews(memory.regions)
            self._gather = host_copy.gather
        self._kv_bytes = sum(r.nbytes for r in memory.regions)
        self._lock = threading.Lock()  # the free slots and the sessions
        self._free: list[int] = []
        self._sessions: dict[tuple[str, str, str], _Session] = {}
        self._todo: queue.Queue[_Session | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.gathered_bytes = 0  # totals, for tests and metrics
        self.refused = 0

    def start(self) -> Stager:
        """Allocate the staging buffer (host memory, or on the KV tensors' device; the caller registers `region`
        as `mem_type`) and start the gather thread."""
        if self._tensors:
            self.buffer, self.region = device_copy.staging_buffer(self.num_slots * self.slot_bytes, self._tensors[0])
        else:
            self.buffer = np.zeros(self.num_slots * self.slot_bytes, dtype=np.uint8)
            self.region = Region(self.buffer.ctypes.data, self.buffer.nbytes, 0)
        self._free = list(range(self.num_slots))
        self._thread = threading.Thread(target=self._run, name="kvbridge-stage", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._todo.put(None)
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def mem_type(self) -> str:
        """How NIXL registers the buffer."""
        return "VRAM" if self._tensors and self._tensors[0].is_cuda else "DRAM"

    @property
    def memory_region(self) -> WorkerMemory:
        return WorkerMemory((self.region,), ())

    @property
    def sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    @property
    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)

    # -- the side channel's thread ------------------------------------------------------------------

    def answer(self, msg: wire.Stage, until: float, epoch: str) -> wire.Message:
        """Chunk `msg.chunk` of the reader's part, gathered (now, or already by the gather thread): `Staged`, or an
        ErrorReply saying why not. `until`: the claim's pin (the session lapses then)."""
        key = (msg.request_id, msg.engine_id, str(msg.worker))
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                session, why = self._open(key, msg, until)
                if session is None:
                    self.refused += 1
                    reason = wire.Refusal.BUSY if why == "busy" else wire.Refusal.STAGE
                    return wire.ErrorReply(message=f"stage refused: {why}", reason=reason)
        with session.lock:
            if session.closed:
                return wire.ErrorReply(message="stage refused: ended", reason=wire.Refusal.STAGE)
            session.until = max(session.until, until)
            session.released = max(session.released, min(msg.released, session.gathered))
            k = msg.chunk
            if k >= len(session.chunks):
                return wire.ErrorReply(
                    message=f"stage refused: chunk {k} of {len(session.chunks)}", reason=wire.Refusal.STAGE
                )
            if k + len(session.slots) < session.gathered:  # its slot holds a later chunk now
                return wire.ErrorReply(message=f"stage refused: chunk {k} is gone", reason=wire.Refusal.STAGE)
            while session.gathered <= k:
                if not self._gather_next(session):
                    return wire.ErrorReply(
                        message=f"stage refused: chunk {k} before chunk {session.released} read",
                        reason=wire.Refusal.STAGE,
                    )
            offset = self._offset(session, k)
        self._todo.put(session)  # gather the next chunk while this one is read
        return wire.Staged(
            request_id=msg.request_id,
            chunk=k,
            chunks=len(session.chunks),
            offset=offset,
            nbytes=session.sizes[k],
            epoch=epoch,
        )

    def _open(self, key, msg: wire.Stage, until: float) -> tuple[_Session | None, str]:
        """A new session (under _lock), or None and why not."""
        if not msg.src_addr:
            return None, "no segments"
        if not (len(msg.src_addr) == len(msg.block_stride) == len(msg.length)):
            return None, "segments"
        addr = np.array(msg.src_addr, dtype=np.int64)
        stride = np.array(msg.block_stride, dtype=np.int64)
        length = np.array(msg.length, dtype=np.int64)
        blocks = np.array(msg.block_ids, dtype=np.int64)
        if not blocks.size:
            return None, "no blocks"
        if blocks.max() >= self.memory.num_blocks:
            return None, "blocks"
        outside = runs_inside(self.memory.regions, addr, stride, length, blocks)
        if outside:
            logger.warning("kvbridge stage: refused %s: %s", key, outside)
            return None, "outside"
        try:
            layout = StageLayout(length, int(blocks.size), min(msg.chunk_bytes, self.slot_bytes))
        except ValueError:
            return None, "chunk_bytes"
        # A part reads each byte of this worker's KV at most once: larger means repeated blocks or runs, refused
        # before its chunk table is built (that table is what a session costs beyond its slots).
        if layout.nbytes > self._kv_bytes or -(-layout.nbytes // layout.chunk_bytes) > MAX_CHUNKS:
            return None, "too_large"
        chunks = layout.chunks()
        want = min(DEPTH, len(chunks))
        if len(self._free) < want:
            return None, "busy"
        slots = [self._free.pop() for _ in range(want)]
        session = _Session(key, addr, stride, length, blocks, chunks, layout.chunk_sizes(), slots, until)
        self._sessions[key] = session
        return session, ""

    def _offset(self, session: _Session, k: int) -> int:
        return session.slots[k % len(session.slots)] * self.slot_bytes

    def _gather_next(self, session: _Session) -> bool:
        """Gather the session's next chunk if its slot is free (under session.lock); False if it is not."""
        k = session.gathered
        if k >= len(session.chunks) or k - len(session.slots) >= session.released:
            return False
        offset = self._offset(session, k)
        out = self.buffer[offset : offset + self.slot_bytes]
        self.gathered_bytes += self._gather(
            self._views, session.addr, session.block_stride, session.length, session.blocks, session.chunks[k], out
        )
        session.gathered = k + 1
        return True

    def _run(self) -> None:
        unpin_this_thread()
        while (session := self._todo.get()) is not None:
            with session.lock:
                if not session.closed:
                    try:
                        self._gather_next(session)
                    except Exception:  # never lose the thread; the reader's next Stage gathers (or fails) itself
                        logger.exception("kvbridge stage: gathering ahead failed")

    # -- ends ------------------------------------------------------------------------------------------

    def finish(self, request_id: str, engine_id: str, worker: str) -> None:
        """The reader's notification arrived (its last READ is done): its session ends."""
        with self._lock:
            session = self._sessions.pop((request_id, engine_id, worker), None)
        if session is not None:
            self._close(session)

    def drop(self, request_ids: set[str], now: float) -> int:
        """End the sessions of requests that left the lease book, and those whose pin lapsed; returns how many."""
        with self._lock:
            gone = [s for k, s in self._sessions.items() if k[0] in request_ids or now >= s.until]
            for s in gone:
                del self._sessions[s.key]
        for s in gone:
            self._close(s)
        return len(gone)

    def _close(self, session: _Session) -> None:
        with session.lock:  # waits for a gather in progress: the slot is never written once it is free
            session.closed = True
        with self._lock:
            self._free.extend(session.slots)
