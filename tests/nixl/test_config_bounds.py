"""Every bound a peer or client controls is a `BridgeConfig` key (safe defaults, all
configurable): the defaults are the modules' values, an out-of-range value refuses to start naming the key, and a
changed value takes effect where the bound is enforced (real PrefillWorker and side channel, real NIXL agent). The
proxy's bounds (`ProxyConfig`, its flags) are checked in tests/unit/test_proxy_config.py.
"""

from __future__ import annotations

import argparse
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch
import zmq

from kvbridge.core import leases
from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import ConfigError, PeerGone, RequestParamsError, TransferError
from kvbridge.core.identity import WorkerIdentity
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.runtime import claims
from kvbridge.runtime.decode_worker import DecodeWorker, LoadJob
from kvbridge.runtime.peers import PeerBook
from kvbridge.runtime.prefill_worker import PrefillWorker
from kvbridge.serving import serve
from kvbridge.serving.launcher import free_base_port
from kvbridge.wire import messages as wire
from kvbridge.wire import params as wire_params
from kvbridge.wire import side_channel as sc
from kvbridge.wire import side_channel_client as scc
from kvbridge.wire.auth import Sealer
from kvbridge.wire.params import PrefillDone, parse_prefill_done
from support.prefill_workers import prefill_worker

BOUNDS = {  # key: the module value it replaced
    "side_channel_max_frame_bytes": sc.MAX_REQUEST_BYTES,
    "side_channel_queued_frames": sc.QUEUED_PER_PEER,
    "side_channel_max_connections": sc.MAX_CONNECTIONS,
    "side_channel_max_connections_per_address": sc.MAX_CONNECTIONS_PER_ADDRESS,
    "auth_max_nonces": Sealer(b"k" * 32).max_nonces,
    "max_early_notes": leases.MAX_EARLY,
    "early_notes_per_request": leases.EARLY_NOTES_PER_REQUEST,
    "early_note_s": leases.LeaseBook(1.0).early_ttl_s,
    "side_channel_max_answer_bytes": sc.MAX_ANSWER_BYTES,
    "side_channel_sockets_per_thread": scc.SideChannelClient().max_sockets,
    "max_cached_engines": 64,
    "dead_engine_s": 10.0,
    "claim_window_s": 10.0,
    "claims_per_engine": 4,
    "max_remote_blocks": wire_params.MAX_BLOCKS,
    "max_seen_params": 65536,
}

GEOMETRY = KVGeometry(num_layers=48, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)


def field_bounds(name: str) -> tuple[float, float]:
    """(lowest, highest) value `name` accepts, from its msgspec Meta."""
    info = next(f for f in msgspec.inspect.type_info(BridgeConfig).fields if f.name == name)
    low = info.type.ge if info.type.ge is not None else info.type.gt
    return low, info.type.le


def test_every_bound_defaults_to_the_value_the_modules_enforced():
    config = BridgeConfig()
    assert {name: getattr(config, name) for name in BOUNDS} == BOUNDS
    assert all(field_bounds(name)[1] is not None for name in BOUNDS), "every bound has a ceiling"


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_an_out_of_range_bound_refuses_to_start_naming_the_key(name, monkeypatch, tmp_path):
    low, high = field_bounds(name)
    integer = isinstance(BOUNDS[name], int)
    too_low = low - 1 if integer else (low - 1e-3 if low else -1.0)
    too_high = high + 1 if integer else high * 2
    for bad in (too_low, too_high):
        with pytest.raises(ConfigError, match=rf"\$\.{name}\b"):
            BridgeConfig.from_extra({name: bad})
    # the control: the bounds themselves are accepted (a value strictly above gt=0 for the open ones)
    for good in (high, low if low or integer else 1e-3):
        assert getattr(BridgeConfig.from_extra({name: good}), name) == good
    # and `kvbridge serve` refuses it before starting anything (dry run included)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    argv = ["--role", "prefill", "--model", "m", "--platform", "cpu", "--keyless-exposes-kv-to-local-processes"]
    with pytest.raises(ConfigError, match=name):
        serve.spec_from_args(parser.parse_args([*argv, "--kv-extra", f"{name}={too_high}"]))


# --- each bound takes effect where it is enforced -----------------------------------------------------------------


def make_prefill(key: bytes | None = None, **bounds) -> PrefillWorker:
    return prefill_worker(GEOMETRY, key, layers=range(48), num_blocks=4, **bounds)


def params_of(engine: str, port: int, request_id: str = "r") -> PrefillDone:
    return PrefillDone(
        remote_engine_id=engine,
        remote_request_id=request_id,
        remote_block_ids=[1],
        remote_host="127.0.0.1",
        remote_port=port,
        remote_layout="pp=1,tp=1",
        remote_token="t",
    )


