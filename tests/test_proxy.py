"""`kvbridge proxy` and `kvbridge serve`.

Three layers: the balancer and the request bodies as pure code; the proxy over HTTP against small fake
backends (raw ASGI apps under uvicorn, in threads, on 127.0.0.1) that record what they receive and notice
disconnects; and one test with real vLLM servers (a prefill server pp=2 and a decode server pp=1 started with
`kvbridge serve`) behind the `kvbridge proxy` command.

The fakes and helpers here are shared by test_proxy_fanout.py (lists of prompts, n, merged streams),
test_proxy_release.py (prefill KV released when its decode leg fails) and test_proxy_bounds.py (limits for
clients); test_openai_client.py runs the official client against real servers.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from kvbridge.core.errors import ConfigError
from kvbridge.serving.launcher import (
    VllmServer,
    complete,
    complete_streaming,
    ensure_key_file,
    free_base_port,
    free_port,
    metric_sum,
    metrics,
)
from kvbridge.serving.proxy import (
    Backend,
    Balancer,
    NoBackendError,
    Proxy,
    ProxyConfig,
    bind_socket,
    decode_body,
    prefill_body,
    socket_url,
    uvicorn_config,
)
from kvbridge.serving.tiny_model import build_tiny_model

# --- the balancer and the bodies (pure) -------------------------------------------------------------------


def test_least_outstanding_then_round_robin():
    b = Balancer(["http://p1", "http://p2/"], ["http://d1"])
    first, second, third = (b.acquire("prefill") for _ in range(3))
    assert [first.url, second.url, third.url] == ["http://p1", "http://p2", "http://p1"]  # trailing / dropped
    assert (first.outstanding, second.outstanding) == (2, 1)
    b.release(first)
    b.release(third)  # p1: 0 outstanding, p2: 1
    assert b.pick("prefill").url == "http://p1"
    assert b.acquire("prefill").url == "http://p1"  # 1 and 1 now: p2 was picked less recently
    assert b.acquire("prefill").url == "http://p2"
    assert b.acquire("decode").url == "http://d1"


def test_down_leaves_rotation_and_up_returns():
    b = Balancer(["http://p1", "http://p2"], ["http://d1"])
    p1, _ = b.backends("prefill")
    assert b.mark_down(p1, "ConnectError") is True
    assert b.mark_down(p1, "again") is False
    assert [b.acquire("prefill").url for _ in range(3)] == ["http://p2"] * 3
    assert b.down() == [p1] and p1.last_error == "again"
    assert b.mark_up(p1) is True and b.mark_up(p1) is False
    assert b.acquire("prefill") is p1  # fewest outstanding again


def test_all_down_raises_naming_the_kind():
    b = Balancer(["http://p1"], ["http://d1", "http://d2"])
    for d in b.backends("decode"):
        b.mark_down(d, "gone")
    with pytest.raises(NoBackendError, match="no decode backend is up") as info:
        b.acquire("decode")
    assert info.value.kind == "decode"
    assert b.acquire("prefill").url == "http://p1"


def test_same_url_as_prefill_and_decode_is_two_backends():
    b = Balancer(["http://both"], ["http://both"])
    p, d = b.backends()
    b.mark_down(p, "x")
    assert b.acquire("decode") is d


@pytest.mark.parametrize(
    ("prefill", "decode", "message"),
    [
        ([], ["http://d"], "at least one prefill backend"),
        (["http://p", "http://p/"], ["http://d"], "listed twice"),
        (["localhost:8000"], ["http://d"], "must look like http://host:port"),
    ],
)
def test_bad_backend_lists_are_refused(prefill, decode, message):
    with pytest.raises(ConfigError, match=message):
        Balancer(prefill, decode)


def test_release_without_acquire_is_an_error():
    b = Balancer(["http://p"], ["http://d"])
    with pytest.raises(ValueError, match="no outstanding"):
        b.release(b.backends("prefill")[0])


def test_prefill_and_decode_bodies():
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 9, "min_tokens": 3, "stream": True, "stream_options": {}}
    p = prefill_body(body, chat=False)
    assert p == {
        "model": "m",
        "prompt": [1, 2],
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    chat = prefill_body({"messages": [], "max_completion_tokens": 50}, chat=True)
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1
    params = {"do_remote_prefill": True, "remote_block_ids": [3]}
    assert decode_body(body, params) == {**body, "kv_transfer_params": params}
    assert body["max_tokens"] == 9 and "kv_transfer_params" not in body  # the client's body is not changed


def test_config_is_validated():
    with pytest.raises(ConfigError, match="prefill_timeout_s must be positive"):
        ProxyConfig(prefill=("http://p",), decode=("http://d",), prefill_timeout_s=0)
    with pytest.raises(ConfigError, match="connect_retries"):
        ProxyConfig(prefill=("http://p",), decode=("http://d",), connect_retries=-1)
    with pytest.raises(ConfigError, match="backend_keepalive_s"):
        ProxyConfig(prefill=("http://p",), decode=("http://d",), backend_keepalive_s=-1)


# --- fakes and servers in threads -------------------------------------------------------------------------


class ServerThread:
    """An ASGI app under uvicorn on 127.0.0.1, in a daemon thread; `config`: uvicorn settings of its own (the
    proxy's, from `uvicorn_config`)."""

    def __init__(self, app: Any, port: int = 0, config: uvicorn.Config | None = None) -> None:
        self.sock = bind_socket("127.0.0.1", port)
        self.url = socket_url(self.sock)
        if config is None:
            config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def prompt_key(body: dict[str, Any]) -> str:
    """What a leg's prompt is, as one string (the fakes' way of checking which prompt a leg carries)."""
    return json.dumps(body.get("prompt", body.get("messages")), sort_keys=True)


class FakeBackend:
    """A vLLM stand-in. A request with kv_transfer_params.do_remote_decode is a prefill leg, answered with
    kv_transfer_params naming this backend, a request id of its own (`<name>-<k>`, k counting prefill legs) and
    the prompt it prefilled; any other request is a decode leg, answered with `tokens` (as SSE when asked to
    stream, one chunk every `chunk_delay` s), one choice at index 0 that says what it was for (`for`: the
    prompt, the seed, and the prompt and request id of the params it got), and usage. It records every request
    body and notices disconnects. `fail_prompts`: prompts (as `prompt_key`) answered with `status` (400)."""

    def __init__(
        self,
        name: str,
        *,
        tokens: tuple[str, ...] = ("a", "b", "c"),
        chunk_delay: float = 0.0,
        delay: float = 0.0,
        status: int = 200,
        no_params: bool = False,
        crash_after: int | None = None,
        fail_prompts: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.tokens = tokens
        self.chunk_delay = chunk_delay
        self.delay = delay
        self.status = status
        self.no_params = no_params
        self.crash_after = crash_after
        self.fail_prompts = fail_prompts
        self.healthy = True
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.clients: list[tuple[str, int]] = []  # the connection (peer address) each request came on
        self.headers: list[dict[str, str]] = []
        self.prefills = 0
        self.sent = bytearray()
        self.disconnected = threading.Event()

    def params(self, body: dict[str, Any]) -> dict[str, Any]:
        self.prefills += 1
        return {
            "do_remote_prefill": True,
            "remote_engine_id": self.name,
            "remote_request_id": f"{self.name}-{self.prefills - 1}",
            "prompt_key": prompt_key(body),
        }

    def answer_for(self, body: dict[str, Any]) -> dict[str, Any]:
        params = body.get("kv_transfer_params") or {}
        return {
            "prompt": prompt_key(body),
            "seed": body.get("seed"),
            "params_prompt": params.get("prompt_key"),
            "request": params.get("remote_request_id"),
        }

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if scope["path"] == "/health":
            await self._json(send, 200 if self.healthy else 503, {})
            return
        if scope["path"] == "/v1/models":
            await self._json(send, 200, {"data": [{"id": self.name}]})
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = json.loads(raw)
        self.requests.append((scope["path"], body))
        self.clients.append(tuple(scope["client"]))
        self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        watcher = asyncio.create_task(self._watch(receive))
        try:
            if self.delay:
                done, _ = await asyncio.wait({watcher}, timeout=self.delay)
                if done:  # the caller went away while we were "working"
                    return
            failing = self.status != 200 and (not self.fail_prompts or prompt_key(body) in self.fail_prompts)
            if failing:
                await self._json(send, self.status, {"error": {"message": f"{self.name} says no", "code": self.status}})
            elif (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                params = None if self.no_params else self.params(body)
                await self._json(send, 200, {"choices": [{"index": 0, "text": "x"}], "kv_transfer_params": params})
            elif body.get("stream"):
                await self._stream(send, body)
            else:
                choice = {"index": 0, "text": "".join(self.tokens), "for": self.answer_for(body)}
                doc = {"id": "cmpl-1", "choices": [choice], "served_by": self.name, "usage": self.usage(body)}
                await self._json(send, 200, doc)
        finally:
            watcher.cancel()

    def usage(self, body: dict[str, Any]) -> dict[str, int]:
        prompt = len(prompt_key(body))
        return {
            "prompt_tokens": prompt,
            "completion_tokens": len(self.tokens),
            "total_tokens": prompt + len(self.tokens),
        }

    async def _watch(self, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.disconnected.set()

    async def _json(self, send: Any, status: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": data})

    async def _stream(self, send: Any, body: dict[str, Any]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for i, token in enumerate(self.tokens):
            if self.disconnected.is_set():
                return
            if i == self.crash_after:
                raise RuntimeError(f"{self.name} crashes mid-stream (on purpose)")
            choice = {"index": 0, "text": token, "n": i, "for": self.answer_for(body)}
            chunk = b"data: " + json.dumps({"id": "cmpl-1", "choices": [choice]}).encode() + b"\n\n"
            self.sent += chunk
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await asyncio.sleep(self.chunk_delay)
        if (body.get("stream_options") or {}).get("include_usage"):
            chunk = b"data: " + json.dumps({"id": "cmpl-1", "choices": [], "usage": self.usage(body)}).encode()
            self.sent += chunk + b"\n\n"
            await send({"type": "http.response.body", "body": chunk + b"\n\n", "more_body": True})
        self.sent += b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


@contextmanager
def running(*apps: Any) -> Iterator[list[ServerThread]]:
    servers: list[ServerThread] = []
    try:
        for app in apps:
            servers.append(ServerThread(app).start())
        yield servers
    finally:
        for server in servers:
            server.stop()


@contextmanager
def proxy_for(prefill: list[str], decode: list[str], **config: Any) -> Iterator[tuple[str, Proxy]]:
    """A proxy in a thread, under the uvicorn settings `kvbridge proxy` uses (its connection bounds)."""
    config.setdefault("health_interval_s", 0.1)
    proxy = Proxy(ProxyConfig(prefill=tuple(prefill), decode=tuple(decode), **config))
    uv = uvicorn_config(proxy, log_level="warning")
    uv.timeout_graceful_shutdown = 1
    server = ServerThread(None, config=uv).start()
    try:
        yield server.url, proxy
    finally:
        server.stop()


def backend(proxy: Proxy, kind: str, index: int = 0) -> Backend:
    """The proxy's view of one backend (/health shows counts only)."""
    return proxy.balancer.backends(kind)[index]


def wait_for(condition: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


BODY = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0, "return_token_ids": True}


# --- the proxy over HTTP ----------------------------------------------------------------------------------


def test_both_legs_get_the_right_bodies():
    p, d = FakeBackend("p"), FakeBackend("d")
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        reply = httpx.post(url + "/v1/completions", json=BODY, headers={"x-request-id": "r1"}, timeout=10)
        assert reply.status_code == 200, reply.text
        assert reply.json()["served_by"] == "d" and reply.headers["x-request-id"] == "r1"
        ((path, prefill),) = p.requests
        assert path == "/v1/completions"
        assert prefill == {**BODY, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        ((path, decode),) = d.requests
        params = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "p-0"}
        assert decode == {**BODY, "kv_transfer_params": {**params, "prompt_key": prompt_key(BODY)}}
        metrics = httpx.get(url + "/metrics", timeout=5).text
        assert 'kvbridge_proxy_leg_requests_total{backend="prefill-0",leg="prefill"} 1.0' in metrics
        assert 'kvbridge_proxy_backend_inflight{backend="decode-0",leg="decode"} 0.0' in metrics
        assert 'kvbridge_proxy_backend_up{backend="decode-0",leg="decode"} 1.0' in metrics
        assert 'kvbridge_proxy_requests_total{endpoint="/v1/completions",status="200"} 1.0' in metrics
        assert 'kvbridge_proxy_leg_seconds_count{leg="decode"} 1.0' in metrics
        assert httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"] == "d"


def test_chat_streaming_is_passed_through():
    p, d = FakeBackend("p"), FakeBackend("d", tokens=("he", "llo", "!"), chunk_delay=0.05)
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": {"include_usage": True}}
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as reply:
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            received = b"".join(reply.iter_raw())
        assert received == bytes(d.sent) and received.endswith(b"data: [DONE]\n\n")
        ((path, prefill),) = p.requests
        assert path == "/v1/chat/completions"
        assert prefill["max_tokens"] == prefill["max_completion_tokens"] == 1
        assert prefill["stream"] is False and "stream_options" not in prefill
        ((_, decode),) = d.requests
        assert decode["stream"] is True and decode["stream_options"] == {"include_usage": True}
        assert decode["kv_transfer_params"]["remote_engine_id"] == "p"


@pytest.mark.parametrize(("keepalive_s", "reused"), [(0.0, False), (5.0, True)])
def test_backend_connections_are_reused_only_when_asked(keepalive_s, reused):
    """By default every leg has its own connection: a reused one races the backend's keep-alive timeout (a
    stalled vLLM server reset one under load in CI: HTTP 502)."""
    p, d = FakeBackend("p"), FakeBackend("d")
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url], backend_keepalive_s=keepalive_s) as (url, _):
        for _ in range(3):
            assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 200
    for backend in (p, d):
        assert len(backend.clients) == 3
        assert (len(set(backend.clients)) < 3) == reused, backend.clients


def test_requests_are_spread_over_backends():
    fakes = [FakeBackend(n) for n in ("p1", "p2", "d1", "d2")]
    with running(*fakes) as servers, proxy_for([s.url for s in servers[:2]], [s.url for s in servers[2:]]) as (url, _):
        for _ in range(4):
            assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 200
    assert [len(f.requests) for f in fakes] == [2, 2, 2, 2]


def test_backend_down_gives_502_leaves_rotation_and_comes_back():
    port = free_port()
    down_url = f"http://127.0.0.1:{port}"
    p2, d = FakeBackend("p2"), FakeBackend("d")
    with running(p2, d) as (p2s, ds), proxy_for([down_url, p2s.url], [ds.url], connect_retries=0) as (url, proxy):
        reply = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert reply.status_code == 502
        error = reply.json()["error"]
        assert error["type"] == "bad_gateway" and error["backend"] == "prefill-0" and "ConnectError" in error["message"]
        assert down_url not in reply.text  # clients see backends by name
        assert d.requests == []  # no decode leg after a failed prefill
        assert backend(proxy, "prefill", 0).up is False
        for _ in range(3):  # out of rotation: every request goes to p2
            assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 200
        assert len(p2.requests) == 3
        # The backend starts: the health task puts it back, and it gets requests again.
        revived = FakeBackend("revived")
        server = ServerThread(revived, port=port).start()
        try:
            wait_for(lambda: backend(proxy, "prefill", 0).up)
            for _ in range(2):
                assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 200
            assert len(revived.requests) == 1 and len(p2.requests) == 4  # least outstanding, then round robin
        finally:
            server.stop()


def test_no_backend_up_gives_503_and_a_retry_finds_another():
    down = dead_url()
    d = FakeBackend("d")
    with running(d) as (ds,), proxy_for([down], [ds.url], health_interval_s=60) as (url, _):
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 502
        reply = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert reply.status_code == 503
        assert reply.json()["error"]["type"] == "service_unavailable"
        assert "no prefill backend is up" in reply.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=5).status_code == 503
    p = FakeBackend("p")
    with running(p, d) as (ps, ds), proxy_for([dead_url(), ps.url], [ds.url]) as (url, _):  # connect_retries=1
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 200
        assert len(p.requests) == 1


def test_timeouts_give_504_and_keep_the_backend():
    slow_p, d = FakeBackend("slow", delay=3), FakeBackend("d")
    with running(slow_p, d) as (ps, ds), proxy_for([ps.url], [ds.url], prefill_timeout_s=0.3) as (url, proxy):
        t0 = time.monotonic()
        reply = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert reply.status_code == 504 and time.monotonic() - t0 < 2
        error = reply.json()["error"]
        assert error["type"] == "gateway_timeout" and error["backend"] == "prefill-0"
        assert backend(proxy, "prefill").up is True  # slow is not dead
    p, slow_d = FakeBackend("p"), FakeBackend("slow", delay=3)
    with running(p, slow_d) as (ps, ds), proxy_for([ps.url], [ds.url], decode_timeout_s=0.3) as (url, proxy):
        reply = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert reply.status_code == 504 and reply.json()["error"]["backend"] == "decode-0"


def test_backend_errors_pass_through_and_missing_params_are_502():
    p, d = FakeBackend("p"), FakeBackend("d", status=400)
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, proxy):
        reply = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert reply.status_code == 400 and reply.json()["error"]["message"] == "d says no"
        assert backend(proxy, "decode").up is True
        assert httpx.post(url + "/v1/completions", content=b"{nope", timeout=10).status_code == 400
    p, d = FakeBackend("p", no_params=True), FakeBackend("d")
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, proxy):
        reply = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
        assert reply.status_code == 502 and "no kv_transfer_params" in reply.json()["error"]["message"]
        assert d.requests == []


def test_decode_backend_dying_mid_stream_ends_the_stream_with_an_error_event():
    p, d = FakeBackend("p"), FakeBackend("d", tokens=("a", "b", "c", "d"), crash_after=2)
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url], health_interval_s=60) as (url, proxy):
        with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=10) as reply:
            assert reply.status_code == 200
            received = b"".join(reply.iter_raw())
        assert received.startswith(bytes(d.sent))
        events = [json.loads(e[6:]) for e in received.decode().split("\n\n") if e.startswith("data: {")]
        assert [e["choices"][0]["text"] for e in events[:-1]] == ["a", "b"]
        assert events[-1]["error"]["type"] == "bad_gateway" and events[-1]["error"]["backend"] == "decode-0"
        assert backend(proxy, "decode").up is False


