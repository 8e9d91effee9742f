"""The deployment key: sealed side-channel frames (AES-GCM, replay window) and signed kv_transfer_params."""

from __future__ import annotations

import msgspec
import pytest

from kvbridge.core.errors import ConfigError, ParamsRefused
from kvbridge.wire import messages as wire
from kvbridge.wire.auth import Sealer
from kvbridge.wire.keys import load_keys
from kvbridge.wire.params import PrefillDone, check_binding, parse_prefill_done, prompt_hash
from kvbridge.wire.side_channel_client import exchange
from kvbridge.wire.side_channel_server import SideChannelServer

KEY = b"k" * 32
OTHER = b"o" * 32


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_sealed_request_opens_once_and_its_answer_only_for_it():
    clock = Clock()
    client, server = Sealer(KEY, clock=clock), Sealer(KEY, clock=clock)
    frame, nonce = client.seal_request(b"hello")
    assert server.open_request(frame) == (b"hello", nonce)
    assert server.open_request(frame) is None  # a replay
    assert server.dropped["replayed"] == 1
    answer = server.seal_answer(b"world", nonce)
    assert client.open_answer(answer, nonce) == b"world"
    _, other_nonce = client.seal_request(b"again")
    assert client.open_answer(answer, other_nonce) is None  # not the answer to that request


def test_a_request_sealed_for_one_worker_is_not_taken_by_another():
    """A frame captured on its way to one prefill worker (port 5600) and replayed to another (5601) is dropped."""
    clock = Clock()
    frame, _ = Sealer(KEY, clock=clock).seal_request(b"hello", 5600)
    assert Sealer(KEY, clock=clock).open_request(frame, 5601) is None
    assert Sealer(KEY, clock=clock).open_request(frame, 5600) is not None


def test_frames_not_sealed_with_the_key_are_dropped_and_counted():
    clock = Clock()
    server = Sealer(KEY, clock=clock)
    frame, _ = Sealer(OTHER, clock=clock).seal_request(b"hello")
    assert server.open_request(frame) is None
    assert server.open_request(b"plain msgpack") is None
    tampered = bytearray(Sealer(KEY, clock=clock).seal_request(b"hello")[0])
    tampered[-1] ^= 1
    assert server.open_request(bytes(tampered)) is None
    assert server.dropped["unauthenticated"] == 3


def test_stale_frames_are_not_taken_but_answered_with_the_servers_clock():
    """A request outside the window is not taken (no body): the server may only tell its sender its clock."""
    server_clock, client_clock = Clock(1000.0), Clock(1000.0 - 31)
    frame, ticket = Sealer(KEY, clock=client_clock).seal_request(b"x")
    server = Sealer(KEY, clock=server_clock, window_s=30)
    assert server.open_request(frame) == (None, ticket) and server.dropped["stale"] == 1
    frame, _ = Sealer(KEY, clock=Clock(1000.0 - 29)).seal_request(b"x")
    assert Sealer(KEY, clock=server_clock, window_s=30).open_request(frame)[0] == b"x"


def test_seen_nonces_are_forgotten_after_the_window_and_bounded():
    clock = Clock()
    server = Sealer(KEY, clock=clock, max_nonces=3)
    client = Sealer(KEY, clock=clock)
    for _ in range(3):
        assert server.open_request(client.seal_request(b"x")[0]) is not None
    assert server.open_request(client.seal_request(b"x")[0]) is None  # full: refused, not forgotten
    clock.now += 31
    assert server.open_request(client.seal_request(b"x")[0]) is not None
    assert len(server._seen) == 1


def test_keys_come_from_a_value_or_a_file_never_a_default(tmp_path):
    assert load_keys(None, None) is None
    path = tmp_path / "key"
    path.write_bytes(b"  " + b"0123456789abcdef" * 4 + b"  \n")
    assert load_keys(None, str(path)).current.key_id == load_keys(("0123456789abcdef" * 4), None).current.key_id
    with pytest.raises(ConfigError, match="auth_key holds 5 bytes"):
        load_keys("short", None)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_keys(None, str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="not both"):
        load_keys("x" * 32, str(path))


def test_a_keyed_server_answers_only_sealed_requests():
    """On real sockets: the right key gets its answer, no key or a wrong key gets nothing (a timeout)."""
    ack = wire.Ack(request_id="r")
    with SideChannelServer(0, lambda m: ack, sealer=Sealer(KEY)) as server:
        assert exchange("127.0.0.1", server.port, wire.Ack(), timeout_s=2, sealer=Sealer(KEY)) == ack
        for sealer in (None, Sealer(OTHER)):
            with pytest.raises(Exception, match="no answer"):
                exchange("127.0.0.1", server.port, wire.Ack(), timeout_s=0.3, retries=0, sealer=sealer)
        assert server.sealer.dropped["unauthenticated"] == 2


def test_negative_control_an_unkeyed_server_answers_anyone():
    ack = wire.Ack(request_id="r")
    with SideChannelServer(0, lambda m: ack) as server:
        assert exchange("127.0.0.1", server.port, wire.Ack(), timeout_s=2) == ack


