"""A decode worker's runtime: read a request's KV from the prefill workers that hold it, then tell them.

Every load takes one order of operations, whatever the path:

    queued --(control thread) connect, claim--> claimed --(transfer thread) post READs / launch kernels-->
    in flight --(poll / waiter)--> reported --(notifier) Notify the prefill workers

and on any failure: drained (nothing can still write the blocks) --> reported failed --> Abort to the prefill
workers, which free the blocks at once. Every load has a deadline from the moment it is queued.

Threads, so that nothing slow stands in front of a transfer:
- control threads (a small pool): handshakes (`peers.PeerBook`: one per engine, shared by the jobs waiting for
  it) and claims (which pin the request on the prefill side for the read). One slow or dead engine holds only
  its own jobs; a dead one fails the next jobs to it at once for a while.
- the transfer thread: owns NIXL (with `results()`, which polls too when it can take the lock): posts claimed
  jobs' READs, or launches their gather kernels on the CUDA IPC path (`kvbridge.transport.ipc_reader`), and
  polls READs. A READ whose release NIXL refuses (a status error does not mean the DMA stopped) is kept and
  retried; its load is reported failed only once the release succeeds.
- the waiter (CUDA IPC path): sleeps on the kernels' blocking-sync events and reports loads as they finish; an
  engine's IPC mappings stay open while any kernel queued on them runs.
- the notifier: sends notifications and aborts over the side channel (a dead peer's timeouts delay no load).
Nothing here raises into the engine.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.core.config import BridgeConfig
from kvbridge.core.descriptors import block_lists, worker_descriptors
from kvbridge.core.errors import (
    IncompatiblePeerError,
    KVBridgeError,
    RequestParamsError,
    TransferError,
    TransferTimeout,
)
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import WorkerMemory
from kvbridge.core.topology import WorkerRank
from kvbridge.runtime.peers import Engine, PeerBook, address, engine_key
from kvbridge.runtime.prefill_worker import transport_config
from kvbridge.transport.nixl import Backoff, MemType, NixlTransport, Transfer
from kvbridge.wire import messages as wire
from kvbridge.wire.affinity import unpin_this_thread
from kvbridge.wire.auth import Sealer
from kvbridge.wire.params import PrefillDone
from kvbridge.wire.side_channel import SideChannelClient

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

PER_ENGINE = 4
"""Claim steps of one prefill engine on control threads at once (a slow engine must not take them all)."""

CLAIM_WINDOW_S = 2.0
"""How long a claim refused as `not_held` is retried: the prefill side learns of a hold one engine step after the
client got its kv_transfer_params."""


@dataclass(frozen=True)
class LoadJob:
    """Read `remote_blocks` of a prefill request into `local_blocks`. `report` False: only tell the prefill side
    to free (the request is gone here, e.g. aborted before it was scheduled). `refused`: fail at once, reading
    nothing (the scheduler refused the params under kv_load_failure_policy=fail)."""

    request_id: str
    source: PrefillDone | None
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    report: bool = True
    refused: str = ""


@dataclass
class _Load:
    """One job on its way: what it holds at each step."""

    job: LoadJob
    queued: float
    deadline: float
    engine: Engine | None = None
    begun: bool = False  # counted in engine.inflight (reached the transfer thread)
    transfers: list[Transfer] = field(default_factory=list)
    read_ranks: tuple[WorkerRank, ...] = ()
    nbytes: int = 0
    descriptors: int = 0
    posted: float = 0.0
    # CUDA IPC path: the kernels' events (the GPU time is start_event.elapsed_time(event))
    event: Any = None
    start_event: Any = None
    error: str = ""  # set once it failed; it is reported when nothing can still write its blocks


@dataclass
class TransferStats:
    """Counters since the last `results()` call."""

    transfers: int = 0
    failures: int = 0
    bytes: int = 0
    descriptors: int = 0
    seconds: list[float] = field(default_factory=list)  # per load: from the job to the reported completion
    post_seconds: list[float] = field(default_factory=list)  # per load: from the job to the READs posted/kernels queued
    gpu_seconds: list[float] = field(default_factory=list)  # per CUDA IPC load: the kernels' time on the GPU


class DecodeWorker:
    def __init__(
        self,
        identity: WorkerIdentity,
        memory: WorkerMemory,
        config: BridgeConfig,
        mem_type: MemType = "DRAM",
        regions: Sequence[torch.Tensor] = (),
        key: bytes | None = None,
        control_threads: int = 8,
    ) -> None:
        """`regions`: `memory`'s regions as tensors (`torch_memory.region_tensors`); with GPU memory they enable
        the CUDA IPC path (config.gpu_peer_copy). `key`: the deployment key (`wire.auth.load_key`)."""
        self.identity = identity
        self.memory = memory
        self.config = config
        self.mem_type = mem_type
        # A kv_both worker also runs a PrefillWorker: agent names must differ.
        self.transport = NixlTransport(identity.agent_name + "-reader", transport_config(config, mem_type))
        self.sealer = Sealer(key, window_s=config.auth_window_s) if key else None
        self._regions = tuple(regions)
        self._ipc = None  # IpcReader, when this worker may read through CUDA IPC
        self._nixl = threading.Lock()  # the transport and _active: one caller at a time
        self._lock = threading.Lock()  # results and stats
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._stats = TransferStats()
        self._pool = ThreadPoolExecutor(
            control_threads, thread_name_prefix=f"kvbridge-control-{identity.rank}", initializer=unpin_this_thread
        )
        self._local = threading.local()  # each control thread's side-channel sockets
        self._clients: list[SideChannelClient] = []
        self.peers = PeerBook(identity, memory, config, self._pool, self._add_agent, self.sealer, self._ipc_connect)
        self._ready: queue.Queue[_Load | None] = queue.Queue()  # claimed: to post or launch
        self._active: list[_Load] = []  # READs posted (transfer thread)
        self._draining: list[_Load] = []  # failed READs whose release NIXL has not accepted yet
        self._launched: queue.Queue[_Load | None] = queue.Queue()  # kernels queued, in launch order (one stream)
        self._notes: queue.Queue[tuple[wire.Message, LoadJob, tuple[WorkerRank, ...]] | None] = queue.Queue()
        self._claiming: dict = {}  # engine key -> claim steps on control threads (under _lock)
        self._backlog: dict = {}  # engine key -> loads waiting for one of them
        self._threads: list[threading.Thread] = []

    def start(self) -> DecodeWorker:
        self.transport.start()
        self.transport.register(self.memory, self.mem_type)
        if self.mem_type == "VRAM" and self.config.gpu_peer_copy == "auto" and self._regions:
            try:
                from kvbridge.transport.ipc_reader import IpcReader

                self._ipc = IpcReader(self.memory, self._regions)
                self._spawn(self._wait_loop, "kvbridge-ipc-wait")
            except Exception as exc:  # no Triton, no CUDA: NIXL only
                logger.warning("kvbridge decode %s: CUDA IPC path unavailable (%s); using NIXL", self.identity, exc)
        self._spawn(self._transfer_loop, f"kvbridge-decode-{self.identity.rank}")
        self._spawn(self._notify_loop, "kvbridge-notify")
        return self

    def _spawn(self, target, name: str) -> None:
        def run() -> None:
            unpin_this_thread()  # light threads: never wait behind vLLM's spinning, pinned workers
            target()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # -- the engine's side ------------------------------------------------------------------------

    def load(self, job: LoadJob) -> None:
        """Queue a job (the engine's step thread); it never blocks."""
        now = time.monotonic()
        load = _Load(job, now, now + self.config.transfer_timeout_s)
        if job.refused or job.source is None:
            self._refuse(load, job.refused or "no prefill location")
            return
        if not job.report:  # the request is gone here: only free the prefill side's blocks
            self._notes.put(
                (self._abort_message(job, "aborted before its load"), job, tuple(job.source.layout.workers()))
            )
            return
        future = self.peers.connect(job.source)
        future.add_done_callback(lambda f: self._admit(load, f))

    def results(self) -> tuple[set[str], set[str], TransferStats]:
        """(ids loaded, ids that failed, stats) since the last call; failed ids are not in the loaded set.

        Polls the active reads too (unless the transfer thread is busy): vLLM steps continuously while a load
        is pending, so completions are seen at once even when the transfer thread is starved of CPU."""
        if (self._active or self._draining) and self._nixl.acquire(blocking=False):
            try:
                self._poll()
            finally:
                self._nixl.release()
        with self._lock:
            done, self._done = self._done, set()
            failed, self._failed = self._failed, set()
            stats, self._stats = self._stats, TransferStats()
        return done, failed, stats

    def reads_through_ipc(self, source: PrefillDone) -> bool:
        """Whether this worker reads `source`'s engine through CUDA IPC (after it connected to it)."""
        return any(e.kernels and e.key[0] == source.remote_engine_id for e in self.peers.all_engines())

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        threads = {t.name: t for t in self._threads}
        self._ready.put(None)
        if (transfer := threads.get(f"kvbridge-decode-{self.identity.rank}")) is not None:
            transfer.join(timeout=30)
        self._launched.put(None)  # after the transfer thread: it launches no more
        if (waiter := threads.get("kvbridge-ipc-wait")) is not None:
            waiter.join(timeout=60)
        self._notes.put(None)
        if (notifier := threads.get("kvbridge-notify")) is not None:
            notifier.join(timeout=30)
        for client in self._clients:
            client.close()
        self.transport.close()

    # -- control threads: claim ---------------------------------------------------------------------

    def _client(self) -> SideChannelClient:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = SideChannelClient(
                timeout_s=self.config.handshake_timeout_s, retries=self.config.handshake_retries, sealer=self.sealer
            )
            with self._lock:
                self._clients.append(client)
        return client

    def _admit(self, load: _Load, connected: Future[Engine]) -> None:
        """Run the load's claim on a control thread, at most PER_ENGINE at once per engine: a slow engine's claims
        wait in its own backlog, never in front of other engines' (they hold control threads while they wait)."""
        key = engine_key(load.job.source)
        with self._lock:
            running = self._claiming.get(key, 0)
            if running >= PER_ENGINE:
                self._backlog.setdefault(key, collections.deque()).append((load, connected))
                return
            self._claiming[key] = running + 1
        self._pool.submit(self._claim_then_next, key, load, connected)

    def _claim_then_next(self, key, load: _Load, connected: Future[Engine]) -> None:
        try:
            self._claim_step(load, connected)
        finally:
            with self._lock:
                backlog = self._backlog.get(key)
                nxt = backlog.popleft() if backlog else None
                if backlog is not None and not backlog:
                    del self._backlog[key]
                if nxt is None:
                    self._claiming[key] -= 1
                    if not self._claiming[key]:
                        del self._claiming[key]
            if nxt is not None:
                with contextlib.suppress(RuntimeError):  # shut down meanwhile
                    self._pool.submit(self._claim_then_next, key, *nxt)

    def _claim_step(self, load: _Load, connected: Future[Engine], retried: bool = False) -> None:
        """Control thread: the engine is connected (or failed); claim the request on the workers read."""
        try:
            engine = connected.result()
            load.engine = engine
            if time.monotonic() > load.deadline:
                raise TransferTimeout(f"not started after {self.config.transfer_timeout_s:g} s")
            load.read_ranks = self._ranks_read(load, engine)
            if self.config.verify_requests and load.job.remote_blocks and load.read_ranks:
                stale = self._claim(load, engine)
                if stale:
                    self.peers.drop(engine, f"worker {stale} restarted (new epoch)")
                    if retried:
                        raise TransferError(f"prefill engine {engine.key[0]} restarted twice during one claim")
                    self._claim_step(load, self.peers.connect(load.job.source), retried=True)
                    return
        except Exception as exc:
            if not isinstance(exc, KVBridgeError):
                logger.exception("kvbridge decode %s: claim step failed", self.identity)
            self._fail(load, str(exc) or type(exc).__name__)
            return
        self._ready.put(load)

    def _ranks_read(self, load: _Load, engine: Engine) -> tuple[WorkerRank, ...]:
        """The prefill workers this worker reads from for this job (all of the plan's, if it has blocks)."""
        if not load.job.local_blocks:
            return ()
        return engine.plan.peers_of(self.identity.rank)

    def _claim(self, load: _Load, engine: Engine) -> WorkerRank | None:
        """Pin the request on every worker read (all at once); RequestParamsError if one refuses. Returns a
        worker whose epoch changed (the engine restarted: the caller handshakes again), or None."""
        job, source = load.job, load.job.source
        claim = wire.Claim(
            request_id=source.remote_request_id,
            block_ids=tuple(job.remote_blocks),
            engine_id=self.identity.engine_id,
            worker=wire.Worker.from_core(self.identity.dp_rank, self.identity.rank),
            token=source.remote_token,
            prompt_hash=source.remote_prompt_hash,
            read_timeout_s=max(0.0, load.deadline - time.monotonic()),
        )
        window = min(load.deadline, time.monotonic() + CLAIM_WINDOW_S)
        pending = list(load.read_ranks)
        backoff = Backoff(first_s=5e-3, cap_s=50e-3)
        while pending:
            answers = self._client().exchange_all([address(source, r) for r in pending], claim)
            refused = []
            for rank, answer in zip(pending, answers, strict=True):
                if isinstance(answer, Exception):
                    raise answer
                if isinstance(answer, wire.Ack):
                    if answer.epoch and answer.epoch != engine.peers[rank].epoch:
                        return rank
                    continue
                text = answer.message if isinstance(answer, wire.ErrorReply) else repr(answer)
                if not text.endswith("not_held"):  # mismatch, another reader: final
                    raise RequestParamsError(f"prefill worker {rank} refused the read: {text}")
                refused.append((rank, text))
            if refused and time.monotonic() > window:
                rank, text = refused[0]
                raise RequestParamsError(f"prefill worker {rank} refused the read: {text}")
            pending = [r for r, _ in refused]
            if pending:
                backoff.sleep()
        return None

    # -- transfer thread ----------------------------------------------------------------------------

    def _transfer_loop(self) -> None:
        backoff = Backoff(first_s=50e-6, cap_s=2e-3)
        while True:
            busy = self._active or self._draining
            try:
                load = self._ready.get(timeout=backoff.step() if busy else 0.5)
            except queue.Empty:
                load = False
            if load is None:
                return
            with self._nixl:
                try:
                    if load:
                        backoff.reset()
                        self._post(load)
                    self._poll()
                    self._reap()
                except Exception:  # a bug must not kill the thread and leave every later load hanging
                    logger.exception("kvbridge decode %s: transfer thread error", self.identity)
                    if load and load not in self._active and not load.transfers:
                        self._fail(load, "internal error in the transfer thread (see log)")

    def _post(self, load: _Load) -> None:
        """Post the load's READs (NIXL) or launch its kernels (CUDA IPC); failures drain what was posted."""
        engine, job = load.engine, load.job
        self.peers.begin(engine)
        load.begun = True
        if time.monotonic() > load.deadline:
            self._drain_and_fail(load, f"not started after {self.config.transfer_timeout_s:g} s")
            return
        if engine.kernels is not None:
            self._launch(load, engine)
            return
        try:
            descs = self._descriptors(load, engine)
        except KVBridgeError as exc:
            self._drain_and_fail(load, str(exc))
            return
        note = wire.encode(self._notify_message(job))
        load.nbytes = sum(d.nbytes for d in descs.values())
        load.descriptors = sum(len(d) for d in descs.values())
        for rank, d in descs.items():
            peer = engine.peers[rank]
            try:
                load.transfers.append(self.transport.read(peer.agent, d, self.memory, peer.memory, note))
            except TransferError as exc:
                pending = getattr(exc, "transfer", None)
                if pending is not None:
                    load.transfers.append(pending)
                self._drain_and_fail(load, str(exc), broken=engine)
                return
        load.posted = time.monotonic()
        others = tuple(r for r in engine.layout.workers() if r not in descs)
        if others:
            self._notes.put((self._notify_message(job), job, others))
        self._active.append(load)

    def _launch(self, load: _Load, engine: Engine) -> None:
        job = load.job
        try:
            remote, local = job.remote_blocks, job.local_blocks
            for rank in engine.kernels:  # arrays after the first: the later checks convert nothing
                remote, local = block_lists(remote, local, engine.peers[rank].memory, self.memory)
            live = engine.kernels if job.local_blocks else {}
            load.start_event, load.event = self._ipc.launch(live, remote, local)
        except Exception as exc:  # bad block ids, or a launch error
            if not isinstance(exc, KVBridgeError):
                logger.exception("kvbridge decode %s: gather kernel launch failed", self.identity)
            # whatever was queued must finish before the blocks can be reused: wait for the stream
            try:
                self._ipc.stream.synchronize()
            except Exception:
                logger.exception("kvbridge decode %s: stream sync after a failed launch failed", self.identity)
                return  # unknown state: keep the blocks (the request stays unreported, never reused)
            self._drain_and_fail(load, str(exc))
            return
        load.nbytes = sum(k.block_bytes for k in live.values()) * len(job.local_blocks)
        load.posted = time.monotonic()
        self._launched.put(load)

    def _poll(self) -> None:
        still = []
        for load in self._active:
            try:
                done = all(self.transport.poll(t) for t in load.transfers)
            except Exception as exc:  # KVBridgeError from NIXL, or a bug: this load fails, the others go on
                if not isinstance(exc, KVBridgeError):
                    logger.exception("kvbridge decode %s: polling failed", self.identity)
                self._drain_and_fail(load, str(exc), broken=load.engine)
                continue
            if done:
                if self._release_all(load):
                    self._complete(load)
                else:  # done, but NIXL kept the handle: report once it lets go
                    self._draining.append(load)
            elif time.monotonic() > load.deadline:
                self._drain_and_fail(load, f"not done after {self.config.transfer_timeout_s:g} s")
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

    def _release_all(self, load: _Load) -> bool:
        ok = True
        for t in load.transfers:
            try:
                self.transport.release(t)
            except KVBridgeError as exc:
                logger.debug("kvbridge decode %s: %s (retrying)", self.identity, exc)
                ok = False
        return ok

    def _drain_and_fail(self, load: _Load, error: str, broken: Engine | None = None) -> None:
        """Fail `load` once nothing of it can still write: READs are released first (retried if NIXL refuses)."""
        load.error = error
        if broken is not None and _peer_broken(error):
            self.peers.drop(broken, error)
        if self._release_all(load):
            self._settle(load)
        else:
            logger.warning("kvbridge decode %s: %s: a READ may still write; holding its blocks", self.identity, error)
            self._draining.append(load)

    def _settle(self, load: _Load) -> None:
        """A load whose READs are all released: report it (failed if it has an error, else done)."""
        if load.error:
            self._fail(load, load.error)
        else:
            self._complete(load)

    def _reap(self) -> None:
        for engine in self.peers.reap():
            for peer in engine.peers.values():
                with contextlib.suppress(KVBridgeError):
                    self.transport.remove_peer(peer.agent)
            engine.kernels = None  # the last reference to its IPC mappings

    def _add_agent(self, metadata: bytes, name: str) -> str:
        owner = self.peers.owner_of(name)
        if owner is not None:  # another engine at another address answers under the same name: never replace it
            raise IncompatiblePeerError("agent_name", f"{name} of the engine at {owner[1]}:{owner[2]}", name)
        with self._nixl:
            if name in self.transport.peers:  # a restarted worker under the same name: its old agent goes
                with contextlib.suppress(KVBridgeError):
                    self.transport.remove_peer(name)
            return self.transport.add_peer(metadata)

    def _ipc_connect(self, engine: Engine) -> dict | None:
        if self._ipc is None:
            return None
        try:
            return self._ipc.connect(
                engine.plan, self.identity.rank, {rank: (p.memory, p.ipc) for rank, p in engine.peers.items()}
            )
        except KVBridgeError as exc:
            logger.warning("kvbridge decode %s: reading %s through NIXL: %s", self.identity, engine.key[0], exc)
            return None

    def _descriptors(self, load: _Load, engine: Engine) -> dict:
        job = load.job
        if not job.local_blocks:
            return {}
        descs = worker_descriptors(
            engine.plan,
            self.identity.rank,
            self.memory,
            {rank: peer.memory for rank, peer in engine.peers.items()},
            np.asarray(job.remote_blocks, dtype=np.int64),
            np.asarray(job.local_blocks, dtype=np.int64),
        )
        return {rank: d for rank, d in descs.items() if len(d)}

    # -- waiter: the CUDA IPC path ------------------------------------------------------------------

    def _wait_loop(self) -> None:
        """Report IPC loads as their kernels finish, sleeping in the CUDA driver meanwhile (no polling)."""
        while (load := self._launched.get()) is not None:
            try:
                load.event.synchronize()  # a blocking-sync event: the thread sleeps, without the GIL
            except Exception as exc:  # a CUDA error: the bytes are unknown; the load fails, vLLM recomputes
                logger.exception("kvbridge decode %s: gather kernel failed", self.identity)
                load.error = f"gather kernel failed: {exc}"
            if load.error:
                self._fail(load, load.error)
                continue
            gpu_s = None
            with contextlib.suppress(Exception):  # a statistic: never lose this thread (and every later load) to it
                gpu_s = load.start_event.elapsed_time(load.event) / 1e3
            self._complete(load, gpu_s=gpu_s)

    # -- reporting --------------------------------------------------------------------------------

    def _complete(self, load: _Load, gpu_s: float | None = None) -> None:
        job = load.job
        elapsed = time.monotonic() - load.queued
        with self._lock:
            self._stats.transfers += 1
            self._stats.bytes += load.nbytes
            self._stats.descriptors += load.descriptors
            self._stats.seconds.append(elapsed)
            self._stats.post_seconds.append(load.posted - load.queued)
            if gpu_s is not None:
                self._stats.gpu_seconds.append(gpu_s)
        self._report(load, True)
        if load.engine is not None and load.engine.kernels is not None:  # no READ carried the notification
            self._notes.put((self._notify_message(job), job, tuple(load.engine.layout.workers())))

    def _fail(self, load: _Load, error: str) -> None:
        logger.warning("kvbridge decode %s: load of %s failed: %s", self.identity, load.job.request_id, error)
        with self._lock:
            self._stats.failures += 1
        self._report(load, False)
        job = load.job
        if job.source is not None and not job.refused:
            self._notes.put((self._abort_message(job, error[:200]), job, tuple(job.source.layout.workers())))

    def _refuse(self, load: _Load, error: str) -> None:
        """A job that never got going (refused by the scheduler): report it failed at once, reading nothing."""
        logger.warning("kvbridge decode %s: load of %s refused: %s", self.identity, load.job.request_id, error)
        with self._lock:
            self._stats.failures += 1
        self._report(load, False)

    def _report(self, load: _Load, ok: bool) -> None:
        if load.begun:
            self.peers.end(load.engine)
        with self._lock:
            if load.job.report:
                (self._done if ok else self._failed).add(load.job.request_id)

    # -- notifier -----------------------------------------------------------------------------------

    def _notify_message(self, job: LoadJob) -> wire.Notify:
        """What every prefill worker of the engine receives once this worker is done with the request."""
        return wire.Notify(
            request_id=job.source.remote_request_id,
            engine_id=self.identity.engine_id,
            worker=wire.Worker.from_core(self.identity.dp_rank, self.identity.rank),
            expected=self.identity.layout.workers_per_engine,
            token=job.source.remote_token,
        )

    def _abort_message(self, job: LoadJob, reason: str) -> wire.Abort:
        return wire.Abort(
            request_id=job.source.remote_request_id,
            engine_id=self.identity.engine_id,
            worker=wire.Worker.from_core(self.identity.dp_rank, self.identity.rank),
            reason=reason,
            token=job.source.remote_token,
        )

    def _notify_loop(self) -> None:
        client = SideChannelClient(
            timeout_s=self.config.handshake_timeout_s, retries=self.config.handshake_retries, sealer=self.sealer
        )
        try:
            while (item := self._notes.get()) is not None:
                message, job, ranks = item
                if self.peers.is_dead(job.source):  # its lease frees the blocks; a dead peer would hold us up
                    continue
                try:
                    answers = client.exchange_all([address(job.source, r) for r in ranks], message)
                except Exception as exc:  # never lose the thread over a notification
                    answers = [exc] * len(ranks)
                for rank, answer in zip(ranks, answers, strict=True):
                    if not isinstance(answer, wire.Ack):
                        logger.warning(
                            "kvbridge decode %s: prefill worker %s did not take %s: %s",
                            self.identity,
                            rank,
                            type(message).__name__,
                            answer,
                        )
        finally:
            client.close()


def _peer_broken(error: str) -> bool:
    """Whether an error says the peer itself is gone (not just this request's blocks or claim)."""
    text = error.lower()
    words = ("disconnect", "remote", "connection", "unreachable", "peer", "not_found", "not found")
    return any(word in text for word in words)
