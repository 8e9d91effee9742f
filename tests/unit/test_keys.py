"""Keys derived from the deployment key, a standard AEAD for frames, key ids and rotation, key strength, request
tokens a prefill worker checks before it holds the request, and the explicit keyless flag."""

from __future__ import annotations

import hashlib
import hmac

import msgspec
import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvbridge.core.config import BridgeConfig
from kvbridge.core.errors import ConfigError, ParamsRefused
from kvbridge.wire import auth
from kvbridge.wire import messages as wire
from kvbridge.wire.auth import Sealer, destination
from kvbridge.wire.keys import (
    FRAMES,
    MIN_KEY_BYTES,
    PARAMS,
    KeyRing,
    derive_key,
    load_keys,
    request_token,
    token_is_ours,
)
from kvbridge.wire.params import PrefillDone, check_binding, prompt_hash
from kvbridge.wire.side_channel_client import exchange
from kvbridge.wire.side_channel_server import SideChannelServer

OLD = b"old-deployment-key-0123456789abcdef"
NEW = b"new-deployment-key-0123456789abcdef"
DEST = destination(5600, "engine-p")


def fixed(now: float = 1000.0):
    return lambda: now


def test_a_frame_is_standard_aes_gcm_under_the_derived_frames_key_with_the_header_as_associated_data():
    """Anyone with `cryptography` and HKDF opens a frame: no construction of kvbridge's own. The control: the
    master key itself does not open it (it never encrypts)."""
    frame, _ = Sealer(NEW, clock=fixed()).seal_request(b"claim body", DEST)
    header, sealed = bytes(frame[: auth._HEADER]), bytes(frame[auth._HEADER :])
    nonce = header[auth._NONCE_AT : auth._BINDING_AT]
    assert header.startswith(b"KVB3Q")
    assert AESGCM(derive_key(NEW, FRAMES)).decrypt(nonce, sealed, header) == b"claim body"
    with pytest.raises(InvalidTag):
        AESGCM(hashlib.sha256(NEW).digest()).decrypt(nonce, sealed, header)


@pytest.mark.parametrize(
    ("where", "what"),
    [(4, "kind"), (auth._TS_AT + 7, "timestamp"), (auth._BINDING_AT, "binding"), (auth._HEADER + 1, "body")],
)
def test_any_changed_byte_of_header_or_body_fails_authentication(where, what):
    """The header is associated data: a refreshed timestamp (a replay made fresh), another binding or kind fails
    like a flipped body byte. Control: the frame as sealed opens."""
    frame, _ = Sealer(NEW, clock=fixed()).seal_request(b"x" * 64, DEST)
    server = Sealer(NEW, clock=fixed())
    changed = bytearray(frame)
    changed[where] ^= 1
    assert server.open_request(bytes(changed), DEST) is None, what
    assert server.dropped["unauthenticated"] + server.dropped["misaddressed"] + server.dropped["unrelated"] == 1
    assert server.open_request(bytes(frame), DEST)[0] == b"x" * 64


@pytest.mark.parametrize("magic", [b"KVB1", b"KVB2"])
def test_frames_of_earlier_formats_are_refused_as_old_format(magic):
    frame, _ = Sealer(NEW, clock=fixed()).seal_request(b"x", DEST)
    server = Sealer(NEW, clock=fixed())
    assert server.open_request(magic + bytes(frame[4:]), DEST) is None
    assert server.dropped == {"old_format": 1}


def test_nonces_never_repeat_within_a_sealer():
    sealer = Sealer(NEW, clock=fixed())
    tickets = {sealer.seal_request(b"", DEST)[1] for _ in range(5000)}
    assert len(tickets) == 5000


# --- derived keys, key ids, rotation ------------------------------------------------------------------------


