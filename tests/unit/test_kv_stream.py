"""kvbridge's KV channel at the byte level (`transport.kv_stream`), over socket pairs: key confirmation, sealed frames
in both modes, and what a peer without the key, a changed byte or a replayed frame gets."""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest

from kvbridge.core.config import BridgeConfig, rdma_device
from kvbridge.core.errors import ConfigError
from kvbridge.transport import kv_stream as ks

KEY = ks.stream_key(b"unit-test-deployment-key-0123456789")
OTHER = ks.stream_key(b"another-deployment-key-0123456789ab")


def connect(client_key=KEY, server_key=KEY, client_mode="encrypt", server_mode="encrypt"):
    """(client connection or exception, server connection or exception, the two raw sockets)."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    out = {}

    def serve():
        try:
            out["server"] = ks.server_handshake(b, server_key, server_mode)
        except Exception as exc:
            out["server"] = exc

    t = threading.Thread(target=serve)
    t.start()
    try:
        client = ks.client_handshake(a, client_key, client_mode)
    except Exception as exc:
        client = exc
        a.shutdown(socket.SHUT_RDWR)
    t.join(5)
    return client, out["server"], a, b


def test_the_channel_key_is_derived_not_the_master_key():
    master = b"unit-test-deployment-key-0123456789"
    assert ks.stream_key(master) != master and len(ks.stream_key(master)) == 32
    assert ks.stream_key(master) == KEY != OTHER


@pytest.mark.parametrize("mode", ["encrypt", "integrity"])
def test_frames_cross_both_ways_in_order(mode):
    client, server, *_ = connect(client_mode=mode, server_mode=mode)
    data = np.random.default_rng(1).integers(0, 255, 300_000, dtype=np.uint8)
    client.send(ks.KIND_MESSAGE, 0, b"request")
    assert server.recv(1 << 20) == (ks.KIND_MESSAGE, 0, bytearray(b"request"))
    sender = threading.Thread(target=lambda: [server.send(ks.KIND_DATA, i, data[i:]) for i in range(3)])
    sender.start()
    for i in range(3):
        kind, index, n = client.recv_header(1 << 20)
        out = np.empty(n, dtype=np.uint8)
        client.recv_into(memoryview(out))
        assert (kind, index) == (ks.KIND_DATA, i) and np.array_equal(out, data[i:])
    sender.join(5)


def test_encrypted_frames_do_not_carry_the_plaintext():
    a, b = socket.socketpair()
    keys = ks._session_keys(KEY, "encrypt", bytes(32), bytes(32), client=True)
    conn = ks.StreamConnection(a, keys, "encrypt")
    conn.send(ks.KIND_DATA, 0, b"USER-A PROMPT: my card is 4111" * 10)
    wire = b.recv(1 << 16)
    assert b"4111" not in wire and len(wire) == ks.HEADER.size + 300 + ks.TAG
    # the control: integrity-only frames carry it in clear (what the mode's docs say)
    conn = ks.StreamConnection(a, ks._session_keys(KEY, "integrity", bytes(32), bytes(32), client=True), "integrity")
    conn.send(ks.KIND_DATA, 0, b"USER-A PROMPT: my card is 4111" * 10)
    assert b"4111" in b.recv(1 << 16)


def test_a_peer_without_the_key_is_refused_on_both_sides():
    client, server, _, _b = connect(client_key=OTHER)
    assert isinstance(client, ks.StreamAuthError) and "did not prove" in str(client)
    assert isinstance(server, Exception)
    client, server, _a, _ = connect(server_key=OTHER)  # a server without the key: the reader never sends a request
    assert isinstance(client, ks.StreamAuthError) and isinstance(server, Exception)


def test_a_client_that_does_not_confirm_gets_nothing_more():
    """An outsider that sends a hello gets 32 random bytes and a MAC, then nothing: the server waits for the client's
    confirmation and closes on a wrong one (control: the right one opens the connection)."""
    for confirm_right in (False, True):
        a, b = socket.socketpair()
        a.settimeout(5)
        b.settimeout(5)
        out = {}

        def serve(b=b, out=out):
            try:
                out["server"] = ks.server_handshake(b, KEY)
            except Exception as exc:
                out["server"] = exc

        t = threading.Thread(target=serve)
        t.start()
        mine = bytes(32)
        hello = ks.HELLO.pack(ks.MAGIC, 1, bytes(ks.KEY_ID_BYTES), mine)
        a.sendall(hello)
        answer = ks._recv_bytes(a, ks.ANSWER.size)
        _, _, theirs, _ = ks.ANSWER.unpack(answer)
        if confirm_right:
            keys = ks._session_keys(KEY, "encrypt", mine, theirs, client=True)
            a.sendall(ks._confirmation(keys, b"client", hello + answer[: ks.ANSWER.size - ks.CONFIRM]))
        else:
            a.sendall(bytes(32))
        t.join(5)
        assert isinstance(out["server"], ks.StreamConnection) is confirm_right


@pytest.mark.parametrize("mode", ["encrypt", "integrity"])
def test_a_changed_byte_does_not_open(mode):
    a, b = socket.socketpair()
    send = ks.StreamConnection(a, ks._session_keys(KEY, mode, bytes(32), bytes(32), client=True), mode)
    relay_a, relay_b = socket.socketpair()
    recv = ks.StreamConnection(relay_b, ks._session_keys(KEY, mode, bytes(32), bytes(32), client=False), mode)
    send.send(ks.KIND_DATA, 7, b"x" * 1000)
    frame = bytearray(b.recv(1 << 16))
    frame[ks.HEADER.size + 500] ^= 1
    relay_a.sendall(frame)
    _kind, _index, n = recv.recv_header(1 << 20)
    with pytest.raises(ks.StreamAuthError):
        recv.recv_into(memoryview(bytearray(n)))


def test_a_replayed_frame_does_not_open_again_nor_on_another_connection():
    a, b = socket.socketpair()
    send = ks.StreamConnection(a, ks._session_keys(KEY, "encrypt", bytes(32), bytes(32), client=True), "encrypt")
    send.send(ks.KIND_DATA, 0, b"first")
    frame = b.recv(1 << 16)
    relay_a, relay_b = socket.socketpair()
    recv = ks.StreamConnection(relay_b, ks._session_keys(KEY, "encrypt", bytes(32), bytes(32), client=False), "encrypt")
    relay_a.sendall(frame + frame)
    assert recv.recv(1 << 20)[2] == bytearray(b"first")  # the control: once, it opens
    with pytest.raises(ks.StreamAuthError):
        recv.recv(1 << 20)
    other = ks.StreamConnection(  # another connection's randoms: other keys
        relay_b, ks._session_keys(KEY, "encrypt", bytes(32), b"\1" * 32, client=False), "encrypt"
    )
    relay_a.sendall(frame)
    with pytest.raises(ks.StreamAuthError):
        other.recv(1 << 20)


def test_modes_that_differ_are_refused_naming_both():
    client, _server, *_ = connect(client_mode="integrity", server_mode="encrypt")
    assert isinstance(client, ks.StreamAuthError)
    assert "kv_stream_encrypt" in str(client) and "'integrity'" in str(client) and "'encrypt'" in str(client)


def test_an_oversized_frame_is_refused_before_it_is_read():
    client, server, *_ = connect()
    client.send(ks.KIND_MESSAGE, 0, b"x" * 5000)
    with pytest.raises(ks.StreamAuthError, match="5000 bytes"):
        server.recv_header(4096)


# -- the configuration that keeps UCX's tcp off the network -------------------------------------------


@pytest.mark.parametrize(
    "devices", ["eth0", "all", "lo,eth1", "ib0", "mlx5_0:1,eth0", "eth0:1", "ib0:1", "enp1s0f0:1", "mlx5_0:", ":1"]
)
def test_ucx_devices_beyond_loopback_refuse_to_start_without_the_opt_in(devices):
    with pytest.raises(ConfigError, match="ucx_tcp_exposes_process_memory") as err:
        BridgeConfig(ucx_net_devices=devices).ucx_devices("eth0")
    assert "ucx_net_devices" in str(err.value)
    with pytest.raises(ConfigError, match="the environment's UCX_NET_DEVICES"):
        BridgeConfig().ucx_devices("eth0", env_devices=devices)
    # the control: with the opt-in the same devices are taken
    assert BridgeConfig(ucx_net_devices=devices, ucx_tcp_exposes_process_memory=True).ucx_devices("eth0") == devices


def test_the_default_keeps_ucx_on_loopback_and_rdma_devices():
    assert BridgeConfig(side_channel_host="10.0.0.5").ucx_devices("eth0") == "lo"
    assert BridgeConfig(ucx_net_devices="mlx5_0:1,lo").ucx_devices("eth0") == "mlx5_0:1,lo"
    assert BridgeConfig(side_channel_host="10.0.0.5", ucx_tcp_exposes_process_memory=True).ucx_devices("eth0") == "eth0"
    assert not BridgeConfig().nixl_crosses_hosts()
    assert BridgeConfig(ucx_net_devices="mlx5_0:1").nixl_crosses_hosts()
    assert BridgeConfig(ucx_tcp_exposes_process_memory=True).nixl_crosses_hosts()
    assert BridgeConfig().nixl_crosses_hosts(env_devices="mlx5_1:1")


@pytest.mark.parametrize("device", ["mlx5_0:1", "mlx4_1:2", "bnxt_re0:1", "irdma0:1", "efa_0:1", "rxe0:1", "siw0:1"])
def test_rdma_devices_with_a_port_are_taken(device):
    assert rdma_device(device)
    assert BridgeConfig(ucx_net_devices=f"{device},lo").ucx_devices("eth0") == f"{device},lo"
    assert BridgeConfig(ucx_net_devices=device).nixl_crosses_hosts()
    assert not rdma_device(device.split(":")[0]), "the control: without a port it is not a UCX RDMA device"


@pytest.mark.parametrize("device", ["eth0:1", "ib0:1", "enp1s0f0:1", "bond0:0", "lo:1"])
def test_interface_aliases_are_not_rdma_devices(device):
    assert not rdma_device(device)
    assert not BridgeConfig(ucx_net_devices=device).nixl_crosses_hosts()


def test_a_server_accepting_several_keys_picks_the_clients_by_id():
    """While a key is rotated a server accepts several stream keys by their deployment key's id: a client naming
    an accepted id with its key connects; one naming an id the server does not hold is cut (control: the same
    key under an accepted id connects, so the id is what decides)."""
    keys = {b"old-key1": OTHER, b"new-key1": KEY}

    def attempt(key_id: bytes, key: bytes):
        a, b = socket.socketpair()
        a.settimeout(5)
        b.settimeout(5)
        out = {}

        def serve():
            try:
                out["server"] = ks.server_handshake(b, keys)
            except Exception as exc:
                out["server"] = exc

        t = threading.Thread(target=serve)
        t.start()
        try:
            client = ks.client_handshake(a, key, key_id=key_id)
        except Exception as exc:
            client = exc
        t.join(5)
        a.close()
        b.close()
        return client, out["server"]

    client, server = attempt(b"new-key1", KEY)
    assert isinstance(client, ks.StreamConnection) and isinstance(server, ks.StreamConnection)
    client, server = attempt(b"old-key1", OTHER)
    assert isinstance(client, ks.StreamConnection) and isinstance(server, ks.StreamConnection)
    client, server = attempt(b"unknown!", KEY)
    assert isinstance(server, ks.StreamAuthError) and not isinstance(client, ks.StreamConnection)


def test_the_channel_label_is_the_key_rings_label():
    """transport.kv_stream.PURPOSE and wire.keys.STREAM name one label (the layers keep them apart in the code)."""
    from kvbridge.wire.keys import STREAM

    assert ks.PURPOSE == STREAM
