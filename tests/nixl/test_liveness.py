"""One slow or dead prefill engine never stalls loads from a healthy one (real NIXL agents, real side channels).

A decode worker and a healthy prefill worker live in this process (two NIXL agents over UCX on loopback); a
"silent" prefill engine is a ZMQ socket that takes every message and never answers (a host that swallows
packets). Loads from the healthy engine are timed alone, then with loads to the silent engine queued ahead of
them: with handshakes on the transfer thread (no control pool), every healthy load would wait out the silent
engine's handshake timeouts.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import zmq

from kvbridge.core.config import BridgeConfig
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime.decode_worker import DecodeWorker, LoadJob
from kvbridge.runtime.prefill_worker import PrefillWorker
from kvbridge.serving.launcher import free_base_port
from kvbridge.wire.params import PrefillDone

pytestmark = pytest.mark.nixl

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
BLOCKS = 16


def memory_of(buffer: torch.Tensor):
    return synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, BLOCKS, buffer.data_ptr())


@pytest.fixture
def workers(request):
    threads, handshake_threads = getattr(request, "param", (8, None))
    config = BridgeConfig(side_channel_port=free_base_port(1), handshake_timeout_s=1.0, handshake_retries=1)
    layout = ParallelLayout()
    prefill_kv = torch.randn(1 << 14)
    decode_kv = torch.zeros(1 << 14)
    prefill = PrefillWorker(
        WorkerIdentity("healthy", layout, 0, WorkerRank(0, 0), GEOMETRY), memory_of(prefill_kv), config
    ).start()
    decode = DecodeWorker(
        WorkerIdentity("decode", layout, 0, WorkerRank(0, 0), GEOMETRY),
        memory_of(decode_kv),
        config,
        control_threads=threads,
        handshake_threads=handshake_threads,
    ).start()
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent_port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield prefill, decode, config, silent_port
    finally:
        decode.close()
        prefill.close()
        silent.close(linger=0)


def source(engine: str, port: int, request_id: str) -> PrefillDone:
    return PrefillDone(
        remote_engine_id=engine,
        remote_request_id=request_id,
        remote_block_ids=[1, 2],
        remote_host="127.0.0.1",
        remote_port=port,
        remote_layout="pp=1,tp=1",
        remote_token=f"token-{request_id}",
        remote_prompt_hash="h",
    )


def healthy_load(prefill: PrefillWorker, decode: DecodeWorker, config: BridgeConfig, i: int) -> float:
    """Seconds from queueing a healthy load to its report."""
    request_id = f"ok-{i}"
    prefill.hold(request_id, ((1, 2),), token=f"token-{request_id}", prompt_hash="h")
    job = LoadJob(f"decode-{request_id}", source("healthy", config.side_channel_port, request_id), ((3, 4),), ((1, 2),))
    t0 = time.monotonic()
    decode.load(job)
    deadline = t0 + 20
    while time.monotonic() < deadline:
        done, failed, _ = decode.results()
        OTHERS.update(failed)  # the silent engine's loads fail meanwhile
        assert job.request_id not in failed
        if job.request_id in done:
            return time.monotonic() - t0
        time.sleep(0.001)
    raise AssertionError("the healthy load never finished")


OTHERS: set[str] = set()


def latencies(workers) -> tuple[list[float], list[float]]:
    """Healthy loads alone, then with three loads to the silent engine queued first."""
    prefill, decode, config, silent_port = workers
    OTHERS.clear()
    healthy_load(prefill, decode, config, -1)  # connect once: both series then read a cached engine
    alone = [healthy_load(prefill, decode, config, i) for i in range(10)]
    for i in range(3):  # three requests to the silent engine, each would wait 2 x 1 s for its handshake
        decode.load(LoadJob(f"decode-silent-{i}", source("silent", silent_port, f"s{i}"), ((5, 6),), ((1, 2),)))
    time.sleep(0.05)
    return alone, [healthy_load(prefill, decode, config, 100 + i) for i in range(10)]


@pytest.mark.parametrize("workers", [(1, 0)], indirect=True)
def test_negative_control_with_one_control_thread_the_silent_engine_does_delay_them(workers):
    """The oracle can tell: with the handshake and the claims on one thread (a transfer thread that does
    both), the first healthy load waits for the silent engine's handshake to time out."""
    _, beside = latencies(workers)
    assert max(beside) > 1.0


