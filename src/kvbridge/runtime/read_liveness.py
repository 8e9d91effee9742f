"""Whether the prefill workers a decode worker's NIXL READs wait on are still there.

NIXL gives no progress signal for a READ in flight: one from a silent prefill (a stopped process, its host or link
down; UCX over tcp needs the target's progress) just stays in flight until its load's deadline. So while a load's
READs on a prefill worker run past `read_liveness_s`, the worker's side channel is asked (`wire.Ping`), one
question per worker at a time, again every `read_liveness_s` while READs on it run:

    answered (any authentic answer: its process runs)     -> alive; asked again read_liveness_s after the answer
    no answer within the answer deadline and its retries  -> silent  } a verdict, which the transfer thread takes
    refused, or its process gone here (/proc)             -> gone    } (`verdicts`) and acts on (`NixlReads`)

The questions run on the decode worker's handshake pool (the threads kept for waits on slow or silent peers, so
they never hold the threads that claim for connected engines), each on a socket of its own, closed after it: they
are rare (READs running long), and keep no connection open on the prefill side. The transfer thread only compares
times and queues a question (`due`). Loads whose READs finish within `read_liveness_s` never get here.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import HostUnreachable, PeerGone, TransferTimeout
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.topology import WorkerRank
from kvbridge.runtime.peers import Peer, address, gone_check, identity
from kvbridge.wire import messages as wire
from kvbridge.wire.auth import Sealer
from kvbridge.wire.params import PrefillDone
from kvbridge.wire.side_channel_client import SideChannelClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    """A prefill worker found silent or gone while READs on it ran: `peer` is the worker as its engine holds it
    (a newer handshake of the same agent name is another `Peer`), `why` what the loads fail with."""

    peer: Peer
    why: str


class ReadLiveness:
    """One decode worker's questions to the prefill workers its READs wait on (see the module docstring)."""

    def __init__(
        self, reader: WorkerIdentity, config: BridgeConfig, executor: Executor, sealer: Sealer | None = None
    ) -> None:
        """`executor`: where the questions run (they may wait the whole answer deadline); `sealer`: the deployment
        key's (None: frames are not sealed)."""
        self.reader = reader
        self.config = config
        self.sealer = sealer
        self.interval_s = config.read_liveness_s
        self.deadline_s = (1 + config.handshake_retries) * config.handshake_timeout_s
        self.executor = executor
        self._lock = threading.Lock()
        self._asking: set[str] = set()  # agents with a question on the wire
        self._answered: dict[str, float] = {}  # agent -> when it last answered
        self._verdicts: dict[str, Verdict] = {}  # agent -> its verdict, not taken yet
        self.asked = 0  # questions sent

    def due(self, agent: str, source: PrefillDone, rank: WorkerRank, peer: Peer, now: float) -> None:
        """READs on `peer` (worker `rank` of the engine `source` names, NIXL agent `agent`) have run past
        `interval_s`: ask it, unless a question is on the wire or it answered within `interval_s`."""
        with self._lock:
            if agent in self._asking or agent in self._verdicts:
                return
            if now - self._answered.get(agent, float("-inf")) < self.interval_s:
                return
            self._asking.add(agent)
            self.asked += 1
        try:
            self.executor.submit(self._ask, agent, source, rank, peer)
        except RuntimeError:  # shut down: the worker is closing
            with self._lock:
                self._asking.discard(agent)

    def verdicts(self) -> dict[str, Verdict]:
        """The verdicts since the last call, by agent (read without the lock first: the common case is none)."""
        if not self._verdicts:
            return {}
        with self._lock:
            out, self._verdicts = self._verdicts, {}
        return out

    def forget(self, agent: str) -> None:
        """`agent` was removed: its next question, if it comes back, is not delayed by an old answer."""
        with self._lock:
            self._answered.pop(agent, None)

    def _ask(self, agent: str, source: PrefillDone, rank: WorkerRank, peer: Peer) -> None:
        client = SideChannelClient(
            timeout_s=self.config.handshake_timeout_s,
            retries=self.config.handshake_retries,
            sealer=self.sealer,
            max_answer_bytes=self.config.side_channel_max_answer_bytes,
            link_timeout_s=self.config.link_timeout_s,
        )
        try:
            [answer] = client.exchange_all(
                [address(source, rank)],
                wire.Ping(engine_id=self.reader.engine_id),
                [identity(source, rank)],
                gone_checks=[gone_check(peer)],
            )
        except Exception as exc:  # a bug: no verdict (the load's deadline still ends it)
            logger.exception("kvbridge decode %s: asking prefill worker %s failed", self.reader, rank)
            answer = exc
        finally:
            client.close()
        with self._lock:
            self._asking.discard(agent)
            if isinstance(answer, (TransferTimeout, PeerGone)):
                host, port = address(source, rank)
                gone = isinstance(answer, PeerGone)
                known = gone or isinstance(answer, HostUnreachable)
                said = str(answer) if known else f"no answer in {self.deadline_s:g} s"
                self._verdicts[agent] = Verdict(
                    peer,
                    f"prefill worker {rank} of {source.remote_engine_id} is {'gone' if gone else 'silent'} while READs "
                    f"from it ran (its side channel {host}:{port}, asked after read_liveness_s {self.interval_s:g} s: "
                    f"{said})",
                )
            else:  # answered (or an answer that is no message of ours: nothing known either way), asked again later
                self._answered[agent] = time.monotonic()
                if isinstance(answer, Exception):
                    logger.debug("kvbridge decode %s: prefill worker %s: %s", self.reader, rank, answer)