def test_limits():
    p, d = FakeBackend("p"), FakeBackend("d", tokens=tuple("abcdefghij"), chunk_delay=0.1)
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url], max_inflight=1, max_body_bytes=1000) as (url, _):
        with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=10) as reply:
            chunks = reply.iter_raw()  # kept: a dropped iterator closes the response
            next(chunks)
            second = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
            assert second.status_code == 503 and second.json()["error"]["type"] == "overloaded"
        big = httpx.post(url + "/v1/completions", json={**BODY, "prompt": list(range(1000))}, timeout=10)
        assert big.status_code == 413


def test_client_disconnect_closes_the_upstream_legs():
    p, d = FakeBackend("p"), FakeBackend("d", tokens=tuple("abcdefghijklmnopqrstuvwxyz"), chunk_delay=0.1)
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, proxy):
        with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=10) as reply:
            first = next(reply.iter_raw())
            assert first.startswith(b"data: ")
        assert d.disconnected.wait(5), "the decode backend did not see the proxy close the stream"
        assert len(d.sent) < 26 * 40  # it stopped early
        wait_for(lambda: backend(proxy, "decode").outstanding == 0)
        metrics = httpx.get(url + "/metrics", timeout=5).text
        assert "kvbridge_proxy_client_disconnects_total 1.0" in metrics
        assert 'status="499"' in metrics
    slow_p, d = FakeBackend("slow", delay=5), FakeBackend("d")
    with running(slow_p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, proxy):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up during the prefill leg
            httpx.post(url + "/v1/completions", json=BODY, timeout=0.5)
        assert slow_p.disconnected.wait(3), "the prefill backend did not see the proxy close the request"
        wait_for(lambda: backend(proxy, "prefill").outstanding == 0)
        assert d.requests == []


