"""A decode worker's reading NIXL agent, shared by its direct READs (`nixl_reads`) and its staged ones
(`staged_reads`): the transport, the one lock every call to it takes, and the flush READs that tell when nothing
more can arrive from a prefill agent.

Why flush READs: NIXL's release of a READ that was still running does not stop UCX, whose data may land later (over
tcp, when a cut link comes back or a stopped peer runs again); UCX answers one reader's READs from a peer in order,
so a flush READ posted after it is done only once every earlier READ from that agent has landed or been dropped. An
endpoint that has failed delivers nothing more. One closed by removing its agent may (NIXL 1.5.1 closes it in UCX's
flush mode): where no flush READ can be done (a silent peer), the fence is a new agent (`NixlTransport.renew`;
`renewing` names the agents waiting for it).
"""

from __future__ import annotations

import logging
import threading

from kvbridge.core.errors import KVBridgeError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import WorkerMemory
from kvbridge.transport.nixl import NixlTransport
from kvbridge.transport.nixl_descriptors import MemType, Transfer

logger = logging.getLogger(__name__)


class NixlReader:
    """The transport and its lock (the transfer thread, the engine's `results()` calls, handshakes on control
    threads and the staged drivers all call NIXL: one caller at a time). The flush helpers expect the caller to
    hold `lock`."""

    def __init__(self, transport: NixlTransport, identity: WorkerIdentity | str, mem_type: MemType) -> None:
        self.transport = transport
        self.identity = identity
        self.mem_type = mem_type
        self.lock = threading.Lock()
        self.renewing: set[str] = set()  # agents whose READs only the agent's renewal can fence (under `lock`)

    def post_flush(self, agent: str, memory: WorkerMemory) -> Transfer | None:
        """A flush READ from `agent` (`NixlTransport.post_flush`), or None if its endpoint has failed already (it
        delivers nothing more: nothing left to wait for)."""
        try:
            return self.transport.post_flush(agent, memory.regions[0], self.mem_type)
        except KVBridgeError as exc:
            logger.debug("kvbridge decode %s: no flush READ from %s: %s", self.identity, agent, exc)
            return None

    def flushed(self, agent: str, flush: Transfer) -> bool:
        """Whether nothing more can arrive from `agent` before `flush`: it is done or failed, or the agent is gone
        (removed for a worker known dead or restarted, whose endpoint has failed)."""
        try:
            return agent not in self.transport.peers or self.transport.poll(flush)
        except KVBridgeError:
            return True
