"""Wire format: round trips, compatibility refusals naming the field, and ProtocolError for bad bytes."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.core.errors import IncompatiblePeerError, LayoutError, ProtocolError
from kvbridge.core.memory import NAMED_LAYOUTS, synthesize_memory
from kvbridge.core.topology import DTYPE_SIZES, KVGeometry, ParallelLayout, WorkerRank
from kvbridge.wire import messages as wire

GEOMETRY = KVGeometry(num_layers=8, num_kv_heads=4, head_size=64, dtype="bfloat16", block_size=16)
PREFILL = ParallelLayout(pp=2, tp=2, dp=2)
PREFILL_WORKER = (1, WorkerRank(1, 0))
DECODE = ParallelLayout()


def make_reply(
    layout: ParallelLayout = PREFILL,
    geometry: KVGeometry = GEOMETRY,
    dp_rank: int = 1,
    rank: WorkerRank = PREFILL_WORKER[1],
    kv_layout: str = "LBHNC",
    num_blocks: int = 32,
    base: int = 1 << 32,
) -> wire.HandshakeReply:
    memory = synthesize_memory(
        kv_layout,
        geometry,
        list(layout.stage_layers(geometry.num_layers, rank.pp)),
        len(layout.kv_heads(geometry.num_kv_heads, rank.tp)),
        num_blocks,
        base,
        device_id=rank.tp,
    )
    return wire.HandshakeReply.build(
        "prefill-0", layout, dp_rank, rank, geometry, kv_layout, "agent-p", b"\x00nixl\xff", memory
    )


def make_request(
    layout: ParallelLayout = DECODE,
    geometry: KVGeometry = GEOMETRY,
    kv_layout: str = "LBNHC",
    target: tuple[int, WorkerRank] | None = PREFILL_WORKER,
) -> wire.HandshakeRequest:
    memory = synthesize_memory(kv_layout, geometry, range(geometry.num_layers), geometry.num_kv_heads, 8, 1 << 20)
    return wire.HandshakeRequest.build(
        "decode-0", layout, 0, WorkerRank(0, 0), geometry, kv_layout, memory, target=target
    )


def _builtins(message: wire.Message) -> dict:
    """The message as the plain dict msgpack carries (bytes kept as bytes)."""
    return msgspec.to_builtins(message, builtin_types=(bytes,))


# --- strategies ---------------------------------------------------------------------------------------------


@st.composite
def deployments(draw: st.DrawFn) -> tuple[ParallelLayout, KVGeometry, int, WorkerRank]:
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    tp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    pp = draw(st.integers(1, 4))
    num_layers = draw(st.integers(pp, 48))
    partition = None
    if draw(st.booleans()):
        inner = st.integers(1, num_layers - 1) if num_layers > 1 else st.nothing()
        cuts = sorted(draw(st.sets(inner, min_size=pp - 1, max_size=pp - 1)))
        bounds = [0, *cuts, num_layers]
        partition = tuple(b - a for a, b in itertools.pairwise(bounds))
    layout = ParallelLayout(pp=pp, tp=tp, dp=draw(st.integers(1, 4)), layer_partition=partition)
    geometry = KVGeometry(
        num_layers=num_layers,
        num_kv_heads=heads,
        head_size=draw(st.sampled_from([16, 64, 80, 128, 256])),
        dtype=draw(st.sampled_from(sorted(DTYPE_SIZES))),
        block_size=draw(st.sampled_from([1, 16, 64, 128])),
    )
    dp_rank = draw(st.integers(0, layout.dp - 1))
    rank = WorkerRank(draw(st.integers(0, pp - 1)), draw(st.integers(0, tp - 1)))
    return layout, geometry, dp_rank, rank


@st.composite
def replies(draw: st.DrawFn) -> tuple[wire.HandshakeReply, tuple]:
    layout, geometry, dp_rank, rank = draw(deployments())
    kv_layout = draw(st.sampled_from(sorted(NAMED_LAYOUTS)))
    memory = synthesize_memory(
        kv_layout,
        geometry,
        list(layout.stage_layers(geometry.num_layers, rank.pp)),
        len(layout.kv_heads(geometry.num_kv_heads, rank.tp)),
        draw(st.integers(1, 64)),
        draw(st.integers(0, 1 << 50)),
        device_id=draw(st.integers(0, 7)),
    )
    engine_id, agent_name = draw(st.text(max_size=30)), draw(st.text(max_size=30))
    metadata = draw(st.binary(max_size=512))
    core = (engine_id, layout, dp_rank, rank, geometry, kv_layout, agent_name, metadata, memory)
    return wire.HandshakeReply.build(*core), core


def msgpack_values() -> st.SearchStrategy[object]:
    """Random msgpack-able values, maps biased towards our tags and field names."""
    tags = st.sampled_from([m.__struct_config__.tag for m in wire.MESSAGE_TYPES])
    names = [f for m in wire.MESSAGE_TYPES for f in m.__struct_fields__] + ["type", "pp", "addr", "layers"]
    leaves = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    leaves |= st.binary(max_size=8) | tags
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.sampled_from(names) | st.text(max_size=4), inner, max_size=6)
        ),
        max_leaves=20,
    )


# --- round trips --------------------------------------------------------------------------------------------


@given(replies())
def test_reply_round_trips_and_converts_back_to_core(case: tuple[wire.HandshakeReply, tuple]) -> None:
    reply, (engine_id, layout, dp_rank, rank, geometry, kv_layout, agent, metadata, memory) = case
    decoded = wire.decode(wire.encode(reply))
    assert decoded == reply
    assert isinstance(decoded, wire.HandshakeReply)
    assert decoded.protocol_version == wire.PROTOCOL_VERSION
    assert decoded.engine_id == engine_id and decoded.agent_name == agent
    assert decoded.agent_metadata == metadata and decoded.kv_layout == kv_layout
    assert decoded.layout.to_core() == layout
    assert (decoded.worker.dp_rank, decoded.worker.rank) == (dp_rank, rank)
    assert decoded.geometry.to_core() == geometry
    assert decoded.memory.to_core() == memory
    wire.check_compatible(decoded, decoded)


@given(deployments(), st.sampled_from(sorted(NAMED_LAYOUTS)), st.none() | st.tuples(st.integers(0, 3)))
def test_request_round_trips(deployment: tuple, kv_layout: str, target: tuple | None) -> None:
    layout, geometry, dp_rank, rank = deployment
    memory = synthesize_memory(kv_layout, geometry, [0], 1, 4, 0)
    request = wire.HandshakeRequest.build(
        "d", layout, dp_rank, rank, geometry, kv_layout, memory, target=target and (target[0], rank)
    )
    assert wire.decode(wire.encode(request)) == request
    assert request.page_format() == (memory.layers[0].num_planes, memory.layers[0].row_bytes)


@pytest.mark.parametrize(
    "message",
    [
        make_request(),
        make_request(target=None),
        make_reply(),
        wire.HandshakeRefused(field="head_size", ours=64, theirs=128),
        wire.HandshakeRefused(field="layer_partition", ours=[3, 5], theirs=None),
        wire.Notify(request_id="r1", engine_id="decode-0", worker=wire.Worker(dp_rank=0, pp=1, tp=0)),
        wire.Abort(request_id="r1", engine_id="decode-0", worker=wire.Worker(), reason="cancelled"),
        wire.Ack(request_id="r1"),
        wire.Ack(),
        wire.ErrorReply(message="bad"),
    ],
    ids=lambda m: type(m).__name__,
)
def test_every_message_round_trips(message: wire.Message) -> None:
    data = wire.encode(message)
    assert msgspec.msgpack.decode(data)["type"] == message.__struct_config__.tag
    assert wire.decode(data) == message


def test_a_claim_carries_one_groups_blocks_as_before_and_several_groups_per_group() -> None:
    worker = wire.Worker()
    one = wire.Claim(request_id="r", engine_id="d", worker=worker, **wire.Claim.blocks_of(((3, 1, 2),)))
    assert one.block_ids == (3, 1, 2) and one.group_block_ids == () and one.groups == ((3, 1, 2),)
    several = wire.Claim(request_id="r", engine_id="d", worker=worker, **wire.Claim.blocks_of(((3,), (), (1, 2))))
    assert several.block_ids == () and several.groups == ((3,), (), (1, 2))
    for claim in (one, several):
        assert wire.decode(wire.encode(claim)) == claim
    older = _builtins(one)
    del older["group_block_ids"]  # from a peer before per-group claims: its one list
    assert wire.decode(msgspec.msgpack.encode(older)).groups == ((3, 1, 2),)


def test_encode_refuses_what_is_not_a_message() -> None:
    with pytest.raises(TypeError):
        wire.encode(wire.Worker())  # type: ignore[arg-type]


def test_unknown_fields_are_ignored_and_new_fields_default() -> None:
    """Schema evolution: a newer peer's extra fields are ignored; an older peer's missing ones default."""
    reply = make_reply()
    as_dict = _builtins(reply)
    as_dict["field_from_the_future"] = {"x": 1}
    as_dict["memory"]["layers"][0]["also_new"] = 7
    assert wire.decode(msgspec.msgpack.encode(as_dict)) == reply
    request = _builtins(make_request())
    for field in ("target", "num_planes", "protocol_version"):
        del request[field]
    decoded = wire.decode(msgspec.msgpack.encode(request))
    assert isinstance(decoded, wire.HandshakeRequest)
    assert (decoded.target, decoded.num_planes, decoded.protocol_version) == (None, 1, wire.PROTOCOL_VERSION)


def test_worker_and_refusal_helpers() -> None:
    worker = wire.Worker.from_core(1, WorkerRank(0, 3))
    assert str(worker) == "dp1/pp0/tp3" and worker.rank == WorkerRank(0, 3)
    with pytest.raises(LayoutError, match="dp rank 1"):
        worker.check_in(ParallelLayout(tp=4))
    refused = wire.HandshakeRefused(field="head_size", ours=64, theirs=128)
    error = refused.to_error()  # from the requester's side: its own value first
    assert (error.field, error.ours, error.theirs) == ("head_size", 128, 64)
    assert wire.HandshakeRefused.from_error(error) == wire.HandshakeRefused(field="head_size", ours=128, theirs=64)
    odd = wire.HandshakeRefused.from_error(IncompatiblePeerError("x", WorkerRank(0, 1), (1, WorkerRank(0, 0))))
    assert wire.decode(wire.encode(odd)) == wire.HandshakeRefused(field="x", ours="pp0/tp1", theirs=[1, "pp0/tp0"])


# --- compatibility ------------------------------------------------------------------------------------------


def test_compatible_peers_with_different_layouts_and_physical_orders() -> None:
    reply, request = (
        make_reply(kv_layout="LBHNC"),
        make_request(ParallelLayout(pp=4, tp=1), kv_layout="BLNHC"),
    )
    wire.check_compatible(reply, request)
    wire.check_compatible(request, reply)
    assert wire.answer_handshake(reply, request) is reply


def _geometry(**changes: object) -> KVGeometry:
    return KVGeometry(**{**GEOMETRY.__dict__, **changes})


@pytest.mark.parametrize(
    ("request_", "field", "ours", "theirs"),
    [
        (
            msgspec.structs.replace(make_request(), protocol_version=wire.PROTOCOL_VERSION + 1),
            "protocol_version",
            wire.PROTOCOL_VERSION,
            wire.PROTOCOL_VERSION + 1,
        ),
        (make_request(geometry=_geometry(num_layers=16)), "num_layers", 8, 16),
        (make_request(geometry=_geometry(num_kv_heads=8)), "num_kv_heads", 4, 8),
        (make_request(geometry=_geometry(head_size=128)), "head_size", 64, 128),
        (make_request(geometry=_geometry(dtype="float16")), "dtype", "bfloat16", "float16"),
        (make_request(geometry=_geometry(block_size=32)), "block_size", 16, 32),
        (make_request(kv_layout="KV_NHD"), "num_planes", 1, 2),
        (msgspec.structs.replace(make_request(), row_bytes=64), "row_bytes", 256, 64),
        (
            msgspec.structs.replace(
                make_request(),
                geometry=wire.Geometry(
                    **{**msgspec.structs.asdict(wire.Geometry.from_core(GEOMETRY)), "dtype": "float4_e2m1"}
                ),
            ),
            "dtype",
            "bfloat16",
            "float4_e2m1",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_mismatch_is_refused_naming_the_field_and_both_values(
    request_: wire.HandshakeRequest, field: str, ours: object, theirs: object
) -> None:
    reply = make_reply()
    with pytest.raises(IncompatiblePeerError) as info:
        wire.check_compatible(reply, request_)
    assert (info.value.field, info.value.ours, info.value.theirs) == (field, ours, theirs)
    assert field in str(info.value) and repr(ours) in str(info.value) and repr(theirs) in str(info.value)
    with pytest.raises(IncompatiblePeerError) as swapped:  # the decode side sees it the other way round
        wire.check_compatible(request_, reply)
    assert (swapped.value.field, swapped.value.ours, swapped.value.theirs) == (field, theirs, ours)
    refused = wire.answer_handshake(reply, request_)
    assert refused == wire.HandshakeRefused(field=field, ours=ours, theirs=theirs)
    assert wire.decode(wire.encode(refused)) == refused


def test_wrong_target_is_refused_naming_the_worker() -> None:
    """The seed bug: a decode side that computes the wrong port reaches the wrong worker and must notice."""
    refused = wire.answer_handshake(make_reply(), make_request(target=(1, WorkerRank(0, 0))))
    assert refused == wire.HandshakeRefused(field="worker", ours="dp1/pp1/tp0", theirs="dp1/pp0/tp0")


@settings(max_examples=60)
@given(replies(), replies())
def test_compatibility_is_symmetric(a: tuple, b: tuple) -> None:
    def outcome(ours: wire.HandshakeReply, theirs: wire.HandshakeReply) -> tuple | None:
        try:
            wire.check_compatible(ours, theirs)
        except IncompatiblePeerError as exc:
            return exc.field, exc.ours, exc.theirs
        return None

    forward, backward = outcome(a[0], b[0]), outcome(b[0], a[0])
    assert (forward is None) == (backward is None)
    if forward is not None:
        assert forward == (backward[0], backward[2], backward[1])


@pytest.mark.parametrize(
    ("memory_of", "match"),
    [
        (WorkerRank(0, 0), "memory lacks"),  # stage 0's layers published by a stage-1 worker
        (WorkerRank(1, 1), None),  # tp rank 1 holds the same number of heads: consistent
    ],
)
def test_a_reply_that_contradicts_itself_is_a_protocol_error(memory_of: WorkerRank, match: str | None) -> None:
    wrong = make_reply(rank=memory_of)
    reply = msgspec.structs.replace(make_reply(), memory=wrong.memory)
    if match is None:
        wire.check_compatible(reply, make_request())
        return
    with pytest.raises(ProtocolError, match=match):
        wire.check_compatible(make_request(), reply)


def test_heads_and_layout_inconsistencies_are_protocol_errors() -> None:
    tp1 = make_reply(layout=ParallelLayout(pp=2, tp=1, dp=2), rank=WorkerRank(1, 0))
    too_many_heads = msgspec.structs.replace(make_reply(), memory=tp1.memory)
    with pytest.raises(ProtocolError, match="holds 4 KV heads"):
        wire.check_compatible(make_request(), too_many_heads)
    bad_layout = msgspec.structs.replace(make_request(), layout=wire.Layout(tp=3))
    with pytest.raises(ProtocolError, match="tp=3"):
        wire.check_compatible(make_reply(), bad_layout)


# --- bad bytes ----------------------------------------------------------------------------------------------


def _encoded(value: object) -> bytes:
    return msgspec.msgpack.encode(value)


def _with(message: wire.Message, path: tuple, value: object) -> bytes:
    data = _builtins(message)
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return _encoded(data)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "truncated"),
        (b"\xc1", "malformed"),
        (_encoded([1, 2, 3]), "Expected `object`"),
        (_encoded({"type": "nope"}), "Invalid value 'nope'"),
        (_encoded({"no_tag": 1}), "missing required field `type`"),
        (_encoded({"type": "ack", "request_id": 5}), "Expected `str`"),
        (_encoded({"type": "error"}), "missing required field `message`"),
        (_with(make_reply(), ("layout", "pp"), 0), r"Expected `int` >= 1"),
        (_with(make_reply(), ("layout", "layer_partition"), [8]), "layer_partition has 1 entries"),
        (_with(make_reply(), ("worker", "tp"), 2), "outside layout"),
        (_with(make_reply(), ("worker", "dp_rank"), 2), "dp rank 2 is outside dp=2"),
        (_with(make_reply(), ("memory", "layers"), []), "holds no layers"),
        (_with(make_reply(), ("memory", "layers", 0, "addr"), -1), r"Expected `int` >= 0"),
        (_with(make_reply(), ("memory", "layers", 0, "region"), 3), "names region 3"),
        (_with(make_reply(), ("memory", "layers", 0, "num_blocks"), 10**6), "outside its region"),
        (_with(make_reply(), ("memory", "layers", 0, "num_planes"), 3), r"Expected `int` <= 2"),
        (_with(make_reply(), ("memory", "layers", 0, "row_bytes"), 128), "one \\(num_planes, row_bytes\\)"),
        (_with(make_reply(), ("memory", "layers", 1, "layer"), 4), "appears twice"),
        (_with(make_reply(), ("agent_metadata",), "text"), "Expected `bytes`"),
        (_with(make_reply(), ("memory", "regions", 0, "addr"), 1.5), "Expected `int`, got `float`"),
        (_with(make_request(), ("target",), {"pp": "1"}), "Expected `int`"),
    ],
)
def test_bad_messages_are_protocol_errors(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        wire.decode(data)


def test_not_bytes_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="not bytes"):
        wire.decode("text")  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        wire.decode(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("message", [make_reply(), make_request(), wire.Ack(request_id="r")], ids=repr)
def test_every_truncation_and_trailing_bytes_are_protocol_errors(message: wire.Message) -> None:
    data = wire.encode(message)
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            wire.decode(data[:cut])
    with pytest.raises(ProtocolError, match="trailing"):
        wire.decode(data + b"\x00")


def _decodes_or_protocol_error(data: bytes) -> None:
    try:
        message = wire.decode(data)
    except ProtocolError:
        return
    assert isinstance(message, wire.MESSAGE_TYPES)


@given(st.binary(max_size=300))
def test_fuzzed_bytes_never_raise_anything_but_protocol_error(data: bytes) -> None:
    _decodes_or_protocol_error(data)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(msgpack_values())
def test_fuzzed_msgpack_values_never_raise_anything_but_protocol_error(value: object) -> None:
    _decodes_or_protocol_error(_encoded(value))


_REPLY_BYTES = wire.encode(make_reply())


@given(st.lists(st.tuples(st.integers(0, len(_REPLY_BYTES) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_corrupted_replies_never_raise_anything_but_protocol_error(flips: list[tuple[int, int]]) -> None:
    data = bytearray(_REPLY_BYTES)
    for index, byte in flips:
        data[index] = byte
    _decodes_or_protocol_error(bytes(data))


def test_peer_version_reads_the_version_of_messages_we_cannot_decode() -> None:
    future = _builtins(make_request())
    future.update(protocol_version=7, layout="a new shape")
    data = _encoded(future)
    with pytest.raises(ProtocolError):
        wire.decode(data)
    assert wire.peer_version(data) == 7
    assert wire.peer_version(wire.encode(make_reply())) == wire.PROTOCOL_VERSION
    assert wire.peer_version(wire.encode(wire.Ack())) is None
    assert wire.peer_version(b"\xc1garbage") is None
    assert wire.peer_version(_encoded({"protocol_version": "x"})) is None


def test_cuda_ipc_handles_travel_in_the_handshake():
    from kvbridge.transport.cuda_ipc import IpcHandle

    handle = IpcHandle(
        device=1,
        handle=b"\x01" * 64,
        storage_bytes=1 << 30,
        storage_offset=0,
        ref_counter_handle=b"/torch_123_456",
        ref_counter_offset=8,
        event_handle=b"\x02" * 64,
        event_sync_required=True,
        region_offset=512,
        region_bytes=1 << 29,
    )
    reply = make_reply()
    with_ipc = msgspec.structs.replace(reply, ipc=(wire.IpcRegion.from_core(handle),))
    decoded = wire.decode(wire.encode(with_ipc))
    assert decoded.ipc[0].to_core() == handle
    assert wire.decode(wire.encode(reply)).ipc == ()  # a peer without GPU memory shares nothing
