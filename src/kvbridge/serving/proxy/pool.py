"""Connections to the backends: kept open between legs, and a request whose kept connection breaks before any
answer is sent again, once, on a new connection.

A new connection per leg costs a TCP handshake and a connection set up by the backend's server for every leg
(about 0.7 ms of the proxy's time to a first byte, `bench/proxy_overhead.py`). A kept connection races the
backend's own keep-alive timeout (uvicorn's and vLLM's: 5 s): a backend that closes an idle connection as a
request arrives on it (its timer fired, or its event loop was stalled past it) answers nothing, and the proxy
reads the close before any byte of an answer. Such a request never reached the backend's app, so it is sent
again on a new connection; one that got any byte of an answer is never sent again. `keepalive_s` below the
backends' timeout makes the race rare; the resend makes it harmless.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

Broken = Callable[[httpx.Request, Exception], None]
"""Told of each request sent again: the request and what broke its kept connection."""


def backend_transport(max_connections: int, keepalive_s: float, resent: Broken) -> httpx.AsyncBaseTransport:
    """The proxy's transport to its backends: connections kept `keepalive_s` (0: a new one per request, no
    resend), at most `max_connections` open."""
    if not keepalive_s:
        return new_connection_per_request(max_connections)
    return ResendOnBrokenKeptConnection(max_connections, keepalive_s, resent)


def new_connection_per_request(max_connections: int) -> httpx.AsyncHTTPTransport:
    """A transport that keeps no connection: each request opens its own."""
    return httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=0))


class ResendOnBrokenKeptConnection(httpx.AsyncBaseTransport):
    """Kept connections (`kept`), and new ones for requests sent again (`fresh`)."""

    def __init__(self, max_connections: int, keepalive_s: float, resent: Broken) -> None:
        self.kept = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=min(max_connections, 100),
                keepalive_expiry=keepalive_s,
            )
        )
        self.fresh = new_connection_per_request(max_connections)
        self.resent = resent

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self.kept.handle_async_request(request)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            # closed or reset before the answer's first byte (the response is returned at its head): sent again
            self.resent(request, exc)
            return await self.fresh.handle_async_request(request)

    async def aclose(self) -> None:
        try:
            await self.kept.aclose()
        finally:
            await self.fresh.aclose()
