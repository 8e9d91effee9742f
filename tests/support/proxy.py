"""The proxy's test fakes: ASGI backends under uvicorn in threads on 127.0.0.1 that record what they
receive and notice disconnects, the proxy in a thread or as a process, and the request body they share."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from kvbridge.serving.launcher import (
    free_port,
)
from kvbridge.serving.proxy import (
    Backend,
    Proxy,
    ProxyConfig,
    bind_socket,
    socket_url,
    uvicorn_config,
)

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
        self.ask_to_stop()
        self.thread.join(10)
        self.sock.close()

    def ask_to_stop(self) -> None:
        """Start the shutdown (uvicorn notices it within its 0.1 s tick); `stop` waits for it."""
        self.server.should_exit = True


def prompt_key(body: dict[str, Any]) -> str:
    """What a leg's prompt is, as one string (the fakes' way of checking which prompt a leg carries)."""
    return json.dumps(body.get("prompt", body.get("messages")), sort_keys=True)


class FakeBackend:
    """A vLLM stand-in. A request with kv_transfer_params.do_remote_decode is a prefill leg, answered with
    kv_transfer_params naming this backend, a request id of its own (`<name>-<k>`, k counting prefill legs) and
    the prompt it prefilled; any other request is a decode leg, answered with `tokens` (as SSE when asked to
    stream, one chunk every `chunk_delay` s), one choice at index 0 that says what it was for (`for`: the
    prompt, the seed, and the prompt and request id of the params it got), and usage. It records every request
    body and notices disconnects. `fail_prompts`: prompts (as `prompt_key`) answered with `status` (400), after
    `fail_delay` s (so that the other prompts' legs can be answered first)."""

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
        fail_delay: float = 0.0,
    ) -> None:
        self.name = name
        self.tokens = tokens
        self.chunk_delay = chunk_delay
        self.delay = delay
        self.status = status
        self.no_params = no_params
        self.crash_after = crash_after
        self.fail_prompts = fail_prompts
        self.fail_delay = fail_delay
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
            if failing and self.fail_delay:
                done, _ = await asyncio.wait({watcher}, timeout=self.fail_delay)
                if done:
                    return
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
        for server in servers:  # every server shuts down at once, not one tick after another
            server.ask_to_stop()
        for server in servers:
            server.stop()


@contextmanager
def proxy_for(prefill: list[str], decode: list[str], **config: Any) -> Iterator[tuple[str, Proxy]]:
    """A proxy in a thread, under the uvicorn settings `kvbridge proxy` uses (its connection bounds)."""
    config.setdefault("health_interval_s", 0.1)
    config.setdefault("routing", "least_loaded")  # the balancing tests; routing tests choose cache_aware
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


@contextmanager
def proxy_process(cmd: list[str], log_path: Path | None = None) -> Iterator[str]:
    """Run `kvbridge proxy` as a user does; yield the URL it prints; stop it with SIGTERM.

    Its output goes to `log_path` (a temporary file if None), never to a pipe: a pipe nobody drains fills after
    some 64 KiB of log lines, and the proxy's event loop then blocks on its next log write."""
    with contextlib.ExitStack() as stack:
        if log_path is None:
            log_path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvbridge-proxy-"))) / "proxy.log"
        log = stack.enter_context(open(log_path, "w"))
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            url = _listening_url(proc, log_path)
            wait_for(lambda: _answers(url), timeout=20)
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _listening_url(proc: subprocess.Popen, log_path: Path, timeout: float = 30.0) -> str:
    """The URL of the proxy's first output line, once written."""
    deadline = time.monotonic() + timeout
    while True:
        with open(log_path) as f:
            line = f.readline()
        if line.endswith("\n"):
            assert line.startswith("kvbridge proxy listening on http://127.0.0.1:"), line
            return line.split()[-1]
        assert proc.poll() is None, f"the proxy exited ({proc.returncode}): {log_path.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"the proxy printed no URL within {timeout} s"
        time.sleep(0.05)


def _answers(url: str) -> bool:
    try:
        httpx.get(url + "/metrics", timeout=1)
    except httpx.HTTPError:
        return False
    return True
