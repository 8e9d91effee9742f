"""Client connections: a deadline for each request's head (request line and headers).

uvicorn closes a connection that idles between requests (`timeout_keep_alive`) but has no deadline for a head
that arrives slowly: any byte cancels its keep-alive timer, so a client sending one byte every few seconds holds
a connection (a file descriptor) for ever (slowloris; review 2026-12-01 §6, probe X5). This is uvicorn's h11
protocol with one more timer, armed when a connection opens and after each response, disarmed once a request's
head has been read, and closing the connection when it fires first. The body has its own deadline in the app
(`body_timeout_s`).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvbridge.serving.proxy")


def head_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's `H11Protocol` with a head deadline of `timeout_s` (pass as `uvicorn.Config(http=...)`)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutH11Protocol(H11Protocol):
        _head_timer: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if self.conn.their_state is h11.IDLE:
                self._head_timer = self.loop.call_later(timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closing a connection from %s: no request head within %s s", self.client, timeout_s)
                self.transport.close()

    return HeadTimeoutH11Protocol
