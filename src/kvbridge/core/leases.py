"""The prefill side's bookkeeping of held requests: pure, torch-free, with the clock passed in.

A finished prefill request's blocks are held until every decode worker of the reading engine has notified
this worker (each sends exactly one notification per request and says how many to expect), or until the
lease expires (a dead or slow decode side must never pin blocks forever). Notifications may arrive before
the hold does (the scheduler tells workers one step later than the HTTP response leaves): they are kept,
and forgotten after one lease if no hold ever comes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Entry:
    expiry: float | None = None  # None: not held (yet), only notified
    received: int = 0
    expected: int | None = None
    first_seen: float = 0.0
    readers: set[str] = field(default_factory=set)


@dataclass
class LeaseBook:
    lease_s: float
    _entries: dict[str, _Entry] = field(default_factory=dict)
    expired_total: int = 0
    completed_total: int = 0

    def hold(self, request_id: str, now: float) -> None:
        entry = self._entries.setdefault(request_id, _Entry(first_seen=now))
        entry.expiry = now + self.lease_s

    def notified(self, request_id: str, reader: str, expected: int, now: float) -> None:
        """One decode worker (`reader`) is done with `request_id`; repeats from the same reader count once."""
        entry = self._entries.setdefault(request_id, _Entry(first_seen=now))
        if reader in entry.readers:
            return
        entry.readers.add(reader)
        entry.received += 1
        entry.expected = expected

    def due(self, now: float) -> tuple[set[str], set[str]]:
        """(requests all readers are done with, requests whose lease expired); both are forgotten."""
        done, expired = set(), set()
        for request_id, entry in list(self._entries.items()):
            if entry.expiry is None:
                if now - entry.first_seen > self.lease_s:
                    del self._entries[request_id]  # notifications for a hold that never came
                continue
            if entry.expected is not None and entry.received >= entry.expected:
                done.add(request_id)
            elif now >= entry.expiry:
                expired.add(request_id)
            else:
                continue
            del self._entries[request_id]
        self.completed_total += len(done)
        self.expired_total += len(expired)
        return done, expired

    @property
    def held(self) -> int:
        return sum(1 for e in self._entries.values() if e.expiry is not None)

    def next_expiry(self) -> float | None:
        expiries = [e.expiry for e in self._entries.values() if e.expiry is not None]
        return min(expiries) if expiries else None
