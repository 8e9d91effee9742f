"""A NIXL agent in a process of its own, to READ from: `NixlTarget(nbytes, fill)` registers `nbytes` of host memory
holding `fill` and progresses its agent until closed; `metadata` and `region` are what a reader needs; `stop`
(SIGSTOP) and `resume` (SIGCONT) make it a silent peer. Used as a context manager, it is ended on exit."""

from __future__ import annotations

import os
import signal
import time

from kvbridge.core.memory import Region
from support import fork_server, stopping


def _main(nbytes: int, fill: int, out, done) -> None:
    import numpy as np

    from kvbridge.core.memory import WorkerMemory
    from kvbridge.transport.nixl import NixlTransport

    buffer = np.full(nbytes, fill, dtype=np.uint8)
    with NixlTransport("nixl-target") as transport:
        region = Region(buffer.ctypes.data, nbytes)
        transport.register(WorkerMemory((region,), ()))
        out.put((transport.agent_metadata(), region))
        while done.empty():  # UCX over tcp answers READs only while the target progresses
            transport.notifications()
            time.sleep(0.001)


class NixlTarget:
    def __init__(self, nbytes: int, fill: int) -> None:
        ctx = fork_server.context()
        out, self._done = ctx.Queue(), ctx.Queue()
        self.process = fork_server.start(_main, nbytes, fill, out, self._done)
        self.metadata, self.region = out.get(timeout=60)

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self) -> None:
        stopping.stop(self.process.pid)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGCONT)
            self._done.put(None)
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)

    def __enter__(self) -> NixlTarget:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