def test_params_are_signed_with_a_derived_key_never_the_master_key():
    """A client that receives params sees an HMAC made with a key derived by HKDF: a guess of the master key
    must go through HKDF to be checked. Control: the HMAC of the same payload with the master key differs."""
    done = params().signed(NEW)
    payload = done._payload()
    derived = hmac.new(derive_key(NEW, PARAMS), b"kv_transfer_params-v2|" + payload, hashlib.sha256).hexdigest()
    master = hmac.new(NEW, b"kv_transfer_params-v2|" + payload, hashlib.sha256).hexdigest()
    assert done.kvbridge_sig == derived != master
    assert len({derive_key(NEW, FRAMES), derive_key(NEW, PARAMS), NEW}) == 3


def test_a_key_id_names_the_key_in_frames_and_params():
    ring = KeyRing.of(NEW)
    frame, ticket = Sealer(NEW, clock=fixed()).seal_request(b"x", DEST)
    assert bytes(frame[auth._KEY_AT : auth._TS_AT]) == ring.current.key_id == ticket[-8:]
    assert params().signed(NEW).kvbridge_key_id == ring.current.key_id.hex()
    assert KeyRing.of(OLD).current.key_id != ring.current.key_id


def rotating(tmp_path, current: bytes, *accepted: bytes) -> KeyRing:
    files = []
    for i, key in enumerate((current, *accepted)):
        path = tmp_path / f"key{i}-{key[:3].decode()}"
        path.write_bytes(key + b"\n")
        files.append(str(path))
    return load_keys(None, files[0], files[1:])


def test_an_instance_rotated_to_a_new_key_still_talks_to_one_on_the_old_key(tmp_path):
    """Rotation instance by instance, on real sockets: a server that sends with NEW and accepts OLD answers a
    client still on OLD (with OLD, which that client opens), and the reverse. Negative control: a server on NEW
    alone drops the OLD client's frames (a timeout, counted)."""
    rotated = rotating(tmp_path, NEW, OLD)
    ack = wire.Ack(request_id="r")
    with SideChannelServer(0, lambda m: ack, sealer=Sealer(rotated)) as server:
        assert exchange("127.0.0.1", server.port, wire.Ack(), timeout_s=2, sealer=Sealer(OLD)) == ack
        assert exchange("127.0.0.1", server.port, wire.Ack(), timeout_s=2, sealer=Sealer(NEW)) == ack
    with SideChannelServer(0, lambda m: ack, sealer=Sealer(OLD)) as server:
        assert (
            exchange("127.0.0.1", server.port, wire.Ack(), timeout_s=2, sealer=Sealer(rotating(tmp_path, OLD, NEW)))
            == ack
        )
    with SideChannelServer(0, lambda m: ack, sealer=Sealer(NEW)) as server:
        with pytest.raises(Exception, match="no answer"):
            exchange("127.0.0.1", server.port, wire.Ack(), timeout_s=0.3, retries=0, sealer=Sealer(OLD))
        assert server.sealer.dropped["unauthenticated"] == 1


def test_params_signed_with_a_previous_key_pass_where_it_is_accepted(tmp_path):
    old_params = params().signed(OLD)
    check_binding(old_params, PROMPT, key=rotating(tmp_path, NEW, OLD), now=1000.0, max_workers=8)
    with pytest.raises(ParamsRefused) as err:  # control: not accepted there
        check_binding(old_params, PROMPT, key=KeyRing.of(NEW), now=1000.0, max_workers=8)
    assert err.value.reason == "unknown_key" and old_params.kvbridge_key_id in str(err.value)


# --- key strength --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "ok"),
    [
        (b"k" * (MIN_KEY_BYTES - 1), False),
        (b"k" * MIN_KEY_BYTES, True),
        (b"ab" * (MIN_KEY_BYTES - 1), False),  # 62 hex digits: 31 bytes of key material
        (b"ab" * MIN_KEY_BYTES, True),  # 64 hex digits (`openssl rand -hex 32`, what kvbridge serve writes)
    ],
)
def test_keys_under_32_bytes_of_material_are_refused_naming_the_field(tmp_path, key, ok):
    path = tmp_path / "deployment.key"
    path.write_bytes(key)
    if ok:
        assert load_keys(None, str(path)) is not None
        return
    with pytest.raises(ConfigError, match=r"auth_key_file .*deployment.key.* holds .*at least 32 bytes"):
        load_keys(None, str(path))


