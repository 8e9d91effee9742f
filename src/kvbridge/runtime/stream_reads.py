"""A decode worker's side of kvbridge's KV channel: read a claimed request's blocks from prefill workers on other
hosts over authenticated, AEAD-sealed TCP connections (`transport.kv_stream`), and scatter them into its blocks.

The path for an engine on another host unless UCX may cross hosts (`nixl_crosses_hosts`: RDMA devices named, or
the operator's `ucx_tcp_exposes_process_memory`). A load runs after its claim was granted (the decode worker's
claim step), on this object's threads:

    per prefill worker read, `kv_stream_connections` connections (from a pool of authenticated ones, or new):
        StreamRead(first=i, step=n) -> chunks i, i+n, ... arrive as data frames, each opened into this
        connection's buffer and scattered into the KV blocks (`transport.host_copy`) before the next is read
    all done -> loaded(load): the decode worker reports it and tells every prefill worker (Notify)
    any error (also no byte for `kv_stream_stall_s`, a silent prefill) -> the load's other connections are cut,
    and once none of its threads can still scatter -> failed(load, error)
    a prefill worker's host unreachable (no connection within `link_timeout_s`) -> `unreachable(engine, why)`:
    the decode worker knows the engine dead, and `cut` ends every load in flight from it the same way

So no byte lands in a block after the load was reported. A connection is returned to the pool only after a whole
part and its StreamEnd; a failed one is closed. Chunks are laid out as the staged NIXL path lays them out
(`core.staging.StageLayout`), group after group.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kvbridge.core.config import BridgeConfig
from kvbridge.core.descriptors import block_lists
from kvbridge.core.errors import HostUnreachable, KVBridgeError, RequestParamsError, TransferError, TransferTimeout
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import WorkerMemory
from kvbridge.core.segments import Segments
from kvbridge.core.staging import StageLayout
from kvbridge.core.topology import WorkerRank
from kvbridge.runtime.load import Load
from kvbridge.runtime.peers import Engine
from kvbridge.transport import host_copy
from kvbridge.transport.kv_stream import KIND_DATA, KIND_MESSAGE, StreamConnection, client_handshake, connect, shut
from kvbridge.wire import messages as wire
from kvbridge.wire import stream_messages as sm
from kvbridge.wire.affinity import unpin_this_thread
from kvbridge.wire.keys import KeyRing
from kvbridge.wire.local_address import on_this_host

logger = logging.getLogger(__name__)

MAX_IDLE_PER_ADDRESS = 16
"""Authenticated connections kept open per prefill worker between loads."""

IDLE_CLOSE_S = 60.0
"""An idle connection unused this long is closed by this side (well before the prefill worker's own idle limit,
600 s), so that pooled connections do not hold the prefill worker's `kv_stream_max_connections` for nothing."""


_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class _Group:
    segments: Segments | None  # None or empty: no runs of this group here (its blocks still name the claim's)
    s_blocks: np.ndarray
    d_blocks: np.ndarray
    chunks: list
    sizes: list[int]


@dataclass
class _Part:
    """One prefill worker's part of a load."""

    rank: WorkerRank
    address: tuple[str, int]
    groups: list[_Group]
    request: sm.StreamRead

    @property
    def chunks(self) -> list[tuple[_Group, list, int]]:
        return [(g, c, s) for g in self.groups for c, s in zip(g.chunks, g.sizes, strict=True)]


@dataclass(eq=False)
class _Tracker:
    load: Load
    left: int
    error: str = ""
    socks: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stop(self, error: str) -> None:
        """Under `lock`: the load fails with `error` unless it failed already, and its connections are shut at once
        (a thread blocked on one returns)."""
        if not self.error:
            self.error = error
            for sock in self.socks:
                shut(sock)


