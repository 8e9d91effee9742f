"""What a failed client request gets back: an OpenAI-shaped JSON error.

    LegFailed        a leg (prefill or decode) ended the client request: status + body to send
    InvalidRequest   the client's body cannot be served; raised before any leg is sent (400, names `param`)

Statuses: 400 invalid request, 408 body too slow, 413 body too large, 502 a backend refused, dropped the
connection or answered nonsense (`bad_gateway`), 503 no backend of a kind up or the proxy is full, 504 a backend
did not answer in time (`gateway_timeout`); a backend's own HTTP error is passed through unchanged.
"""

from __future__ import annotations

import json
from typing import Any


def error_json(status: int, kind: str, message: str, backend: str | None = None, param: str | None = None) -> bytes:
    """`{"error": {"message", "type", "param", "code"[, "backend"]}}`, the shape OpenAI clients parse."""
    error: dict[str, Any] = {"message": message, "type": kind, "param": param, "code": status}
    if backend is not None:
        error["backend"] = backend
    return json.dumps({"error": error}).encode()


class LegFailed(Exception):
    """A leg failed in a way that ends the client request with `status` and `body`. `retry`: nothing reached
    the backend (no connection), so another backend of the kind may be tried."""

    def __init__(self, status: int, body: bytes, content_type: str = "application/json", retry: bool = False):
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status
        self.body = body
        self.content_type = content_type
        self.retry = retry


class InvalidRequest(Exception):
    """The client's body is not one the PD flow can serve; `param` names the field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status

    def body(self) -> bytes:
        return error_json(self.status, "invalid_request_error", self.message, param=self.param)