def test_a_silent_engine_does_not_delay_loads_from_a_healthy_one(workers):
    decode = workers[1]
    alone, beside = latencies(workers)
    print(
        f"healthy load latency: alone median {1000 * statistics.median(alone):.1f} ms, "
        f"with a silent engine's loads queued median {1000 * statistics.median(beside):.1f} ms "
        f"(max {1000 * max(beside):.1f} ms)"
    )
    assert max(beside) < 0.5, "a healthy load waited behind the silent engine's handshake"
    assert statistics.median(beside) < 3 * statistics.median(alone) + 0.02
    # the silent engine's loads fail (its handshake times out once), they do not hang
    deadline = time.monotonic() + 10
    failed = set(OTHERS)
    while len(failed) < 3 and time.monotonic() < deadline:
        failed |= decode.results()[1]
        time.sleep(0.05)
    assert failed == {f"decode-silent-{i}" for i in range(3)}


def test_a_dead_engine_fails_the_next_loads_at_once(workers):
    """After one handshake to it timed out, loads naming the same engine fail within milliseconds (for a while),
    instead of each waiting out its own timeouts (three requests took 15, 30 and 45 s before)."""
    _prefill, decode, _config, silent_port = workers
    decode.load(LoadJob("first", source("silent", silent_port, "a"), ((5,),), ((1,),)))
    deadline = time.monotonic() + 10
    while not decode.results()[1] and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    for i in range(3):
        decode.load(LoadJob(f"next-{i}", source("silent", silent_port, f"b{i}"), ((5,),), ((1,),)))
    failed: set[str] = set()
    while len(failed) < 3 and time.monotonic() < t0 + 5:
        failed |= decode.results()[1]
        time.sleep(0.005)
    elapsed = time.monotonic() - t0
    print(f"three loads to a dead engine failed in {1000 * elapsed:.0f} ms")
    assert failed == {"next-0", "next-1", "next-2"} and elapsed < 0.5


def test_an_idle_step_waits_for_an_outstanding_load_and_no_longer(workers):
    """results(wait_s) (vLLM's idle steps): with a load outstanding it blocks until that load is reported, which
    ends the wait at once; with none outstanding it returns at once. Negative control: results() without a wait
    returns before the load finishes, which is what let vLLM's idle loop spin."""
    prefill, decode, config, _ = workers
    healthy_load(prefill, decode, config, -1)  # connected: the next load takes milliseconds
    t0 = time.monotonic()
    assert decode.results(0.5)[:2] == (set(), set())
    assert time.monotonic() - t0 < 0.05  # nothing outstanding: no wait
    prefill.hold("idle", ((1, 2),), token="token-idle", prompt_hash="h")
    job = LoadJob("decode-idle", source("healthy", config.side_channel_port, "idle"), ((3, 4),), ((1, 2),))
    decode.load(job)
    assert decode.results()[0] == set()  # the negative control: no wait, not done yet
    waited, done = [], set()
    while not done and len(waited) < 10:
        t0 = time.monotonic()
        done = decode.results(2.0)[0]
        waited.append(time.monotonic() - t0)
    assert done == {"decode-idle"}, waited
    assert len(waited) == 1 and waited[0] < 1.0, waited  # woken by the report, not by the 2 s bound