class StreamReads:
    def __init__(
        self,
        identity: WorkerIdentity,
        memory: WorkerMemory,
        config: BridgeConfig,
        key: bytes,
        *,
        loaded: Callable[[Load], None],
        failed: Callable[[Load, str], None],
        unreachable: Callable[[Engine, str], None] | None = None,
    ) -> None:
        """`key`: the deployment key (the channel derives its own, `stream_key`). `loaded(load)` and
        `failed(load, error)` report a load once nothing of it can still write its blocks; `unreachable(engine,
        why)`: a prefill worker of `engine` did not accept a connection within link_timeout_s."""
        self.identity = identity
        self.memory = memory
        self.config = config
        current = KeyRing.of(key).current
        self.key, self.key_id = current.stream, current.key_id
        self.mode = "encrypt" if config.kv_stream_encrypt else "integrity"
        self.loaded = loaded
        self.failed = failed
        self.unreachable = unreachable
        self._running: set[_Tracker] = set()  # the loads with parts in flight (`cut`)
        self._views = host_copy.HostViews(memory.regions)
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[tuple[StreamConnection, float]]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.bytes = 0  # totals, for tests and benches
        self.parts = 0

    def start(self) -> StreamReads:
        host_copy.warm()  # not inside the first scatter, while a load's other connections wait
        self._pool = ThreadPoolExecutor(
            self.config.kv_stream_threads, thread_name_prefix="kvbridge-stream", initializer=unpin_this_thread
        )
        return self

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=False)
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn, _ in conns:
                conn.close()

    # -- a load -----------------------------------------------------------------------------------

    def launch(self, load: Load) -> None:
        """Read the claimed load over the channel; reports it through `loaded` or `failed`, never raises."""
        if not self.config.verify_requests:  # no claim was made: the prefill would refuse every read
            self.failed(load, "the kv stream sends only claimed requests: verify_requests is false")
            return
        try:
            parts = self._parts(load, load.engine)
        except KVBridgeError as exc:
            self.failed(load, str(exc))
            return
        load.posted = time.monotonic()
        load.nbytes = sum(s for p in parts for _, _, s in p.chunks)
        n = self.config.kv_stream_connections
        jobs = [(p, i, min(n, len(p.chunks))) for p in parts for i in range(min(n, len(p.chunks)))]
        if not jobs:
            self.loaded(load)
            return
        tracker = _Tracker(load, len(jobs))
        load.descriptors = len(jobs)
        with self._lock:
            self._running.add(tracker)
        for k, (part, first, step) in enumerate(jobs):
            try:
                self._pool.submit(self._run, tracker, part, first, step)
            except RuntimeError as exc:  # closed meanwhile: the jobs not submitted end here
                with tracker.lock:
                    tracker.stop(f"kv stream reads: {exc}")
                    tracker.left -= len(jobs) - k
                    last = tracker.left == 0
                if last:
                    with self._lock:
                        self._running.discard(tracker)
                    self.failed(load, tracker.error)
                return

    def cut(self, key: tuple, why: str) -> None:
        """Fail every load in flight from the engine `key` names (its host is unreachable, or it is known dead):
        their connections are shut at once, and each load is reported failed once none of its threads can still
        scatter."""
        with self._lock:
            trackers = [t for t in self._running if t.load.engine.key == key]
        for tracker in trackers:
            with tracker.lock:
                if tracker.left > 0:
                    tracker.stop(f"kv stream: prefill engine {key[0]} is down: {why}")

    def _parts(self, load: Load, engine: Engine) -> list[_Part]:
        job, source = load.job, load.job.source
        if job.span is not None:
            raise RequestParamsError(
                f"remote_block_size {job.remote_block_size}: the kv stream moves whole blocks of equal size only"
            )
        groups = self.memory.num_groups
        if len(job.remote_blocks) != groups:
            raise RequestParamsError(f"{len(job.remote_blocks)} block lists for {groups} KV-cache groups")
        sources = {rank: peer.memory for rank, peer in engine.peers.items()}
        # Every group is named in each part (the claim's blocks are checked group by group), its runs only where
        # this prefill worker holds some of its layers.
        found: dict[WorkerRank, list[tuple[Segments | None, np.ndarray, np.ndarray]]] = {}
        for g in range(groups):
            for rank, segments in self._segments_of(engine, g).items():
                s_blocks, d_blocks = block_lists(job.remote_blocks[g], job.local_blocks[g], sources[rank], self.memory)
                found.setdefault(rank, [(None, _EMPTY, _EMPTY)] * groups)[g] = (segments, s_blocks, d_blocks)
        by_rank: dict[WorkerRank, tuple[int, list[_Group]]] = {}
        for rank, runs in found.items():  # one chunk size per part: the configured one, or its longest run
            used = [(seg, s, d) for seg, s, d in runs if seg is not None and len(seg) and s.size]
            if not used:
                continue
            size = max(self.config.kv_stream_chunk_bytes, *(int(seg.length.max()) for seg, _, _ in used))
            got = []
            for segments, s_blocks, d_blocks in runs:
                if segments is None or not len(segments) or not s_blocks.size:
                    got.append(_Group(segments, s_blocks, d_blocks, [], []))
                    continue
                layout = StageLayout(segments.length, int(s_blocks.size), size)
                got.append(_Group(segments, s_blocks, d_blocks, layout.chunks(), layout.chunk_sizes()))
            by_rank[rank] = (size, got)
        worker = wire.Worker.from_core(self.identity.dp_rank, self.identity.rank)
        parts = []
        for rank, (size, got) in by_rank.items():
            peer = engine.peers[rank]
            if not peer.stream_port:
                raise TransferError(f"prefill worker {rank} offers no kv stream")
            request = sm.StreamRead(
                request_id=source.remote_request_id,
                engine_id=self.identity.engine_id,
                worker=worker,
                token=source.remote_token,
                groups=tuple(_group_message(g) for g in got),
                chunk_bytes=size,
            )
            parts.append(_Part(rank, (source.remote_host, peer.stream_port), got, request))
        return parts

    def _segments_of(self, engine: Engine, group: int) -> dict[WorkerRank, Segments]:
        return engine.segments(self.identity.rank, self.memory, group if self.memory.num_groups > 1 else None)

    def _run(self, tracker: _Tracker, part: _Part, first: int, step: int) -> None:
        error = ""
        try:
            self._read(tracker, part, first, step)
        except Exception as exc:
            if not isinstance(exc, (KVBridgeError, OSError)):
                logger.exception("kvbridge decode %s: kv stream read failed", self.identity)
            error = f"kv stream from prefill worker {part.rank}: {exc}" if not tracker.error else ""
            if isinstance(exc, HostUnreachable) and self.unreachable is not None:
                try:
                    self.unreachable(tracker.load.engine, error or str(exc))
                except Exception:  # the load must still be counted down and reported
                    logger.exception("kvbridge decode %s: reporting an unreachable prefill failed", self.identity)
        with tracker.lock:
            if error:
                tracker.stop(error)  # the load's other connections stop at once
            tracker.left -= 1
            last = tracker.left == 0
            failure = tracker.error
        if last:
            with self._lock:
                self._running.discard(tracker)
            if failure:
                self.failed(tracker.load, failure)
            else:
                with self._lock:
                    self.parts += 1
                self.loaded(tracker.load)

    def _read(self, tracker: _Tracker, part: _Part, first: int, step: int) -> None:
        load = tracker.load
        request = sm.StreamRead(**{**_fields(part.request), "first": first, "step": step})
        chunks = part.chunks
        mine = range(first, len(chunks), step)
        conn, pooled = self._connection(part.address, tracker)
        with tracker.lock:
            if tracker.error:
                conn.close()
                return
            tracker.socks.add(conn.sock)
        done = False
        stall = False  # whether the socket's timeout is the stall bound (else the load's deadline)
        try:
            stall = self._timeout(conn, load)
            try:
                conn.send(KIND_MESSAGE, 0, sm.encode(request))
                header = conn.recv_header(max(s for _, _, s in chunks) or 1)
            except (OSError, TransferError) as exc:
                if not pooled or isinstance(exc, TimeoutError):  # silent, not closed: a fresh one would wait too
                    raise
                conn.close()  # a pooled connection the server closed meanwhile: one fresh try
                with tracker.lock:
                    tracker.socks.discard(conn.sock)
                conn, _ = self._connection(part.address, tracker, pooled=False)
                with tracker.lock:
                    tracker.socks.add(conn.sock)
                stall = self._timeout(conn, load)
                conn.send(KIND_MESSAGE, 0, sm.encode(request))
                header = conn.recv_header(max(s for _, _, s in chunks) or 1)
            buffer = np.empty(max(s for _, _, s in chunks), dtype=np.uint8)
            for index in mine:
                kind, got, size = header
                if kind == KIND_MESSAGE:
                    raise TransferError(f"refused at chunk {index}: {self._end(conn, size).error or 'early end'}")
                group, pieces, want = chunks[index]
                if kind != KIND_DATA or got != index or size != want:
                    raise TransferError(f"frame {got} of {size} B, expected chunk {index} of {want} B")
                out = buffer[:size]
                conn.recv_into(memoryview(out))
                if tracker.error:
                    raise TransferError("stopped: another part of the load failed")
                seg = group.segments
                host_copy.scatter(
                    self._views, seg.dst_addr, seg.dst_block_stride, seg.length, group.d_blocks, pieces, out
                )
                with self._lock:
                    self.bytes += size
                stall = self._timeout(conn, load)
                header = conn.recv_header(max(want, 1 << 20))
            kind, _, size = header
            end = self._end(conn, size) if kind == KIND_MESSAGE else None
            if end is None or end.error or end.chunks != len(chunks):
                raise TransferError(f"bad end of part: {end}")
            done = True
        except TimeoutError as exc:  # the socket's timeout: no byte within it, or TCP_USER_TIMEOUT's abort
            if exc.errno == errno.ETIMEDOUT:
                host, port = part.address
                raise TransferTimeout(
                    f"the connection to {host}:{port} was aborted: bytes sent to it unacknowledged for "
                    f"{self.config.link_timeout_s:g} s (link_timeout_s)"
                ) from exc
            if not stall:
                raise TransferTimeout("kv stream: the load's deadline passed") from exc
            host, port = part.address
            raise TransferTimeout(
                f"no byte from {host}:{port} for {self.config.kv_stream_stall_s} s (kv_stream_stall_s)"
            ) from exc
        finally:
            with tracker.lock:
                tracker.socks.discard(conn.sock)
            if done:
                self._give_back(part.address, conn)
            else:
                conn.close()

    def _end(self, conn: StreamConnection, size: int) -> sm.StreamEnd:
        if size > 1 << 20:
            raise TransferError(f"a message of {size} B")
        payload = bytearray(size)
        conn.recv_into(memoryview(payload))
        end = sm.decode(payload)
        if not isinstance(end, sm.StreamEnd):
            raise TransferError(f"unexpected {type(end).__name__}")
        return end

    def _timeout(self, conn: StreamConnection, load: Load) -> bool:
        """Bound the connection's next waits: each receive (or send) fails after min(time left to the load's
        deadline, kv_stream_stall_s) without a byte. Returns whether the stall bound is the shorter."""
        left = load.deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout("kv stream: the load's deadline passed")
        stall = self.config.kv_stream_stall_s
        conn.sock.settimeout(min(left, stall))
        return stall < left

    # -- connections ---------------------------------------------------------------------------------

    def _connection(
        self, address: tuple[str, int], tracker: _Tracker, pooled: bool = True
    ) -> tuple[StreamConnection, bool]:
        """A pooled connection to `address` (unless `pooled` is false), else a new one; a new connect is given up
        as soon as another part of the load failed (`cut` included)."""
        load = tracker.load
        if pooled:
            with self._lock:
                stale = self._expire(time.monotonic())
                idle = self._idle.get(address)
                got = idle.pop()[0] if idle else None
            for conn in stale:
                conn.close()
            if got is not None:
                return got, True
        left = load.deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout("kv stream: the load's deadline passed")
        timeout = min(left, self.config.handshake_timeout_s)
        link = 0.0 if on_this_host(address[0]) else self.config.link_timeout_s  # this host's kernel: no link to lose
        wait = min(timeout, link) if link > 0 else timeout
        tries = 2 if link > 0 and 2 * link <= timeout else 1  # one lost SYN is no verdict: a second connect
        try:
            sock = connect(address, wait, lambda: bool(tracker.error), tries)
        except TimeoutError as exc:
            if tries == 2:
                raise HostUnreachable(
                    f"no connection to {address[0]}:{address[1]} in 2 connects of {wait:g} s (link_timeout_s): "
                    "its host or the link to it is down"
                ) from exc
            raise TransferTimeout(f"no connection to {address[0]}:{address[1]} within {wait:g} s") from exc
        except OSError as exc:
            if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):  # no route, or no answer to ARP
                raise HostUnreachable(f"no connection to {address[0]}:{address[1]}: {exc.strerror}") from exc
            raise
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if link > 0:  # bytes sent and not acknowledged this long: the connection is aborted
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, round(link * 1000)))
            sock.settimeout(timeout)
            return client_handshake(sock, self.key, self.mode, self.key_id), False
        except TimeoutError as exc:
            sock.close()
            raise TransferTimeout(
                f"no handshake answer from {address[0]}:{address[1]} within {timeout:g} s (handshake_timeout_s)"
            ) from exc
        except BaseException:
            sock.close()
            raise

    def _give_back(self, address: tuple[str, int], conn: StreamConnection) -> None:
        now = time.monotonic()
        with self._lock:
            stale = self._expire(now)
            idle = self._idle.setdefault(address, [])
            if len(idle) < MAX_IDLE_PER_ADDRESS:
                idle.append((conn, now))
            else:
                stale.append(conn)
        for old in stale:
            old.close()

    def _expire(self, now: float) -> list[StreamConnection]:
        """Under the lock: take out the idle connections unused for IDLE_CLOSE_S (the caller closes them)."""
        stale = []
        for address, idle in list(self._idle.items()):
            keep = [(c, t) for c, t in idle if now - t < IDLE_CLOSE_S]
            stale += [c for c, t in idle if now - t >= IDLE_CLOSE_S]
            if keep:
                self._idle[address] = keep
            else:
                del self._idle[address]
        return stale


def _group_message(group: _Group) -> sm.StreamGroup:
    seg = group.segments
    if seg is None or not group.chunks:
        return sm.StreamGroup(block_ids=tuple(group.s_blocks.tolist()))
    return sm.StreamGroup(
        block_ids=tuple(group.s_blocks.tolist()),
        src_addr=tuple(seg.src_addr.tolist()),
        block_stride=tuple(seg.src_block_stride.tolist()),
        length=tuple(seg.length.tolist()),
    )


def _fields(request: sm.StreamRead) -> dict:
    return {f: getattr(request, f) for f in request.__struct_fields__}