# --- kv_transfer_params bound to the prompt, signed ---------------------------------------------------


PROMPT = list(range(100, 140))


def params(**changes) -> PrefillDone:
    done = PrefillDone(
        remote_engine_id="p",
        remote_request_id="req",
        remote_block_ids=[3, 4, 5],
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_layout="pp=2,tp=1",
        remote_num_tokens=len(PROMPT),
        remote_prompt_hash=prompt_hash(PROMPT),
        remote_token="t" * 32,
        remote_expires=2000.0,
    )
    return msgspec.structs.replace(done, **changes)


def check(done: PrefillDone, prompt=PROMPT, key=KEY, now=1000.0, max_workers=1024) -> None:
    check_binding(done, prompt, key=key, now=now, max_workers=max_workers)


def test_signed_params_for_this_prompt_pass_after_a_json_round_trip():
    done = params().signed(KEY)
    again = parse_prefill_done(msgspec.json.decode(msgspec.json.encode(done.to_dict())))
    check(again)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"remote_host": "10.0.0.66"}, "bad_signature"),
        ({"remote_block_ids": [7, 8, 9]}, "bad_signature"),
        ({"remote_request_id": "victim"}, "bad_signature"),
        ({"remote_expires": 99999.0}, "bad_signature"),
        ({"kvbridge_sig": ""}, "unsigned"),
    ],
)
def test_edited_or_unsigned_params_are_refused(change, reason):
    done = msgspec.structs.replace(params().signed(KEY), **change)
    with pytest.raises(ParamsRefused) as err:
        check(done)
    assert err.value.reason == reason


def test_params_signed_with_another_key_are_refused():
    with pytest.raises(ParamsRefused, match="kvbridge_key_id") as err:
        check(params().signed(OTHER))
    assert err.value.reason == "unknown_key"
    ours = params().signed(KEY).kvbridge_key_id  # another key's signature under our key's id
    with pytest.raises(ParamsRefused, match="kvbridge_sig") as err:
        check(msgspec.structs.replace(params().signed(OTHER), kvbridge_key_id=ours))
    assert err.value.reason == "bad_signature"


def test_expired_params_are_refused():
    with pytest.raises(ParamsRefused) as err:
        check(params().signed(KEY), now=2100.0)
    assert err.value.reason == "expired"


def test_another_prompt_of_the_same_length_is_refused():
    other = [t + 1 for t in PROMPT]
    with pytest.raises(ParamsRefused) as err:
        check(params().signed(KEY), prompt=other)
    assert err.value.reason == "prompt_hash"
    with pytest.raises(ParamsRefused) as err:
        check(params().signed(KEY), prompt=PROMPT[:-1])
    assert err.value.reason == "prompt_length"


def test_a_huge_layout_is_refused_before_anything_is_built():
    done = params(remote_layout="pp=100000,tp=100000").signed(KEY)
    with pytest.raises(ParamsRefused) as err:
        check(done)
    assert err.value.reason == "layout"


def test_without_a_key_signatures_are_not_required_but_the_prompt_still_is():
    check(params(), key=None)
    with pytest.raises(ParamsRefused):
        check(params(), prompt=PROMPT[::-1], key=None)


def test_prompt_hash_is_stable_and_order_sensitive():
    assert prompt_hash([1, 2, 3]) == prompt_hash((1, 2, 3))
    assert prompt_hash([1, 2, 3]) != prompt_hash([3, 2, 1])
    assert prompt_hash([1, 2, 3]) == "4636993d3e1da4e9d6b8f87b79e8f7c6"  # pinned: the same on every platform and run
    assert len(prompt_hash([])) == 32


def test_a_sealed_frame_hides_its_body_and_is_bound_to_its_destination():
    """Protocol 3: the body is encrypted (not in the frame; two seals of one body differ), the request
    is bound to a destination identity (another one's server drops it, counted as misaddressed), the answer to
    its request's nonce, and a flipped ciphertext byte fails the MAC. Control: the right destination opens it."""
    from kvbridge.wire.auth import destination

    clock = Clock(1000.0)
    body = b"agent-metadata:" + bytes(range(200))
    here, there = destination(5600, "engine-a", 0, 1, 2), destination(5600, "engine-b", 0, 1, 2)
    client = Sealer(KEY, clock=clock)
    frame, nonce = client.seal_request(body, here)
    assert body[:16] not in frame and frame != client.seal_request(body, here)[0]
    elsewhere = Sealer(KEY, clock=clock)
    assert elsewhere.open_request(frame, there) is None and elsewhere.dropped["misaddressed"] == 1
    flipped = bytearray(frame)
    flipped[60] ^= 1
    server = Sealer(KEY, clock=clock)
    assert server.open_request(bytes(flipped), here) is None and server.dropped["unauthenticated"] == 1
    assert server.open_request(frame, here) == (body, nonce)
    answer = server.seal_answer(body, nonce)
    assert body[:16] not in answer
    assert client.open_answer(answer, client.seal_request(b"other", here)[1]) is None  # another request's
    assert client.open_answer(answer, nonce) == body