def test_proxy_command_prints_its_url_and_serves():
    p, d = FakeBackend("p"), FakeBackend("d")
    with running(p, d) as (ps, ds):
        cmd = [
            sys.executable,
            "-m",
            "kvbridge.serving.cli",
            "proxy",
            "--prefill",
            ps.url,
            "--decode",
            ds.url,
            "--port",
            "0",
        ]
        with proxy_process(cmd) as url:
            reply = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
            assert reply.status_code == 200 and reply.json()["served_by"] == "d"


@contextmanager
def proxy_process(cmd: list[str]) -> Iterator[str]:
    """Run `kvbridge proxy` as a user does; yield the URL it prints; stop it with SIGTERM."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("kvbridge proxy listening on http://127.0.0.1:"), line
        url = line.split()[-1]
        wait_for(lambda: _answers(url), timeout=20)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _answers(url: str) -> bool:
    try:
        httpx.get(url + "/metrics", timeout=1)
    except httpx.HTTPError:
        return False
    return True


# --- kvbridge serve --dry-run -----------------------------------------------------------------------------


def kvbridge(*args: str, config_home: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "VLLM_"))}
    if config_home is not None:
        env["XDG_CONFIG_HOME"] = str(config_home)
    return subprocess.run(
        [sys.executable, "-m", "kvbridge.serving.cli", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_serve_dry_run_prints_command_and_environment(tmp_path):
    out = kvbridge(
        "serve", "--role", "prefill", "--model", "/models/m", "--pp", "2", "--port", "9100",
        "--side-channel-port", "6000", "--lease-s", "20", "--kv-extra", "handshake_retries=3",
        "--platform", "cpu", "--cpu-bind", "0|0", "--dry-run", "--", "--max-model-len", "2048",
        config_home=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    words = shlex.split(out.stdout.replace("\\\n", " "), comments=True)
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith(("-", "{")))
    assert env["VLLM_HOST_IP"] == "127.0.0.1" and env["UCX_NET_DEVICES"] == "lo"
    assert env["UCX_TLS"] == "self,sm,cma,tcp" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0|0"
    cmd = words[len(env) :]
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    opts = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert opts["--model"] == "/models/m" and opts["--port"] == "9100" and opts["--pipeline-parallel-size"] == "2"
    assert json.loads(opts["--kv-transfer-config"]) == {
        "kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "kvbridge.vllm",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "handshake_retries": 3,
            "side_channel_port": 6000,
            "lease_s": 20.0,
            "auth_key_file": str(tmp_path / "kvbridge" / "deployment.key"),  # the user's key, by default
        },
    }
    assert not (tmp_path / "kvbridge").exists(), "a dry run creates nothing"
    assert json.loads(opts["--compilation-config"]) == {"mode": 2, "backend": "eager"}  # PP on CPU
    assert cmd[-2:] == ["--max-model-len", "2048"]


def test_serve_refuses_bad_settings_before_starting():
    out = kvbridge("serve", "--role", "decode", "--model", "m", "--kv-extra", "lease_seconds=3", "--dry-run")
    assert out.returncode == 2 and "lease_seconds" in out.stderr and "Traceback" not in out.stderr
    out = kvbridge("serve", "--role", "decode", "--model", "m", "--dry-run", "--", "--tensor-parallel-size", "2")
    assert out.returncode == 2 and "use its --tp" in out.stderr
    out = kvbridge("serve", "--role", "both", "--model", "m", "--platform", "gpu", "--dry-run")
    assert out.returncode == 0 and "kv_both" in out.stdout and "--enforce-eager" not in out.stdout
    assert "--port 8000" in out.stdout and "UCX_NET_DEVICES=lo" in out.stdout
    assert "UCX_TLS" not in out.stdout  # on GPUs UCX picks cuda_ipc / cuda_copy
    out = kvbridge("serve", "--role", "prefill", "--model", "m", "--host", "0.0.0.0", "--dry-run")
    assert out.returncode == 0 and "UCX_NET_DEVICES" not in out.stdout and "VLLM_HOST_IP" not in out.stdout


# --- real vLLM servers behind the proxy -------------------------------------------------------------------

SOURCE = "vllm:prompt_tokens_by_source_total"
QUIET = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@contextmanager
def serve_process(args: list[str], out: Path) -> Iterator[subprocess.Popen]:
    """`kvbridge serve` as a user runs it; stopped with SIGTERM (it then stops vLLM's whole tree). If it
    does not exit, it is killed and so is the vLLM process group it reported."""
    with open(out, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvbridge.serving.cli", "serve", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **QUIET},
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                for line in out.read_text(errors="replace").splitlines():
                    if line.startswith("kvbridge serve: vLLM") and " pid " in line:
                        with suppress(ProcessLookupError, PermissionError):
                            os.killpg(int(line.split(" pid ")[1].split(",")[0]), signal.SIGKILL)


def wait_healthy(url: str, proc: subprocess.Popen, out: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"kvbridge serve exited with {proc.returncode}:\n{out.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not ready after {timeout} s:\n{out.read_text()[-3000:]}"
        time.sleep(0.5)


def external_tokens(url: str) -> float:
    return metric_sum(metrics(url), SOURCE, source="external_kv_transfer")


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_real_vllm_servers_behind_the_proxy(tmp_path):
    """Prefill pp=2 (core 0, kv_both) and decode pp=1 (core 1, `kvbridge serve --role decode`), the
    `kvbridge proxy` command in front: outputs equal the prefill server's own, every prompt token reaches the
    decode server through kvbridge, and a stopped decode server gives the client a JSON error, not a hang."""
    model = build_tiny_model(tmp_path / "model")
    key_file, _ = ensure_key_file(tmp_path / "deployment.key")  # one key for the servers and the proxy
    prefill = VllmServer(
        model,
        port=free_port(),
        pp=2,
        cpu_bind="0|0",
        kv_transfer_config={
            "kv_connector": "KVBridgeConnector",
            "kv_connector_module_path": "kvbridge.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "side_channel_port": free_base_port(2),
                "lease_s": 30,
                "auth_key_file": str(key_file),
            },
        },
        name="prefill",
        log_path=tmp_path / "prefill.log",
    )
    decode_url = f"http://127.0.0.1:{free_port()}"
    decode_args = ["--role", "decode", "--model", str(model), "--port", decode_url.rsplit(":", 1)[1]]
    decode_args += ["--platform", "cpu", "--cpu-bind", "1", "--kv-cache-gib", "1", "--dtype", "float32"]
    decode_args += ["--auth-key-file", str(key_file)]
    decode_args += ["--log-file", str(tmp_path / "decode.log"), "--", "--skip-tokenizer-init"]
    t0 = time.monotonic()
    with prefill, serve_process(decode_args, tmp_path / "serve.out") as serve:
        wait_healthy(decode_url, serve, tmp_path / "serve.out", 300)
        prefill.wait_ready(300)
        print(f"servers ready after {time.monotonic() - t0:.0f} s")
        cmd = [sys.executable, "-m", "kvbridge.serving.cli", "proxy", "--prefill", prefill.url, "--decode", decode_url]
        cmd += ["--auth-key-file", str(key_file)]
        with proxy_process([*cmd, "--port", "0", "--log-level", "warning", "--prefill-timeout", "60"]) as url:
            rng = random.Random(11)
            prompts = [[rng.randrange(1, 1000) for _ in range(n)] for n in (150, 300, 90, 200)]
            before = external_tokens(decode_url)
            got = [complete(url, p, 8, timeout=120)["choices"][0]["token_ids"] for p in prompts[:2]]
            got += [complete_streaming(url, p, 8, timeout=120)[0] for p in prompts[2:]]
            expected = [complete(prefill.url, p, 8, timeout=120)["choices"][0]["token_ids"] for p in prompts]
            assert got == expected
            moved = sum(len(p) for p in prompts)
            wait_for(lambda: external_tokens(decode_url) - before >= moved, timeout=10)
            assert external_tokens(decode_url) - before == moved
            print(f"requests done after {time.monotonic() - t0:.0f} s")

            serve.send_signal(signal.SIGTERM)  # the decode server goes away
            assert serve.wait(40) == 0
            statuses = []
            for _ in range(2):
                reply = httpx.post(url + "/v1/completions", json={"prompt": prompts[0], "max_tokens": 4}, timeout=60)
                assert reply.json()["error"]["type"] in ("bad_gateway", "service_unavailable"), reply.text
                statuses.append(reply.status_code)
            assert statuses == [502, 503]
