"""A tiny Qwen2-architecture model with seeded random weights, for real-vLLM tests, the demo and benchmarks.

vLLM loads it with `load_format=auto` (safetensors + config.json); no tokenizer is written, so servers run
with `--skip-tokenizer-init` and take prompts as token ids. The weights are real (not `load_format=dummy`), so
every TP shard sees the same model and greedy outputs can be compared across layouts (in float32).

Defaults: 4 layers, hidden 256, 8 attention heads, 4 KV heads, head_dim 32 (vLLM's CPU attention supports head
sizes 32, 64, 80, ...), so TP 1/2/4 split the KV heads evenly and PP 1/2/4 split the layers. Weights are drawn
with std 0.2 rather than HF's 0.02: with 0.02 greedy generation falls into 1-2 token loops.

    python -m kvbridge.serving.tiny_model OUT_DIR [--num-layers N] [--overwrite]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

STAMP = "kvbridge_tiny_model.json"
# vllm/v1/attention/backends/cpu_attn.py: CPUAttentionBackend.get_supported_head_sizes() in vLLM 0.32
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_STAMP_VERSION = 1


def _spec(**kwargs: object) -> dict[str, object]:
    return {"stamp_version": _STAMP_VERSION, **kwargs}


def build_tiny_model(
    out_dir: str | Path,
    *,
    num_layers: int = 4,
    hidden: int = 256,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    head_dim: int | None = None,
    intermediate: int | None = None,
    vocab: int = 1024,
    max_positions: int = 4096,
    init_std: float = 0.2,
    seed: int = 0,
    dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
    """Write the model to `out_dir` (config.json + model.safetensors) and return the directory.

    Idempotent: a stamp file records the arguments; if it matches, the existing model is reused.
    `head_dim` defaults to hidden // num_heads, `intermediate` to 2 * hidden.
    """
    head_dim = head_dim if head_dim is not None else hidden // num_heads
    intermediate = intermediate if intermediate is not None else 2 * hidden
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim not in CPU_HEAD_SIZES:
        raise ValueError(f"head_dim must be one of {CPU_HEAD_SIZES} (vLLM's CPU attention), got {head_dim}")
    spec = _spec(
        num_layers=num_layers,
        hidden=hidden,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=vocab,
        max_positions=max_positions,
        init_std=init_std,
        seed=seed,
        dtype=dtype,
    )
    out = Path(out_dir)
    stamp = out / STAMP
    if not overwrite and stamp.is_file() and (out / "model.safetensors").is_file():
        try:
            if json.loads(stamp.read_text()) == spec:
                return out
        except (OSError, ValueError):
            pass

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        dtype=dtype,
    )
    torch_dtype = getattr(torch, dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch_dtype).eval()
    out.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(spec, indent=1, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbridge.serving.tiny_model", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    path = build_tiny_model(
        args.out_dir,
        num_layers=args.num_layers,
        hidden=args.hidden,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        vocab=args.vocab,
        seed=args.seed,
        dtype=args.dtype,
        overwrite=args.overwrite,
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
