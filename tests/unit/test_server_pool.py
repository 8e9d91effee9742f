"""The end-to-end server pool (`support.server_pool`) with stand-in servers: a `python` that only answers /health on
the port it is given, so that the pool's keying, reuse and stopping run on real processes in a second."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support.e2e_support import Place
from support.server_pool import ServerPool

STAND_IN = f"""#!{sys.executable}
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

A = Place(1, 1, "0")
B = Place(1, 1, "1")
C = Place(2, 1, "0|0")


@pytest.fixture
def pool(tmp_path: Path):
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    pool = ServerPool(tmp_path / "servers", max_idle_workers=3)
    pool.python = str(python)
    try:
        yield pool
    finally:
        pool.close()


def layout(pool: ServerPool, places: dict, **kv):
    return pool.layout(Path("/model"), places, kv=kv, python=pool.python, timeout=30)


def test_the_same_configuration_is_reused_and_another_is_started(pool):
    with layout(pool, {"a": A, "b": B}) as first:
        pids = {name: s.process.pid for name, s in first.items()}
    assert pool.started == 2 and pool.reused == 0
    with layout(pool, {"x": A, "y": B}) as again:  # other names, the same configurations
        assert {"a": again["x"].process.pid, "b": again["y"].process.pid} == pids
    assert pool.started == 2 and pool.reused == 2
    with layout(pool, {"a": A}, lease_s=5.0) as other:  # the connector config differs: a new server
        assert other["a"].process.pid not in pids.values()
    assert pool.started == 3


def test_idle_servers_a_layout_does_not_take_are_stopped_first(pool):
    with layout(pool, {"a": A, "b": B}) as first:
        b = first["b"]
    with layout(pool, {"a": A, "c": C}) as second:
        assert b.process.poll() is not None, "the idle server the layout did not take still runs"
        assert second["a"] is first["a"]
    pool.release_idle()
    assert all(s.process.poll() is not None for s in second.values())


def test_a_dead_server_is_not_handed_out_again(pool):
    with layout(pool, {"a": A}) as first:
        dead = first["a"]
    dead.kill()
    with layout(pool, {"a": A}) as second:
        assert second["a"] is not dead and second["a"].is_healthy()
    assert pool.started == 2 and pool.reused == 0


def test_idle_workers_beyond_the_bound_are_stopped(pool):
    with layout(pool, {"a": A, "b": B, "c": C}) as servers:  # 4 workers; the bound is 3
        pass
    running = [name for name, s in servers.items() if s.process.poll() is None]
    assert running == ["b", "c"]  # the least recently given back went first


def test_two_places_of_one_configuration_are_refused(pool):
    with pytest.raises(ValueError, match="same configuration"), layout(pool, {"a": A, "a2": A}):
        pass
