"""A decode worker's claims: the request pinned on every prefill worker it reads from, before the read.

- `ClaimQueue` runs claim steps on the control threads, at most `claims_per_engine` (config) at once per engine:
  a slow engine's claims wait in its own backlog, never in front of other engines' (they hold control threads
  while they wait).
- `claim_reads` sends one `Claim` to every worker read (all at once) and retries those that do not hold the
  request yet, within the claim window.

`DecodeWorker` owns the step itself (connect, count on the engine, claim, hand to a read path) and delegates here.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import RequestParamsError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.leases import groups_digest
from kvbridge.core.topology import WorkerRank
from kvbridge.runtime.load import Load
from kvbridge.runtime.peers import Engine, address, gone_check, identity
from kvbridge.transport.backoff import Backoff
from kvbridge.wire import messages as wire
from kvbridge.wire.side_channel_client import SideChannelClient

Step = Callable[[Load, "Future[Engine]"], None]
"""A load's claim step, run on a control thread once its engine is connected (or failed)."""

CLAIM_WAIT_SHARE = 0.5
"""The share of an attempt's answer deadline (`handshake_timeout_s`) a claim asks the prefill worker to wait for a
hold that has not come. The rest is the slack for the answer to come back: a prefill worker on a loaded machine
answers a lapsed wait late (its threads wait for a core), and an answer later than the deadline counts as none,
so two such in a row would make a live engine dead for `dead_engine_s`. A hold that takes longer costs another
round trip (the claim is sent again at its not-held answer), not a failed load."""


class ClaimQueue:
    """Claim steps on `pool`, at most `config.claims_per_engine` at once per engine, the rest in its backlog.
    `lock` guards the counts (the decode worker's lock)."""

    def __init__(self, pool: ThreadPoolExecutor, lock: threading.Lock, config: BridgeConfig, step: Step) -> None:
        self._pool = pool
        self._lock = lock
        self._config = config
        self._step = step
        self._claiming: dict = {}  # engine key -> claim steps on control threads (under _lock)
        self._backlog: dict = {}  # engine key -> loads waiting for one of them

    def admit(self, key, load: Load, connected: Future[Engine]) -> None:
        """Run the load's claim step on a control thread now, or after one of its engine's steps ends."""
        with self._lock:
            running = self._claiming.get(key, 0)
            if running >= self._config.claims_per_engine:
                self._backlog.setdefault(key, collections.deque()).append((load, connected))
                return
            self._claiming[key] = running + 1
        self._pool.submit(self._then_next, key, load, connected)

    def _then_next(self, key, load: Load, connected: Future[Engine]) -> None:
        try:
            self._step(load, connected)
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
                    self._pool.submit(self._then_next, key, *nxt)


def claim_reads(
    load: Load,
    engine: Engine,
    reader: WorkerIdentity,
    config: BridgeConfig,
    client: SideChannelClient,
    while_waiting: Callable[[], None] | None = None,
) -> WorkerRank | None:
    """Pin the request on every worker read (all at once); RequestParamsError if one refuses. Returns a
    worker whose epoch changed (the engine restarted: the caller handshakes again), or None.
    `reader`: this decode worker; `while_waiting`: work to do while each round of claims is on the wire."""
    job, source = load.job, load.job.source
    claim = wire.Claim(
        request_id=source.remote_request_id,
        **wire.Claim.blocks_of(job.remote_blocks),
        engine_id=reader.engine_id,
        worker=wire.Worker.from_core(reader.dp_rank, reader.rank),
        token=source.remote_token,
        prompt_hash=source.remote_prompt_hash,
        read_timeout_s=max(0.0, load.deadline - time.monotonic()),
        blocks_digest=groups_digest(source.group_block_ids),
        issued=source.remote_issued,
    )
    load.claim_sent = time.monotonic()
    load.block_arrays = None  # checked for this engine only (a restarted one is claimed again)
    window = min(load.deadline, load.claim_sent + config.claim_window_s)
    pending = list(load.read_ranks)
    backoff = Backoff(first_s=5e-3, cap_s=50e-3)
    while pending:
        # A prefill worker that does not hold the request yet keeps the claim until the hold comes (within
        # `wait_s`, under the client's timeout) and answers then: no retry in the common case.
        wait_s = max(0.0, min(window - time.monotonic(), CLAIM_WAIT_SHARE * config.handshake_timeout_s))
        answers = client.exchange_all(
            [address(source, r) for r in pending],
            msgspec.structs.replace(claim, wait_s=round(wait_s, 3)),
            [identity(source, r) for r in pending],
            while_waiting=while_waiting,
            gone_checks=[gone_check(engine.peers[r]) for r in pending],  # a killed worker whose sockets linger
        )
        refused = []
        for rank, answer in zip(pending, answers, strict=True):
            if isinstance(answer, Exception):
                raise answer
            epoch = answer.epoch if isinstance(answer, (wire.Ack, wire.ErrorReply)) else ""
            if epoch and epoch != engine.peers[rank].epoch:  # another run on the address: handshake again
                return rank
            if isinstance(answer, wire.Ack):
                continue
            text = answer.message if isinstance(answer, wire.ErrorReply) else repr(answer)
            if ends_the_claim(answer):
                raise RequestParamsError(f"prefill worker {rank} refused the read: {text}")
            refused.append((rank, text))
        if refused and time.monotonic() >= window:
            rank, text = refused[0]
            raise RequestParamsError(f"prefill worker {rank} refused the read: {text}")
        pending = [r for r, _ in refused]
        if pending:  # not held: its wait passed, or refused at once (its waiting claims are full)
            load.claim_retries += 1
            backoff.sleep()
    return None


def ends_the_claim(answer: wire.Message) -> bool:
    """Whether a claim's answer other than a grant ends the claim: anything but a `not_held` refusal that asking
    again within the window may change (a hold not come yet; not one the prefill marked `final`: freed there)."""
    return not isinstance(answer, wire.ErrorReply) or answer.reason is not wire.Refusal.NOT_HELD or answer.final
