"""A prefill worker's runtime: publish its KV over the side channel, hold finished requests for readers.

Threads: the side-channel server answers handshakes (no NIXL calls there). Progress (polling NIXL
notifications, which also lets readers' UCX connections complete, and turning completed or expired leases into
finished ids) runs under one lock, from two places: a background thread that polls with backoff, and the
engine's step thread each time it asks for finished ids. vLLM steps continuously while requests are held, and on
a loaded machine a background thread can starve for seconds; the step path then keeps transfers moving.

Every structure the threads share (the lease book, the finished ids) is touched under `_lock` only; the lease
book itself is pure (`core.leases`): claims pin a request for its reader, and claims, notifications and aborts
must carry the request's token. With a deployment key the side channel answers only sealed messages.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from kvbridge.core.config import BridgeConfig, is_loopback, rdma_device
from kvbridge.core.errors import ConfigError, ProtocolError, TransferError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.leases import LeaseBook
from kvbridge.core.memory import WorkerMemory
from kvbridge.runtime.hold_times import HoldTimeline
from kvbridge.runtime.host import has_nvidia_gpu, host_id, interface_of, process_start
from kvbridge.runtime.staging import Stager
from kvbridge.runtime.stream_server import KvStreamServer
from kvbridge.runtime.waiting_claims import WaitingClaims
from kvbridge.transport.backoff import Backoff
from kvbridge.transport.nixl import NixlTransport
from kvbridge.transport.nixl_config import TransportConfig
from kvbridge.transport.nixl_descriptors import MemType
from kvbridge.wire import messages as wire
from kvbridge.wire.affinity import unpin_this_thread
from kvbridge.wire.auth import Sealer
from kvbridge.wire.keys import KeyRing, token_is_ours
from kvbridge.wire.later import Later
from kvbridge.wire.side_channel import handshake_handler, side_channel_port
from kvbridge.wire.side_channel_server import SideChannelServer
from kvbridge.wire.stream_messages import StreamRead

if TYPE_CHECKING:
    from kvbridge.core.memory import IpcHandle

logger = logging.getLogger(__name__)

FED_NOTE_MAX_AGE_S = 1.0
"""A hold from the feed older than this (since the scheduler finished the request) is left to the metadata: the
copy the metadata brings may have come, been read and freed already."""
MAX_FED = 1 << 16
"""Holds the feed brought whose metadata copy has not come yet, remembered to drop that copy (the oldest go)."""


class PrefillWorker:
    def __init__(
        self,
        identity: WorkerIdentity,
        memory: WorkerMemory,
        config: BridgeConfig,
        mem_type: MemType = "DRAM",
        clock=time.monotonic,
        ipc: tuple[IpcHandle, ...] = (),
        key: bytes | KeyRing | None = None,
        regions: Sequence = (),
    ) -> None:
        """`ipc`: CUDA IPC handles of `memory`'s regions (`cuda_ipc.export_region`), published in the handshake
        so that decode workers on this host can read with a GPU kernel instead of NIXL. `key`: the deployment keys
        (`wire.keys.load_keys`; bytes: one key); without one the side channel must listen on loopback (ConfigError
        otherwise).
        `regions`: `memory`'s regions as tensors (`torch_memory.region_tensors`); with GPU memory they enable the
        staged NIXL path in VRAM (`nixl_staging_bytes`)."""
        self.identity = identity
        self.ipc = ipc
        self.memory = memory
        self.config = config
        self.mem_type = mem_type
        self.clock = clock
        self.port = side_channel_port(config.side_channel_port, identity.layout, identity.dp_rank, identity.rank)
        self.transport = NixlTransport(identity.agent_name, transport_config(config, mem_type))
        self.key = key
        self.epoch = secrets.token_hex(8)
        self.started = time.time()  # before any params of this run are issued (the engine serves after start)
        self.process = (os.getpid(), process_start(os.getpid()) or 0)  # (0, 0): not said in the handshake
        self._leases = LeaseBook(  # under _lock
            config.lease_s,
            early_ttl_s=config.early_note_s,
            check_blocks=config.check_blocks,
            max_early=config.max_early_notes,
            early_notes_per_request=config.early_notes_per_request,
            token_check=token_check(key, identity.engine_id),
        )
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified when a lease may have ended (under _lock)
        self._finished: set[str] = set()
        self._expired_new = 0
        self._waiting = WaitingClaims(config.max_waiting_claims)  # claims waiting for their holds (under _lock)
        self._fed: OrderedDict[str, str] = OrderedDict()  # the feed's holds not yet in the metadata (under _lock)
        self._unfed: OrderedDict[str, tuple[str, float]] = OrderedDict()  # the metadata's first, for the feed's copy
        self._times = HoldTimeline()  # held requests' timelines (under _lock)
        self._progress_lock = threading.Lock()  # NIXL agents are not thread-safe: one caller at a time
        self._backoff = Backoff(first_s=100e-6, cap_s=5e-3)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: SideChannelServer | None = None
        self.stream: KvStreamServer | None = None  # kvbridge's KV channel (from start(), with a key, host memory)
        check_stream_memory(config, mem_type, key is not None)
        self.stager: Stager | None = None  # the staged NIXL path, when staging is configured
        tensors = staging_copies(mem_type, regions, memory)
        if config.nixl_staging_bytes and tensors is not None:
            self.stager = Stager(memory, config.nixl_staging_bytes, config.nixl_staging_chunk_bytes, tensors)

    def start(self) -> PrefillWorker:
        if not self.config.check_exposure(self.key is not None):
            _warn_once(
                "kvbridge: no auth key: the side channel accepts any local process (set auth_key_file in "
                "kv_connector_extra_config to authenticate peers)"
            )
        self.transport.start()
        self.transport.register(self.memory, self.mem_type)
        if self.stager is not None:  # before the metadata: readers see the staging buffer with the KV
            self.stager.start()
            self.transport.register(self.stager.memory_region, self.stager.mem_type)
        ident = self.identity
        if self.key and self.mem_type == "DRAM":
            self.stream = KvStreamServer(
                self.memory,
                {k.key_id: k.stream for k in KeyRing.of(self.key).all},
                self._stream_grant,
                still=self._stream_still,
                host=self.config.side_channel_host,
                port=(
                    side_channel_port(self.config.kv_stream_port, ident.layout, ident.dp_rank, ident.rank)
                    if self.config.kv_stream_port
                    else 0
                ),
                mode="encrypt" if self.config.kv_stream_encrypt else "integrity",
                max_connections=self.config.kv_stream_max_connections,
                max_per_address=self.config.kv_stream_max_connections_per_address,
                handshake_timeout_s=self.config.handshake_timeout_s,
                name=f"kv-stream-{ident.rank}",
            ).start()
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
            epoch=self.epoch,
            started=self.started,
            staging=self.stager.region if self.stager else None,
            staging_slot_bytes=self.stager.slot_bytes if self.stager else 0,
            model=ident.model,
            kv_stream_port=self.stream.port if self.stream else 0,
            pid=self.process[0] if self.process[1] else 0,
            pid_started=self.process[1],
        )
        sealer = (
            Sealer(self.key, window_s=self.config.auth_window_s, max_nonces=self.config.auth_max_nonces)
            if self.key is not None
            else None
        )
        self._server = SideChannelServer(
            self.port,
            handshake_handler(reply, self._answer),
            host=self.config.side_channel_host,
            max_message_bytes=self.config.side_channel_max_frame_bytes,
            max_connections=self.config.side_channel_max_connections,
            max_connections_per_address=self.config.side_channel_max_connections_per_address,
            queued_frames=self.config.side_channel_queued_frames,
            sealer=sealer,
            identity=(ident.engine_id, ident.dp_rank, ident.rank.pp, ident.rank.tp),
        )
        self._server.start()
        self._thread = threading.Thread(target=self._run, name=f"kvbridge-prefill-{ident.rank}", daemon=True)
        self._thread.start()
        logger.info("kvbridge prefill worker %s serving handshakes on port %d", ident, self.port)
        return self

    def hold(
        self,
        request_id: str,
        block_ids: tuple[tuple[int, ...], ...] = (),
        token: str = "",
        prompt_hash: str = "",
        finished_at: float | None = None,
        fed: bool = False,
    ) -> None:
        """Keep `request_id`'s blocks (per KV-cache group, as its params publish them) until its readers are done,
        it is aborted, or its lease expires; claims of it that came first are answered now. `finished_at`: when the
        scheduler finished the request (time.monotonic, for its timeline).

        Every hold comes with the step metadata; `fed`: this is the hold feed's copy (`wire.hold_feed`), which
        usually comes first. The second copy changes nothing, also once the request was read and freed: the
        metadata's copy of a fed hold is dropped by its id; a fed copy is dropped once older than
        FED_NOTE_MAX_AGE_S (by time.monotonic, the scheduler's clock for `finished_at`, whatever `clock` is), and
        otherwise when the metadata's copy came first (remembered that long) or the request is held here."""
        now = self.clock()
        with self._lock:
            mono = time.monotonic()
            while self._unfed and (
                next(iter(self._unfed.values()))[1] < mono - FED_NOTE_MAX_AGE_S or len(self._unfed) > MAX_FED
            ):
                self._unfed.popitem(last=False)
            if fed:
                if finished_at is not None and mono - finished_at > FED_NOTE_MAX_AGE_S:
                    return
                unfed = self._unfed.get(request_id)
                if (unfed is not None and unfed[0] == token) or self._leases.knows(request_id, token):
                    return
                self._fed[request_id] = token
                while len(self._fed) > MAX_FED:
                    self._fed.popitem(last=False)
            else:
                if self._fed.pop(request_id, None) == token or self._leases.knows(request_id, token):
                    return
                self._unfed[request_id] = (token, mono)
            self._leases.hold(request_id, now, token, prompt_hash, block_ids)
            self._times.held(request_id, now if finished_at is None else finished_at, now)
            answers = [(w.answer, self._claim(w.claim, now)) for w in self._waiting.take(request_id)]
        for later, answer in answers:
            later.give(answer)
        self._wake.set()

    def _claim(self, message: wire.Claim, now: float) -> wire.Message:
        """Grant or refuse a claim (under _lock)."""
        refused = self._leases.claim(
            message.request_id,
            message.token,
            message.prompt_hash,
            message.groups,
            message.engine_id,
            message.read_timeout_s or self.config.transfer_timeout_s,
            now,
            message.blocks_digest,
        )
        if refused:
            return wire.ErrorReply(message=f"claim refused: {refused}", reason=wire.Refusal(refused))
        self._times.claimed(message.request_id, now)
        return wire.Ack(request_id=message.request_id, epoch=self.epoch)

    def _wait_for_hold(self, message: wire.Claim, now: float) -> Later | None:
        """Keep a claim of a request not held yet until its hold comes (under _lock); None: answer now (held; freed
        lately, the claim carrying its token: read, aborted or expired; no wait asked; or no room:
        `max_waiting_claims` or MAX_WAITING_BLOCK_IDS)."""
        wait_s = min(message.wait_s, self.config.claim_window_s)
        request_id = message.request_id
        if wait_s <= 0 or self._leases.holds(request_id) or self._leases.freed(request_id, message.token):
            return None
        if message.issued and message.issued < self.started:  # params of an earlier run here: no hold will come
            return None
        return self._waiting.keep(message, now + wait_s)

    def take_phases(self) -> list[tuple[float, float, float]]:
        """Timelines of the requests released since the last call: (finished -> held, held -> claim answered,
        claim answered -> released) seconds each."""
        with self._lock:
            return self._times.take()

    def _answer(self, message: wire.Message) -> wire.Message:
        """Side-channel messages other than handshakes (runs on the side-channel thread, no NIXL calls).
        Refusals say one word, and (with a deployment key) nothing at all of a request to a peer without its token."""
        now = self.clock()
        match message:
            case wire.Claim():
                with self._lock:
                    later = self._wait_for_hold(message, now)
                    if later is not None:
                        self._wake.set()  # the progress thread answers it once its wait passed
                        return later
                    answer = self._claim(message, now)
                    if isinstance(answer, wire.ErrorReply):
                        # its token's holder may know: the request is gone here, no claim window changes that
                        final = answer.reason is wire.Refusal.NOT_HELD and self._leases.freed(
                            message.request_id, message.token
                        )
                        answer = msgspec.structs.replace(answer, final=final, epoch=self.epoch)
                    return answer
            case wire.Notify():
                # Readers that copied through CUDA IPC made no NIXL transfer to carry their notification.
                with self._lock:
                    taken = self._take_note(message, now)
                    self._changed.notify_all()
                self._wake.set()
                return wire.Ack(request_id=message.request_id, epoch=self.epoch) if taken else _REFUSED
            case wire.Stage() if self.stager is not None:
                # the staged path: gathering takes this thread for one chunk's copy (milliseconds); later chunks
                # are gathered ahead by the stager's own thread
                with self._lock:
                    until = self._leases.reading(
                        message.request_id, message.token, message.engine_id, (message.block_ids,), now
                    )
                if until is None:
                    return wire.ErrorReply(message="stage refused: not_claimed", reason=wire.Refusal.NOT_CLAIMED)
                return self.stager.answer(message, until, self.epoch)
            case wire.Ping():  # a reader whose READs run long asks whether this process runs: no lock taken
                return wire.Ack(epoch=self.epoch)
            case wire.Abort():
                with self._lock:
                    taken = self._leases.abort(message.request_id, message.token, now)
                    self._changed.notify_all()
                self._wake.set()
                return wire.Ack(request_id=message.request_id, epoch=self.epoch) if taken else _REFUSED
            case _:
                return wire.ErrorReply(message=f"unexpected {type(message).__name__}", reason=wire.Refusal.UNEXPECTED)

    def _stream_grant(self, request: StreamRead) -> float | None:
        """The KV channel asks (its connection's thread): until when this reader may read these blocks."""
        blocks = tuple(g.block_ids for g in request.groups)
        with self._lock:
            return self._leases.reading(request.request_id, request.token, request.engine_id, blocks, self.clock())

    def _stream_still(self, request: StreamRead) -> bool:
        """The KV channel asks before every chunk of a read `_stream_grant` granted: may it go on."""
        with self._lock:
            return self._leases.still_reading(request.request_id, request.token, request.engine_id, self.clock())

    def _take_note(self, msg: wire.Notify, now: float) -> bool:
        taken = self._leases.notified(msg.request_id, msg.token, msg.engine_id, str(msg.worker), msg.expected, now)
        if taken and self.stager is not None:  # its reader is done: its staging slots are free
            self.stager.finish(msg.request_id, msg.engine_id, str(msg.worker))
        return taken

    def finished(self, wait_s: float = 0.0) -> tuple[set[str], int]:
        """(ids whose blocks may be freed now, leases expired since the last call). Makes progress too, unless
        the background thread is doing so right now.

        `wait_s` (an idle step): with requests held and none finished, wait up to `wait_s` for a notification,
        an abort or an expiry first. vLLM steps the prefill engine continuously for as long as it holds a
        finished request's blocks (up to lease_s): without the wait its worker burns a core for every held
        lease, and on a shared core it starves a decode worker (docs/benchmarks/shared-cores.md)."""
        self._progress_once()
        if wait_s > 0:
            with self._lock:
                if self._leases.held and not self._finished:
                    self._changed.wait(wait_s)
            self._progress_once()
        with self._lock:
            out, self._finished = self._finished, set()
            expired, self._expired_new = self._expired_new, 0
        return out, expired

    def _progress_once(self) -> None:
        if self._progress_lock.acquire(blocking=False):
            try:
                self._progress()
            except Exception:  # never raise into vLLM's step; the background thread retries
                logger.exception("kvbridge prefill %s: progress error", self.identity)
            finally:
                self._progress_lock.release()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._server is not None:
            self._server.close()
        if self.stream is not None:
            self.stream.close()
        self.transport.close()
        if self.stager is not None:
            self.stager.close()

    def _run(self) -> None:
        unpin_this_thread()  # light work: never wait behind vLLM's spinning, pinned worker threads
        while not self._stop.is_set():
            with self._progress_lock:
                try:
                    active = self._progress()
                except Exception:  # keep serving: leases still expire on later rounds
                    logger.exception("kvbridge prefill %s: progress error", self.identity)
                    active = False
            with self._lock:
                held = self._leases.held
                next_wait = self._waiting.next_until()
            if active:
                self._backoff.reset()
            # Wait for work; poll quickly while requests are held (readers need our progress).
            delay = self._backoff.step() if held else 0.05
            if next_wait is not None:  # answer a claim whose wait passed when it passes
                delay = max(0.0, min(delay, next_wait - self.clock()))
            self._wake.wait(delay)
            self._wake.clear()

    def _progress(self) -> bool:
        """One round of holds, notifications and lease accounting; True if anything happened."""
        active = False
        try:
            notes = self.transport.notifications()
        except TransferError as exc:
            logger.warning("kvbridge prefill %s: %s", self.identity, exc)
            notes = {}
        now = self.clock()
        decoded = []
        for agent, messages in notes.items():
            for raw in messages:
                active = True
                try:
                    msg = wire.decode(raw)
                except ProtocolError as exc:
                    logger.warning("kvbridge prefill %s: bad notification from %s: %s", self.identity, agent, exc)
                    continue
                if isinstance(msg, wire.Notify) and msg.token:  # a notification without its token is ignored
                    decoded.append(msg)
        with self._lock:
            for msg in decoded:
                self._take_note(msg, now)
            done, expired = self._leases.due(now)
            self._finished |= done | expired
            self._expired_new += len(expired)
            if decoded or done or expired:
                self._changed.notify_all()
            self._times.released(done | expired, now)
            lapsed = self._waiting.lapsed(now) if self._waiting else []
            self._leases.refused_total += len(lapsed)
        for later in lapsed:
            later.give(
                wire.ErrorReply(message="claim refused: not_held", reason=wire.Refusal.NOT_HELD, epoch=self.epoch)
            )
        if self.stager is not None:  # sessions of requests freed, or whose pin lapsed, give their slots back
            self.stager.drop(done | expired, now)
        if expired:
            logger.warning("kvbridge prefill %s: lease expired for %s", self.identity, sorted(expired))
        return active or bool(done or expired)

    def lease_counts(self) -> dict[str, int]:
        """Totals for metrics and tests: completed, expired, aborted, refused (claims/notes/aborts)."""
        sealer = self._server.sealer if self._server else None
        with self._lock:
            book = self._leases
            return {
                "held": book.held,
                "completed": book.completed_total,
                "expired": book.expired_total,
                "aborted": book.aborted_total,
                "refused": book.refused_total,
                "unauthenticated": sum(sealer.dropped.values()) if sealer else 0,
            }


_REFUSED = wire.ErrorReply(message="refused", reason=wire.Refusal.REFUSED)
_warned: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        logger.warning(text)


def token_check(key: bytes | KeyRing | None, engine_id: str):
    """The lease book's check of a token before its request is held: a MAC under the deployment keys of this
    engine's request (`wire.keys.request_token`); None without a key."""
    if key is None:
        return None
    ring = KeyRing.of(key)
    return lambda request_id, token: token_is_ours(ring, engine_id, request_id, token)


def check_stream_memory(config: BridgeConfig, mem_type: MemType, has_key: bool) -> None:
    """ConfigError for a prefill worker that other hosts would read with nothing to read it over: KV in GPU memory
    (kvbridge's KV channel carries host memory only) behind a side channel beyond loopback, where NIXL does not
    cross hosts (no RDMA devices named, no `ucx_tcp_exposes_process_memory`)."""
    if mem_type == "DRAM" or is_loopback(config.side_channel_host) or not has_key:
        return
    if config.nixl_crosses_hosts(os.environ.get("UCX_NET_DEVICES")):
        return
    raise ConfigError(
        f"kv_connector_extra_config: side_channel_host {config.side_channel_host!r} serves other hosts, the KV is in "
        "GPU memory, and kvbridge's KV channel carries host memory only: name RDMA devices in ucx_net_devices "
        '("mlx5_0:1"), or set ucx_tcp_exposes_process_memory to true (UCX tcp then serves this process\'s memory '
        "to anyone who reaches it)"
    )


def staging_copies(mem_type: MemType, regions: Sequence, memory: WorkerMemory) -> tuple | None:
    """How a worker's staged NIXL path copies: () for host copies (KV in host memory), the region tensors for
    torch copies on their GPU (KV in GPU memory, tensors given), None for no staged path (GPU memory without
    the tensors that own it)."""
    if mem_type == "DRAM":
        return ()
    return tuple(regions) if regions and len(regions) == len(memory.regions) else None


def transport_config(config: BridgeConfig, mem_type: MemType) -> TransportConfig:
    """UCX settings: the transports for the memory type, and the network devices (`BridgeConfig.ucx_devices`):
    loopback and RDMA devices only, unless the operator opted into UCX tcp beyond loopback
    (`ucx_tcp_exposes_process_memory`; then the devices named, else the interface of `side_channel_host`)."""
    devices = config.ucx_devices(interface_of(config.side_channel_host), os.environ.get("UCX_NET_DEVICES"))
    tls = config.ucx_tls
    if tls == "auto":
        if mem_type != "DRAM" or any(rdma_device(d) for d in (devices or "").split(",")):
            tls = None  # UCX's own choice: cuda_ipc / cuda_copy for GPU memory, rc / ud / dc to reach RDMA peers
        else:
            # host memory on one host: shared memory, CMA and tcp on loopback (what detects a dead peer);
            # cuda_copy too on a GPU host, where NIXL refuses a UCX_TLS without a CUDA transport
            tls = "self,sm,cma,tcp,cuda_copy" if has_nvidia_gpu() else "self,sm,cma,tcp"
    return TransportConfig(ucx_tls=tls, ucx_net_devices=None if devices == "all" else devices)
