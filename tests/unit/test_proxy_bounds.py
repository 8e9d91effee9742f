"""Bounds for clients: slow heads and bodies are cut, bodies and headers are bounded,
pathological JSON is a 400 (never a 500), connections and requests at once are limited, x-request-id is bounded,
and /health says nothing about the backends but counts. Each bound has a negative control: the same client
within the bound is served (or, for slowness, kept while the deadline is long).

Raw sockets play the slow clients; the proxy runs under the uvicorn settings `kvbridge proxy` uses.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from kvbridge.serving.proxy import ProxyConfig, uvicorn_config
from kvbridge.serving.proxy.app import Proxy
from support.proxy import BODY, FakeBackend, dead_url, proxy_for, running

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"


def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=5)


def closed_within(sock: socket.socket, seconds: float, drip: bytes = b"") -> float | None:
    """Send `drip` one byte every 0.2 s until the peer closes; the seconds it took, or None if still open."""
    t0 = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - t0 < seconds:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - t0
        if drip:
            try:
                sock.sendall(drip[:1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0
            drip = drip[1:] or drip
    return None


def test_a_head_sent_slowly_is_cut_after_head_timeout():
    p, d = FakeBackend("p"), FakeBackend("d")
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url], head_timeout_s=1.0) as (url, _):
        slow = connect(url)
        slow.sendall(HEAD)
        took = closed_within(slow, 5, drip=b"X-Slow: " + b"a" * 100)
        assert took is not None and 0.7 < took < 3, took
        # on a kept-alive connection the deadline starts again after each response
        conn = connect(url)
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in conn.recv(65536)
        conn.sendall(b"P")
        took = closed_within(conn, 5, drip=b"OST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert took is not None and took < 3, took
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 200
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url], head_timeout_s=30) as (url, _):
        slow = connect(url)  # negative control: the same client, a long deadline
        slow.sendall(HEAD)
        assert closed_within(slow, 2, drip=b"X-Slow: " + b"a" * 100) is None
        slow.close()


def test_a_body_sent_slowly_gets_408_and_the_connection_closed():
    p, d = FakeBackend("p"), FakeBackend("d")
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url], body_timeout_s=0.5) as (url, _):
        sock = connect(url)
        sock.sendall(HEAD + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        t0 = time.monotonic()
        answer = b""
        sock.settimeout(5)
        while chunk := sock.recv(65536):
            answer += chunk
        assert time.monotonic() - t0 < 3
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
        assert json.loads(body)["error"]["type"] == "timeout"
        assert p.requests == []
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 200  # negative control


def test_bodies_over_one_mib_are_refused_by_default():
    assert ProxyConfig(prefill=("http://p",), decode=("http://d",)).max_body_bytes == 1024 * 1024
    p, d = FakeBackend("p"), FakeBackend("d")
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        fits = {**BODY, "prompt": "x" * (1024 * 1024 - 200)}
        assert httpx.post(url + "/v1/completions", json=fits, timeout=30).status_code == 200
        big = {**BODY, "prompt": "x" * (1024 * 1024)}
        reply = httpx.post(url + "/v1/completions", json=big, timeout=30)
        assert reply.status_code == 413 and reply.json()["error"]["type"] == "invalid_request_error"


def nested(depth: int) -> bytes:
    """An object `depth` deep in all (the body itself is level 1)."""
    inner = "[" * (depth - 1) + "]" * (depth - 1)
    return ('{"prompt": [5, 6], "max_tokens": 2, "x": ' + inner + "}").encode()


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,
        nested(65),
        b'{"prompt": [1], "temperature": NaN}',
        b'{"prompt": [1], "temperature": Infinity}',
        b'{"prompt": [1], "temperature": -Infinity}',
        b'{"prompt": [1], "temperature": 1e999}',
        b'{"prompt": [1], "seed": ' + b"9" * 5000 + b"}",
        b"[1, 2]",
        b'"prompt"',
        b'{"prompt": "\xff"}',
        b"{nope",
        b"",
    ],
    ids=[
        "deep-100000",
        "deep-65",
        "nan",
        "inf",
        "-inf",
        "1e999",
        "5000-digits",
        "array",
        "string",
        "utf8",
        "bad",
        "empty",
    ],
)
def test_pathological_json_is_a_400_json_error(raw):
    p, d = FakeBackend("p"), FakeBackend("d")
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        reply = httpx.post(url + "/v1/completions", content=raw, timeout=10)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["type"] == "invalid_request_error"
        assert p.requests == []
        # negative control: 64 deep is served
        assert httpx.post(url + "/v1/completions", content=nested(64), timeout=10).status_code == 200


def test_x_request_id_is_bounded():
    p, d = FakeBackend("p"), FakeBackend("d")
    ok = "req-" + "a" * 124  # 128 characters
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        reply = httpx.post(url + "/v1/completions", json=BODY, headers={"x-request-id": ok}, timeout=10)
        assert reply.headers["x-request-id"] == ok  # negative control: a plain id of 128 chars is kept
        assert [h["x-request-id"] for h in p.headers + d.headers] == [ok, ok]
        for bad in (ok + "b", "a b", "x;rm -rf", "é".encode("latin-1")):
            p.headers.clear()
            reply = httpx.post(url + "/v1/completions", json=BODY, headers={"x-request-id": bad}, timeout=10)
            fresh = reply.headers["x-request-id"]
            assert fresh not in (bad, "é") and len(fresh) == 32 and int(fresh, 16) >= 0
            assert p.headers[0]["x-request-id"] == d.headers[-1]["x-request-id"] == fresh


def test_health_shows_counts_only_and_the_details_go_to_the_log(caplog):
    down = dead_url()
    p, d = FakeBackend("p"), FakeBackend("d")
    with (
        caplog.at_level(logging.WARNING, logger="kvbridge.serving.proxy"),
        running(p, d) as (ps, ds),
        proxy_for([down, ps.url], [ds.url], connect_retries=0, health_interval_s=60) as (url, _),
    ):
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 502
        reply = httpx.get(url + "/health", timeout=5)
        assert reply.status_code == 200
        doc = reply.json()
        assert doc["backends"] == {"prefill": {"up": 1, "total": 2}, "decode": {"up": 1, "total": 1}}
        for secret in (down, ps.url, ds.url, "127.0.0.1", "ConnectError", "refused"):
            assert secret not in reply.text
    assert down in caplog.text and "ConnectError" in caplog.text  # negative control: the details exist, in the log


def test_client_connections_are_limited():
    p, d = FakeBackend("p"), FakeBackend("d")
    for limit, status in ((3, 503), (6, 200)):  # 3 idle connections held, then one request
        with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url], max_client_connections=limit) as (url, _):
            idle = [connect(url) for _ in range(3)]
            time.sleep(0.2)  # accepted by the server
            try:
                assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == status
            finally:
                for sock in idle:
                    sock.close()


def post_from(url: str, address: str) -> httpx.Response:
    """A completion request from the loopback `address` (any 127.x.y.z is this machine: another client)."""
    with httpx.Client(transport=httpx.HTTPTransport(local_address=address)) as client:
        return client.post(url + "/v1/completions", json=BODY, timeout=10)


def test_connections_per_client_address_are_limited():
    """Three idle connections from 127.0.0.1 with a limit of 3: its next one gets a JSON 429 and is closed, while
    another address is served; once they close, 127.0.0.1 is served again. The negative control: with the limit
    off (0), the same fourth connection is served."""
    p, d = FakeBackend("p"), FakeBackend("d")
    for limit, status in ((3, 429), (0, 200)):
        with (
            running(p, d) as (ps, ds),
            proxy_for([ps.url], [ds.url], max_connections_per_client=limit) as (url, _),
        ):
            idle = [connect(url) for _ in range(3)]
            try:
                time.sleep(0.2)  # accepted by the server
                reply = post_from(url, "127.0.0.1")
                assert reply.status_code == status, reply.text
                if status == 429:
                    assert reply.json()["error"]["type"] == "too_many_connections"
                    assert reply.headers["connection"] == "close"
                    assert post_from(url, "127.0.0.2").status_code == 200, "another client is not limited"
            finally:
                for sock in idle:
                    sock.close()
            deadline = time.monotonic() + 5
            while post_from(url, "127.0.0.1").status_code != 200:  # their count is given back
                assert time.monotonic() < deadline, "closed connections still count"
                time.sleep(0.1)


def test_metrics_name_backends_and_never_show_their_urls():
    """/metrics needs no authentication, like /health: backends are labelled prefill-0, decode-0, and no URL (nor
    its host or port) appears; the names are mapped to URLs only in the proxy's start-up output and log."""
    p, d = FakeBackend("p"), FakeBackend("d")
    down = dead_url()
    with running(p, d) as (ps, ds), proxy_for([down, ps.url], [ds.url], health_interval_s=60) as (url, _):
        for _ in range(2):  # one reaches the down backend and is retried on the live one
            assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 200
        text = httpx.get(url + "/metrics", timeout=5).text
        assert 'backend="prefill-1"' in text and 'backend="decode-0"' in text  # the control: backends are there
        assert 'kvbridge_proxy_leg_failures_total{backend="prefill-0",leg="prefill",reason="connect"} 1.0' in text
        for secret in (down, ps.url, ds.url, urlsplit(ps.url).netloc, "127.0.0.1"):
            assert secret not in text


