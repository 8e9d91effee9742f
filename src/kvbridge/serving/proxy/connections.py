"""Client connections: a deadline and a size bound for each request's head (request line and headers).

uvicorn closes a connection that idles between requests (`timeout_keep_alive`) but has no deadline for a head
that arrives slowly: any byte cancels its keep-alive timer, so a client sending one byte every few seconds holds
a connection (a file descriptor) for ever (slowloris; review 2026-12-01 §6, probe X5). This is uvicorn's h11
protocol with one more timer, armed when a connection opens and after each response, disarmed once a request's
head has been read, and closing the connection when it fires first. The body has its own deadline in the app
(`body_timeout_s`).

h11's `max_incomplete_event_size` bounds only a head still incomplete in its buffer: a head that arrives whole
in one read (up to asyncio's 256 KiB) passes whatever its size. The connection here also measures each parsed
head and refuses one over the bound with uvicorn's 400 and a close.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("kvbridge.serving.proxy")


def head_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's `H11Protocol` with a head deadline of `timeout_s` (pass as `uvicorn.Config(http=...)`)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedHeadConnection(h11.Connection):
        def next_event(self) -> Any:
            event = super().next_event()
            if type(event) is h11.Request and head_bytes(event) > self._max_incomplete_event_size:
                raise h11.RemoteProtocolError("request head too large")
            return event

    class HeadTimeoutH11Protocol(H11Protocol):
        _head_timer: Any = None

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            self.conn = BoundedHeadConnection(h11.SERVER, self.conn._max_incomplete_event_size)

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


def head_bytes(request: Any) -> int:
    """The size of an h11 request's head as sent: request line and header lines."""
    line = len(request.method) + len(request.target) + len(b"HTTP/1.1") + 4
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers.raw_items())
