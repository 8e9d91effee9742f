"""`kvbridge proxy` and `kvbridge serve`.

Three layers: the balancer and the request bodies as pure code; the proxy over HTTP against small fake
backends (raw ASGI apps under uvicorn, in threads, on 127.0.0.1) that record what they receive and notice
disconnects; and one test with real vLLM servers (a prefill server pp=2 and a decode server pp=1 started with
`kvbridge serve`) behind the `kvbridge proxy` command.

The fake backends (tests/support/proxy.py) also serve test_proxy_fanout.py (lists of prompts, n, merged streams),
test_proxy_release.py (prefill KV released when its decode leg fails) and test_proxy_bounds.py (limits for
clients); test_openai_client.py runs the official client against real servers.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvbridge.core.errors import ConfigError
from kvbridge.serving.launcher import (
    free_port,
)
from kvbridge.serving.proxy import (
    Balancer,
    NoBackendError,
    ProxyConfig,
    decode_body,
    prefill_body,
)
from support.proxy import (
    BODY,
    FakeBackend,
    ServerThread,
    backend,
    dead_url,
    prompt_key,
    proxy_for,
    proxy_process,
    running,
    wait_for,
)

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
    with pytest.raises(ConfigError, match=r"prefill_timeout_s: Expected `float` > 0.0 \(got 0\)"):
        ProxyConfig(prefill=("http://p",), decode=("http://d",), prefill_timeout_s=0)
    with pytest.raises(ConfigError, match="connect_retries"):
        ProxyConfig(prefill=("http://p",), decode=("http://d",), connect_retries=-1)
    with pytest.raises(ConfigError, match="backend_keepalive_s"):
        ProxyConfig(prefill=("http://p",), decode=("http://d",), backend_keepalive_s=-1)


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


@pytest.mark.parametrize(("keepalive_s", "reused"), [(0.0, False), (2.0, True)])
def test_backend_connections_are_reused_unless_turned_off(keepalive_s, reused):
    """Kept connections by default (2 s); 0: every leg has its own connection."""
    p, d = FakeBackend("p"), FakeBackend("d")
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url], backend_keepalive_s=keepalive_s) as (url, _):
        for _ in range(3):
            assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 200
    for fake in (p, d):
        assert len(fake.clients) == 3
        assert (len(set(fake.clients)) < 3) == reused, fake.clients


class ClosingBackend:
    """A raw HTTP/1.1 backend that answers the first request of each connection (JSON with kv_transfer_params,
    kept alive) and closes the connection at the second without answering, as a backend whose keep-alive timer
    fires as a request arrives on the connection does."""

    ANSWER = json.dumps({"kv_transfer_params": {"remote_engine_id": "x"}, "choices": [{"text": "ok"}]}).encode()

    def __init__(self) -> None:
        import socketserver
        import threading

        outer = self
        self.answered = self.closed_unanswered = 0

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                reader = self.request.makefile("rb")
                for k in range(2):
                    length = 0
                    while (line := reader.readline()) not in (b"\r\n", b""):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    if not line:
                        return
                    reader.read(length)
                    if k == 1:
                        outer.closed_unanswered += 1
                        return
                    outer.answered += 1
                    head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    head += f"content-length: {len(outer.ANSWER)}\r\n\r\n"
                    self.request.sendall(head.encode() + outer.ANSWER)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_request_whose_kept_connection_closes_unanswered_is_sent_again_on_a_new_one():
    backend_ = ClosingBackend()
    try:
        # the negative control: a plain kept-alive client loses its second request on the closed connection
        with httpx.Client(trust_env=False) as plain:
            assert plain.post(backend_.url + "/v1/completions", json=BODY).status_code == 200
            with pytest.raises(httpx.RemoteProtocolError):
                plain.post(backend_.url + "/v1/completions", json=BODY)
        closed_before = backend_.closed_unanswered
        with proxy_for([backend_.url], [backend_.url]) as (url, proxy):
            for _ in range(3):  # each request's decode leg goes onto its prefill leg's kept connection
                reply = httpx.post(url + "/v1/completions", json=BODY, timeout=10)
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["text"] == "ok"
            resent = proxy.metrics.registry.get_sample_value("kvbridge_proxy_resent_on_new_connection_total")
        assert backend_.closed_unanswered - closed_before == resent >= 1
    finally:
        backend_.close()


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
        "kv_load_failure_policy": "recompute",  # serve's default: a failed load costs latency, not the request
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
