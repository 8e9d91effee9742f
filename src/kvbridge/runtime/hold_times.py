"""A prefill worker's timelines of the requests it holds, and the phases of those it released (for vLLM's stats).

Not thread-safe: the prefill worker's lock guards it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MAX_TIMELINES = 4096
"""Released requests' timelines kept until `take_phases` (vLLM's stats take them every step)."""


@dataclass
class HoldTimes:
    """One held request's timeline on this worker (monotonic seconds; the clock is the host's, shared by
    processes): request finished (the scheduler's request_finished) -> hold registered here -> first claim
    answered -> released (freed: read, aborted or expired)."""

    finished: float
    held: float
    claimed: float = 0.0

    def phases(self, released: float) -> tuple[float, float, float]:
        """(finished -> held, held -> claim answered (0 if none: the phase ends at release), -> released)."""
        claimed = self.claimed or released
        return max(0.0, self.held - self.finished), max(0.0, claimed - self.held), max(0.0, released - claimed)


class HoldTimeline:
    """Held requests' timelines, and the phases of the last MAX_TIMELINES released since `take`."""

    def __init__(self) -> None:
        self._times: dict[str, HoldTimes] = {}
        self._phases: list[tuple[float, float, float]] = []

    def held(self, request_id: str, finished: float, now: float) -> None:
        self._times[request_id] = HoldTimes(finished, now)

    def claimed(self, request_id: str, now: float) -> None:
        """A claim of `request_id` was granted (the first one ends its claim phase)."""
        times = self._times.get(request_id)
        if times is not None and not times.claimed:
            times.claimed = now

    def released(self, request_ids: Iterable[str], now: float) -> None:
        for request_id in request_ids:
            if (times := self._times.pop(request_id, None)) is not None:
                self._phases.append(times.phases(now))
        del self._phases[:-MAX_TIMELINES]  # nobody takes them (a harness without vLLM): keep the last

    def take(self) -> list[tuple[float, float, float]]:
        """The phases of the requests released since the last call."""
        out, self._phases = self._phases, []
        return out
