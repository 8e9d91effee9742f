"""Client connections: a deadline and a size bound for each request's head (request line and headers), and a
bound on the connections one client address holds at once.

uvicorn closes a connection that idles between requests (`timeout_keep_alive`) but has no deadline for a head
that arrives slowly: any byte cancels its keep-alive timer, so a client sending one byte every few seconds holds
a connection (a file descriptor) for ever (slowloris). This is uvicorn's h11
protocol with one more timer, armed when a connection opens and after each response, disarmed once a request's
head has been read, and closing the connection when it fires first. The body has its own deadline in the app
(`body_timeout_s`).

h11's `max_incomplete_event_size` bounds only a head still incomplete in its buffer: a head that arrives whole
in one read (up to asyncio's 256 KiB) passes whatever its size. The connection here also measures each parsed
head and refuses one over the bound with uvicorn's 400 and a close.

uvicorn's `limit_concurrency` counts every client together, so one address could hold all of them and shut
everyone else out. Here a connection beyond `max_per_client` from one address is answered `429` (JSON) at once
and closed: what it sends is read and dropped, never parsed or handed to the app.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from kvbridge.serving.proxy.errors import error_json

log = logging.getLogger("kvbridge.serving.proxy")

OVER_LIMIT_LINGER_S = 1.0
"""How long a refused connection stays open, its request read and dropped, before it is closed: closing with
unread data would reset the connection, and the client could lose the 429 on the way."""


def too_many_connections(limit: int) -> bytes:
    """The whole HTTP response a connection over the per-client limit gets."""
    body = error_json(429, "too_many_connections", f"this client has {limit} connections open already")
    head = (
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def head_timeout_protocol(timeout_s: float, max_per_client: int = 0) -> type:
    """uvicorn's `H11Protocol` with a head deadline of `timeout_s` and at most `max_per_client` connections per
    client address (0: no such limit); pass as `uvicorn.Config(http=...)`. Each call has its own counts."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    open_per_client: Counter[str] = Counter()

    class BoundedHeadConnection(h11.Connection):
        def next_event(self) -> Any:
            event = super().next_event()
            if type(event) is h11.Request and head_bytes(event) > self._max_incomplete_event_size:
                raise h11.RemoteProtocolError("request head too large")
            return event

    class HeadTimeoutH11Protocol(H11Protocol):
        _head_timer: Any = None
        _counted: str | None = None
        _refused = False

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            self.conn = BoundedHeadConnection(h11.SERVER, self.conn._max_incomplete_event_size)

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            address = self.client[0] if self.client else None
            if max_per_client and address is not None:
                if open_per_client[address] >= max_per_client:
                    self._refuse(address)
                    return
                open_per_client[address] += 1
                self._counted = address
            self._arm()

        def _refuse(self, address: str) -> None:
            self._refused = True
            log.info(
                "refusing a connection from %s: %d open already (max_connections_per_client)", address, max_per_client
            )
            self.transport.write(too_many_connections(max_per_client))
            self._head_timer = self.loop.call_later(OVER_LIMIT_LINGER_S, self.transport.close)

        def data_received(self, data: bytes) -> None:
            if self._refused:  # dropped unread; the linger timer closes the connection
                return
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self._refused:
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._counted is not None:
                open_per_client[self._counted] -= 1
                if open_per_client[self._counted] <= 0:
                    del open_per_client[self._counted]
                self._counted = None
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
