"""`Backoff`: how every poll in kvbridge waits (NIXL transfers and notifications, claims, pipes) without spinning."""

from __future__ import annotations

import time


class Backoff:
    """Sleeps between polls: short at first (transfers finish in micro- to milliseconds), doubling up to a
    cap, so waiting on an idle peer costs almost no CPU. `reset()` after something happened."""

    def __init__(self, first_s: float = 50e-6, cap_s: float = 5e-3) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self.delay_s = first_s

    def step(self) -> float:
        """The delay to wait now (for callers that wait on something else, e.g. a pipe); doubles the next."""
        delay = self.delay_s
        self.delay_s = min(self.cap_s, self.delay_s * 2)
        return delay

    def sleep(self) -> None:
        time.sleep(self.step())

    def reset(self) -> None:
        self.delay_s = self.first_s
