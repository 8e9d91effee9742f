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
        """The whole fingerprint, 32 hex; "" when nothing is known (an engine without a model: tests)."""
        if not any(getattr(self, part) for part in PARTS):
            return ""
        text = "\0".join(f"{part}={getattr(self, part)}" for part in PARTS)
        return hashlib.sha256(b"kvbridge-model-v1\0" + text.encode()).hexdigest()[:32]

    def differences(self, other: ModelFingerprint) -> list[str]:
        """The parts on which the two differ, in PARTS order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def describe(self, parts: list[str]) -> str:
        """`parts` with their values, for an error: "weights 0f3e..., config 8a1b..."."""
        return ", ".join(f"{part} {getattr(self, part) or '-'}" for part in parts)