def padded_notify(pad: int) -> bytes:
    """A Notify frame `pad` bytes longer: receivers ignore unknown fields (newer peers may add some), so it is a
    valid message of any size."""
    note = msgspec.to_builtins(wire.Notify(request_id="r", engine_id="d", worker=wire.Worker(), expected=1, token="t"))
    return msgspec.msgpack.encode({**note, "pad": "x" * pad})


def send_raw(port: int, frame: bytes, timeout_s: float) -> bytes | None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(frame)
        return sock.recv() if sock.poll(round(timeout_s * 1000)) else None
    finally:
        sock.close(linger=0)


@pytest.mark.nixl
@pytest.mark.parametrize("limit", [None, 4096])
def test_a_smaller_frame_bound_refuses_a_frame_the_default_takes(limit):
    frame = padded_notify(10_000)
    assert 4096 < len(frame) < sc.MAX_REQUEST_BYTES
    worker = make_prefill(**({} if limit is None else {"side_channel_max_frame_bytes": limit}))
    try:
        answer = send_raw(worker.port, frame, timeout_s=5 if limit is None else 0.5)
        if limit is None:
            assert answer is not None and isinstance(wire.decode(answer), wire.Ack)
        else:  # ZMQ cuts the connection of an oversized frame: no answer at all
            assert answer is None
            small = send_raw(worker.port, padded_notify(100), timeout_s=5)
            assert small is not None and isinstance(wire.decode(small), wire.Ack), "frames under it still pass"
    finally:
        worker.close()


@pytest.mark.nixl
@pytest.mark.parametrize("limit", [None, 4096])
def test_a_smaller_answer_bound_makes_the_decode_side_refuse_a_handshake_reply(limit):
    """The reply (memory map of 48 layers, NIXL metadata) is over 4 KiB: through the PeerBook the decode side
    uses, the default connects and under the smaller bound ZMQ cuts the connection (a reset, on every attempt)."""
    worker = make_prefill()
    memory = synthesize_memory("LBHNC", GEOMETRY, range(48), 2, 4, 1 << 20)
    bounds = {} if limit is None else {"side_channel_max_answer_bytes": limit}
    config = BridgeConfig(side_channel_port=worker.port, handshake_timeout_s=0.5, handshake_retries=0, **bounds)
    source = params_of("p", worker.port)
    identity = WorkerIdentity("d", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY)
    try:
        with ThreadPoolExecutor(1) as pool:
            book = PeerBook(identity, memory, config, pool, lambda meta, name: name)
            future = book.connect(source)
            if limit is None:
                assert future.result(timeout=10).peers
            else:
                with pytest.raises(TransferError, match="reset the connection"):
                    future.result(timeout=10)
    finally:
        worker.close()


@pytest.mark.nixl
@pytest.mark.parametrize("per_address", [None, 4])
def test_the_per_address_connection_bound_cuts_what_exceeds_it(per_address):
    worker = make_prefill(**({} if per_address is None else {"side_channel_max_connections_per_address": per_address}))
    conns = []
    try:
        for _ in range(10):
            conns.append(socket.create_connection(("127.0.0.1", worker.port), timeout=5))
        deadline = time.monotonic() + 5
        want = 0 if per_address is None else 10 - per_address
        while worker._server.connections.cut < want and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # no late cuts either
        assert worker._server.connections.cut == want
        assert worker._server.connections.per_address == (per_address or sc.MAX_CONNECTIONS_PER_ADDRESS)
    finally:
        for c in conns:
            c.close()
        worker.close()


@pytest.mark.nixl
def test_the_server_takes_its_queue_connection_and_nonce_bounds_from_the_config():
    worker = make_prefill(b"k" * 32, side_channel_queued_frames=3, side_channel_max_connections=7, auth_max_nonces=2048)
    try:
        assert worker._server.queued_frames == 3 and worker._server.connections.limit == 7
        assert worker._server.sealer.max_nonces == 2048
    finally:
        worker.close()


@pytest.mark.nixl
@pytest.mark.parametrize("kept", [None, 8])
def test_the_early_notification_bound_limits_what_unknown_ids_cost(kept):
    worker = make_prefill(**({} if kept is None else {"max_early_notes": kept}), early_note_s=30.0)
    try:
        answers = [
            scc.exchange(
                "127.0.0.1",
                worker.port,
                wire.Notify(request_id=f"never-{i}", engine_id="x", worker=wire.Worker(), expected=1, token="t"),
                timeout_s=5,
            )
            for i in range(20)
        ]
        acked = sum(isinstance(a, wire.Ack) for a in answers)
        assert acked == (20 if kept is None else kept)
        assert worker._leases.early_ttl_s == 30.0
    finally:
        worker.close()


