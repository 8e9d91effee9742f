"""A prefill worker's runtime: publish its KV over the side channel, hold finished requests for readers.

Threads: the side-channel server answers handshakes (no NIXL calls there). Progress (polling NIXL
notifications, which also lets readers' UCX connections complete, and turning completed or expired leases into
finished ids) runs under one lock, from two places: a background thread that polls with backoff, and the
engine's step thread each time it asks for finished ids. vLLM steps continuously while requests are held, and on
a loaded machine a background thread can starve for seconds; the step path then keeps transfers moving.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import ProtocolError, TransferError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.leases import LeaseBook
from kvbridge.core.memory import WorkerMemory
from kvbridge.runtime.host import host_id
from kvbridge.transport.nixl import Backoff, MemType, NixlTransport, TransportConfig
from kvbridge.wire import messages as wire
from kvbridge.wire.side_channel import SideChannelServer, handshake_handler, side_channel_port

if TYPE_CHECKING:
    from kvbridge.core.memory import IpcHandle

logger = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(
        self,
        identity: WorkerIdentity,
        memory: WorkerMemory,
        config: BridgeConfig,
        mem_type: MemType = "DRAM",
        clock=time.monotonic,
        ipc: tuple[IpcHandle, ...] = (),
    ) -> None:
        """`ipc`: CUDA IPC handles of `memory`'s regions (`cuda_ipc.export_region`), published in the handshake
        so that decode workers on this host can read with a GPU kernel instead of NIXL."""
        self.identity = identity
        self.ipc = ipc
        self.memory = memory
        self.config = config
        self.mem_type = mem_type
        self.clock = clock
        self.port = side_channel_port(config.side_channel_port, identity.layout, identity.dp_rank, identity.rank)
        self.transport = NixlTransport(identity.agent_name, transport_config(config, mem_type))
        self._leases = LeaseBook(config.lease_s)
        self._lock = threading.Lock()
        self._to_hold: list[str] = []
        self._held: dict[str, frozenset[int]] = {}  # what claims are checked against (under _lock)
        self._finished: set[str] = set()
        self._side_notes: list[wire.Notify] = []  # notifications that came over the side channel (CUDA IPC readers)
        self._expired_new = 0
        self._progress_lock = threading.Lock()  # NIXL agents are not thread-safe: one caller at a time
        self._backoff = Backoff(first_s=100e-6, cap_s=5e-3)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: SideChannelServer | None = None

    def start(self) -> PrefillWorker:
        self.transport.start()
        self.transport.register(self.memory, self.mem_type)
        ident = self.identity
        reply = wire.HandshakeReply.build(
            ident.engine_id,
            ident.layout,
            ident.dp_rank,
            ident.rank,
            ident.geometry,
            ident.kv_layout,
            self.transport.name,
            self.transport.agent_metadata(),
            self.memory,
            host_id=host_id(),
            ipc=self.ipc,
        )
        self._server = SideChannelServer(
            self.port, handshake_handler(reply, self._answer), host=self.config.side_channel_host
        )
        self._server.start()
        self._thread = threading.Thread(target=self._run, name=f"kvbridge-prefill-{ident.rank}", daemon=True)
        self._thread.start()
        logger.info("kvbridge prefill worker %s serving handshakes on port %d", ident, self.port)
        return self

    def hold(self, request_id: str, block_ids: tuple[int, ...] = ()) -> None:
        """Keep `request_id`'s blocks until its readers are done or its lease expires."""
        with self._lock:
            self._to_hold.append(request_id)
            self._held[request_id] = frozenset(block_ids)
        self._wake.set()

    def _answer(self, message: wire.Message) -> wire.Message:
        """Side-channel messages other than handshakes (runs on the side-channel thread, no NIXL calls)."""
        match message:
            case wire.Claim(request_id=request_id, block_ids=blocks):
                with self._lock:
                    held = self._held.get(request_id)
                if held is None:
                    return wire.ErrorReply(
                        message=f"request {request_id} is not held by {self.identity} (unknown, already read, "
                        "or its lease expired)"
                    )
                stray = sorted(set(blocks) - held)
                if stray:
                    return wire.ErrorReply(message=f"blocks {stray[:8]} are not request {request_id}'s")
                return wire.Ack(request_id=request_id)
            case wire.Notify(request_id=request_id):
                # Readers that copied through CUDA IPC made no NIXL transfer to carry their notification.
                with self._lock:
                    self._side_notes.append(message)
                self._wake.set()
                return wire.Ack(request_id=request_id)
            case _:
                return wire.ErrorReply(message=f"unexpected {type(message).__name__}")

    def finished(self) -> tuple[set[str], int]:
        """(ids whose blocks may be freed now, leases expired since the last call). Makes progress too, unless
        the background thread is doing so right now."""
        if self._progress_lock.acquire(blocking=False):
            try:
                self._progress()
            except Exception:  # never raise into vLLM's step; the background thread retries
                logger.exception("kvbridge prefill %s: progress error", self.identity)
            finally:
                self._progress_lock.release()
        with self._lock:
            out, self._finished = self._finished, set()
            expired, self._expired_new = self._expired_new, 0
        return out, expired

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._server is not None:
            self._server.close()
        self.transport.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._progress_lock:
                try:
                    active = self._progress()
                except Exception:  # keep serving: leases still expire on later rounds
                    logger.exception("kvbridge prefill %s: progress error", self.identity)
                    active = False
            if active:
                self._backoff.reset()
            # Wait for work; poll quickly while requests are held (readers need our progress).
            delay = self._backoff.step() if self._leases.held else 0.05
            self._wake.wait(delay)
            self._wake.clear()

    def _progress(self) -> bool:
        """One round of holds, notifications and lease accounting; True if anything happened."""
        now = self.clock()
        active = False
        with self._lock:
            holds, self._to_hold = self._to_hold, []
            side_notes, self._side_notes = self._side_notes, []
        for request_id in holds:
            self._leases.hold(request_id, now)
            active = True
        try:
            notes = self.transport.notifications()
        except TransferError as exc:
            logger.warning("kvbridge prefill %s: %s", self.identity, exc)
            notes = {}
        for agent, messages in notes.items():
            for raw in messages:
                active = True
                try:
                    msg = wire.decode(raw)
                except ProtocolError as exc:
                    logger.warning("kvbridge prefill %s: bad notification from %s: %s", self.identity, agent, exc)
                    continue
                if isinstance(msg, wire.Notify):
                    self._leases.notified(msg.request_id, f"{msg.engine_id}/{msg.worker}", msg.expected, now)
        for msg in side_notes:
            active = True
            self._leases.notified(msg.request_id, f"{msg.engine_id}/{msg.worker}", msg.expected, now)
        done, expired = self._leases.due(now)
        if expired:
            logger.warning("kvbridge prefill %s: lease expired for %s", self.identity, sorted(expired))
        if done or expired:
            with self._lock:
                for request_id in done | expired:
                    self._held.pop(request_id, None)
                self._finished |= done | expired
                self._expired_new += len(expired)
        return active


def transport_config(config: BridgeConfig, mem_type: MemType) -> TransportConfig:
    tls = config.ucx_tls
    if tls == "auto":
        tls = "self,sm,cma,tcp" if mem_type == "DRAM" else None
    return TransportConfig(ucx_tls=tls, ucx_net_devices=config.ucx_net_devices)
