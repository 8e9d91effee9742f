"""Integrity and security against real vLLM servers with a deployment key: a decode loads only KV computed for its
own prompt, as the prefill signed it, once; outsiders get nothing from the side channel and free nothing.

Four servers for the module, all with the same key file: a prefill (core 0), a decode with
`kv_load_failure_policy=recompute` (core 1), a decode with the prompt check off (the negative control: it shows
that a swapped load really changes the output, so the oracle can tell), and a decode with policy `fail`.
"""

from __future__ import annotations

import random
import threading
import time

import msgspec
import pytest
import zmq

from kvbridge.core.errors import TransferTimeout
from kvbridge.serving.launcher import (
    RequestFailed,
    VllmServer,
    complete,
    free_base_port,
    free_port,
    kvbridge_config,
    metric_sum,
    metrics,
    running,
)
from kvbridge.wire import messages as wire
from kvbridge.wire.auth import Sealer
from kvbridge.wire.params import PrefillDone, parse_prefill_done
from kvbridge.wire.side_channel_client import exchange

pytestmark = pytest.mark.vllm

KEY = b"kvbridge-test-deployment-key-0001"
SOURCE = "vllm:prompt_tokens_by_source_total"
REJECTED = "vllm:kvbridge_rejected_params_total"


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("trust")
    model = tiny_model
    key_file = root / "key"
    key_file.write_bytes(KEY)
    secure = {"auth_key_file": str(key_file)}

    def decode(name: str, policy: str = "recompute", **extra) -> VllmServer:
        return VllmServer(
            model,
            port=free_port(),
            cpu_bind="1",
            kv_transfer_config=kvbridge_config(
                "kv_consumer", policy, side_channel_port=free_base_port(1), handshake_timeout_s=2.0, **secure, **extra
            ),
            name=name,
            log_path=root / f"{name}.log",
        )

    prefill_port = free_base_port(1)
    prefill = VllmServer(
        model,
        port=free_port(),
        cpu_bind="0",
        kv_transfer_config=kvbridge_config("kv_producer", side_channel_port=prefill_port, lease_s=20.0, **secure),
        name="prefill",
        log_path=root / "prefill.log",
    )
    group = (prefill, decode("decode"), decode("unchecked", check_prompt=False), decode("strict", policy="fail"))
    with running(group):
        yield {
            "prefill": prefill,
            "port": prefill_port,
            "model": model,
            "root": root,
            "secure": secure,
            **{s.name: s for s in group[1:]},
        }


