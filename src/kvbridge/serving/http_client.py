"""HTTP calls to a vLLM OpenAI server (httpx) and its Prometheus metrics (`prometheus_client.parser`): greedy
completions by token ids, plain and streamed (server-sent events), and /metrics as {series: value}.

A server that cannot be reached, or does not answer in time, raises an OSError (`ServerUnreachable`, a
ConnectionError, or TimeoutError); an answer with an error status raises `RequestFailed` with the status and body.

Every call passes one SSL context, built once (`_tls`): httpx builds a new one per call otherwise, loading the CA
bundle each time, about 40 ms of CPU; a server's /health polled every 0.5 s while it starts then cost a tenth of a
core that its start-up on a 2-core machine needs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import ssl
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


class RequestFailed(RuntimeError):
    """An HTTP request to a server returned an error status."""

    def __init__(self, url: str, status: int, body: str, method: str = "POST") -> None:
        self.url = url
        self.status = status
        self.body = body
        super().__init__(f"{method} {url} -> HTTP {status}: {body[:2000]}")


class ServerUnreachable(ConnectionError):
    """No HTTP answer from a server: refused, reset or cut (an OSError, so `except OSError` still catches it)."""


@functools.cache
def _tls() -> ssl.SSLContext:
    """httpx's default SSL context (the CA bundle, and SSL_CERT_FILE / SSL_CERT_DIR if set), built once."""
    return httpx.create_ssl_context()


@contextlib.contextmanager
def _transport_errors(url: str) -> Iterator[None]:
    """httpx's transport errors as OSErrors: TimeoutError for a timeout, `ServerUnreachable` for the others."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise TimeoutError(f"{url}: {exc!r}") from exc
    except httpx.TransportError as exc:
        raise ServerUnreachable(f"{url}: {exc!r}") from exc


def is_healthy(url: str, timeout: float = 2.0) -> bool:
    """Whether GET /health answers 200."""
    try:
        return httpx.get(url.rstrip("/") + "/health", timeout=timeout, verify=_tls()).status_code == 200
    except httpx.HTTPError:
        return False


def post_json(url: str, body: Mapping[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    """POST `body` as JSON and return the parsed JSON reply; RequestFailed on an HTTP error status."""
    with _transport_errors(url):
        response = httpx.post(url, json=dict(body), timeout=timeout, verify=_tls())
    if response.status_code >= 400:
        raise RequestFailed(url, response.status_code, response.text)
    return response.json()


def _completion_body(
    prompt_token_ids: Sequence[int], max_tokens: int, kv_transfer_params: Mapping[str, Any] | None, **fields: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": [int(t) for t in prompt_token_ids],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    body.update(fields)
    return body


def complete(
    url: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    **fields: Any,
) -> dict[str, Any]:
    """Greedy `/v1/completions` for one prompt given as token ids; returns the parsed JSON reply.

    The reply's `choices[0]["token_ids"]` are the generated ids (`return_token_ids`), and its top-level
    `kv_transfer_params` is what the server's connector returned from `request_finished`.
    `fields` are added to the request body (e.g. `ignore_eos=True`, `min_tokens=...`).
    """
    body = _completion_body(prompt_token_ids, max_tokens, kv_transfer_params, **fields)
    return post_json(url.rstrip("/") + "/v1/completions", body, timeout=timeout)


def complete_streaming(
    url: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    kv_transfer_params: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    **fields: Any,
) -> tuple[list[int], float]:
    """Greedy streaming `/v1/completions`; returns (generated token ids, seconds to the first token). `fields`
    are added to the request body (e.g. `cache_salt="..."`). An error status, or an error event in the stream
    (how vLLM ends a stream whose generation failed), raises RequestFailed."""
    body = _completion_body(prompt_token_ids, max_tokens, kv_transfer_params, stream=True, **fields)
    target = url.rstrip("/") + "/v1/completions"
    start = time.monotonic()
    first: float | None = None
    tokens: list[int] = []
    with _transport_errors(target), httpx.stream("POST", target, json=body, timeout=timeout, verify=_tls()) as response:
        if response.status_code >= 400:
            raise RequestFailed(target, response.status_code, response.read().decode(errors="replace"))
        for line in response.iter_lines():
            line = line.strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:  # vLLM's error after the 200 (a generation error, e.g. a KV load that failed)
                raise RequestFailed(target, _error_code(event["error"]), json.dumps(event["error"]))
            for choice in event.get("choices", ()):
                ids = choice.get("token_ids") or []
                if ids and first is None:
                    first = time.monotonic() - start
                tokens.extend(ids)
    return tokens, first if first is not None else time.monotonic() - start


def _error_code(error: Any) -> int:
    """The HTTP status an error event of a stream names (vLLM's `{"error": {"code": 500, ...}}`), else 500."""
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else 500


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(sample name, labels, value) of every sample; a text the parser refuses is read line by line, skipping
    the lines it refuses."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        families = []
        for line in text.splitlines():
            with contextlib.suppress(ValueError):
                families += list(text_string_to_metric_families(line + "\n"))
    for family in families:
        for sample in family.samples:
            yield sample.name, sample.labels, sample.value


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> {series: value}, series as `name{a="x",b="y"}` with labels sorted
    (`name` alone when there are none). Comments and unparsable lines are skipped."""
    out: dict[str, float] = {}
    for name, labels, value in _samples(text):
        pairs = sorted(labels.items())
        out[name + ("{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}" if pairs else "")] = value
    return out


def metrics(url: str, timeout: float = 10.0) -> dict[str, float]:
    """GET /metrics from a server and parse it with `parse_prometheus`."""
    target = url.rstrip("/") + "/metrics"
    with _transport_errors(target):
        response = httpx.get(target, timeout=timeout, verify=_tls())
    if response.status_code >= 400:
        raise RequestFailed(target, response.status_code, response.text, "GET")
    return parse_prometheus(response.text)


def series_labels(series: str) -> tuple[str, dict[str, str]]:
    """Split a series key from `parse_prometheus` into its name and labels."""
    name, _, rest = series.partition("{")
    unescape = re.compile(r"\\[\\\"n]")
    return name, {k: unescape.sub(lambda m: _UNESCAPE[m.group(0)], v) for k, v in _LABEL.findall(rest)}


def metric_sum(samples: Mapping[str, float], name: str, **labels: str) -> float:
    """Sum of every series called `name` whose labels include `labels` (0.0 if none), e.g.
    `metric_sum(m, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")`."""
    total = 0.0
    for series, value in samples.items():
        series_name, series_lbls = series_labels(series)
        if series_name == name and all(series_lbls.get(k) == v for k, v in labels.items()):
            total += value
    return total
