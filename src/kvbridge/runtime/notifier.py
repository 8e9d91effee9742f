"""A decode worker's notifier: the Notify and Abort messages that tell prefill workers a request's KV was read (or
will not be), queued by any thread (`Notifier.tell`) and sent by the notifier thread over the side channel, off
every load's path (a dead peer's timeouts delay no load). The worker is `decode_worker.DecodeWorker`.
"""

from __future__ import annotations

import logging
import queue

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.topology import WorkerRank
from kvbridge.runtime.load import LoadJob
from kvbridge.runtime.peers import PeerBook, address, identity
from kvbridge.wire import messages as wire
from kvbridge.wire.auth import Sealer
from kvbridge.wire.side_channel_client import SideChannelClient

logger = logging.getLogger(__name__)

NOTIFY_TIMEOUT_S = 5.0
"""Answer deadline of one notification or abort attempt (the notifier thread; no load waits on it)."""
NOTIFY_RETRIES = 2


class Notifier:
    """Sends a decode worker's notifications and aborts: `run` is the notifier thread, `stop` ends it."""

    def __init__(self, identity: WorkerIdentity, config: BridgeConfig, sealer: Sealer | None, peers: PeerBook) -> None:
        self.identity = identity
        self.config = config
        self.sealer = sealer
        self.peers = peers
        self._notes: queue.Queue[tuple[wire.Message, LoadJob, tuple[WorkerRank, ...]] | None] = queue.Queue()

    def stop(self) -> None:
        """End `run` once the messages queued before are sent."""
        self._notes.put(None)

    def tell(self, message: wire.Message, job: LoadJob, ranks: tuple[WorkerRank, ...]) -> None:
        """Queue `message` for the notifier, to the prefill workers `ranks` of the job's engine."""
        self._notes.put((message, job, ranks))

    def notify_message(self, job: LoadJob) -> wire.Notify:
        """What every prefill worker of the engine receives once this worker is done with the request."""
        return wire.Notify(
            request_id=job.source.remote_request_id,
            engine_id=self.identity.engine_id,
            worker=wire.Worker.from_core(self.identity.dp_rank, self.identity.rank),
            expected=self.identity.layout.workers_per_engine,
            token=job.source.remote_token,
        )

    def abort_message(self, job: LoadJob, reason: str) -> wire.Abort:
        return wire.Abort(
            request_id=job.source.remote_request_id,
            engine_id=self.identity.engine_id,
            worker=wire.Worker.from_core(self.identity.dp_rank, self.identity.rank),
            reason=reason,
            token=job.source.remote_token,
        )

    def run(self) -> None:
        # Off every load's path: a busy prefill (a starved side-channel thread on shared cores) gets the deadline
        # it had before the short claim deadlines; a gone one is still known at once (a refused connection).
        client = SideChannelClient(
            timeout_s=max(NOTIFY_TIMEOUT_S, self.config.handshake_timeout_s),
            retries=max(NOTIFY_RETRIES, self.config.handshake_retries),
            sealer=self.sealer,
            max_sockets=self.config.side_channel_sockets_per_thread,
            max_answer_bytes=self.config.side_channel_max_answer_bytes,
            link_timeout_s=self.config.link_timeout_s,
        )
        try:
            while (item := self._notes.get()) is not None:
                message, job, ranks = item
                if self.peers.is_dead(job.source):  # its lease frees the blocks; a dead peer would hold us up
                    continue
                try:
                    answers = client.exchange_all(
                        [address(job.source, r) for r in ranks], message, [identity(job.source, r) for r in ranks]
                    )
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