def test_early_notifications_per_request_and_their_lifetime_follow_the_book():
    book = leases.LeaseBook(10.0, early_ttl_s=1.0, max_early=2, early_notes_per_request=3)
    took = [book.notified("r", "t", "e", f"w{i}", 8, 0.0) for i in range(5)]
    assert took == [True, True, True, False, False]
    assert book.notified("s", "t", "e", "w", 1, 0.0) and not book.notified("u", "t", "e", "w", 1, 0.0)
    book.due(2.0)  # past early_ttl_s: forgotten, room again
    assert book.notified("u", "t", "e", "w", 1, 2.0)


def test_the_block_bound_of_kv_transfer_params():
    params = {
        "remote_engine_id": "p",
        "remote_request_id": "r",
        "remote_block_ids": list(range(100)),
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_layout": "pp=1,tp=1",
    }
    assert len(parse_prefill_done(params).remote_block_ids) == 100
    with pytest.raises(RequestParamsError, match="remote_block_ids"):
        parse_prefill_done(params, max_blocks=99)


def test_the_dead_engine_time_is_the_configs():
    """A handshake to a port nobody serves fails (refused: at once); the engine is then dead for `dead_engine_s`
    (0: not at all)."""
    memory = synthesize_memory("LBHNC", GEOMETRY, range(48), 2, 4, 1 << 20)
    identity = WorkerIdentity("d", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY)
    port = free_base_port(1)
    source = params_of("gone", port)
    dead = {}
    for dead_s in (10.0, 0.0):
        config = BridgeConfig(handshake_timeout_s=0.2, handshake_retries=0, dead_engine_s=dead_s)
        with ThreadPoolExecutor(1) as pool:
            book = PeerBook(identity, memory, config, pool, lambda meta, name: name)
            with pytest.raises(PeerGone):
                book.connect(source).result(timeout=10)
            dead[dead_s] = book.is_dead(source)
            assert book.max_engines == config.max_cached_engines
    assert dead == {10.0: True, 0.0: False}


@pytest.mark.nixl
@pytest.mark.parametrize("window_s", [2.0, 0.3])
def test_the_claim_window_is_how_long_a_not_held_request_is_retried(window_s):
    """A load of a request the prefill never held fails once its claims stop being retried: after a configured
    2 s, or 0.3 s."""
    prefill = make_prefill()
    config = BridgeConfig(
        side_channel_port=prefill.port,
        claims_per_engine=2,
        side_channel_sockets_per_thread=9,
        claim_window_s=window_s,
    )
    kv = torch.zeros(1 << 16, dtype=torch.uint8)
    memory = synthesize_memory("LBHNC", GEOMETRY, range(48), 2, 4, kv.data_ptr())
    decode = DecodeWorker(WorkerIdentity("d", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY), memory, config)
    decode.start()
    source = params_of("p", prefill.port, "never-held")
    try:
        decode.load(LoadJob("d-1", source, ((2,),), ((1,),)))
        t0 = time.monotonic()
        failed: set[str] = set()
        while "d-1" not in failed and time.monotonic() < t0 + 15:
            failed |= decode.results()[1]
            time.sleep(0.01)
        took = time.monotonic() - t0
        assert "d-1" in failed
        assert decode._clients.get().max_sockets == 9
        if window_s == 2.0:
            assert took >= 1.9
        else:
            assert took < 1.5
        print(f"claim window {window_s} s: the load failed after {took:.2f} s")
    finally:
        decode.close()
        prefill.close()


# --- the decode's scheduler side (vLLM's configs as plain namespaces: no server) ---------------------------------

PROMPT = list(range(1, 41))


def scheduler(**bounds):
    from types import SimpleNamespace

    from kvbridge.vllm.scheduler_side import SchedulerSide

    kv = SimpleNamespace(engine_id="engine-d", is_kv_producer=False, is_kv_consumer=True, kv_load_failure_policy="fail")
    parallel = SimpleNamespace(
        pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel_size=1, data_parallel_index=0
    )
    vllm_config = SimpleNamespace(
        kv_transfer_config=kv, parallel_config=parallel, cache_config=SimpleNamespace(block_size=16)
    )
    return SchedulerSide(vllm_config, BridgeConfig(keyless_exposes_kv_to_local_processes=True, **bounds))


def ask(side, request_id: str, remote_request_id: str, blocks: int = 3) -> str | None:
    """The reason `side` refuses the request's params (its `rejected_params` metric label), or None if it takes
    them."""
    from types import SimpleNamespace

    from kvbridge.wire.params import prompt_hash

    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_request_id": remote_request_id,
        "remote_block_ids": list(range(1, blocks + 1)),
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_layout": "pp=1,tp=1",
        "remote_num_tokens": len(PROMPT),
        "remote_prompt_hash": prompt_hash(PROMPT),
    }
    side.get_num_new_matched_tokens(
        SimpleNamespace(request_id=request_id, kv_transfer_params=params, prompt_token_ids=PROMPT), 0
    )
    stats = side.take_stats()  # None: nothing to report
    return next(iter(stats.data.get("rejected_params", {})), None) if stats else None


