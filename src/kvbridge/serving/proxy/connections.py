"""Client connections: a deadline and a size bound for each request's head (request line and headers), and a
bound on the connections one client address holds at once.

uvicorn closes a connection that idles between requests (`timeout_keep_alive`) but has no deadline for a head
that arrives slowly: any byte cancels its keep-alive timer, so a client sending one byte every few seconds holds
a connection (a file descriptor) for ever (slowloris). This is uvicorn's httptools protocol (llhttp, a parser in
C) with one more timer, armed when a connection opens and after each response, disarmed once a request's head has
been parsed, and closing the connection when it fires first. The body has its own deadline in the app
(`body_timeout_s`).

llhttp bounds no head. The connection here counts each head's bytes as the parser hands them over (request line
and header lines), whether the head came in one read or in many, and refuses one over the bound with uvicorn's
400 and a close.

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

REQUEST_LINE_EXTRA = len(b"POST  HTTP/1.1\r\n")
"""What a request line holds besides its target, counted towards the head's bytes (the method's length is
counted as POST's)."""


class HeadTooLarge(Exception):
    """Raised from a parser callback: llhttp stops, and uvicorn answers 400 and closes."""


def too_many_connections(limit: int) -> bytes:
    """The whole HTTP response a connection over the per-client limit gets."""
    body = error_json(429, "too_many_connections", f"this client has {limit} connections open already")
    head = (
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def bounded_protocol(timeout_s: float, max_head_bytes: int, max_per_client: int = 0) -> type:
    """uvicorn's `HttpToolsProtocol` with a head deadline of `timeout_s`, heads of at most `max_head_bytes` and at
    most `max_per_client` connections per client address (0: no such limit); pass as `uvicorn.Config(http=...)`.
    Each call has its own counts."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    open_per_client: Counter[str] = Counter()

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _head_timer: Any = None
        _counted: str | None = None
        _refused = False
        _head_bytes = 0
        _in_request = False  # from a whole head to its response's end: no head deadline meanwhile

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

        # parser callbacks: count the head, stop the deadline once it is whole

        def on_message_begin(self) -> None:
            self._head_bytes = REQUEST_LINE_EXTRA
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_request = True
            self._disarm()
            super().on_headers_complete()

        def _count(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > max_head_bytes:
                raise HeadTooLarge(f"request head over {max_head_bytes} bytes")

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)  # the next request's head is whole already: it starts now
            super().on_response_complete()
            if not pipelined:
                self._in_request = False
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
            self._head_timer = self.loop.call_later(timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
            if not self._in_request and not self.transport.is_closing():
                log.info("closing a connection from %s: no request head within %s s", self.client, timeout_s)
                self.transport.close()

    return BoundedHttpToolsProtocol
