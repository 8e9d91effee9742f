"""Claims of requests a prefill worker does not hold yet, kept until their holds come or their waits pass.

A decode worker may claim a request one engine step before the prefill side registers its hold: the claim is
kept and answered at the hold, instead of being refused and sent again. What is kept is bounded in count
(config `max_waiting_claims`) and in the block ids the claims carry (MAX_WAITING_BLOCK_IDS), so a forged flood
costs a bounded amount. Not thread-safe: the prefill worker's lock guards it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.wire import messages as wire
from kvbridge.wire.later import Later

MAX_WAITING_BLOCK_IDS = 1 << 20
"""Block ids that waiting claims may hold in all (about 36 MB as Python ints): with `max_waiting_claims` claims of
the largest frames a flood could otherwise keep gigabytes; beyond it a claim is answered at once."""


@dataclass
class Waiting:
    """A claim of a request not held yet, answered when its hold comes or at `until`."""

    claim: wire.Claim
    answer: Later
    until: float


class WaitingClaims:
    """The claims kept waiting, per request id."""

    def __init__(self, max_claims: int) -> None:
        self.max_claims = max_claims
        self._by_request: dict[str, list[Waiting]] = {}
        self._count = 0
        self._ids = 0  # block ids the waiting claims hold (bounded by MAX_WAITING_BLOCK_IDS)

    def __bool__(self) -> bool:
        return bool(self._by_request)

    def keep(self, claim: wire.Claim, until: float) -> Later | None:
        """Keep `claim` until `until`: the answer to give it later; None (answer it now) when `max_claims` claims
        or MAX_WAITING_BLOCK_IDS block ids are waiting already."""
        ids = sum(map(len, claim.groups))
        if self._count >= self.max_claims or self._ids + ids > MAX_WAITING_BLOCK_IDS:
            return None
        later = Later()
        self._by_request.setdefault(claim.request_id, []).append(Waiting(claim, later, until))
        self._count += 1
        self._ids += ids
        return later

    def take(self, request_id: str) -> list[Waiting]:
        """The claims of `request_id` (its hold came), no longer kept."""
        waiting = self._by_request.pop(request_id, [])
        self._forget(waiting)
        return waiting

    def lapsed(self, now: float) -> list[Later]:
        """The answers of claims whose wait passed without their hold (they are answered not held), no longer
        kept."""
        out = []
        for request_id in [r for r, ws in self._by_request.items() if any(w.until <= now for w in ws)]:
            keep = [w for w in self._by_request[request_id] if w.until > now]
            lapsed = [w for w in self._by_request[request_id] if w.until <= now]
            out += [w.answer for w in lapsed]
            self._forget(lapsed)
            if keep:
                self._by_request[request_id] = keep
            else:
                del self._by_request[request_id]
        return out

    def next_until(self) -> float | None:
        """When the first kept claim's wait passes (None: none kept)."""
        return min((w.until for ws in self._by_request.values() for w in ws), default=None)

    def _forget(self, waiting: list[Waiting]) -> None:
        self._count -= len(waiting)
        self._ids -= sum(sum(map(len, w.claim.groups)) for w in waiting)
