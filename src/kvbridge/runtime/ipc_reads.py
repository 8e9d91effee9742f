"""A decode worker's CUDA IPC path: launch a load's gather kernels, and report the load when they have finished.

Per engine: the prefill workers' regions opened through CUDA IPC and one gather kernel per worker read
(`kvbridge.transport.ipc_reader`), made by its handshake (`connect`; None: that engine is read through NIXL) and
dropped when the engine is reaped (`forget`): the engine's `inflight` counts every load launched on it until that
load is reported, so the mappings stay open while any kernel queued on them runs. Per load: one launch from the
thread that has it ready (the transfer thread, or the control thread that claimed it), one at a time under
`_launching`, on one stream, so kernels finish in launch order; the waiter thread sleeps on each load's
blocking-sync event in that order and reports it. A launch that fails waits for the stream first: whatever it
queued must finish before the engine can reuse the blocks.

A load's kernels may go out while its claim is still on the wire (`launch(load, claim_open=True)`): a read only
reads, and the prefill worker held the request's blocks from before its params left it. Such a load is reported
once both are done (`claim_done`): loaded if the claim was granted, failed (its kernels finished: nothing writes
its blocks any more) if it was refused. The price: a load whose claim then finds its prefill gone or restarted
has read through that process's old mapping (what CUDA does on a read of a dead exporter's memory is not
specified; the mapping is kept open until the engine is reaped). No GPU test kills a prefill under a launch.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvbridge.core.descriptors import block_lists
from kvbridge.core.errors import KVBridgeError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import WorkerMemory
from kvbridge.core.topology import WorkerRank
from kvbridge.runtime.load import Load
from kvbridge.runtime.peers import Engine
from kvbridge.wire.affinity import unpin_this_thread

if TYPE_CHECKING:
    import torch

    from kvbridge.transport.ipc_reader import IpcReader

logger = logging.getLogger(__name__)


class IpcReads:
    """One decode worker's GPU reader and the kernels it has queued."""

    def __init__(
        self,
        identity: WorkerIdentity,
        memory: WorkerMemory,
        regions: Sequence[torch.Tensor],
        *,
        loaded: Callable[[Load, float | None], None],
        failed: Callable[[Load, str], None],
    ) -> None:
        """`regions`: `memory`'s regions as GPU tensors. `loaded(load, gpu_s)` (the kernels' time on the GPU, None
        if unknown) and `failed(load, error)` report a load to the decode worker."""
        self.identity = identity
        self.memory = memory
        self.regions = tuple(regions)
        self.loaded = loaded
        self.failed = failed
        self.reader: IpcReader | None = None
        self._launched: queue.Queue[Load | None] = queue.Queue()  # kernels queued, in launch order (one stream)
        self._launching = threading.Lock()  # one launch at a time: stream order = the waiter's order
        self._joined = threading.Lock()  # a load launched during its claim: its kernels' end meets its claim's
        self._waiter: threading.Thread | None = None

    def start(self, reader: IpcReader | None = None) -> IpcReads:
        """Open the GPU side (or take `reader`) and start the waiter; raises without Triton or CUDA (the worker then
        uses NIXL only)."""
        if reader is None:
            from kvbridge.transport.ipc_reader import IpcReader

            reader = IpcReader(self.memory, self.regions)
        self.reader = reader
        self._waiter = threading.Thread(target=self._wait_loop, name="kvbridge-ipc-wait", daemon=True)
        self._waiter.start()
        return self

    def close(self) -> None:
        """Once nothing launches any more (the transfer thread has stopped): report what is queued, then stop."""
        self._launched.put(None)
        if self._waiter is not None:
            self._waiter.join(timeout=60)

    # -- per engine -------------------------------------------------------------------------------

    def connect(self, engine: Engine) -> dict[WorkerRank, Any] | None:
        """Gather kernels for the engine's workers this worker reads (the peer book's handshake), or None if their
        handles cannot be used here: the engine is then read through NIXL."""
        try:
            return self.reader.connect(
                engine.plan, self.identity.rank, {rank: (p.memory, p.ipc) for rank, p in engine.peers.items()}
            )
        except KVBridgeError as exc:
            logger.warning("kvbridge decode %s: reading %s through NIXL: %s", self.identity, engine.key[0], exc)
            return None

    def forget(self, engine: Engine) -> None:
        """A reaped engine (nothing of it in flight): drop the last reference to its IPC mappings."""
        engine.kernels = None

    # -- per load ---------------------------------------------------------------------------------

    def _checked(self, load: Load) -> tuple:
        """The load's (remote, local) block ids as arrays, checked against every worker read and this one (timed:
        `Load.checks_began` -> `Load.checked`)."""
        load.checks_began = time.monotonic()
        engine = load.engine
        remote, local = load.job.one_group()  # the gather kernels serve one-group engines only
        for rank in engine.kernels:  # arrays after the first: the later checks convert nothing
            remote, local = block_lists(remote, local, engine.peers[rank].memory, self.memory)
        load.checked = time.monotonic()
        return remote, local

    def launch(self, load: Load, claim_open: bool = False) -> None:
        """Queue the load's kernels (any thread, one at a time); a failed launch reports the load once the stream is
        idle. `claim_open`: its claim is still on the wire; the load is reported only after `claim_done` too."""
        load.claim_open = load.launched_in_claim = claim_open
        with self._launching:
            self._launch(load)

    def claim_done(self, load: Load, error: str = "") -> None:
        """The claim of a load launched during it is answered: granted (no `error`) or not. The load is reported
        now if its kernels have finished, else when they do."""
        if error:
            load.error = load.error or error
        self._finish(load, claim=True)

    def _finish(self, load: Load, *, kernels: bool = False, claim: bool = False) -> None:
        """Report the load once its kernels are done and its claim (if it was launched during one) is answered;
        whichever comes second reports it."""
        with self._joined:
            if kernels:
                load.kernels_done = True
            if claim:
                load.claim_open = False
            ready = load.kernels_done and not load.claim_open
        if not ready:
            return
        if load.error:
            self.failed(load, load.error)
        else:
            self.loaded(load, load.gpu_s)

    def _launch(self, load: Load) -> None:
        engine, job = load.engine, load.job
        try:
            remote, local = load.block_arrays or self._checked(load)
            live = engine.kernels if job.num_blocks else {}
            load.start_event, load.event = self.reader.launch(live, remote, local)
            load.launched = time.monotonic()
        except Exception as exc:  # bad block ids, or a launch error
            if not isinstance(exc, KVBridgeError):
                logger.exception("kvbridge decode %s: gather kernel launch failed", self.identity)
            # whatever was queued must finish before the blocks can be reused: wait for the stream
            try:
                self.reader.stream.synchronize()
            except Exception:
                logger.exception("kvbridge decode %s: stream sync after a failed launch failed", self.identity)
                return  # unknown state: keep the blocks (the request stays unreported, never reused)
            load.error = load.error or str(exc)
            self._finish(load, kernels=True)
            return
        load.nbytes = sum(k.block_bytes for k in live.values()) * job.num_blocks
        load.posted = time.monotonic()
        self._launched.put(load)

    def _wait_loop(self) -> None:
        """Report loads as their kernels finish, sleeping in the CUDA driver meanwhile (no polling)."""
        unpin_this_thread()  # a light thread: never wait behind vLLM's spinning, pinned workers
        while (load := self._launched.get()) is not None:
            try:
                load.event.synchronize()  # a blocking-sync event: the thread sleeps, without the GIL
            except Exception as exc:  # a CUDA error: the bytes are unknown; the load fails, vLLM recomputes
                logger.exception("kvbridge decode %s: gather kernel failed", self.identity)
                load.error = f"gather kernel failed: {exc}"
            load.kernels_landed = time.monotonic()
            if not load.error:
                with contextlib.suppress(Exception):  # a statistic: never lose this thread (and later loads) to it
                    load.gpu_s = load.start_event.elapsed_time(load.event) / 1e3
            self._finish(load, kernels=True)
