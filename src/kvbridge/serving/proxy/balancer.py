"""Which backend serves the next leg: pure bookkeeping over the configured backends, no I/O and no clock.

The HTTP side calls `acquire` / `release` around each leg and `mark_down` / `mark_up` on failures and
recoveries (`health.py`); keeping the state here, apart from the I/O, is what lets the tests drive it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge.core.errors import ConfigError

PREFILL = "prefill"
DECODE = "decode"
KINDS = (PREFILL, DECODE)


class NoBackendError(Exception):
    """No backend of `kind` is in rotation."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        super().__init__(f"no {kind} backend is up")


@dataclass(eq=False)
class Backend:
    """One upstream server as the balancer sees it. Identity is the object: the same URL may be listed both
    as a prefill and as a decode backend (a kv_both server), and is then two backends."""

    url: str
    kind: str
    index: int
    up: bool = True
    outstanding: int = 0
    """Requests picked for this backend and not yet released."""
    picks: int = 0
    """Requests ever picked for it."""
    last_pick: int = -1
    """When it was last picked (the balancer's pick count then): ties go to the least recently picked."""
    last_error: str | None = None

    @property
    def name(self) -> str:
        """How clients and the metrics see this backend ("prefill-0"): its URL stays in the log."""
        return f"{self.kind}-{self.index}"


class Balancer:
    """The up backend of the kind with the fewest outstanding requests (ties: the least recently picked, so
    idle backends take turns)."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str]) -> None:
        self._backends: dict[str, list[Backend]] = {}
        for kind, urls in ((PREFILL, prefill), (DECODE, decode)):
            normalized = [normalize_url(u) for u in urls]
            if not normalized:
                raise ConfigError(f"at least one {kind} backend is needed")
            dupes = sorted({u for u in normalized if normalized.count(u) > 1})
            if dupes:
                raise ConfigError(f"{kind} backend listed twice: {', '.join(dupes)}")
            self._backends[kind] = [Backend(url, kind, i) for i, url in enumerate(normalized)]
        self._picks = 0

    def backends(self, kind: str | None = None) -> list[Backend]:
        if kind is None:
            return [b for k in KINDS for b in self._backends[k]]
        return list(self._backends[kind])

    def up(self, kind: str) -> list[Backend]:
        return [b for b in self._backends[kind] if b.up]

    def down(self) -> list[Backend]:
        return [b for b in self.backends() if not b.up]

    def pick(self, kind: str) -> Backend:
        """The backend the next leg of `kind` should go to (does not count it: see `acquire`)."""
        candidates = self.up(kind)
        if not candidates:
            raise NoBackendError(kind)
        return min(candidates, key=lambda b: (b.outstanding, b.last_pick, b.index))

    def acquire(self, kind: str) -> Backend:
        """Pick a backend and count one outstanding request on it; pair with `release`."""
        return self.take(self.pick(kind))

    def take(self, backend: Backend) -> Backend:
        """Count one outstanding request on `backend` (chosen by the caller); pair with `release`."""
        backend.outstanding += 1
        backend.picks += 1
        backend.last_pick = self._picks
        self._picks += 1
        return backend

    def release(self, backend: Backend) -> None:
        if backend.outstanding <= 0:
            raise ValueError(f"release of {backend.kind} backend {backend.url} with no outstanding request")
        backend.outstanding -= 1

    def mark_down(self, backend: Backend, reason: str) -> bool:
        """Take `backend` out of rotation; True if it was up (the caller then logs it)."""
        was_up = backend.up
        backend.up = False
        backend.last_error = reason
        return was_up

    def mark_up(self, backend: Backend) -> bool:
        """Put `backend` back in rotation; True if it was down."""
        was_down = not backend.up
        backend.up = True
        return was_down


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise ConfigError(f"backend URL must look like http://host:port, got {url!r}")
    return url
