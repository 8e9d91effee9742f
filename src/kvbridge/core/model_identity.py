"""What makes a KV cache this model's beyond its geometry: two instances with the same layers, heads and dtypes but
other weights (a rolling update), another tokenizer, quantization or KV-cache dtype compute other KV, which
the other would read silently. Each part is a short digest, computed once per process at startup
(`kvbridge.vllm.fingerprint`); the handshake carries them and the decode refuses a peer whose parts differ,
naming them; signed kv_transfer_params carry the whole fingerprint (`digest`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

PARTS = ("config", "tokenizer", "weights", "quantization", "kv_cache_dtype")


@dataclass(frozen=True)
class ModelFingerprint:
    config: str = ""
    """Digest of the model's configuration as the engine uses it (paths and library versions left out)."""
    tokenizer: str = ""
    """Digest of the tokenizer's files ("" without any)."""
    weights: str = ""
    """Digest of the weights' files: names, sizes, safetensors headers and sampled content (or the content hashes a
    Hugging Face cache names its files by); "dummy" for vLLM's load_format=dummy."""
    quantization: str = ""
    """The quantization method ("" for none)."""
    kv_cache_dtype: str = ""
    """vLLM's kv_cache_dtype setting ("auto", "fp8", ...)."""

    @property
    def digest(self) -> str:
        """The whole fingerprint: one 8-hex digest per part in PARTS order, joined by "." (44 characters), so a
        decode that receives it can name the parts that differ (`digest_differences`); "" when nothing is known
        (an engine without a model: tests)."""
        if not any(getattr(self, part) for part in PARTS):
            return ""
        return ".".join(_part_digest(part, getattr(self, part)) for part in PARTS)

    def differences(self, other: ModelFingerprint) -> list[str]:
        """The parts on which the two differ, in PARTS order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def describe(self, parts: list[str]) -> str:
        """`parts` with their values, for an error: "weights 0f3e..., config 8a1b..."."""
        return ", ".join(f"{part} {getattr(self, part) or '-'}" for part in parts)


def _part_digest(part: str, value: str) -> str:
    return hashlib.sha256(f"kvbridge-model-v2\0{part}={value}".encode()).hexdigest()[:8]


def digest_differences(theirs: str, ours: str) -> list[str]:
    """The parts on which two `ModelFingerprint.digest` strings differ, in PARTS order; every part when either is
    not of that form."""
    a, b = theirs.split("."), ours.split(".")
    if len(a) != len(PARTS) or len(b) != len(PARTS):
        return list(PARTS)
    return [part for part, x, y in zip(PARTS, a, b, strict=True) if x != y]
