"""One client completion request in flight, and the state of the reply sent to it (ASGI `send` wrapped so that
the proxy knows whether a status went out, whether the reply is complete and whether the client left)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


class Call:
    def __init__(self, send: Any, path: str, headers: dict[str, str]) -> None:
        self._send = send
        self.path = path
        self.chat = path == CHAT_COMPLETIONS
        self.body: dict[str, Any] = {}
        """The client's request, once read."""
        self.headers = headers
        """Forwarded to both legs (x-request-id, authorization)."""
        self.arrived = time.monotonic()
        self.status = 0
        """Status sent to the client (0: nothing sent yet)."""
        self.done = False
        """The reply is complete."""
        self.disconnected = False
        """The client went away before the reply was complete."""
        self.routed: dict[int, tuple[Any, float]] = {}
        """Sub-requests (by index) routed whose first token has not come yet: their route and when it was made."""
        self.queued: dict[int, Any] = {}
        """Sub-requests (by index) whose compute is in the router's queues (Router.settle): their route."""

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def request_id(self) -> str:
        return self.headers["x-request-id"]

    @property
    def started(self) -> bool:
        """A status went out: errors from now on can only be written into the body."""
        return self.status != 0

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif not message.get("more_body", False):
            self.done = True
        await self._send(message)

    async def reply(
        self, status: int, body: bytes, content_type: str = "application/json", close: bool = False
    ) -> None:
        await reply(self.send, status, body, self.request_id, content_type, close)

    async def start_stream(self, status: int, content_type: str) -> None:
        headers = [
            (b"content-type", content_type.encode("latin-1")),
            (b"cache-control", b"no-cache"),
            (b"x-request-id", self.request_id.encode("latin-1")),
        ]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, chunk: bytes) -> None:
        await self.send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self, chunk: bytes = b"") -> None:
        await self.send({"type": "http.response.body", "body": chunk})


async def reply(
    send: Any, status: int, body: bytes, request_id: str, content_type: str = "application/json", close: bool = False
) -> None:
    """A whole reply; `close`: ask the server to close the connection after it (the body may be unread)."""
    headers = [
        (b"content-type", content_type.encode("latin-1")),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode("latin-1")),
    ]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def watch_client(receive: Any, call: Call, cancel_scope: Any) -> None:
    """Wait for the client to go away; if the reply is not complete then, cancel the legs in flight."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
    if not call.done:
        call.disconnected = True
        cancel_scope.cancel()


async def close_shielded(resp: httpx.Response) -> None:
    """Close an upstream response, also while being cancelled (the client went away): closing a response
    whose body is unread drops its connection, and vLLM then aborts the request."""
    import anyio

    with anyio.CancelScope(shield=True):
        await resp.aclose()
