"""A prefill worker's side of kvbridge's KV channel: send a reader the blocks its granted claim names, sealed.

One listening TCP socket per prefill worker (on `side_channel_host`; port `kv_stream_port`, 0: the OS picks, the
handshake reply tells readers). Each connection runs on a thread of its own:

    key confirmation (`transport.kv_stream.server_handshake`; a peer that does not prove the key is cut, having
    received 32 random bytes and a MAC)  ->  StreamRead  ->  checked: claimed by this reader with these blocks and
    this token (`authorize`, the lease book's `reading`), every run within one block of a layer of its group
    in this worker's own layout (`core.run_bounds`: start in a span of block 0, stride that layer's block stride,
    end inside the span)  ->  chunks gathered (`transport.host_copy`, the staged path's copies) and sent as
    sealed data frames  ->  StreamEnd  ->  the next StreamRead on the same connection

The claim is checked again before every chunk (`still`: held, token, reader, not lapsed; the blocks once per part), so a
request aborted or freed meanwhile stops its stream. Bounds: `max_connections` open at once and `max_per_address` from
one source address (when full, the oldest connection that has not proved the key is cut, else the least recently used
authenticated one waiting for its next request (one that has not yet sent its first: after `handshake_timeout_s`), else
the new one), the handshake within `handshake_timeout_s`, an idle authenticated connection closed after `idle_s`, a send
that makes no progress for `stall_s` ends the connection, a request frame of at most `MAX_REQUEST_BYTES`, and a part no
larger than the worker's KV.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from kvbridge.core.errors import KVBridgeError, ProtocolError
from kvbridge.core.memory import WorkerMemory
from kvbridge.core.run_bounds import RunBounds
from kvbridge.core.staging import StageLayout, runs_inside
from kvbridge.transport import host_copy
from kvbridge.transport.kv_stream import KIND_DATA, KIND_MESSAGE, Mode, StreamConnection, server_handshake, shut
from kvbridge.wire import stream_messages as sm
from kvbridge.wire.affinity import unpin_this_thread

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 4 << 20
"""The largest StreamRead frame taken (64 groups of 16,384 segments and 65,536 blocks fit)."""

MAX_CHUNK_BYTES = 64 << 20
"""The largest chunk a reader may ask for (what one connection's buffer costs this worker)."""


@dataclass
class _Part:
    """One group's runs of a StreamRead, as arrays, and its chunks."""

    addr: np.ndarray
    stride: np.ndarray
    length: np.ndarray
    blocks: np.ndarray
    chunks: list
    sizes: list[int]


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    opened: float
    address: str = ""
    authenticated: bool = False
    busy: bool = False  # a request read and not yet answered
    used: float = 0.0  # when its last request was answered (or it was opened)
    served: int = 0  # requests answered
    cut: bool = False  # shut to make room; its thread removes it
    thread: threading.Thread | None = field(default=None, repr=False)


def plan_parts(
    memory: WorkerMemory, request: sm.StreamRead, bounds: RunBounds | None = None
) -> tuple[list[_Part], str]:
    """Each group's runs and chunks, or why the request is refused ("" if it is not). Every run must lie within
    one block of a layer of its group (`bounds`, from this worker's own layout): a claim names blocks, so a reader
    names no bytes beyond those blocks."""
    bounds = bounds if bounds is not None else RunBounds(memory)
    if len(request.groups) > memory.num_groups:
        return [], f"{len(request.groups)} groups for {memory.num_groups}"
    if request.chunk_bytes > MAX_CHUNK_BYTES:
        return [], f"chunk_bytes {request.chunk_bytes} above {MAX_CHUNK_BYTES}"
    parts = []
    total = 0
    kv_bytes = sum(r.nbytes for r in memory.regions)
    for g, group in enumerate(request.groups):
        if not (len(group.src_addr) == len(group.block_stride) == len(group.length)):
            return [], "segments"
        if not group.src_addr or not group.block_ids:
            continue
        addr = np.array(group.src_addr, dtype=np.int64)
        stride = np.array(group.block_stride, dtype=np.int64)
        length = np.array(group.length, dtype=np.int64)
        blocks = np.array(group.block_ids, dtype=np.int64)
        if int(blocks.max()) >= memory.num_blocks:
            return [], "blocks"
        outside = bounds.check(g, addr, stride, length) or runs_inside(memory.regions, addr, stride, length, blocks)
        if outside:
            return [], f"outside ({outside})"
        try:
            layout = StageLayout(length, int(blocks.size), request.chunk_bytes)
        except ValueError:
            return [], "chunk_bytes"
        total += layout.nbytes
        if total > kv_bytes:  # each byte of this worker's KV at most once
            return [], "too_large"
        parts.append(_Part(addr, stride, length, blocks, layout.chunks(), layout.chunk_sizes()))
    if not parts:
        return [], "no runs"
    return parts, ""


class KvStreamServer:
    def __init__(
        self,
        memory: WorkerMemory,
        key: bytes | Mapping[bytes, bytes],
        authorize: Callable[[sm.StreamRead], float | None],
        *,
        still: Callable[[sm.StreamRead], bool] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        mode: Mode = "encrypt",
        max_connections: int = 256,
        max_per_address: int | None = None,
        handshake_timeout_s: float = 5.0,
        idle_s: float = 600.0,
        stall_s: float = 30.0,
        name: str = "kv-stream",
    ) -> None:
        """`key`: the channel's key, or its keys by deployment key id (`wire.keys.DeploymentKey.stream`).
        `authorize(request)`: until when the request's reader may read those blocks (its claim's pin), or None:
        refused. `still(request)`: before every chunk of a granted read, whether it may go on (the claim still
        held; constant cost, the blocks were checked by `authorize`); None: `authorize` again."""
        self.memory = memory
        self.key = key
        self.authorize = authorize
        self.still = still
        self.host = host
        self.port = port
        self.mode: Mode = mode
        self.max_connections = max_connections
        self.max_per_address = max_per_address or max_connections
        self.handshake_timeout_s = handshake_timeout_s
        self.idle_s = idle_s
        self.stall_s = stall_s
        self.name = name
        self._views = host_copy.HostViews(memory.regions)
        self._bounds = RunBounds(memory)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counts = {
            "connections": 0,
            "unauthenticated": 0,
            "refused": 0,
            "parts": 0,
            "bytes": 0,
            "evicted": 0,
            "cut": 0,
        }

    def start(self) -> KvStreamServer:
        host_copy.warm()  # not inside the first chunk: a reader would wait on the import
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host.strip("[]"), self.port))
        sock.listen(128)
        sock.settimeout(0.5)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name=f"kvbridge-{self.name}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:  # first: no frame leaves once close() is called
            shut(conn.sock)
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            conns = list(self._conns)  # any accepted meanwhile
        for conn in conns:
            shut(conn.sock)
        for conn in conns:
            if conn.thread is not None:
                conn.thread.join(timeout=5)

    @property
    def open_connections(self) -> int:
        with self._lock:
            return sum(not c.cut for c in self._conns)

    def _accept_loop(self) -> None:
        unpin_this_thread()
        while not self._stop.is_set():
            try:
                sock, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.01)
                continue
            now = time.monotonic()
            conn = _Conn(sock, now, address=str(peer[0]), used=now)
            with self._lock:
                if not self._make_room(conn.address):
                    self.counts["cut"] += 1
                    shut(sock)
                    sock.close()
                    continue
                self._conns.append(conn)
                self.counts["connections"] += 1
            conn.thread = threading.Thread(
                target=self._serve, args=(conn,), name=f"kvbridge-{self.name}-c", daemon=True
            )
            conn.thread.start()

    def _make_room(self, address: str) -> bool:
        """Under the lock: whether a new connection from `address` may open, having cut one to make room where
        needed (the oldest that has not proved the key, else the least recently used idle authenticated one)."""
        for pool, limit in (
            ([c for c in self._conns if c.address == address], self.max_per_address),
            (self._conns, self.max_connections),
        ):
            live = [c for c in pool if not c.cut]
            if len(live) < limit:
                continue
            waiting = [c for c in live if not c.authenticated]
            now = time.monotonic()  # a new connection gets a handshake's time to send its first request
            idle = [
                c
                for c in live
                if c.authenticated and not c.busy and (c.served or now - c.opened > self.handshake_timeout_s)
            ]
            if waiting:
                victim = min(waiting, key=lambda c: c.opened)
            elif idle:
                victim = min(idle, key=lambda c: c.used)
                self.counts["evicted"] += 1
            else:
                return False
            victim.cut = True
            shut(victim.sock)  # its thread removes it
        return True

    def _serve(self, conn: _Conn) -> None:
        unpin_this_thread()
        sock = conn.sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.handshake_timeout_s)
            try:
                stream = server_handshake(sock, self.key, self.mode)
            except (KVBridgeError, OSError) as exc:
                with self._lock:
                    self.counts["unauthenticated"] += 1
                logger.debug("kvbridge %s: connection dropped before the key was proved: %s", self.name, exc)
                return
            conn.authenticated = True
            sock.settimeout(self.idle_s)
            while not self._stop.is_set():
                kind, _, payload = stream.recv(MAX_REQUEST_BYTES)
                if kind != KIND_MESSAGE:
                    raise ProtocolError(f"kv stream: frame kind {kind} where a request was expected")
                request = sm.decode(payload)
                if not isinstance(request, sm.StreamRead):
                    raise ProtocolError(f"kv stream: unexpected {type(request).__name__}")
                conn.busy = True
                sock.settimeout(self.stall_s)  # a reader that stops reading (gone, cut off) frees the thread
                self._send_part(stream, request)
                conn.used, conn.busy, conn.served = time.monotonic(), False, conn.served + 1
                sock.settimeout(self.idle_s)
        except (KVBridgeError, OSError) as exc:
            if conn.authenticated and not self._stop.is_set():
                logger.debug("kvbridge %s: connection closed: %s", self.name, exc)
        except Exception:
            logger.exception("kvbridge %s: connection failed", self.name)
        finally:
            shut(sock)
            sock.close()
            with self._lock:
                if conn in self._conns:
                    self._conns.remove(conn)

    def _send_part(self, stream: StreamConnection, request: sm.StreamRead) -> None:
        """Every chunk of `request` it asks for (first, first + step, ...), then StreamEnd; a refusal is a StreamEnd
        with the reason, before any byte of KV is read."""
        end = self._refusal(request)
        if end is not None:
            with self._lock:
                self.counts["refused"] += 1
            stream.send(KIND_MESSAGE, 0, sm.encode(end))
            return
        parts, why = plan_parts(self.memory, request, self._bounds)
        if why:
            with self._lock:
                self.counts["refused"] += 1
            logger.warning("kvbridge %s: refused a read of %s: %s", self.name, request.request_id, why)
            stream.send(KIND_MESSAGE, 0, sm.encode(sm.StreamEnd(request_id=request.request_id, error=why)))
            return
        chunks = [(p, c, s) for p in parts for c, s in zip(p.chunks, p.sizes, strict=True)]
        buffer = np.empty(max(s for _, _, s in chunks), dtype=np.uint8)
        sent = 0
        for index in range(request.first, len(chunks), request.step):
            going = self.still(request) if self.still is not None else self.authorize(request) is not None
            if not going:  # aborted or freed meanwhile: stop here
                stream.send(
                    KIND_MESSAGE, 0, sm.encode(sm.StreamEnd(request_id=request.request_id, error="not_claimed"))
                )
                return
            part, pieces, size = chunks[index]
            out = buffer[:size]
            host_copy.gather(self._views, part.addr, part.stride, part.length, part.blocks, pieces, out)
            stream.send(KIND_DATA, index, out)
            sent += size
        with self._lock:
            self.counts["parts"] += 1
            self.counts["bytes"] += sent
        stream.send(KIND_MESSAGE, 0, sm.encode(sm.StreamEnd(request_id=request.request_id, chunks=len(chunks))))

    def _refusal(self, request: sm.StreamRead) -> sm.StreamEnd | None:
        if self.authorize(request) is None:  # not claimed, lapsed, or other blocks or token
            return sm.StreamEnd(request_id=request.request_id, error="not_claimed")
        return None
