"""A decode worker's runtime: fetch prefill workers' handshakes, read a request's KV, tell the readers' peers.

One transfer thread owns the NIXL transport; the engine's step thread only calls `load` and `results`.
Per request the thread connects to every worker of the prefill engine (cached per engine), computes the
descriptors of the plan, posts one READ per prefill worker it reads from (its completion notifies that worker)
and tells the others over the side channel, acknowledged (every prefill worker must learn that this decode worker
is done, or it would hold the blocks until its lease expires; a bare NIXL notification to a peer with no READ can
sit unsent until UCX happens to make progress), then polls the READs with backoff. Failures and timeouts become
failed ids; nothing here raises into the engine.

GPU memory on both sides, same host: the engine's workers are read through CUDA IPC by kvbridge's gather kernel
instead (`kvbridge.transport.ipc_reader`). The transfer thread launches, then claims the blocks while the kernel runs (a
read before the claim is safe: it only reads, and the load counts only if the claim then succeeds); a waiter thread
sleeps on the kernels' blocking-sync CUDA event, reports the load the moment it completes, and hands the
notifications to the notifier thread.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbridge.core.config import BridgeConfig
from kvbridge.core.descriptors import block_lists, worker_descriptors
from kvbridge.core.errors import KVBridgeError, RequestParamsError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import WorkerMemory
from kvbridge.core.plan import TransferPlan, make_plan
from kvbridge.core.topology import WorkerRank
from kvbridge.runtime.host import host_id
from kvbridge.runtime.prefill_worker import transport_config
from kvbridge.transport.nixl import Backoff, MemType, NixlTransport, Transfer
from kvbridge.wire import messages as wire
from kvbridge.wire.params import PrefillDone
from kvbridge.wire.side_channel import SideChannelClient, fetch_handshake, side_channel_port

if TYPE_CHECKING:
    import torch

    from kvbridge.core.memory import IpcHandle

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadJob:
    """Read `remote_blocks` of a prefill request into `local_blocks`; `report` False: only notify the prefill
    side (the request is gone here, e.g. aborted before it was scheduled)."""

    request_id: str
    source: PrefillDone
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    report: bool = True


@dataclass
class _Peer:
    agent: str
    memory: WorkerMemory
    same_host: bool = False
    ipc: tuple[IpcHandle, ...] = ()


@dataclass
class _Active:
    job: LoadJob
    transfers: list[Transfer]
    deadline: float
    started: float
    nbytes: int
    descriptors: int
    # IPC path: the gather kernels' CUDA event. No timeout once launched: a kernel cannot be cancelled, and failing
    # the load would let vLLM reuse blocks it still writes (it takes milliseconds; the lease is far longer).
    event: Any = None
    start_event: Any = None  # recorded before the kernels: the GPU time is start_event.elapsed_time(event)
    posted: float = 0.0  # when the READs were posted or the kernels queued (monotonic)
    error: str = ""  # IPC path: the claim failed while the kernel ran; the load fails once the kernel is done


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
    ) -> None:
        """`regions`: `memory`'s regions as tensors (`torch_memory.region_tensors`); with GPU memory they enable
        the CUDA IPC path (config.gpu_peer_copy)."""
        self.identity = identity
        self.memory = memory
        self.config = config
        self.mem_type = mem_type
        # A kv_both worker also runs a PrefillWorker: agent names must differ.
        self.transport = NixlTransport(identity.agent_name + "-reader", transport_config(config, mem_type))
        self._jobs: queue.Queue[LoadJob | None] = queue.Queue()
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._stats = TransferStats()
        self._engines: dict[tuple[str, int], dict[WorkerRank, _Peer]] = {}
        self._regions = tuple(regions)
        self._ipc = None  # IpcReader, when this worker may read through CUDA IPC
        self._kernels: dict[tuple[str, int], dict] = {}  # per prefill engine read through CUDA IPC
        self._plans: dict[str, TransferPlan] = {}
        self._active: list[_Active] = []
        # Prefill workers to tell over the side channel, per load: a thread of their own sends them, so that a
        # dead peer's timeouts never hold up transfers or vLLM's step.
        self._notes: queue.Queue[tuple[LoadJob, tuple[WorkerRank, ...]] | None] = queue.Queue()
        self._notifier: threading.Thread | None = None
        # Open side-channel connections to prefill workers, one set per thread that sends (ZMQ sockets are not
        # thread-safe): claims from the transfer thread, notifications from the notifier.
        timeouts = dict(timeout_s=config.handshake_timeout_s, retries=config.handshake_retries)
        self._claims = SideChannelClient(**timeouts)
        self._notify_client = SideChannelClient(**timeouts)
        # IPC loads whose kernels run, in launch order (one stream: their events complete in that order).
        self._launched: queue.Queue[_Active | None] = queue.Queue()
        self._waiter: threading.Thread | None = None
        self._nixl = threading.Lock()  # the transport and _active: one caller at a time
        self._thread: threading.Thread | None = None

    def start(self) -> DecodeWorker:
        self.transport.start()
        self.transport.register(self.memory, self.mem_type)
        if self.mem_type == "VRAM" and self.config.gpu_peer_copy == "auto" and self._regions:
            try:
                from kvbridge.transport.ipc_reader import IpcReader

                self._ipc = IpcReader(self.memory, self._regions)
                self._waiter = threading.Thread(target=self._wait_loop, name="kvbridge-ipc-wait", daemon=True)
                self._waiter.start()
            except Exception as exc:  # no Triton, no CUDA: NIXL only
                logger.warning("kvbridge decode %s: CUDA IPC path unavailable (%s); using NIXL", self.identity, exc)
        self._thread = threading.Thread(target=self._run, name=f"kvbridge-decode-{self.identity.rank}", daemon=True)
        self._thread.start()
        self._notifier = threading.Thread(target=self._notify_loop, name="kvbridge-notify", daemon=True)
        self._notifier.start()
        return self

    def load(self, job: LoadJob) -> None:
        self._jobs.put(job)

    def results(self) -> tuple[set[str], set[str], TransferStats]:
        """(ids loaded, ids that failed, stats) since the last call; failed ids are not in the loaded set.

        Polls the active reads too (unless the transfer thread is busy): vLLM steps continuously while a load
        is pending, so completions are seen at once even when the transfer thread is starved of CPU."""
        if self._active and self._nixl.acquire(blocking=False):
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
        return (source.remote_engine_id, source.remote_dp_rank) in self._kernels

    def close(self) -> None:
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._launched.put(None)  # after the transfer thread: it launches no more
        if self._waiter is not None:
            self._waiter.join(timeout=60)
        self._notes.put(None)
        if self._notifier is not None:
            self._notifier.join(timeout=10)
        self.transport.close()

    # -- transfer thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._transfer_loop()
        finally:
            self._claims.close()  # the thread's own sockets

    def _transfer_loop(self) -> None:
        backoff = Backoff(first_s=50e-6, cap_s=2e-3)
        while True:
            try:
                job = self._jobs.get(timeout=None if not self._active else backoff.step())
            except queue.Empty:
                job = False
            if job is None:
                return
            with self._nixl:
                try:
                    if job:
                        backoff.reset()
                        self._start(job)
                    else:
                        self._poll()
                except Exception:
                    # A bug must not kill the thread and leave every later load hanging (_poll guards each
                    # active load itself; this catches a job that failed before it became active).
                    logger.exception("kvbridge decode %s: transfer thread error", self.identity)
                    if job and not self._has(job):
                        self._finish(job, False, "internal error in the transfer thread (see log)")

    def _notify_loop(self) -> None:
        try:
            while (item := self._notes.get()) is not None:
                self._notify_side_channel(*item)
        finally:
            self._notify_client.close()

    def _has(self, job: LoadJob) -> bool:
        return any(a.job is job for a in self._active)

    def _finish(self, job: LoadJob, ok: bool, error: str = "") -> None:
        logger.info("kvbridge decode %s: %s %s", self.identity.rank, job.request_id, "loaded" if ok else "failed")
        if not ok:
            logger.warning("kvbridge decode %s: load of %s failed: %s", self.identity, job.request_id, error)
        if not job.report:
            return
        with self._lock:
            (self._done if ok else self._failed).add(job.request_id)
            if not ok:
                self._stats.failures += 1

    def _start(self, job: LoadJob) -> None:
        started = time.monotonic()
        try:
            peers = self._connect(job.source)
            kernels = self._kernels.get((job.source.remote_engine_id, job.source.remote_dp_rank))
            if kernels is not None:
                self._start_ipc(job, peers, kernels, started)
                return
            plan = self._plan(job.source)
            descs = self._descriptors(plan, peers, job)
            if self.config.verify_requests and job.remote_blocks:
                self._claim(job, [rank for rank, d in descs.items() if len(d)])
            note = self._note(job)
            reads = {rank: d for rank, d in descs.items() if len(d)}
            transfers = [
                self.transport.read(peers[rank].agent, d, self.memory, peers[rank].memory, note)
                for rank, d in reads.items()
            ]
            posted = time.monotonic()
            self._notes.put((job, tuple(rank for rank in peers if rank not in reads)))
        except KVBridgeError as exc:
            self._forget(job.source)
            self._finish(job, False, str(exc))
            return
        logger.info(
            "kvbridge decode %s: %s reading %d blocks from %d workers (%.1f ms to post)",
            self.identity.rank,
            job.request_id,
            len(job.local_blocks),
            len(transfers),
            1000 * (posted - started),
        )
        total = sum(len(d) for d in descs.values())
        nbytes = sum(d.nbytes for d in descs.values())
        deadline = started + self.config.transfer_timeout_s
        active = _Active(job, transfers, deadline, started, nbytes, total, posted=posted)
        self._active.append(active)
        self._poll()

    def _notify_message(self, job: LoadJob) -> wire.Notify:
        """What every prefill worker of the engine receives once this worker is done with the request."""
        return wire.Notify(
            request_id=job.source.remote_request_id,
            engine_id=self.identity.engine_id,
            worker=wire.Worker.from_core(self.identity.dp_rank, self.identity.rank),
            expected=self.identity.layout.workers_per_engine,
        )

    def _note(self, job: LoadJob) -> bytes:
        return wire.encode(self._notify_message(job))

    def _notify_side_channel(self, job: LoadJob, ranks: tuple[WorkerRank, ...]) -> None:
        """Tell prefill workers that no READ notifies (those read through CUDA IPC, those with nothing to read)
        over the side channel, acknowledged. A worker that does not answer frees the blocks when its lease
        expires; the load itself is not affected."""
        source, message = job.source, self._notify_message(job)
        try:
            answers = self._notify_client.exchange_all([_address(source, r) for r in ranks], message)
        except Exception as exc:  # never lose the thread over a notification
            answers = [exc] * len(ranks)
        for rank, answer in zip(ranks, answers, strict=True):
            if not isinstance(answer, wire.Ack):
                logger.warning("kvbridge decode %s: prefill worker %s not notified: %s", self.identity, rank, answer)

    def _start_ipc(self, job: LoadJob, peers: dict[WorkerRank, _Peer], kernels: dict, started: float) -> None:
        """The CUDA IPC path: check the blocks, launch, claim while the kernel runs; the waiter thread reports."""
        try:
            remote, local = job.remote_blocks, job.local_blocks
            for rank in kernels:  # arrays after the first: the later checks convert nothing
                remote, local = block_lists(remote, local, peers[rank].memory, self.memory)
            live = kernels if job.local_blocks else {}
            start_event, event = self._ipc.launch(live, remote, local)
        except Exception as exc:  # bad block ids, or a launch error: nothing may still write our blocks
            if not isinstance(exc, KVBridgeError):
                logger.exception("kvbridge decode %s: gather kernel launch failed", self.identity)
                with contextlib.suppress(Exception):
                    self._ipc.stream.synchronize()
            self._forget(job.source)
            self._finish(job, False, str(exc))
            return
        nbytes = sum(k.block_bytes for k in live.values()) * len(job.local_blocks)
        deadline = started + self.config.transfer_timeout_s
        active = _Active(job, [], deadline, started, nbytes, 0, event, start_event, posted=time.monotonic())
        if self.config.verify_requests and job.remote_blocks:
            try:
                self._claim(job, list(kernels))
            except Exception as exc:  # reported once the kernel is done: it still writes our blocks
                active.error = str(exc) if isinstance(exc, KVBridgeError) else f"claim failed: {exc!r}"
        self._launched.put(active)

    def _wait_loop(self) -> None:
        """Report IPC loads as their kernels finish, sleeping in the CUDA driver meanwhile (no polling)."""
        while (active := self._launched.get()) is not None:
            try:
                active.event.synchronize()  # a blocking-sync event: the thread sleeps, without the GIL
            except Exception as exc:  # a CUDA error: the bytes are unknown; the load fails, vLLM recomputes
                logger.exception("kvbridge decode %s: gather kernel failed", self.identity)
                active.error = active.error or f"gather kernel failed: {exc}"
            if active.error:
                self._finish(active.job, False, active.error)
                continue  # the claim failed: the prefill side does not hold the request
            gpu_s = None
            with contextlib.suppress(Exception):  # a statistic: never lose this thread (and every later load) to it
                gpu_s = active.start_event.elapsed_time(active.event) / 1e3
            self._complete(active, gpu_s=gpu_s)
            self._notes.put((active.job, tuple(active.job.source.layout.workers())))  # after the report

    def _poll(self) -> None:
        still = []
        for active in self._active:
            try:
                done = all(self.transport.poll(t) for t in active.transfers)
            except Exception as exc:  # KVBridgeError from NIXL, or a bug: this load fails, the others go on
                if not isinstance(exc, KVBridgeError):
                    logger.exception("kvbridge decode %s: polling failed", self.identity)
                self._release(active)
                self._forget(active.job.source)
                self._finish(active.job, False, str(exc))
                continue
            if done:
                self._release(active)
                self._complete(active)
            elif time.monotonic() > active.deadline:
                self._release(active)
                self._finish(active.job, False, f"not done after {self.config.transfer_timeout_s} s")
            else:
                still.append(active)
        self._active = still

    def _complete(self, active: _Active, gpu_s: float | None = None) -> None:
        elapsed = time.monotonic() - active.started
        with self._lock:
            self._stats.transfers += 1
            self._stats.bytes += active.nbytes
            self._stats.descriptors += active.descriptors
            self._stats.seconds.append(elapsed)
            self._stats.post_seconds.append(active.posted - active.started)
            if gpu_s is not None:
                self._stats.gpu_seconds.append(gpu_s)
        self._finish(active.job, True)

    def _release(self, active: _Active) -> None:
        for t in active.transfers:
            try:
                self.transport.release(t)
            except KVBridgeError as exc:
                logger.warning("kvbridge decode %s: %s", self.identity, exc)

    def _connect(self, source: PrefillDone) -> dict[WorkerRank, _Peer]:
        key = (source.remote_engine_id, source.remote_dp_rank)
        if key in self._engines:
            return self._engines[key]
        layout = source.layout
        ident = self.identity
        peers = {}
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
            )
            reply = fetch_handshake(
                *_address(source, rank),
                request,
                timeout_s=self.config.handshake_timeout_s,
                retries=self.config.handshake_retries,
            )
            same_host = reply.host_id == host_id()
            agent = self.transport.add_peer(reply.agent_metadata)
            ipc = tuple(h.to_core() for h in reply.ipc)
            peers[rank] = _Peer(agent, reply.memory.to_core(), same_host, ipc)
        self._engines[key] = peers
        path = "NIXL"
        if self._ipc is not None and all(p.same_host and p.ipc for p in peers.values()):
            try:
                plan = self._plan(source)
                self._kernels[key] = self._ipc.connect(
                    plan, ident.rank, {rank: (p.memory, p.ipc) for rank, p in peers.items()}
                )
                path = f"CUDA IPC + gather kernel on {self._ipc.device}"
            except KVBridgeError as exc:
                logger.warning("kvbridge decode %s: reading %s through NIXL: %s", ident, source.remote_engine_id, exc)
        logger.info(
            "kvbridge decode %s connected to %d workers of %s at %s (%s; %s; UCX_TLS=%s)",
            ident,
            len(peers),
            source.remote_engine_id,
            source.remote_host,
            "same host: shared memory/CMA usable" if same_host else "another host: network transports only",
            path,
            self.transport.ucx_env.get("UCX_TLS", "UCX default"),
        )
        return peers

    def _claim(self, job: LoadJob, ranks: list[WorkerRank]) -> None:
        """Make sure every prefill worker we read from still holds the request with these blocks.

        The prefill side learns of a hold one engine step after the client got its kv_transfer_params, so a
        refusal is retried for a short while before it counts."""
        source = job.source
        claim = wire.Claim(
            request_id=source.remote_request_id,
            block_ids=tuple(job.remote_blocks),
            engine_id=self.identity.engine_id,
            worker=wire.Worker.from_core(self.identity.dp_rank, self.identity.rank),
        )
        deadline = time.monotonic() + 2.0
        pending = list(ranks)
        while pending:  # all at once: one round trip per attempt, however many workers
            answers = self._claims.exchange_all([_address(source, r) for r in pending], claim)
            for answer in answers:
                if isinstance(answer, Exception):  # no answer, or not a message: as exchange would raise
                    raise answer
            refused = [(r, a) for r, a in zip(pending, answers, strict=True) if not isinstance(a, wire.Ack)]
            if refused and time.monotonic() > deadline:
                rank, answer = refused[0]
                text = answer.message if isinstance(answer, wire.ErrorReply) else repr(answer)
                raise RequestParamsError(f"prefill worker {rank} refused the read: {text}")
            pending = [r for r, _ in refused]
            if pending:
                time.sleep(0.02)

    def _forget(self, source: PrefillDone) -> None:
        """Drop a prefill engine's cached connection after a failure, so the next request handshakes again
        (a restarted prefill instance has new agents and memory)."""
        self._kernels.pop((source.remote_engine_id, source.remote_dp_rank), None)
        peers = self._engines.pop((source.remote_engine_id, source.remote_dp_rank), None)
        for peer in (peers or {}).values():
            with contextlib.suppress(KVBridgeError):
                self.transport.remove_peer(peer.agent)

    def _plan(self, source: PrefillDone) -> TransferPlan:
        plan = self._plans.get(source.remote_layout)
        if plan is None:
            plan = make_plan(source.layout, self.identity.layout, self.identity.geometry)
            self._plans[source.remote_layout] = plan
        return plan

    def _descriptors(self, plan: TransferPlan, peers: dict[WorkerRank, _Peer], job: LoadJob) -> dict:
        if not job.local_blocks:
            return {}
        return worker_descriptors(
            plan,
            self.identity.rank,
            self.memory,
            {rank: peer.memory for rank, peer in peers.items()},
            np.asarray(job.remote_blocks, dtype=np.int64),
            np.asarray(job.local_blocks, dtype=np.int64),
        )


def _address(source: PrefillDone, rank: WorkerRank) -> tuple[str, int]:
    """(host, port) of the side channel of worker `rank` of the prefill engine that `source` names."""
    return source.remote_host, side_channel_port(source.remote_port, source.layout, source.remote_dp_rank, rank)
