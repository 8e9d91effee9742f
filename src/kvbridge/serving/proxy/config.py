"""The proxy's settings: one typed, frozen struct with bounds (msgspec), a docstring per field (the command line's
help is generated from them: `flags.py`); constructing one checks every field (ConfigError names the field and its
value).

The client-facing bounds default to values safe on a public port: a slow client is cut after `head_timeout_s` /
`body_timeout_s`, bodies are at most 1 MiB, at most `max_inflight` requests are handled and
`max_client_connections` connections served at once (`max_connections_per_client` of them from one client
address), and one request fans out to at most `max_prompts_per_request` x `max_n` sub-requests.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, get_type_hints

import msgspec

from kvbridge.core.errors import ConfigError
from kvbridge.serving.proxy.balancer import Balancer

Seconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]
Count = Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]
Urls = Annotated[tuple[str, ...], msgspec.Meta(min_length=1, max_length=4096)]


class ProxyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prefill: Urls
    """Prefill backends' base URLs (http://host:port)."""

    decode: Urls
    """Decode backends' base URLs."""

    connect_timeout_s: Seconds = 5.0
    """Connecting to a backend; past it the backend is taken out of rotation (504)."""

    prefill_timeout_s: Seconds = 300.0
    """Longest wait for the prefill leg's reply (504 after it)."""

    decode_timeout_s: Seconds = 600.0
    """Longest wait for the decode backend's next bytes: the whole reply when not streaming, the gap between chunks
    when streaming (504, or an error event in the stream)."""

    health_interval_s: Seconds = 1.0
    """How often backends out of rotation are probed on /health."""

    health_timeout_s: Seconds = 2.0
    """One /health probe (and one GET /v1/models or /metrics from a backend)."""

    connect_retries: Annotated[int, msgspec.Meta(ge=0, le=64)] = 1
    """Further backends of the same kind to try when a connection cannot be made."""

    max_inflight: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 256
    """Client completion requests handled at once, counted from their arrival (reading the body included); more get
    503 (`overloaded`) before their body is read. 0: no limit."""

    max_body_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)] = 1024 * 1024
    """Largest request body accepted (413 above)."""

    max_connections: Count = 1000
    """Connections to all backends together (httpx pool)."""

    backend_keepalive_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 2.0
    """How long a connection to a backend may idle to be reused; 0: a new connection per leg. Keep it below the
    backends' own keep-alive timeout (uvicorn's and vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE: 5 s). A request whose
    kept connection the backend closes before any byte of an answer (its timer fired as the request came, or its
    event loop stalled past it) is sent again once on a new connection (`kvbridge_proxy_resent_on_new_connection`):
    it never reached the backend's app."""

    max_prompts_per_request: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    """Prompts in one completions request (`prompt` as a list); each is a prefill leg of its own (400 above)."""

    max_n: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 16
    """Largest `n`; each choice is a prefill and a decode leg of its own (400 above)."""

    auth_key_file: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    """The deployment key's file (as the connectors' `auth_key_file`), read once at start: releases of prefill KV
    are sealed with it. None: no key."""

    release_timeout_s: Seconds = 2.0
    """Longest wait for a prefill worker to acknowledge a release."""

    head_timeout_s: Seconds = 10.0
    """A client must send its request line and headers within this long of connecting (or of the previous response
    on a kept-alive connection); else the connection is closed."""

    body_timeout_s: Seconds = 10.0
    """A client must send its whole body within this long of its headers (408 after it)."""

    keepalive_timeout_s: Seconds = 5.0
    """How long an idle client connection stays open between requests (uvicorn `timeout_keep_alive`)."""

    max_header_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)] = 16 * 1024
    """Largest request line plus headers, counted as the parser reads them (larger: 400, closed)."""

    max_client_connections: Count = 1024
    """Client connections served at once (uvicorn `limit_concurrency`; requests beyond it get 503)."""

    max_connections_per_client: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 256
    """Client connections one address may hold at once (more are answered 429 and closed), so that one client cannot
    take all of `max_client_connections`. 0: no such limit (behind a gateway, every client has its address: bound
    clients there)."""

    max_json_depth: Annotated[int, msgspec.Meta(ge=1, le=512)] = 64
    """Deepest nesting of arrays and objects in a request body (400 above)."""

    max_request_id_chars: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 128
    """A client's x-request-id longer than this, or with characters outside [A-Za-z0-9._:+/=-], is replaced by a
    fresh id (it becomes part of vLLM's request ids and logs)."""

    disaggregation: Literal["always", "selective"] = "always"
    """always: every request goes through a prefill instance, then a decode instance. selective: a request whose
    decode instance would compute fewer new tokens than the threshold (its prompt less the prefix that instance
    likely holds) goes straight to it (`direct_below_tokens`; docs/routing.md). The output is the same either
    way."""

    direct_below_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] | None = None
    """With selective disaggregation: a fixed threshold in new tokens (0: never direct). None: learned from the
    servers' /metrics and the proxy's own requests (prefill throughput, transfer time per token, the hop), weighing
    each instance's queue and what the prefill instance lacks of the prompt; an idle decode instance then serves a
    prompt itself when the prefill instance holds no more of it."""

    direct_initial_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] = 256
    """The learned threshold's value until the prefill throughput has been measured (a transfer time or a hop not
    measured yet counts as 0 meanwhile)."""

    metrics_interval_s: Seconds = 2.0
    """How often the proxy reads the backends' /metrics to learn the costs (selective disaggregation, learned)."""

    routing: Literal["cache_aware", "least_loaded"] = "cache_aware"
    """cache_aware: the instance that likely holds the longest prefix of the prompt (within `max_imbalance`);
    least_loaded: the instance with the fewest outstanding requests."""

    sticky: bool = True
    """cache_aware: a conversation stays on the instance holding its prefix while that instance is within
    `max_imbalance`; off: a held prefix only breaks ties between instances equally loaded."""

    max_imbalance: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 4
    """cache_aware: an instance holding the prefix is chosen while its outstanding requests exceed the least loaded
    instance's by at most this many; beyond it the least loaded instance serves (one hot prefix cannot pile onto
    one instance)."""

    prefix_block_tokens: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 16
    """Block size of the prefix index, in tokens (text: 4 characters a token)."""

    prefix_index_blocks: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)] = 65536
    """Block keys remembered per instance (16 bytes each plus overhead); the least recently routed are forgotten
    first."""

    prefix_ttl_s: Seconds = 600.0
    """A block key is forgotten this long after it was last routed to the instance (its cache has likely moved
    on)."""

    def __post_init__(self) -> None:
        for name, kind in _field_types(type(self)).items():
            value = getattr(self, name)
            try:
                msgspec.convert(value, kind, strict=True)
            except msgspec.ValidationError as exc:
                raise ConfigError(f"proxy setting {name}: {exc} (got {value!r})") from None
        Balancer(self.prefill, self.decode)  # validates the URLs

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each field's default (`prefill` and `decode` have none)."""
        info = msgspec.inspect.type_info(cls)
        return {f.name: f.default for f in info.fields if f.default is not msgspec.NODEFAULT}


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)