def test_an_idle_prefill_step_waits_for_its_held_requests_and_no_longer(workers):
    """finished(wait_s) (the prefill engine's idle steps: vLLM steps it continuously while it holds a request's
    blocks, for up to lease_s): with nothing held it returns at once; with a request held it waits, and the
    reader's notification ends the wait at once. Negative control: finished() without a wait returns at once while
    the request is still held, which is what kept the prefill worker spinning on its core."""
    prefill, decode, config, _ = workers
    t0 = time.monotonic()
    assert prefill.finished(0.5) == (set(), 0)
    assert time.monotonic() - t0 < 0.05  # nothing held: no wait
    prefill.hold("held", ((1, 2),), token="token-held", prompt_hash="h")
    t0 = time.monotonic()
    assert prefill.finished() == (set(), 0)  # the negative control: no wait
    assert time.monotonic() - t0 < 0.05
    t0 = time.monotonic()
    assert prefill.finished(0.2) == (set(), 0)  # held, nothing happens: waits its bound
    assert 0.15 < time.monotonic() - t0 < 1.0
    decode.load(LoadJob("decode-held", source("healthy", config.side_channel_port, "held"), ((3, 4),), ((1, 2),)))
    freed, waited = set(), []
    while not freed and len(waited) < 20:
        t0 = time.monotonic()
        freed = prefill.finished(2.0)[0]
        waited.append(time.monotonic() - t0)
        decode.results()
    assert freed == {"held"}, waited
    assert max(waited) < 1.0, waited  # woken by the notification, not by the 2 s bound


def test_a_slow_loads_log_says_where_its_time_went():
    from kvbridge.runtime.load import Load

    load = Load(LoadJob("r", None, (), ()), queued=10.0, deadline=40.0)
    assert load.phases(25.0) == "handshake 15000.00 ms (not done)"
    load.connected, load.claim_sent, load.claimed, load.started, load.posted = 10.5, 10.5, 10.6, 10.6, 10.6
    load.claim_retries = 2
    assert load.phases(12.0) == (
        "handshake 500.00 ms, claim 100.00 ms (2 retries), queue 0.00 ms, post 0.00 ms, wire 1400.00 ms (not done)"
    )
    load.landed = 12.0
    assert load.phases(12.5) == (
        "handshake 500.00 ms, claim 100.00 ms (2 retries), queue 0.00 ms, post 0.00 ms, wire 1400.00 ms"
    )
    phases = load.durations(reported=12.5)
    assert phases == pytest.approx(
        {
            "handshake": 0.5,
            "claim": 0.1,
            "queue": 0.0,
            "post": 0.0,
            "wire": 1.4,
            "report": 0.5,
            "hop": 1.5,
            "total": 2.5,
        }
    )


def many_silent_then_healthy(workers, engines: int = 20) -> float:
    """Loads to `engines` silent engines (each its own engine id: its own handshake, 2 x 1 s), then one
    load from the healthy engine, already connected: seconds to its report."""
    prefill, decode, config, silent_port = workers
    OTHERS.clear()
    healthy_load(prefill, decode, config, -1)  # connected and cached
    for i in range(engines):
        decode.load(LoadJob(f"decode-silent-{i}", source(f"silent-{i}", silent_port, f"s{i}"), ((5, 6),), ((1, 2),)))
    time.sleep(0.05)
    return healthy_load(prefill, decode, config, 0)


def test_handshakes_to_many_silent_engines_do_not_hold_the_claims_of_a_connected_one(workers):
    """With one shared pool, 20 silent engines' handshakes filled the 8 control threads, so a load from a
    connected healthy engine failed 'not started after 10 s'. Handshakes have their own pool (4 threads here):
    the healthy load is reported at once."""
    took = many_silent_then_healthy(workers)
    print(f"healthy load beside 20 silent engines' handshakes: {1000 * took:.1f} ms")
    assert took < 0.5


@pytest.mark.parametrize("workers", [(8, 0)], indirect=True)
def test_negative_control_handshakes_on_the_control_pool_do_hold_them(workers):
    """The oracle can tell: with the handshakes on the 8 control threads (before), the same load waits for the
    first 8 silent handshakes to time out (2 s)."""
    assert many_silent_then_healthy(workers) > 1.0
