"""The launcher's HTTP calls (`serving.http_client`, httpx and prometheus_client) against a real HTTP server in this
process that answers like vLLM's OpenAI server: JSON completions, a server-sent event stream, /metrics, error
statuses; and a port nobody listens on."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from kvbridge.serving.launcher import (
    RequestFailed,
    complete,
    complete_streaming,
    is_healthy,
    metric_sum,
    metrics,
    post_json,
)

METRICS = (
    "# TYPE vllm:prompt_tokens_by_source_total counter\n"
    'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 7.0\n'
    'vllm:prompt_tokens_by_source_total{engine="1",source="external_kv_transfer"} 5.0\n'
)


class Handler(BaseHTTPRequestHandler):
    bodies: ClassVar[list[dict]] = []  # what the server was sent, in order

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/metrics":
            self._send(200, METRICS.encode(), "text/plain")
        else:
            self._send(404, b"no such page")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Handler.bodies.append(body)
        if body.get("max_tokens", 0) < 1:
            self._send(400, b'{"error": "max_tokens must be at least 1"}')
        elif body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            events = [{"choices": [{"token_ids": ids}]} for ids in ([5], [], [6, 7])]
            if body.get("fail_midway"):  # as vLLM ends a stream whose generation failed
                events[1:] = [{"error": {"message": "KV load failed", "type": "InternalServerError", "code": 500}}]
            for event in events:
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        else:
            reply = {"choices": [{"token_ids": [5, 6, 7]}], "kv_transfer_params": body.get("kv_transfer_params")}
            self._send(200, json.dumps(reply).encode())


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_completion_sends_greedy_token_ids_and_returns_the_reply(server):
    reply = complete(server, [1, 2, 3], 3, kv_transfer_params={"do_remote_decode": True}, ignore_eos=True)
    assert reply["choices"][0]["token_ids"] == [5, 6, 7]
    assert reply["kv_transfer_params"] == {"do_remote_decode": True}
    sent = Handler.bodies[-1]
    assert sent["prompt"] == [1, 2, 3] and sent["temperature"] == 0.0 and sent["return_token_ids"] is True
    assert sent["ignore_eos"] is True


def test_a_stream_returns_every_token_and_the_time_to_the_first(server):
    tokens, first_s = complete_streaming(server, [1, 2], 3)
    assert tokens == [5, 6, 7] and 0 < first_s < 10
    assert Handler.bodies[-1]["stream"] is True


def test_an_error_status_raises_with_the_status_and_body(server):
    with pytest.raises(RequestFailed) as failed:
        post_json(server + "/v1/completions", {"prompt": [1], "max_tokens": 0})
    assert failed.value.status == 400 and "max_tokens" in failed.value.body
    with pytest.raises(RequestFailed) as streamed:
        complete_streaming(server, [1], 0)
    assert streamed.value.status == 400


def test_an_error_event_in_a_stream_raises_not_a_short_output(server):
    with pytest.raises(RequestFailed) as failed:
        complete_streaming(server, [1, 2], 3, fail_midway=True)
    assert failed.value.status == 500 and "KV load failed" in failed.value.body


def test_metrics_and_health(server):
    samples = metrics(server)
    assert metric_sum(samples, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 12.0
    assert is_healthy(server)


def test_a_server_not_listening_is_an_os_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: connections are refused
        with pytest.raises(OSError):
            complete(url, [1], 1, timeout=5)
        with pytest.raises(OSError):
            metrics(url, timeout=5)
        with pytest.raises(OSError):
            complete_streaming(url, [1], 1, timeout=5)
        assert not is_healthy(url)
