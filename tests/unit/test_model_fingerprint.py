"""Model identity: two checkpoints of one geometry with other weights get other fingerprints (without the whole
files being read), the handshake refuses a peer of another fingerprint naming the parts that differ, and signed
params carry the fingerprint."""

from __future__ import annotations

import json
import os
import random
import struct
from pathlib import Path

import msgspec
import pytest

from kvbridge.core.errors import IncompatiblePeerError, ParamsRefused
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.model_identity import ModelFingerprint
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.vllm import fingerprint
from kvbridge.wire import messages as wire
from kvbridge.wire.params import PrefillDone, check_binding, prompt_hash

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32", block_size=4)


def checkpoint(folder: Path, seed: int, floats: int = 1 << 16) -> Path:
    """A safetensors file of one float32 tensor with seeded values, and a tokenizer file."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    data = struct.pack(f"<{floats}f", *(rng.uniform(-1, 1) for _ in range(floats)))
    header = json.dumps({"w": {"dtype": "F32", "shape": [floats], "data_offsets": [0, len(data)]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + data)
    (folder / "tokenizer.json").write_text('{"vocab": 1024}')
    return folder


def test_other_weights_of_the_same_shapes_get_another_weights_digest(tmp_path):
    a, b = checkpoint(tmp_path / "a", seed=0), checkpoint(tmp_path / "b", seed=1)
    same = checkpoint(tmp_path / "elsewhere" / "a", seed=0)  # the same checkpoint at another path
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    assert fingerprint.weights_digest(a) != fingerprint.weights_digest(b)
    assert fingerprint.weights_digest(a) == fingerprint.weights_digest(same)
    assert fingerprint.tokenizer_digest(a) == fingerprint.tokenizer_digest(b)


def test_the_weights_digest_reads_windows_not_whole_files(tmp_path, monkeypatch):
    """A large file costs SAMPLES windows, not its size: count the bytes read."""
    folder = checkpoint(tmp_path / "big", seed=3, floats=1 << 20)  # 4 MiB
    read = []
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def read(self, n=-1):
            out = self.f.read(n)
            read.append(len(out))
            return out

        def seek(self, at):
            return self.f.seek(at)

    monkeypatch.setattr(fingerprint, "open", lambda p, mode="r": Counting(real_open(p, mode)), raising=False)
    fingerprint.weights_digest(folder)
    assert sum(read) <= fingerprint.SAMPLES * fingerprint.WINDOW + 4096 < (4 << 20) // 8


def test_a_hugging_face_blob_is_named_by_its_content_hash(tmp_path):
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for digest in ("a" * 64, "b" * 64):
        (blobs / digest).write_bytes(b"\0" * 100)
    os.symlink(blobs / ("a" * 64), snapshot / "model.safetensors")
    first = fingerprint.weights_digest(snapshot)
    (snapshot / "model.safetensors").unlink()
    os.symlink(blobs / ("b" * 64), snapshot / "model.safetensors")
    assert fingerprint.weights_digest(snapshot) != first  # same bytes, other content hash: trusted as named


def model(weights: str = "w0", **parts) -> ModelFingerprint:
    return ModelFingerprint(config="c", tokenizer="t", weights=weights, quantization="", kv_cache_dtype="auto", **parts)


def peers(ours: ModelFingerprint | None, theirs: ModelFingerprint | None):
    memory = synthesize_memory("LBHNC", GEOMETRY, [0, 1], 2, 16, 1 << 20)
    request = wire.HandshakeRequest.build(
        "d", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY, "LBHNC", memory, model=ours
    )
    reply = wire.HandshakeReply.build(
        "p", ParallelLayout(), 0, WorkerRank(0, 0), GEOMETRY, "LBHNC", "agent", b"meta", memory, model=theirs
    )
    return request, wire.decode(wire.encode(reply))


def test_the_handshake_refuses_another_fingerprint_naming_what_differs():
    with pytest.raises(IncompatiblePeerError, match="model_fingerprint is 'weights w0' here but 'weights w1'"):
        wire.check_compatible(*peers(model("w0"), model("w1")))
    with pytest.raises(IncompatiblePeerError, match=r"kv_cache_dtype auto.*kv_cache_dtype fp8"):
        wire.check_compatible(
            *peers(model(), ModelFingerprint(config="c", tokenizer="t", weights="w0", kv_cache_dtype="fp8"))
        )
    with pytest.raises(IncompatiblePeerError, match="model_fingerprint"):  # one side without a fingerprint
        wire.check_compatible(*peers(model(), None))
    request, reply = peers(model("w0"), model("w1"))
    refused = wire.answer_handshake(reply, request)  # the prefill refuses too, and the decode reads why
    assert isinstance(refused, wire.HandshakeRefused) and refused.field == "model_fingerprint"
    wire.check_compatible(*peers(model("w0"), model("w0")))  # control: the same model passes
    wire.check_compatible(*peers(None, None))  # engines without a model (tests) pass as before


PROMPT = list(range(1, 21))


def params(remote_model: str) -> PrefillDone:
    return PrefillDone(
        remote_engine_id="p",
        remote_request_id="r",
        remote_block_ids=[1],
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_layout="pp=1,tp=1",
        remote_num_tokens=len(PROMPT),
        remote_prompt_hash=prompt_hash(PROMPT),
        remote_model=remote_model,
    )


def test_signed_params_carry_the_fingerprint_and_another_is_refused():
    key = b"fingerprint-test-key-0123456789abcdef"
    a, b = model("w0").digest, model("w1").digest
    done = params(a).signed(key)
    check_binding(done, PROMPT, key=key, now=0.0, max_workers=8, model=a)  # control: the same model
    with pytest.raises(ParamsRefused, match=r"remote_model .* differs from this instance's in weights \(") as err:
        check_binding(done, PROMPT, key=key, now=0.0, max_workers=8, model=b)
    assert err.value.reason == "model"
    stripped = msgspec.structs.replace(done, remote_model="")  # the fingerprint is signed: not removable
    with pytest.raises(ParamsRefused) as err:
        check_binding(stripped, PROMPT, key=key, now=0.0, max_workers=8, model=b)
    assert err.value.reason == "bad_signature"