def prompt(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def prefill_params(servers, tokens: list[int], **fields) -> dict:
    reply = complete(servers["prefill"].url, tokens, 1, kv_transfer_params={"do_remote_decode": True}, **fields)
    return reply["kv_transfer_params"]


def tokens_of(url: str, tokens: list[int], params: dict | None = None, n: int = 8, **fields) -> list[int]:
    return complete(url, tokens, n, kv_transfer_params=params, **fields)["choices"][0]["token_ids"]


def counts(url: str) -> tuple[float, dict[str, float]]:
    m = metrics(url)
    reasons = {}
    for series, value in m.items():
        if series.startswith(REJECTED + "{"):
            reason = series.split('reason="', 1)[1].split('"', 1)[0]
            reasons[reason] = reasons.get(reason, 0) + value
    return metric_sum(m, SOURCE, source="external_kv_transfer"), reasons


def wait_rejected(url: str, reason: str, at_least: float, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = counts(url)[1].get(reason, 0)
        if got >= at_least:
            return got
        time.sleep(0.2)
    return counts(url)[1].get(reason, 0)


def edited(params: dict, key: bytes | None = None, **changes) -> dict:
    done = msgspec.structs.replace(parse_prefill_done(params), **changes)
    if key is not None:
        done = done.signed(key)
    return done.to_dict()


def test_a_decode_with_another_prompts_params_computes_its_own(servers):
    """Params of another prompt of the same length (other tokens). Refused before any connection; the answer is the
    request's own continuation; the counter says why; and the params' owner still loads them afterwards."""
    decode = servers["decode"]
    a, b = prompt(1), prompt(2)
    pa, pb = prefill_params(servers, a), prefill_params(servers, b)
    moved, reasons = counts(decode.url)
    assert tokens_of(decode.url, a, pb) == tokens_of(servers["prefill"].url, a)
    assert wait_rejected(decode.url, "prompt_hash", reasons.get("prompt_hash", 0) + 1) > reasons.get("prompt_hash", 0)
    assert counts(decode.url)[0] == moved, "no KV may be loaded for a refused request"
    assert tokens_of(decode.url, b, pb) == tokens_of(servers["prefill"].url, b)
    assert counts(decode.url)[0] == moved + len(b)
    del pa


def test_negative_control_with_the_check_off_a_swapped_load_changes_the_output(servers):
    unchecked = servers["unchecked"]
    a, b = prompt(3), prompt(4)
    prefill_params(servers, a)
    pb = prefill_params(servers, b)
    moved, _ = counts(unchecked.url)
    swapped = tokens_of(unchecked.url, a, pb)
    assert counts(unchecked.url)[0] > moved, "the unchecked decode should have loaded b's KV"
    assert swapped != tokens_of(servers["prefill"].url, a), "a wrong load must show in the output"


def test_under_policy_fail_a_swapped_load_is_a_clear_error(servers):
    strict = servers["strict"]
    a, b = prompt(5), prompt(6)
    pb = prefill_params(servers, b)
    before = counts(strict.url)[1].get("prompt_hash", 0)
    with pytest.raises(RequestFailed):
        tokens_of(strict.url, a, pb)
    assert wait_rejected(strict.url, "prompt_hash", before + 1) == before + 1
    assert tokens_of(strict.url, b, pb) == tokens_of(servers["prefill"].url, b)  # its owner still can


def test_params_computed_under_one_cache_salt_are_refused_under_another(servers):
    """Same tokens, another cache_salt (another tenant, as vLLM's prefix cache keys it): refused before any
    connection, the request computes its own, and the counter says why. The controls: the same salt loads them,
    and the decode with the prompt check off takes them under another salt (so the oracle can tell)."""
    decode, unchecked = servers["decode"], servers["unchecked"]
    for seed, (given, used) in enumerate((("tenant-a", "tenant-b"), ("tenant-a", None), (None, "tenant-b")), 40):
        a = prompt(seed)  # a prompt of its own: the decode's prefix cache must not serve it
        reference = tokens_of(servers["prefill"].url, a)
        salted = prefill_params(servers, a, **({"cache_salt": given} if given else {}))
        moved, reasons = counts(decode.url)
        assert tokens_of(decode.url, a, salted, **({"cache_salt": used} if used else {})) == reference
        assert wait_rejected(decode.url, "prompt_hash", reasons.get("prompt_hash", 0) + 1) > reasons.get(
            "prompt_hash", 0
        ), (given, used)
        assert counts(decode.url)[0] == moved, "no KV may be loaded under another salt"
        if given:  # the owner, with its own salt, still loads them
            assert tokens_of(decode.url, a, salted, cache_salt=given) == reference
            assert counts(decode.url)[0] == moved + len(a)
    a = prompt(43)
    reference = tokens_of(servers["prefill"].url, a)
    salted = prefill_params(servers, a, cache_salt="tenant-a")
    moved = counts(unchecked.url)[0]
    assert tokens_of(unchecked.url, a, salted, cache_salt="tenant-b") == reference
    assert counts(unchecked.url)[0] == moved + len(a), "the unchecked decode should have loaded them"


def test_params_used_twice_are_refused_the_second_time(servers):
    decode = servers["decode"]
    a = prompt(7)
    pa = prefill_params(servers, a)
    reference = tokens_of(servers["prefill"].url, a)
    assert tokens_of(decode.url, a, pa) == reference
    before = counts(decode.url)[1].get("replayed", 0)
    moved = counts(decode.url)[0]
    assert tokens_of(decode.url, a, pa) == reference
    assert wait_rejected(decode.url, "replayed", before + 1) == before + 1
    assert counts(decode.url)[0] == moved


class FakeSideChannel:
    """A ROUTER that Acks everything and counts what it got: where an attacker points edited params."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.received = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                frames = self.sock.recv_multipart()
                self.received += 1
                self.sock.send_multipart([frames[0], wire.encode(wire.Ack(request_id="x"))])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("address", "bad_signature"),  # remote_host/port edited to the attacker's side channel
        ("blocks", "bad_signature"),  # another request's blocks
        ("unsigned", "unsigned"),
        ("wrong_key", "unknown_key"),  # signed with a key this decode does not accept (its id is unknown)
        ("expired", "expired"),  # signed with the right key (an insider), but stale
    ],
)
def test_forged_params_never_connect_anywhere(servers, change, reason):
    decode = servers["decode"]
    a = prompt(10 + len(change))
    params = prefill_params(servers, a)
    fake = FakeSideChannel()
    try:
        forged = {
            "address": lambda: edited(params, remote_port=fake.port),
            "blocks": lambda: edited(params, remote_block_ids=[b + 1 for b in params["remote_block_ids"]]),
            "unsigned": lambda: edited(params, kvbridge_sig="", remote_port=fake.port),
            "wrong_key": lambda: edited(params, b"x" * 32, remote_port=fake.port),
            "expired": lambda: edited(params, KEY, remote_expires=time.time() - 3600, remote_port=fake.port),
        }[change]()
        before = counts(decode.url)
        assert tokens_of(decode.url, a, forged) == tokens_of(servers["prefill"].url, a)
        assert wait_rejected(decode.url, reason, before[1].get(reason, 0) + 1) == before[1].get(reason, 0) + 1
        assert counts(decode.url)[0] == before[0]
        assert fake.received == 0, "the decode connected to an address the client chose"
    finally:
        fake.close()


def handshake_request() -> wire.HandshakeRequest:
    from kvbridge.core.memory import synthesize_memory
    from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank

    geometry = KVGeometry(num_layers=4, num_kv_heads=4, head_size=32, dtype="float32", block_size=128)
    memory = synthesize_memory("LBHNC", geometry, range(4), 4, 64, 1 << 20)
    return wire.HandshakeRequest.build("intruder", ParallelLayout(), 0, WorkerRank(0, 0), geometry, "LBHNC", memory)


def test_the_side_channel_answers_no_one_without_the_key(servers):
    """An outsider asking for the handshake (NIXL metadata, the memory map) gets no answer at all, with no key or
    a wrong one, nor a key holder's request addressed to another worker on this port (a captured sealed request
    replayed to this one); the same request sealed with the deployment key for this worker is answered (the control)."""
    port = servers["port"]
    params = prefill_params(servers, prompt(22))
    me = (params["remote_engine_id"], params["remote_dp_rank"], 0, 0)
    for sealer, identity in ((None, me), (Sealer(b"w" * 32), me), (Sealer(KEY), ("another-engine", 0, 0, 0))):
        with pytest.raises(TransferTimeout):
            exchange("127.0.0.1", port, handshake_request(), timeout_s=1.0, retries=0, sealer=sealer, identity=identity)
    answer = exchange("127.0.0.1", port, handshake_request(), timeout_s=5.0, retries=1, sealer=Sealer(KEY), identity=me)
    assert isinstance(answer, wire.HandshakeReply | wire.HandshakeRefused)


def test_an_insider_without_the_token_frees_nothing(servers):
    """Even with the deployment key, a Notify or Abort without the request's token is refused, and the request's
    reader still loads it afterwards; with the token an Abort frees it at once."""
    prefill, decode = servers["prefill"], servers["decode"]
    a = prompt(20)
    params = prefill_params(servers, a)
    done = PrefillDone(**{k: v for k, v in params.items() if k in PrefillDone.__struct_fields__})
    sealer = Sealer(KEY)
    me = (done.remote_engine_id, done.remote_dp_rank, 0, 0)
    for message in (
        wire.Notify(request_id=done.remote_request_id, engine_id="x", worker=wire.Worker(), expected=1),
        wire.Abort(request_id=done.remote_request_id, engine_id="x", worker=wire.Worker(), token="guess"),
    ):
        answer = exchange("127.0.0.1", servers["port"], message, timeout_s=5.0, sealer=sealer, identity=me)
        assert answer == wire.ErrorReply(message="refused", reason=wire.Refusal.REFUSED)
    assert tokens_of(decode.url, a, params) == tokens_of(prefill.url, a)
    # the control: the token frees an unread request at once (not after the 20 s lease)
    b = prompt(21)
    baseline = prefill.kv_usage()
    pb = prefill_params(servers, b)
    abort = wire.Abort(
        request_id=pb["remote_request_id"], engine_id="x", worker=wire.Worker(), token=pb["remote_token"]
    )
    assert isinstance(
        exchange("127.0.0.1", servers["port"], abort, timeout_s=5.0, sealer=sealer, identity=me), wire.Ack
    )
    deadline = time.monotonic() + 5
    while prefill.kv_usage() > baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    assert prefill.kv_usage() == baseline


def test_a_prefill_restarted_under_the_same_engine_id_is_handshaken_again(servers):
    """A prefill instance restarted with an operator-fixed engine id (same ports, new agents and memory) is
    detected by the epoch in the claim's answer: the decode drops its cached connection and handshakes again,
    and the KV really moves from the new instance (never a read through the stale connection)."""
    decode = servers["decode"]

    def start() -> VllmServer:
        config = kvbridge_config("kv_producer", side_channel_port=port, lease_s=20.0, **servers["secure"])
        config["engine_id"] = "prefill-fixed"
        server = VllmServer(
            servers["model"],
            port=api_port,
            cpu_bind="0",
            kv_transfer_config=config,
            name="restarted",
            log_path=servers["root"] / f"restarted-{time.monotonic_ns()}.log",
        )
        server.start()
        server.wait_ready(timeout=300)
        return server

    port, api_port = free_base_port(1), free_port()
    results = []
    for seed in (30, 31):
        server = start()
        try:
            p = prompt(seed)
            params = complete(server.url, p, 1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
            assert params["remote_engine_id"] == "prefill-fixed"
            moved = counts(decode.url)[0]
            tokens = tokens_of(decode.url, p, params)
            results.append((tokens == tokens_of(server.url, p), counts(decode.url)[0] - moved))
        finally:
            server.stop()
    assert results == [(True, 300), (True, 300)], results