@pytest.mark.parametrize("remembered", [None, 1])
def test_the_replay_memory_holds_max_seen_params(remembered):
    """Params used by one request are refused for another (`replayed`) while remembered: with the default, after
    another request's params came in between; with max_seen_params 1, they are forgotten by then."""
    side = scheduler(**({} if remembered is None else {"max_seen_params": remembered}))
    assert ask(side, "d1", "r-a") is None and ask(side, "d2", "r-b") is None
    assert ask(side, "d3", "r-a") == ("replayed" if remembered is None else None)


def test_the_scheduler_side_takes_its_block_bound_from_the_config():
    assert ask(scheduler(), "d1", "r-a", blocks=3) is None
    assert ask(scheduler(max_remote_blocks=2), "d1", "r-a", blocks=3) == "malformed"


@pytest.mark.nixl
@pytest.mark.parametrize("honours_final", [True, False])
def test_a_load_of_a_freed_request_fails_at_once_not_after_the_claim_window(honours_final, monkeypatch):
    """A request the prefill held and freed (here: aborted) is refused as not held for good (`ErrorReply.final`):
    the load fails at once instead of retrying its claim within its window. The control: a decode that takes every
    `not_held` as one to ask again (a 3 s window here) fails the load only once the window passed."""
    prefill = make_prefill()
    config = BridgeConfig(side_channel_port=prefill.port, **({} if honours_final else {"claim_window_s": 3.0}))
    if not honours_final:
        monkeypatch.setattr(
            claims,
            "ends_the_claim",
            lambda a: not (isinstance(a, wire.ErrorReply) and a.reason is wire.Refusal.NOT_HELD),
        )
    kv = torch.zeros(1 << 16, dtype=torch.uint8)
    memory = synthesize_memory("LBHNC", GEOMETRY, range(48), 2, 4, kv.data_ptr())
    decode = DecodeWorker(WorkerIdentity("d", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY), memory, config)
    decode.start()
    try:
        prefill.hold("gone", ((1,),), token="t")
        abort = wire.Abort(request_id="gone", engine_id="x", worker=wire.Worker(), token="t")
        assert isinstance(scc.exchange("127.0.0.1", prefill.port, abort, timeout_s=5), wire.Ack)
        deadline = time.monotonic() + 5
        while "gone" not in prefill.finished(0.05)[0] and time.monotonic() < deadline:
            pass
        t0 = time.monotonic()
        decode.load(LoadJob("d-gone", params_of("p", prefill.port, "gone"), ((2,),), ((1,),)))
        failed: set[str] = set()
        while "d-gone" not in failed and time.monotonic() < t0 + 15:
            failed |= decode.results(0.05)[1]
        took = time.monotonic() - t0
        assert "d-gone" in failed
        assert took < 1.0 if honours_final else took >= 2.9, took
    finally:
        decode.close()
        prefill.close()
        del kv


@pytest.mark.nixl
@pytest.mark.parametrize(("window_s", "loaded"), [(None, True), (2.0, False)])
def test_a_hold_that_comes_seconds_late_is_waited_for(window_s, loaded):
    """A busy prefill engine registers a hold one step after the request's params left it, and a step can take
    seconds: with the default window a claim that came 3 s before the hold still loads the request; with a 2 s
    window (the control) the load fails, the claim refused as not held."""
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)
    prefill = prefill_worker(geometry, layers=range(2), num_blocks=16)  # its KV fits its buffer: read for real
    bounds = {} if window_s is None else {"claim_window_s": window_s}
    kv = torch.zeros(1 << 16, dtype=torch.uint8)
    memory = synthesize_memory("LBHNC", geometry, range(2), 2, 16, kv.data_ptr())
    decode = DecodeWorker(
        WorkerIdentity("d", ParallelLayout(), 0, WorkerRank(0, 0), geometry),
        memory,
        BridgeConfig(side_channel_port=prefill.port, **bounds),
    ).start()
    try:
        decode.load(LoadJob("d-late", params_of("p", prefill.port, "late"), ((2,),), ((1,),)))
        time.sleep(3.0)
        prefill.hold("late", ((1,),), token="t")
        done: set[str] = set()
        failed: set[str] = set()
        t0 = time.monotonic()
        while not (done or failed) and time.monotonic() < t0 + 15:
            d, f, _ = decode.results(0.05)
            done, failed = done | d, failed | f
        assert (done, failed) == (({"d-late"}, set()) if loaded else (set(), {"d-late"}))
    finally:
        decode.close()
        prefill.close()
        del kv
