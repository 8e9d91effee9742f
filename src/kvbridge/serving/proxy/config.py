"""The proxy's settings: one frozen dataclass that validates itself (ConfigError names the field and its value).

The client-facing bounds default to values safe on a public port (review 2026-12-01, §6): a slow client is cut
after `head_timeout_s` / `body_timeout_s`, bodies are at most 1 MiB, at most `max_inflight` requests are handled
and `max_client_connections` connections served at once (`max_connections_per_client` of them from one client
address), and one request fans out to at most
`max_prompts_per_request` x `max_n` sub-requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.core.errors import ConfigError
from kvbridge.serving.proxy.balancer import Balancer


@dataclass(frozen=True)
class ProxyConfig:
    prefill: tuple[str, ...]
    """Prefill backends' base URLs (http://host:port)."""
    decode: tuple[str, ...]
    """Decode backends' base URLs."""
    connect_timeout_s: float = 5.0
    """Connecting to a backend; past it the backend is taken out of rotation (504)."""
    prefill_timeout_s: float = 300.0
    """Longest wait for the prefill leg's reply (504 after it)."""
    decode_timeout_s: float = 600.0
    """Longest wait for the decode backend's next bytes: the whole reply when not streaming, the gap
    between chunks when streaming (504, or an error event in the stream)."""
    health_interval_s: float = 1.0
    """How often backends out of rotation are probed on /health."""
    health_timeout_s: float = 2.0
    """Longest wait for one /health request's answer."""
    connect_retries: int = 1
    """Further backends of the same kind to try when a connection cannot be made."""
    max_inflight: int = 256
    """Client completion requests handled at once, counted from their arrival (reading the body included); more
    get 503 (`overloaded`) before their body is read. 0: no limit."""
    max_body_bytes: int = 1024 * 1024
    """Largest request body accepted (413 above)."""
    max_connections: int = 1000
    """Connections to all backends together (httpx pool)."""
    backend_keepalive_s: float = 0.0
    """How long a connection to a backend may idle to be reused; 0: a new connection per leg (nginx's default
    towards upstreams). Reuse races the backend's own keep-alive timeout (uvicorn: 5 s, vLLM's
    VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a backend whose event loop stalls past it closes a reused connection with the
    request already in it, and the client gets a 502. Seen in CI under load on 2 cores; on loopback a new
    connection costs well under a millisecond."""
    max_prompts_per_request: int = 64
    """Prompts in one completions request (`prompt` as a list); each is a prefill leg of its own (400 above)."""
    max_n: int = 16
    """Largest `n`; each choice is a prefill and a decode leg of its own (400 above)."""
    auth_key_file: str | None = None
    """The deployment key's file (as the connectors' `auth_key_file`), read once at start: releases of prefill
    KV are sealed with it. None: no key."""
    release_timeout_s: float = 2.0
    """Longest wait for a prefill worker to acknowledge a release."""
    head_timeout_s: float = 10.0
    """A client must send its request line and headers within this long of connecting (or of the previous
    response on a kept-alive connection); else the connection is closed."""
    body_timeout_s: float = 10.0
    """A client must send its whole body within this long of its headers (408 after it)."""
    keepalive_timeout_s: float = 5.0
    """How long an idle client connection stays open between requests (uvicorn `timeout_keep_alive`)."""
    max_header_bytes: int = 16 * 1024
    """Largest request line plus headers (uvicorn `h11_max_incomplete_event_size`; larger: 400, closed)."""
    max_client_connections: int = 1024
    """Client connections served at once (uvicorn `limit_concurrency`; requests beyond it get 503)."""
    max_connections_per_client: int = 256
    """Client connections one address may hold at once (more are answered 429 and closed), so that one client
    cannot take all of `max_client_connections`. 0: no such limit (behind a gateway, every client has its
    address: bound clients there)."""
    max_json_depth: int = 64
    """Deepest nesting of arrays and objects in a request body (400 above)."""
    max_request_id_chars: int = 128
    """A client's x-request-id longer than this, or with characters outside [A-Za-z0-9._:+/=-], is replaced
    by a fresh id (it becomes part of vLLM's request ids and logs)."""

    def __post_init__(self) -> None:
        positive = (
            "connect_timeout_s",
            "prefill_timeout_s",
            "decode_timeout_s",
            "health_interval_s",
            "health_timeout_s",
            "release_timeout_s",
            "head_timeout_s",
            "body_timeout_s",
            "keepalive_timeout_s",
            "max_body_bytes",
            "max_connections",
            "max_prompts_per_request",
            "max_n",
            "max_header_bytes",
            "max_client_connections",
            "max_json_depth",
            "max_request_id_chars",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("connect_retries", "max_inflight", "backend_keepalive_s", "max_connections_per_client"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.auth_key_file is not None and not self.auth_key_file:
            raise ConfigError("auth_key_file must be a path or None, got ''")
        Balancer(self.prefill, self.decode)  # validates the URLs