def test_a_weak_accepted_key_is_refused_too(tmp_path):
    good, weak = tmp_path / "good", tmp_path / "weak"
    good.write_bytes(NEW)
    weak.write_bytes(b"short")
    with pytest.raises(ConfigError, match=r"auth_accepted_key_files .*weak.* holds 5 bytes"):
        load_keys(None, str(good), [str(weak)])


def test_the_keys_kvbridge_serve_makes_are_strong_enough(tmp_path):
    from kvbridge.serving.launcher import ensure_key_file

    path, created = ensure_key_file(tmp_path / "made.key")
    assert created and load_keys(None, str(path)) is not None


# --- request tokens ----------------------------------------------------------------------------------------


def test_a_request_token_is_checked_without_knowing_the_request():
    ring = KeyRing.of(NEW)
    token = request_token(ring, "engine-p", "req-1", b"\x01" * 8)
    assert len(token) == 48 and token_is_ours(ring, "engine-p", "req-1", token)
    assert not token_is_ours(ring, "engine-p", "req-2", token)  # another request's
    assert not token_is_ours(ring, "engine-q", "req-1", token)  # another engine's
    assert not token_is_ours(KeyRing.of(OLD), "engine-p", "req-1", token)  # another key's
    assert not token_is_ours(ring, "engine-p", "req-1", "f" * 48)  # a guess
    assert not token_is_ours(ring, "engine-p", "req-1", "zz" + token[2:])


# --- keyless only behind an explicit flag ------------------------------------------------------------------


def test_keyless_needs_the_flag_that_names_what_it_exposes():
    with pytest.raises(ConfigError, match=r"keyless_exposes_kv_to_local_processes.*read and write the KV"):
        BridgeConfig().check_auth(False)
    BridgeConfig(keyless_exposes_kv_to_local_processes=True).check_auth(False)  # control: with the flag
    BridgeConfig().check_auth(True)  # control: with a key
    with pytest.raises(ConfigError, match="keyless_exposes_kv_to_local_processes is true but an auth key"):
        BridgeConfig(keyless_exposes_kv_to_local_processes=True).check_auth(True)


PROMPT = list(range(10, 30))


def params() -> PrefillDone:
    return PrefillDone(
        remote_engine_id="p",
        remote_request_id="req",
        remote_block_ids=[1, 2],
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_layout="pp=1,tp=1",
        remote_num_tokens=len(PROMPT),
        remote_prompt_hash=prompt_hash(PROMPT),
        remote_token="t" * 48,
        remote_expires=2000.0,
    )


def test_signed_params_round_trip_their_key_id():
    done = params().signed(NEW)
    again = msgspec.json.decode(msgspec.json.encode(done.to_dict()), type=PrefillDone)
    assert again.verify(NEW) and not again.verify(OLD)


def test_large_frames_round_trip_on_real_sockets():
    """Bodies of 64 KiB and more are sealed into one buffer (`encrypt_into`) and opened in place: a 1 MiB request
    and a 2 MiB answer, through `exchange` and a kept client."""
    big = wire.ErrorReply(message="x" * (2 << 20))
    with SideChannelServer(0, lambda m: big, sealer=Sealer(NEW), max_message_bytes=4 << 20) as server:
        request = wire.ErrorReply(message="y" * (1 << 20))
        assert exchange("127.0.0.1", server.port, request, timeout_s=5, sealer=Sealer(NEW)) == big
        from kvbridge.wire.side_channel_client import SideChannelClient

        client = SideChannelClient(timeout_s=5, sealer=Sealer(NEW))
        try:
            assert client.exchange_all([("127.0.0.1", server.port)], request) == [big]
        finally:
            client.close()