def test_headers_are_bounded():
    p, d = FakeBackend("p"), FakeBackend("d")
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url], max_header_bytes=8192) as (url, _):
        fits = httpx.post(url + "/v1/completions", json=BODY, headers={"x-big": "a" * 4000}, timeout=10)
        assert fits.status_code == 200
        # whole in one write, then in pieces
        for pieces in (1, 8):
            sock = connect(url)
            head = HEAD + b"X-Big: " + b"a" * 20000 + b"\r\n\r\n"
            t0 = time.monotonic()
            for i in range(pieces):
                try:
                    sock.sendall(head[i * len(head) // pieces : (i + 1) * len(head) // pieces])
                except (BrokenPipeError, ConnectionResetError):
                    break
            sock.settimeout(10)
            answer, reset = b"", False
            try:
                while chunk := sock.recv(65536):
                    answer += chunk
            except ConnectionResetError:  # closed with our later pieces unread: the kernel resets, maybe before
                reset = True  # the 400 is read
            # refused by the connection and closed at once, not answered by the app and kept alive (the app's
            # answer to this body-less request would be a JSON 400 on a kept-alive connection)
            refused = answer.startswith(b"HTTP/1.1 400") and b"connection: close" in answer.lower()
            assert refused or (reset and not answer), (pieces, answer[:100])
            assert time.monotonic() - t0 < 2.5, pieces
            sock.close()
        assert p.requests[1:] == []


def test_safe_defaults_reach_uvicorn_and_the_command_line_sets_them():
    import argparse

    from kvbridge.serving.proxy import add_arguments, config_from_args

    config = ProxyConfig(prefill=("http://p",), decode=("http://d",))
    assert (config.max_inflight, config.max_body_bytes, config.max_json_depth) == (256, 1024 * 1024, 64)
    assert (config.head_timeout_s, config.body_timeout_s, config.max_request_id_chars) == (10.0, 10.0, 128)
    uv = uvicorn_config(Proxy(config))
    assert (uv.limit_concurrency, uv.timeout_keep_alive) == (1024, 5.0)
    assert config.max_header_bytes == 16384
    assert config.max_connections_per_client == 256
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--prefill", "http://p", "--decode", "http://d", "--head-timeout", "3", "--body-timeout", "4"]
    argv += ["--keepalive-timeout", "2", "--max-header-bytes", "4096", "--max-client-connections", "9"]
    argv += ["--max-json-depth", "8", "--max-request-id-chars", "40", "--max-inflight", "7", "--max-body-bytes", "99"]
    argv += ["--max-connections-per-client", "5"]
    args = parser.parse_args(argv)
    got = config_from_args(args)
    assert got.max_connections_per_client == 5
    assert (got.head_timeout_s, got.body_timeout_s, got.keepalive_timeout_s) == (3, 4, 2)
    assert (got.max_header_bytes, got.max_client_connections, got.max_json_depth) == (4096, 9, 8)
    assert (got.max_request_id_chars, got.max_inflight, got.max_body_bytes) == (40, 7, 99)
