"""Freeing the KV a prefill leg left held when its decode leg will not read it.

A successful prefill leg leaves the prompt's blocks held on the prefill instance until a decode instance reads
them, or until the lease runs out (`lease_s`, 60 s by default). When the decode leg fails before reading (decode
down, 4xx/5xx, timeout), never happens (the client went away, a sibling sub-request failed) or is cancelled
before its first byte, the flow calls `release`, which sends the prefill an Abort
(`kvbridge.wire.release.release_prefill`) at once.

A decode reply that has begun means the decode server has read the KV (vLLM emits nothing for a request before
its KV is loaded): a release then could free blocks under a reader's feet, so `Hold.consumed` stops it.

`release_prefill` does blocking socket I/O, so it runs in a worker thread (`anyio.to_thread`), in a task of its own:
the client's error reply does not wait for it, and the event loop never blocks. It never raises by contract;
anything it does raise is counted as `error`. Outcomes in `kvbridge_proxy_prefill_releases_total{outcome}`:
`released` (a prefill worker took it), `not_taken` (none did: gone, already freed, refused), `error`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from kvbridge.serving.proxy.metrics import ProxyMetrics

log = logging.getLogger("kvbridge.serving.proxy")


class Hold:
    """One prefill's params, while its decode leg has not read them."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.params = params
        self.consumed = False
        """The decode reply began: the KV was read, nothing to release."""


class Releaser:
    def __init__(self, metrics: ProxyMetrics, timeout_s: float) -> None:
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.key: bytes | None = None
        """The deployment key (`auth_key_file`), set by `Proxy.start()`."""
        self._tasks: set[asyncio.Task[None]] = set()

    @contextlib.contextmanager
    def hold(self, params: Mapping[str, Any], what: str) -> Iterator[Hold]:
        """Release `params` on the way out unless the block marked them consumed (also when cancelled)."""
        held = Hold(params)
        try:
            yield held
        except BaseException as exc:
            if not held.consumed:
                self.release(params, f"{what}: {type(exc).__name__}")
            raise
        if not held.consumed:
            self.release(params, f"{what}: its decode leg did not read it")

    def release(self, params: Mapping[str, Any], reason: str) -> None:
        """Start releasing `params` (returns at once)."""
        task = asyncio.get_running_loop().create_task(self._release(dict(params), reason))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the releases under way (at shutdown): each is bounded by its timeout."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.timeout_s + 5)

    async def _release(self, params: dict[str, Any], reason: str) -> None:
        import anyio

        request = params.get("remote_request_id")
        try:
            taken = await anyio.to_thread.run_sync(_release_prefill, params, self.key, self.timeout_s)
        except Exception:
            log.exception("releasing prefill request %s (%s) failed", request, reason)
            outcome = "error"
        else:
            outcome = "released" if taken > 0 else "not_taken"
            log.info("released prefill request %s (%s): %d workers took it", request, reason, taken)
        self.metrics.prefill_releases.labels(outcome).inc()


def _release_prefill(params: dict[str, Any], key: bytes | None, timeout_s: float) -> int:
    from kvbridge.wire.release import release_prefill  # here: the proxy must start without the wire stack's imports

    return release_prefill(params, key, timeout_s)


def read_auth_key(path: str | None) -> bytes | None:
    """The deployment key from `path` (bytes, surrounding whitespace stripped); None without a path."""
    from kvbridge.core.errors import ConfigError

    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read auth_key_file {path}: {exc.strerror}") from None
    if not key:
        raise ConfigError(f"auth_key_file {path} is empty")
    from kvbridge.wire.keys import check_strength

    return check_strength(key, f"auth_key_file {path}")
