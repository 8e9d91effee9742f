"""Prefill KV that no decode leg will read is released at once: the decode leg failed (4xx/5xx, down, timeout),
never happened (client gone, a sibling sub-request failed) or was cancelled before its first byte. A decode leg
that began (it has read the KV) is never followed by a release: those are the negative controls.

`kvbridge.wire.release.release_prefill` is replaced by a recorder (the real one needs prefill workers); one test
runs the real one on the fakes' params, which it refuses without raising.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from kvbridge.core.errors import ConfigError
from kvbridge.serving.proxy import Proxy, ProxyConfig
from support.proxy import BODY, FakeBackend, dead_url, proxy_for, running, wait_for


class Recorder:
    """Stands in for release_prefill: records (params, key, timeout_s) from whatever thread calls it."""

    def __init__(self, answer: int = 1, sleep_s: float = 0.0) -> None:
        self.answer = answer
        self.sleep_s = sleep_s
        self.calls: list[tuple[dict[str, Any], bytes | None, float]] = []
        self.threads: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, params: dict[str, Any], key: bytes | None, timeout_s: float = 2.0) -> int:
        time.sleep(self.sleep_s)  # blocking, as the real one is
        with self._lock:
            self.calls.append((params, key, timeout_s))
            self.threads.append(threading.current_thread().name)
        return self.answer

    def released(self) -> list[str]:
        with self._lock:
            return sorted(p["remote_request_id"] for p, _, _ in self.calls)


@pytest.fixture
def releases(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr("kvbridge.wire.release.release_prefill", recorder)
    return recorder


def release_count(url: str, outcome: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(f'kvbridge_proxy_prefill_releases_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_a_decode_error_releases_its_prefill_and_a_success_does_not(releases):
    p, d = FakeBackend("p"), FakeBackend("d")
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 200
        stream = {**BODY, "stream": True}
        assert httpx.post(url + "/v1/completions", json=stream, timeout=10).status_code == 200
        time.sleep(0.3)
        assert releases.released() == []  # negative control: the decode legs read the KV
        d.status = 503
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 503
        wait_for(lambda: releases.released() == ["p-2"])
        assert httpx.post(url + "/v1/completions", json=stream, timeout=10).status_code == 503
        wait_for(lambda: releases.released() == ["p-2", "p-3"])
        wait_for(lambda: release_count(url, "released") == 2)
    params, key, timeout_s = releases.calls[0]
    assert params["remote_engine_id"] == "p" and key is None and timeout_s == 2.0
    assert releases.threads[0] != threading.main_thread().name


def test_a_decode_backend_that_is_down_or_slow_gets_the_prefill_released(releases):
    p = FakeBackend("p")
    with running(p) as (ps,), proxy_for([ps.url], [dead_url()], connect_retries=0) as (url, _):
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 502
        wait_for(lambda: releases.released() == ["p-0"])
    p, slow = FakeBackend("p"), FakeBackend("slow", delay=3)
    with running(p, slow) as (ps, ds), proxy_for([ps.url], [ds.url], decode_timeout_s=0.3) as (url, _):
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 504
        wait_for(lambda: len(releases.calls) == 2)
    assert releases.calls[1][0]["remote_engine_id"] == "p"


def test_a_client_that_leaves_before_the_decode_answers_gets_the_prefill_released(releases):
    p, slow = FakeBackend("p"), FakeBackend("slow", delay=5)
    with running(p, slow) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=BODY, timeout=0.5)
        assert slow.disconnected.wait(3)
        wait_for(lambda: releases.released() == ["p-0"])
        wait_for(lambda: release_count(url, "released") == 1)


def test_a_client_that_leaves_mid_stream_does_not_release(releases):
    """Negative control: the decode stream began, so the KV was read; a release could free blocks under it."""
    p, d = FakeBackend("p"), FakeBackend("d", tokens=tuple("abcdefghijklmnop"), chunk_delay=0.1)
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, proxy):
        with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=10) as reply:
            next(reply.iter_raw())
        assert d.disconnected.wait(5)
        wait_for(lambda: proxy.balancer.backends("decode")[0].outstanding == 0)
        time.sleep(0.3)
    assert releases.calls == []


def test_a_failing_sibling_releases_the_prefills_whose_decodes_had_not_begun(releases):
    """Prompt "b"'s prefill is refused; "a" and "c" were prefilled and wait on a slow decode: both released."""
    # "b" is refused after "a" and "c" were answered, however loaded the machine: their holds exist to release
    p = FakeBackend("p", status=400, fail_prompts=(json.dumps("b"),), fail_delay=1.0)
    slow = FakeBackend("slow", delay=5)
    for stream in (False, True):
        releases.calls.clear()
        with running(p, slow) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
            body = {**BODY, "prompt": ["a", "b", "c"], "stream": stream}
            t0 = time.monotonic()
            reply = httpx.post(url + "/v1/completions", json=body, timeout=10)
            assert reply.status_code == 400 and time.monotonic() - t0 < 3
            wait_for(lambda: len(releases.calls) == 2)
        assert sorted(json.loads(c[0]["prompt_key"]) for c in releases.calls) == ["a", "c"]


