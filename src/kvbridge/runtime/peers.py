"""A decode worker's connections to prefill engines: handshaken once, verified, bounded, dropped only when idle.

An engine is known by everything the (signed) kv_transfer_params say of where it is: engine id, side-channel host
and base port, DP rank. Handshakes run on the decode worker's control threads; jobs for an engine that is being
connected wait on one shared future rather than each on a thread. A reply must come from the engine the params
name (engine id, the worker the address belongs to, the NIXL agent its metadata loads as); the cache holds at most
`max_cached_engines` engines (config; least recently used first out), an engine whose handshake failed is refused
at once for `dead_engine_s` (the next requests to a dead prefill fail fast instead of each waiting out the
timeouts; so is one whose claim found its peer gone: `mark_dead`), and an engine whose worker restarted (a
claim's Ack carries another epoch) is dropped and handshaken again; params issued before the worker read started
(an earlier run on the same address) are refused unread (`check_run`). An engine leaves for good only when no
transfer or kernel of it is in flight: `reap()` hands the transfer thread what to remove.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import IncompatiblePeerError, ParamsRefused, TransferError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import IpcHandle, Region, WorkerMemory
from kvbridge.core.plan import TransferPlan, make_plan
from kvbridge.core.segments import Segments, worker_segments
from kvbridge.core.topology import ParallelLayout, WorkerRank
from kvbridge.runtime.host import host_id, process_gone, process_start
from kvbridge.wire import messages as wire
from kvbridge.wire.auth import Sealer
from kvbridge.wire.params import PrefillDone
from kvbridge.wire.side_channel import Identity, side_channel_port
from kvbridge.wire.side_channel_client import fetch_handshake

logger = logging.getLogger(__name__)

EngineKey = tuple[str, str, int, int]
"""(engine id, side-channel host, base port, DP rank): where the params say the engine is."""


def engine_key(source: PrefillDone) -> EngineKey:
    return (source.remote_engine_id, source.remote_host, source.remote_port, source.remote_dp_rank)


def address(source: PrefillDone, rank: WorkerRank) -> tuple[str, int]:
    """(host, port) of the side channel of worker `rank` of the prefill engine that `source` names."""
    return source.remote_host, side_channel_port(source.remote_port, source.layout, source.remote_dp_rank, rank)


def identity(source: PrefillDone, rank: WorkerRank) -> Identity:
    """The identity of worker `rank` of the prefill engine `source` names, which sealed requests are bound to."""
    return source.remote_engine_id, source.remote_dp_rank, rank.pp, rank.tp


@dataclass
class Peer:
    agent: str
    memory: WorkerMemory
    epoch: str
    same_host: bool = False
    ipc: tuple[IpcHandle, ...] = ()
    staging: Region | None = None  # its staging buffer (the staged NIXL path), if it offers one
    staging_slot_bytes: int = 0
    stream_port: int = 0  # its KV channel (`stream_server`), if it offers one
    started: float = 0.0  # unix time the worker started (its handshake's `started`; 0: not said)
    process: tuple[int, int] | None = None  # (pid, start) of its process, seen in /proc here (same host), or None


@dataclass
class Engine:
    """One connected prefill engine. `inflight` (loads posted or kernels queued on it) is changed only by the
    transfer thread and the waiter, under the book's lock."""

    key: EngineKey
    layout: ParallelLayout
    peers: dict[WorkerRank, Peer]
    plan: TransferPlan
    kernels: dict[WorkerRank, Any] | None = None  # CUDA IPC: a gather kernel per prefill worker read
    stream: bool = False  # read over kvbridge's KV channel (another host, and NIXL does not cross hosts)
    inflight: int = 0
    stale: bool = False
    used: float = field(default_factory=time.monotonic)
    # worker_segments per (decode worker, KV-cache group), with the memory they were made for
    _segments: dict[tuple[WorkerRank, int | None], tuple[WorkerMemory, dict[WorkerRank, Segments]]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    @property
    def same_host(self) -> bool:
        return all(p.same_host for p in self.peers.values())

    def segments(
        self, reader: WorkerRank, memory: WorkerMemory, group: int | None = None
    ) -> dict[WorkerRank, Segments]:
        """What the decode worker `reader` (its KV in `memory`) copies from each prefill worker it reads, for one
        KV-cache group (None: an engine of one group): `worker_segments`, made on first use. The engine's plan and
        its workers' memory stay as they are until it is dropped (a restarted engine is another `Engine`), so
        nothing here goes stale; other memory for the same reader is never served from here. Not kept: an
        IncompatiblePeerError. Two threads at once may both make them (the same value)."""
        kept = self._segments.get((reader, group))
        if kept is not None and kept[0] is memory:
            return kept[1]
        sources = {rank: peer.memory for rank, peer in self.peers.items()}
        got = worker_segments(self.plan, reader, memory, sources, group=group)
        self._segments[reader, group] = (memory, got)
        return got


class PeerBook:
    def __init__(
        self,
        identity: WorkerIdentity,
        memory: WorkerMemory,
        config: BridgeConfig,
        executor: Executor,
        add_agent: Callable[[bytes, str], str],
        sealer: Sealer | None = None,
        ipc_connect: Callable[[Engine], dict[WorkerRank, Any] | None] | None = None,
    ) -> None:
        """`add_agent(metadata, name)` loads NIXL metadata, replacing an agent of that name (the caller serialises
        it with its other NIXL calls); `ipc_connect`
        opens an engine's CUDA IPC mappings (None: NIXL only)."""
        self.identity = identity
        self.memory = memory
        self.config = config
        self.executor = executor
        self.add_agent = add_agent
        self.sealer = sealer
        self.ipc_connect = ipc_connect
        self.nixl_crosses_hosts = config.nixl_crosses_hosts(os.environ.get("UCX_NET_DEVICES"))
        self.max_engines = config.max_cached_engines
        self.dead_s = config.dead_engine_s
        self._lock = threading.Lock()
        self._engines: OrderedDict[EngineKey, Engine] = OrderedDict()
        self._connecting: dict[EngineKey, Future[Engine]] = {}
        self._dead: dict[EngineKey, tuple[float, str]] = {}
        self._retired: list[Engine] = []  # dropped from the cache, waiting for their in-flight work
        self._plans: OrderedDict[ParallelLayout, TransferPlan] = OrderedDict()

    def connect(self, source: PrefillDone) -> Future[Engine]:
        """The engine `source` names, connected: at once if cached, else when its handshakes are done."""
        key = engine_key(source)
        with self._lock:
            engine = self._engines.get(key)
            if engine is not None:
                self._engines.move_to_end(key)
                engine.used = time.monotonic()
                return _done(engine)
            dead = self._dead.get(key)
            if dead is not None and time.monotonic() < dead[0]:
                failed: Future[Engine] = Future()
                failed.set_exception(TransferError(f"prefill engine {source.remote_engine_id} failed: {dead[1]}"))
                return failed
            future = self._connecting.get(key)
            if future is None:
                future = self._connecting[key] = Future()
                self.executor.submit(self._handshake, source, key, future)
            return future

    def _handshake(self, source: PrefillDone, key: EngineKey, future: Future[Engine]) -> None:
        try:
            engine = self._build(source, key)
        except Exception as exc:
            with self._lock:
                self._connecting.pop(key, None)
                self._dead[key] = (time.monotonic() + self.dead_s, str(exc))
                while len(self._dead) > 4 * self.max_engines:
                    self._dead.pop(next(iter(self._dead)))
            future.set_exception(exc)
            return
        with self._lock:
            self._connecting.pop(key, None)
            self._dead.pop(key, None)
            self._engines[key] = engine
            while len(self._engines) > self.max_engines:
                _, old = self._engines.popitem(last=False)
                old.stale = True
                self._retired.append(old)
        future.set_result(engine)

    def _build(self, source: PrefillDone, key: EngineKey) -> Engine:
        ident = self.identity
        layout = source.layout
        peers: dict[WorkerRank, Peer] = {}
        for rank in layout.workers():
            request = wire.HandshakeRequest.build(
                ident.engine_id,
                ident.layout,
                ident.dp_rank,
                ident.rank,
                ident.geometry,
                ident.kv_layout,
                self.memory,
                target=(source.remote_dp_rank, rank),
                model=ident.model,
            )
            reply = fetch_handshake(
                *address(source, rank),
                request,
                timeout_s=self.config.handshake_timeout_s,
                retries=self.config.handshake_retries,
                sealer=self.sealer,
                identity=identity(source, rank),
                max_answer_bytes=self.config.side_channel_max_answer_bytes,
                link_timeout_s=self.config.link_timeout_s,
            )
            if reply.engine_id != source.remote_engine_id:
                raise IncompatiblePeerError("engine_id", source.remote_engine_id, reply.engine_id)
            if reply.layout.to_core() != layout:
                raise IncompatiblePeerError("layout", str(layout), str(reply.layout.to_core()))
            same_host = reply.host_id == host_id()
            if same_host or self.nixl_crosses_hosts:
                agent = self.add_agent(reply.agent_metadata, reply.agent_name)
                if agent != reply.agent_name:
                    raise IncompatiblePeerError("agent_name", reply.agent_name, agent)
            elif not reply.kv_stream_port:  # never NIXL across hosts unless the operator said so
                raise TransferError(
                    f"prefill worker {rank} of {source.remote_engine_id} is on another host and offers no kv stream "
                    "(it needs a deployment key and KV in host memory), and NIXL does not cross hosts here: name "
                    "RDMA devices in ucx_net_devices, or set ucx_tcp_exposes_process_memory"
                )
            else:  # the KV channel: the prefill's NIXL agent is never loaded here
                agent = reply.agent_name
            ipc = tuple(h.to_core() for h in reply.ipc)
            staging = reply.staging.to_core() if reply.staging is not None else None
            peers[rank] = Peer(
                agent,
                reply.memory.to_core(),
                reply.epoch,
                reply.host_id == host_id(),
                ipc,
                staging,
                reply.staging_slot_bytes if staging is not None else 0,
                reply.kv_stream_port,
                reply.started,
                _process(reply, same_host),
            )
        engine = Engine(key, layout, peers, self.plan(layout))
        engine.stream = not engine.same_host and not self.nixl_crosses_hosts
        path = "kvbridge KV channel" if engine.stream else "NIXL"
        if self.ipc_connect is not None and all(p.same_host and p.ipc for p in peers.values()):
            engine.kernels = self.ipc_connect(engine)
            if engine.kernels is not None:
                path = "CUDA IPC + gather kernel"
        logger.info(
            "kvbridge decode %s connected to %d workers of %s at %s:%d (%s; %s)",
            ident,
            len(peers),
            source.remote_engine_id,
            source.remote_host,
            source.remote_port,
            "same host: shared memory/CMA usable" if engine.same_host else "another host: network transports only",
            path,
        )
        return engine

    def plan(self, layout: ParallelLayout) -> TransferPlan:
        with self._lock:
            plan = self._plans.get(layout)
            if plan is not None:
                self._plans.move_to_end(layout)
                return plan
        plan = make_plan(layout, self.identity.layout, self.identity.geometry)
        with self._lock:
            self._plans[layout] = plan
            while len(self._plans) > self.max_engines:
                self._plans.popitem(last=False)
        return plan

    def drop(self, engine: Engine, why: str) -> None:
        """Stop using `engine` (its peer is broken or restarted); it is removed once idle (`reap`)."""
        with self._lock:
            if self._engines.get(engine.key) is engine:
                del self._engines[engine.key]
                engine.stale = True
                self._retired.append(engine)
                logger.warning("kvbridge decode %s: dropping prefill engine %s: %s", self.identity, engine.key[0], why)

    def mark_dead(self, engine: Engine, why: str) -> None:
        """`engine`'s peer is gone (its port refused, or it was silent past the answer deadline): drop it, and fail
        loads naming it at once for `dead_engine_s`; the first load after that connects again (the probe)."""
        self.drop(engine, why)
        self.mark_dead_key(engine.key, why)

    def mark_dead_key(self, key: EngineKey, why: str) -> None:
        """As `mark_dead`, for the engine `key` names (another worker of this instance found it dead): its cached
        engine, if any, is dropped too."""
        with self._lock:
            engine = self._engines.get(key)
        if engine is not None:
            self.drop(engine, why)
        with self._lock:
            self._dead[key] = (time.monotonic() + self.dead_s, why)
            while len(self._dead) > 4 * self.max_engines:
                self._dead.pop(next(iter(self._dead)))

    def begin(self, engine: Engine) -> None:
        with self._lock:
            engine.inflight += 1

    def end(self, engine: Engine) -> None:
        with self._lock:
            engine.inflight -= 1

    def reap(self) -> list[Engine]:
        """Engines out of the cache with nothing in flight: the caller removes their NIXL agents and mappings."""
        with self._lock:
            idle = [e for e in self._retired if e.inflight <= 0]
            self._retired = [e for e in self._retired if e.inflight > 0]
            live = {p.agent for e in self._engines.values() for p in e.peers.values()}
        for engine in idle:  # an agent re-added by a newer handshake of the same worker stays
            engine.peers = {r: p for r, p in engine.peers.items() if p.agent not in live}
        return idle

    def owner_of(self, agent: str) -> EngineKey | None:
        """The cached engine whose worker loads as NIXL agent `agent`, if any."""
        with self._lock:
            for key, engine in self._engines.items():
                if any(p.agent == agent for p in engine.peers.values()):
                    return key
        return None

    def is_dead(self, source: PrefillDone) -> bool:
        """Whether the engine's handshake failed lately (messages to it are not worth a timeout now)."""
        with self._lock:
            dead = self._dead.get(engine_key(source))
        return dead is not None and time.monotonic() < dead[0]

    def all_engines(self) -> list[Engine]:
        with self._lock:
            return [*self._engines.values(), *self._retired]

    @property
    def cached(self) -> int:
        with self._lock:
            return len(self._engines)


def check_run(source: PrefillDone, engine: Engine, ranks: tuple[WorkerRank, ...]) -> None:
    """Refuse params issued before a worker read started: they name blocks of an earlier run of a prefill engine
    restarted on the same address (its blocks are gone, the numbers may now be another request's). Both times are
    the prefill host's clock (`remote_issued` by its scheduler, `started` by the worker, which starts first)."""
    if not source.remote_issued:
        return
    for rank in ranks:
        started = engine.peers[rank].started
        if started and source.remote_issued < started:
            raise ParamsRefused(
                "epoch",
                f"kv_transfer_params: remote_issued {source.remote_issued:.3f} precedes the start of prefill worker "
                f"{rank} ({started:.3f}): params of an earlier run of engine {source.remote_engine_id}",
            )


def _process(reply: wire.HandshakeReply, same_host: bool) -> tuple[int, int] | None:
    """(pid, start) of the replying worker's process if this worker sees that very process (same host, same pid
    namespace: the start it reads in /proc is the one the worker read), else None."""
    if same_host and reply.pid and reply.pid_started and process_start(reply.pid) == reply.pid_started:
        return reply.pid, reply.pid_started
    return None


def gone_check(peer: Peer) -> Callable[[], bool] | None:
    """A check that `peer`'s process is gone (killed or exited, whatever its sockets still do), or None where this
    worker cannot see its process."""
    if peer.process is None:
        return None
    pid, started = peer.process
    return lambda: process_gone(pid, started)


def _done(engine: Engine) -> Future[Engine]:
    future: Future[Engine] = Future()
    future.set_result(engine)
    return future
