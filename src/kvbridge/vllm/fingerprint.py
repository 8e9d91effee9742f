"""The model fingerprint of a vLLM engine (`core.model_identity.ModelFingerprint`), computed once per process.

Nothing reads the whole model a second time: the weights' part hashes each weight file's name, size and, for
safetensors, its header (tensor names, dtypes, shapes, offsets), and `SAMPLES` windows of `WINDOW` bytes spread
evenly over its content; a file that a Hugging Face cache keeps as a blob named by its SHA-256 is named by that
hash instead (exact, free). That tells apart two checkpoints of one geometry whose weights differ throughout (other
seeds, another fine-tune, a rolling update); an edit confined to bytes between the windows is not seen. The
tokenizer's files are small and hashed whole; the config is the engine's Hugging Face config without paths and
library versions; quantization and kv_cache_dtype are vLLM's settings.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from kvbridge.core.model_identity import ModelFingerprint

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)
SAMPLES = 64
WINDOW = 4096
MAX_HEADER = 100 << 20
_BLOB = re.compile(r"[0-9a-f]{64}")


def model_fingerprint(vllm_config: Any) -> ModelFingerprint:
    """The fingerprint of the model `vllm_config` serves; an empty one for a config without a model (tests)."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None:
        return ModelFingerprint()
    load = getattr(vllm_config, "load_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    return _fingerprint(
        str(getattr(mc, "model", "")),
        str(getattr(mc, "revision", None) or ""),
        str(getattr(mc, "tokenizer", None) or getattr(mc, "model", "")),
        str(getattr(load, "load_format", "") or ""),
        str(getattr(load, "download_dir", None) or ""),
        _config_digest(getattr(mc, "hf_config", None)),
        str(getattr(mc, "quantization", None) or ""),
        str(getattr(cache, "cache_dtype", "") or ""),
    )


@functools.lru_cache(maxsize=8)
def _fingerprint(
    model: str, revision: str, tokenizer: str, load_format: str, download_dir: str, config: str, quant: str, kv: str
) -> ModelFingerprint:
    folder = _local_folder(model, revision, download_dir)
    weights = "dummy" if load_format == "dummy" else weights_digest(folder) if folder else f"unresolved:{model}"
    tokenizer_folder = _local_folder(tokenizer, revision, download_dir) if tokenizer != model else folder
    found = ModelFingerprint(
        config=config,
        tokenizer=tokenizer_digest(tokenizer_folder) if tokenizer_folder else "",
        weights=weights,
        quantization=quant,
        kv_cache_dtype=kv,
    )
    logger.info("kvbridge: model fingerprint %s (%s)", found.digest, found.describe(list(found.__dataclass_fields__)))
    return found


def _local_folder(name: str, revision: str, download_dir: str) -> Path | None:
    """The folder holding `name`'s files: itself if it is one, else its snapshot in the Hugging Face cache."""
    if name and os.path.isdir(name):
        return Path(name)
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(name, revision=revision or None, cache_dir=download_dir or None, local_files_only=True)
    except Exception:  # not cached, or no huggingface_hub: the part names the model instead
        return None
    return Path(path)


def _config_digest(hf_config: Any) -> str:
    if hf_config is None:
        return ""
    try:
        data = hf_config.to_dict()
    except Exception:
        return ""
    kept = {k: v for k, v in data.items() if not k.startswith("_") and k != "transformers_version"}
    return _short(json.dumps(kept, sort_keys=True, default=str).encode())


def weights_digest(folder: Path) -> str:
    """16 hex naming the weight files in `folder` (see the module docstring); "" without any."""
    digest = hashlib.sha256(b"kvbridge-weights-v1\0")
    files = sorted(p for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file())
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        digest.update(_file_content_id(path))
    return digest.hexdigest()[:16] if files else ""


def _file_content_id(path: Path) -> bytes:
    target = Path(os.path.realpath(path))
    if target.parent.name == "blobs" and _BLOB.fullmatch(target.name):
        return b"sha256:" + target.name.encode()  # the Hugging Face cache names a large file by its SHA-256
    size = target.stat().st_size
    out = hashlib.sha256()
    with open(target, "rb") as f:
        start = 0
        if path.name.endswith(".safetensors") and size >= 8:
            header = int.from_bytes(f.read(8), "little")
            if 8 + header <= min(size, MAX_HEADER):
                out.update(f.read(header))
                start = 8 + header
        span = max(size - start - WINDOW, 0)
        for i in range(SAMPLES):
            f.seek(start + span * i // max(SAMPLES - 1, 1))
            out.update(f.read(WINDOW))
    return out.digest()


def tokenizer_digest(folder: Path) -> str:
    """16 hex of the tokenizer files in `folder`; "" without any."""
    digest = hashlib.sha256(b"kvbridge-tokenizer-v1\0")
    found = False
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            found = True
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16] if found else ""


def _short(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]
