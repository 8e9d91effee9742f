"""A decode worker's runtime: read a request's KV from the prefill workers that hold it, then tell them.

Every load takes one order of operations, whatever the path:

    queued --(control thread) connect, claim--> claimed --(transfer thread) post READs / launch kernels-->
    in flight --(poll / waiter)--> reported --(notifier) Notify the prefill workers

and on any failure: drained (nothing can still write the blocks) --> reported failed --> Abort to the prefill
workers, which free the blocks at once. Every load has a deadline from the moment it is queued. On the CUDA IPC
path the claiming thread launches the kernels while its claim is on the wire, and the load is reported once both
are done (`IpcReads.claim_done`): a read only reads, and counts only if the claim is granted.

`DecodeWorker` runs that order; each read path is an object of its own that reports back to it:
`nixl_reads.NixlReads` (READs across hosts, and the fallback) and `ipc_reads.IpcReads` (gather kernels over CUDA
IPC on one host). Threads, so that nothing slow stands in front of a transfer:
- control threads (a small pool): claims (`claims`: they pin the request on the prefill side for the read), run only
  once their engine is connected. Handshakes (`peers.PeerBook`: one per engine, shared by the jobs waiting for
  it) run on a pool of their own, so many slow or silent engines never hold the threads that claim for
  connected ones. One slow or dead engine holds only its own jobs; a dead one fails the next jobs to it at once
  for a while.
- the transfer thread: takes claimed jobs, counts them on their engine and hands each to its path (post its
  READs, or launch its kernels), polls the READs, and reaps engines that left the cache once idle. The engine's
  `results()` calls poll the READs too when NIXL is free.
- the waiter (CUDA IPC path, `IpcReads`): sleeps on the kernels' blocking-sync events and reports loads as they
  finish.
- the notifier (`notifier.Notifier`): sends notifications and aborts over the side channel (a dead peer's timeouts
  delay no load).
- READs that run past `read_liveness_s`: the transfer thread has their prefill workers asked, on the handshake
  pool, whether they are there (`read_liveness.ReadLiveness`); one silent or gone fails the loads reading from it
  as their deadline would (`NixlReads`).
Nothing here raises into the engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import HostUnreachable, KVBridgeError, PeerGone, TransferError, TransferTimeout
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import WorkerMemory
from kvbridge.core.topology import WorkerRank
from kvbridge.runtime.claims import ClaimQueue, claim_reads
from kvbridge.runtime.ipc_reads import IpcReads
from kvbridge.runtime.load import Load, LoadJob
from kvbridge.runtime.nixl_reads import NixlReads
from kvbridge.runtime.notifier import Notifier
from kvbridge.runtime.peers import Engine, PeerBook, check_run, engine_key
from kvbridge.runtime.read_budget import ReadBudget, block_bytes
from kvbridge.runtime.read_liveness import ReadLiveness
from kvbridge.runtime.stream_reads import StreamReads
from kvbridge.runtime.transfer_stats import TransferStats
from kvbridge.transport.backoff import Backoff
from kvbridge.transport.nixl_descriptors import MemType
from kvbridge.wire.affinity import unpin_this_thread
from kvbridge.wire.auth import Sealer
from kvbridge.wire.params import PrefillDone
from kvbridge.wire.side_channel_client import ThreadClients

if TYPE_CHECKING:
    import torch

__all__ = ["DecodeWorker", "LoadJob"]  # LoadJob: the connector imports it from here

logger = logging.getLogger(__name__)

SLOW_LOAD_S = 2.0
"""A load that takes longer is logged with where its time went (handshake, claim, queue, wire)."""

POLL_FRESH_S = 250e-6
"""The transfer thread polls READs in flight at least this often for FRESH_S after a post."""
FRESH_S = 0.05
POLL_STALE_S = 2e-3
"""Then at least this often (a READ that takes longer moves many MiB or crosses a slow link)."""


class DecodeWorker:
    """One vLLM decode worker's reader: queues loads, claims them, hands each to its read path before its deadline,
    reports them to the engine and tells the prefill workers."""

    def __init__(
        self,
        identity: WorkerIdentity,
        memory: WorkerMemory,
        config: BridgeConfig,
        mem_type: MemType = "DRAM",
        regions: Sequence[torch.Tensor] = (),
        key: bytes | None = None,
        control_threads: int = 8,
        handshake_threads: int | None = None,
    ) -> None:
        """`regions`: `memory`'s regions as tensors (`torch_memory.region_tensors`); with GPU memory they enable
        the CUDA IPC path (config.gpu_peer_copy). `key`: the deployment keys (`wire.keys.load_keys`).
        `handshake_threads`: the handshakes' own pool (None: half the control threads, at least 1), so that
        handshakes to silent engines never hold the threads that claim for connected ones; 0: they
        share the control pool (kept for the negative control)."""
        self.identity = identity
        self.memory = memory
        self.config = config
        self.mem_type = mem_type
        self.sealer = Sealer(key, window_s=config.auth_window_s) if key is not None else None
        self._regions = tuple(regions)
        self._lock = threading.Lock()  # results and stats
        self._reported = threading.Condition(self._lock)  # notified when a load is reported
        self._outstanding = 0  # loads queued to report and not yet reported (under _lock)
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._landed: list[Load] = []  # landed since the last results(): their report phase ends there
        self._stats = TransferStats()
        self._pool = ThreadPoolExecutor(
            control_threads, thread_name_prefix=f"kvbridge-control-{identity.rank}", initializer=unpin_this_thread
        )
        if handshake_threads is None:
            handshake_threads = max(1, control_threads // 2)
        self._handshakes = (
            ThreadPoolExecutor(
                handshake_threads,
                thread_name_prefix=f"kvbridge-handshake-{identity.rank}",
                initializer=unpin_this_thread,
            )
            if handshake_threads
            else self._pool
        )
        self._clients = ThreadClients(  # each control thread's side-channel sockets
            timeout_s=config.handshake_timeout_s,
            retries=config.handshake_retries,
            sealer=self.sealer,
            max_sockets=config.side_channel_sockets_per_thread,
            max_answer_bytes=config.side_channel_max_answer_bytes,
            link_timeout_s=config.link_timeout_s,
        )
        self.peers = PeerBook(
            identity, memory, config, self._handshakes, self._add_agent, self.sealer, self._ipc_connect
        )
        self.notifier = Notifier(identity, config, self.sealer, self.peers)  # the notifier thread's work
        self.nixl = NixlReads(
            identity,
            memory,
            config,
            mem_type,
            self.peers,
            loaded=self._complete,
            failed=self._fail,
            tell=self.notifier.tell,
            sealer=self.sealer,
            regions=self._regions,
            liveness=self._liveness(),
        )
        self.budget = ReadBudget(config, block_bytes(memory))  # deadlines that grow with the bytes in flight
        self.ipc: IpcReads | None = None  # when this worker may read through CUDA IPC (from start())
        # kvbridge's KV channel: engines on other hosts where NIXL does not cross hosts (`peers`, `Engine.stream`)
        self.stream = (
            StreamReads(
                identity, memory, config, key, loaded=self._copied_stream, failed=self._fail, unreachable=self._dead
            )
            if key and mem_type == "DRAM"
            else None
        )
        self._dead_news: dict[tuple, str] = {}  # engines found gone or unreachable here, not yet told
        self._ready: queue.Queue[Load | None] = queue.Queue()  # claimed: to post or launch
        self._claims = ClaimQueue(self._pool, self._lock, config, self._claim_step)  # claim steps, per engine
        self._threads: list[threading.Thread] = []

    def start(self) -> DecodeWorker:
        self.nixl.start()
        if self.stream is not None:
            self.stream.start()
        if self.mem_type == "VRAM" and self.config.gpu_peer_copy == "auto" and self._regions:
            try:
                ipc = IpcReads(self.identity, self.memory, self._regions, loaded=self._copied, failed=self._fail)
                self.ipc = ipc.start()
            except Exception as exc:  # no Triton, no CUDA: NIXL only
                logger.warning("kvbridge decode %s: CUDA IPC path unavailable (%s); using NIXL", self.identity, exc)
        self._spawn(self._transfer_loop, f"kvbridge-decode-{self.identity.rank}")
        self._spawn(self.notifier.run, "kvbridge-notify")
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
        load = Load(job, now, now + self.budget.begin(job))
        if job.report:
            with self._lock:
                self._outstanding += 1
        if not job.reads:
            if job.refused or job.source is None:
                self._refuse(load, job.refused or "no prefill location")
            else:  # the request is gone here: only free the prefill side's blocks
                workers = tuple(job.source.layout.workers())
                self.notifier.tell(self.notifier.abort_message(job, "aborted before its load"), job, workers)
            return
        future = self.peers.connect(job.source)
        future.add_done_callback(lambda f: self._admit(load, f))

    def results(self, wait_s: float = 0.0) -> tuple[set[str], set[str], TransferStats]:
        """(ids loaded, ids that failed, stats) since the last call; failed ids are not in the loaded set.

        Polls the active reads too (unless the transfer thread is busy): vLLM steps continuously while a load
        is pending, so completions are seen at once even when the transfer thread is starved of CPU. With
        `wait_s`, loads outstanding and none reported yet, waits up to `wait_s` for one first."""
        self.nixl.poll_if_free()
        if wait_s > 0:
            with self._lock:
                if self._outstanding > 0 and not self._done and not self._failed:
                    self._reported.wait(wait_s)
            self.nixl.poll_if_free()
        with self._lock:
            done, self._done = self._done, set()
            failed, self._failed = self._failed, set()
            stats, self._stats = self._stats, TransferStats()
            landed, self._landed = self._landed, []
        now = time.monotonic()
        for load in landed:
            for name, seconds in load.durations(now).items():
                stats.phases.setdefault(name, []).append(seconds)
        return done, failed, stats

    def loads_outstanding(self) -> bool:
        """Whether loads were queued and not reported yet (read without the lock: a hint for an idle step)."""
        return self._outstanding > 0

    def reads_through_ipc(self, source: PrefillDone) -> bool:
        """Whether this worker reads `source`'s engine through CUDA IPC (after it connected to it)."""
        return any(e.kernels and e.key[0] == source.remote_engine_id for e in self.peers.all_engines())

    def close(self) -> None:
        self._handshakes.shutdown(wait=True, cancel_futures=True)
        self._pool.shutdown(wait=True, cancel_futures=True)
        threads = {t.name: t for t in self._threads}
        self._ready.put(None)
        if (transfer := threads.get(f"kvbridge-decode-{self.identity.rank}")) is not None:
            transfer.join(timeout=30)
        if self.ipc is not None:  # after the transfer thread: it launches no more
            self.ipc.close()
        self.notifier.stop()
        if (notifier := threads.get("kvbridge-notify")) is not None:
            notifier.join(timeout=30)
        self._clients.close()
        if self.stream is not None:  # after the transfer thread: it launches no more
            self.stream.close()
        self.nixl.close()

    def _liveness(self) -> ReadLiveness | None:
        """Who asks the prefill workers of READs running long whether they are there: on the handshake pool, kept
        for waits on slow or silent peers (None: read_liveness_s 0, never asked)."""
        if not self.config.read_liveness_s:
            return None
        return ReadLiveness(self.identity, self.config, self._handshakes, self.sealer)

    # -- the peer book's hooks into the read paths ---------------------------------------------------

    def _add_agent(self, metadata: bytes, name: str) -> str:
        return self.nixl.add_agent(metadata, name)

    def _ipc_connect(self, engine: Engine) -> dict | None:
        return None if self.ipc is None else self.ipc.connect(engine)

    # -- control threads: claim ---------------------------------------------------------------------

    def _admit(self, load: Load, connected: Future[Engine]) -> None:
        """Run the load's claim on a control thread (`claims.ClaimQueue`: at most `claims_per_engine` at once per
        engine). A load that makes no claim (verify_requests off, or nothing to read) takes its step here, on the
        thread that connected it: handing it to a control thread would only add a thread switch."""
        if not (self.config.verify_requests and load.job.num_blocks):
            self._claim_step(load, connected)
            return
        self._claims.admit(engine_key(load.job.source), load, connected)

    def _claim_step(self, load: Load, connected: Future[Engine], retried: bool = False) -> None:
        """Control thread: the engine is connected (or failed); claim the request on the workers read."""
        try:
            engine = connected.result()
            load.engine = engine
            load.connected = time.monotonic()
            if time.monotonic() > load.deadline:
                raise TransferTimeout(f"not started after {load.deadline - load.queued:.3g} s (its deadline)")
            # Counted on its engine from here to its report: an engine retired meanwhile (evicted, restarted) is
            # not reaped, its NIXL agents and IPC mappings kept, while this load waits to be posted.
            self.peers.begin(engine)
            load.begun = True
            load.read_ranks = self._ranks_read(load, engine)
            check_run(load.job.source, engine, load.read_ranks)
            if self.config.verify_requests and load.job.num_blocks and load.read_ranks:
                try:
                    stale = self._claim(load, engine)
                except TransferError as exc:  # gone (refused) or silent past the deadline: not worth a wait again
                    if isinstance(exc, (PeerGone, HostUnreachable)):  # not merely slow: its reads cannot go on
                        self._dead(engine, str(exc))
                    else:
                        self.peers.mark_dead(engine, str(exc))
                    raise
                if stale:
                    self.peers.drop(engine, f"worker {stale} restarted (new epoch)")
                    if load.claim_open:  # kernels already read the old run's memory: this load fails
                        raise TransferError(f"prefill engine {engine.key[0]} restarted during the load")
                    self.peers.end(engine)
                    load.begun = False
                    if retried:
                        raise TransferError(f"prefill engine {engine.key[0]} restarted twice during one claim")
                    self._claim_step(load, self.peers.connect(load.job.source), retried=True)
                    return
            load.claimed = time.monotonic()
        except Exception as exc:
            if not isinstance(exc, KVBridgeError):
                logger.exception("kvbridge decode %s: claim step failed", self.identity)
            error = str(exc) or type(exc).__name__
            if load.claim_open:  # its kernels run: it fails once they are done
                self.ipc.claim_done(load, error)
            else:
                self._fail(load, error)
            return
        if load.claim_open:
            self.ipc.claim_done(load)  # granted: reported now, or when its kernels finish
        elif load.claim_sent and self._launches_here(load):
            self._post(load)  # the kernels go out from the thread that claimed: no hand-off to the transfer thread
        else:
            self._ready.put(load)

    def _launches_here(self, load: Load) -> bool:
        """Whether a claimed load's kernels may be launched by the thread that claimed it (the CUDA IPC path takes
        launches from any thread, one at a time, in stream order); READs are posted by the transfer thread."""
        return self.ipc is not None and load.engine.kernels is not None and load.job.span is None

    def _ranks_read(self, load: Load, engine: Engine) -> tuple[WorkerRank, ...]:
        """The prefill workers this worker reads from for this job (all of the plan's, if it has blocks)."""
        if not load.job.num_blocks:
            return ()
        return engine.plan.peers_of(self.identity.rank)

    def _claim(self, load: Load, engine: Engine) -> WorkerRank | None:
        """Pin the request on every worker read (`claims.claim_reads`); a worker whose epoch changed, or None."""
        return claim_reads(
            load,
            engine,
            self.identity,
            self.config,
            self._clients.get(),
            # the CUDA IPC path checks the block ids and launches its kernels while the claim is on the wire
            while_waiting=(lambda: self._launch_in_claim(load)) if self._launches_here(load) else None,
        )

    def _dead(self, engine: Engine, why: str) -> None:
        """`engine`'s process is gone or its host unreachable: loads naming it fail at once, those in flight on the
        KV channel too (not at their stall bound), and the other workers learn it (`take_dead_news`)."""
        self.engine_down(engine.key, why, engine)
        with self._lock:
            self._dead_news[engine.key] = why

    def take_dead_news(self) -> dict[tuple, str]:
        with self._lock:
            news, self._dead_news = self._dead_news, {}
        return news

    def engine_down(self, key: tuple, why: str, engine: Engine | None = None) -> None:
        """The engine `key` names is gone or unreachable (found here, or by another worker of this instance)."""
        if engine is not None:
            self.peers.mark_dead(engine, why)
        else:
            self.peers.mark_dead_key(key, why)
        if self.stream is not None:
            self.stream.cut(key, why)

    def _launch_in_claim(self, load: Load) -> None:
        """Launch a CUDA IPC load's kernels while its claim is on the wire (once, whatever the claim's rounds): a
        read only reads, and the load counts only if the claim is then granted (`IpcReads.claim_done`)."""
        if not load.started:
            load.started = time.monotonic()
            self.ipc.launch(load, claim_open=True)

    # -- transfer thread ----------------------------------------------------------------------------

    def _transfer_loop(self) -> None:
        # New loads wake the thread at once (the queue); READs in flight have no event to wait on (NIXL without its
        # progress thread): they are polled every POLL_FRESH_S at most while the last post is recent (a READ of a
        # few MiB lands in about a millisecond; a 2 ms cap added up to 2 ms to each), then less often.
        backoff = Backoff(first_s=25e-6, cap_s=POLL_FRESH_S)
        posted_at = 0.0
        while True:
            busy = self.nixl.busy
            if busy and time.monotonic() - posted_at > FRESH_S:
                backoff.cap_s = POLL_STALE_S  # long READs (slow links): poll rarely
            try:
                load = self._ready.get(timeout=backoff.step() if busy else 0.5)
            except queue.Empty:
                load = False
            if load is None:
                return
            try:
                if load:
                    backoff.reset()
                    backoff.cap_s, posted_at = POLL_FRESH_S, time.monotonic()
                    self._post(load)
                self.nixl.poll()
                self._reap()
            except Exception:  # a bug must not kill the thread and leave every later load hanging
                logger.exception("kvbridge decode %s: transfer thread error", self.identity)
                if load and not self.nixl.holds(load) and not load.transfers:
                    self._fail(load, "internal error in the transfer thread (see log)")

    def _post(self, load: Load) -> None:
        """Hand a claimed load (counted on its engine since its claim) to its path: kernels if the engine has them,
        else READs."""
        engine = load.engine
        load.started = time.monotonic()
        if load.started > load.deadline:
            self._fail(load, f"not started after {load.deadline - load.queued:.3g} s (its deadline)")
            return
        if engine.stream:  # another host, NIXL kept off the network: kvbridge's KV channel or nothing
            if self.stream is None:
                self._fail(load, "the prefill engine is on another host; the kv stream needs a key and host memory")
            else:
                self.stream.launch(load)
        elif engine.kernels is not None and load.job.span is None:  # the gather kernels copy block pairs
            self.ipc.launch(load)
        else:
            self.nixl.post(load, self.notifier.notify_message(load.job))

    def _reap(self) -> None:
        """Engines out of the cache with nothing in flight: their NIXL agents and IPC mappings go."""
        for engine in self.peers.reap():
            self.nixl.forget(engine)
            if self.ipc is not None:
                self.ipc.forget(engine)

    # -- reporting --------------------------------------------------------------------------------

    def _complete(self, load: Load, gpu_s: float | None = None) -> None:
        now = load.landed = time.monotonic()
        elapsed = now - load.queued
        if elapsed > SLOW_LOAD_S:
            logger.warning(
                "kvbridge decode %s: load of %s took %.1f s (%s)",
                self.identity,
                load.job.request_id,
                elapsed,
                load.phases(now),
            )
        with self._lock:
            self._stats.transfers += 1
            self._stats.bytes += load.nbytes
            self._stats.descriptors += load.descriptors
            self._stats.seconds.append(elapsed)
            self._stats.post_seconds.append(load.posted - load.queued)
            if gpu_s is not None:
                self._stats.gpu_seconds.append(gpu_s)
            self._stats.claim_retries += load.claim_retries
            if load.job.report:
                self._landed.append(load)
        self._report(load, True)

    def _copied(self, load: Load, gpu_s: float | None) -> None:
        """A CUDA IPC load's kernels finished: no READ carried the notification, so every prefill worker is told."""
        self._complete(load, gpu_s)
        job = load.job
        self.notifier.tell(self.notifier.notify_message(job), job, tuple(load.engine.layout.workers()))

    def _copied_stream(self, load: Load) -> None:
        self._copied(load, None)

    def _fail(self, load: Load, error: str) -> None:
        logger.warning(
            "kvbridge decode %s: load of %s failed: %s (%s)",
            self.identity,
            load.job.request_id,
            error,
            load.phases(time.monotonic()),
        )
        with self._lock:
            self._stats.failures += 1
        self._report(load, False)
        job = load.job
        if job.source is not None and not job.refused:
            self.notifier.tell(self.notifier.abort_message(job, error[:200]), job, tuple(job.source.layout.workers()))

    def _refuse(self, load: Load, error: str) -> None:
        """A job that never got going (refused by the scheduler): report it failed at once, reading nothing."""
        logger.warning("kvbridge decode %s: load of %s refused: %s", self.identity, load.job.request_id, error)
        with self._lock:
            self._stats.failures += 1
        self._report(load, False)

    def _report(self, load: Load, ok: bool) -> None:
        self.budget.end(load.job)
        if load.begun:
            self.peers.end(load.engine)
        with self._lock:
            if load.job.report:
                (self._done if ok else self._failed).add(load.job.request_id)
                self._outstanding -= 1
                self._reported.notify_all()
