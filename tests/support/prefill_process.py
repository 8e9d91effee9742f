"""A kvbridge prefill worker in a process of its own, to kill, stop or restart under a decode worker.

`PrefillProcess(port, engine, seed)` starts a process (`support.fork_server`) holding a `PrefillWorker` whose KV
(one CPU buffer, LBHNC) is seeded from `seed`; `hold` pins requests there; `linger` makes its sockets outlive it (a
child forked with them); `stall_reads` keeps its NIXL agent from serving READs a while (its side channel still
answers); `kill`, `stop` (SIGSTOP), `resume` (SIGCONT) and `close` act on it. `kv(seed)` is what such a process's
buffer holds, to tell whose bytes a decode read.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import torch

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.wire.params import PrefillDone
from support import fork_server, stopping

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
BLOCKS = 16
NUMEL = 2 * BLOCKS * 2 * GEOMETRY.block_size * 2 * GEOMETRY.head_size


def kv(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def params_of(
    port: int, request_id: str, blocks: list[int], *, engine: str = "prefill-a", issued: float = 0.0, prompt_hash="h"
) -> PrefillDone:
    """The kv_transfer_params a `PrefillProcess` on `port` hands out for `request_id` held on `blocks` with token
    `token-<request_id>` (`hold`'s prompt hash is "h": another `prompt_hash` is refused as a mismatch)."""
    return PrefillDone(
        remote_engine_id=engine,
        remote_request_id=request_id,
        remote_block_ids=blocks,
        remote_host="127.0.0.1",
        remote_port=port,
        remote_layout="pp=1,tp=1",
        remote_token=f"token-{request_id}",
        remote_prompt_hash=prompt_hash,
        remote_issued=issued,
    )


def memory_of(buffer: torch.Tensor):
    return synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, BLOCKS, buffer.data_ptr())


def _main(port: int, engine: str, seed: int, say_pid: bool, commands, ready) -> None:
    from kvbridge.runtime.prefill_worker import PrefillWorker

    buffer = kv(seed)
    config = BridgeConfig(side_channel_port=port, lease_s=60.0)
    worker = PrefillWorker(
        WorkerIdentity(engine, ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY), memory_of(buffer), config
    )
    if not say_pid:  # as a prefill that does not say its process in the handshake
        worker.process = (0, 0)
    worker.start()
    ready.put((os.getpid(), time.time()))
    try:
        while (command := commands.get()) is not None:
            if command[0] == "linger":
                child = os.fork()
                if child == 0:  # holds every socket of the worker, answers nothing, then goes
                    try:
                        time.sleep(command[1])
                    finally:
                        os._exit(0)
                ready.put(child)
                continue
            if command[0] == "stall_reads":  # UCX over tcp serves READs only when the worker progresses its agent
                taken = threading.Event()

                def stall(seconds: float = command[1], taken: threading.Event = taken) -> None:
                    with worker._progress_lock:
                        taken.set()
                        time.sleep(seconds)

                threading.Thread(target=stall, daemon=True).start()
                taken.wait()
                ready.put("stalled")
                continue
            _, request_id, blocks, token = command
            worker.hold(request_id, (tuple(blocks),), token=token, prompt_hash="h")
            ready.put(request_id)
    finally:
        worker.close()


class PrefillProcess:
    def __init__(self, port: int, engine: str, seed: int, say_pid: bool = True) -> None:
        """`say_pid`: whether the worker says its process in the handshake (`HandshakeReply.pid`)."""
        ctx = fork_server.context()
        self._commands = ctx.Queue()
        self._ready = ctx.Queue()
        self.process = fork_server.start(_main, port, engine, seed, say_pid, self._commands, self._ready)
        self.pid, self.started = self._ready.get(timeout=60)
        self._lingering: list[int] = []

    def hold(self, request_id: str, blocks: list[int], token: str) -> None:
        self._commands.put(("hold", request_id, blocks, token))
        assert self._ready.get(timeout=10) == request_id

    def linger(self, seconds: float) -> None:
        """Fork a child that holds the worker's sockets (listening and accepted) for `seconds`, answering nothing:
        once the worker is killed, its side channel accepts connections and stays silent, as a killed process's
        does until the kernel has torn down its memory."""
        self._commands.put(("linger", seconds))
        self._lingering.append(self._ready.get(timeout=10))

    def stall_reads(self, seconds: float) -> None:
        """Keep the worker from progressing its NIXL agent for `seconds` (from now): READs from it make no
        progress (UCX over tcp needs the target's), while its side channel answers as usual: a live prefill whose
        READs are slow."""
        self._commands.put(("stall_reads", seconds))
        assert self._ready.get(timeout=10) == "stalled"

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self.process.is_alive() and time.monotonic() < deadline:  # reaps it; join() would wait for a
            time.sleep(0.001)  # lingering child too (it holds the process's sentinel pipe)

    def stop(self) -> None:
        stopping.stop(self.pid)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGCONT)
            self._commands.put(None)
            self.process.join(10)
        if self.process.is_alive():
            self.kill()
        for child in self._lingering:  # reparented when the worker died: not ours to reap
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