def test_the_key_is_read_once_at_start_and_passed_to_every_release(releases, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_bytes(b"  s3cret-key-of-32-bytes-at-least!\n")
    p, d = FakeBackend("p"), FakeBackend("d", status=500)
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url], auth_key_file=str(key_file)) as (url, _):
        key_file.write_bytes(b"changed")  # read at start, not per release
        for _ in range(2):
            assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 500
        wait_for(lambda: len(releases.calls) == 2)
    assert [key for _, key, _ in releases.calls] == [b"s3cret-key-of-32-bytes-at-least!"] * 2


def test_a_missing_or_empty_key_file_stops_the_proxy_before_it_serves(tmp_path):
    proxy = Proxy(ProxyConfig(prefill=("http://p",), decode=("http://d",), auth_key_file=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="cannot read auth_key_file"):
        proxy.load_key()
    (tmp_path / "empty").write_bytes(b"\n")
    proxy = Proxy(ProxyConfig(prefill=("http://p",), decode=("http://d",), auth_key_file=str(tmp_path / "empty")))
    with pytest.raises(ConfigError, match="is empty"):
        proxy.load_key()
    cmd = [sys.executable, "-m", "kvbridge.serving.cli", "proxy", "--prefill", "http://127.0.0.1:9"]
    cmd += ["--decode", "http://127.0.0.1:9", "--port", "0", "--auth-key-file", str(tmp_path / "nope")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot read auth_key_file" in out.stderr and "Traceback" not in out.stderr


def test_releases_do_not_block_the_event_loop(monkeypatch):
    recorder = Recorder(sleep_s=1.5)
    monkeypatch.setattr("kvbridge.wire.release.release_prefill", recorder)
    p, d = FakeBackend("p"), FakeBackend("d", status=503)
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        t0 = time.monotonic()
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 503
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 1.0  # the client's error and other requests do not wait for the release
        wait_for(lambda: len(recorder.calls) == 1)


def test_the_real_release_function_is_called_and_refuses_params_it_cannot_use():
    """No stand-in: the fakes' params name no prefill workers, so release_prefill logs, takes nothing, and the
    proxy counts `not_taken`."""
    p, d = FakeBackend("p"), FakeBackend("d", status=503)
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 503
        wait_for(lambda: release_count(url, "not_taken") == 1)
        assert release_count(url, "error") == 0


def test_a_release_that_raises_is_counted_as_an_error(monkeypatch):
    def broken(params: dict[str, Any], key: bytes | None, timeout_s: float = 2.0) -> int:
        raise RuntimeError("boom")

    monkeypatch.setattr("kvbridge.wire.release.release_prefill", broken)
    p, d = FakeBackend("p"), FakeBackend("d", status=503)
    with running(p, d) as (ps, ds), proxy_for([ps.url], [ds.url]) as (url, _):
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 503
        wait_for(lambda: release_count(url, "error") == 1)
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=10).status_code == 503  # still serving
