"""Tiny seeded models of the families the end-to-end tests cover beside the demo's Qwen2 (which stays in
`kvbridge.serving.tiny_model`, with the kit these builders share): DeepSeek-V2 (MLA), a Llama alternating
sliding-window and full attention, NemotronH (a Mamba2 / attention hybrid). Tests only: nothing in the package
imports this module."""

from __future__ import annotations

import json
from pathlib import Path

from kvbridge.serving.tiny_model import CPU_HEAD_SIZES, STAMP, build_once, decoder_keywords, model_spec, save_seeded

MLA_KV_LORA_RANK = 512
MLA_ROPE_DIM = 64
"""vLLM 0.32's CPU MLA kernel is compiled for one latent width only: kv_lora_rank 512 + rope 64 = 576
(`CPUMLABackend.get_supported_head_sizes()`)."""


def build_tiny_deepseek_v2(
    out_dir: str | Path,
    *,
    num_layers: int = 4,
    hidden: int = 256,
    num_heads: int = 4,
    nope_dim: int = 32,
    v_dim: int = 32,
    intermediate: int = 512,
    vocab: int = 1024,
    max_positions: int = 4096,
    init_std: float = 0.2,
    seed: int = 0,
    dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
    """A tiny DeepSeek-V2 (MLA attention) in `out_dir`, every layer dense, with seeded weights; idempotent like
    `build_tiny_model`.

    MLA caches one latent per token and layer ([kv_c 512 | k_pe 64], no V), the same on every TP rank. The
    MoE fields are set but unused: `first_k_dense_replace = num_layers` makes every layer a dense MLP (vLLM's
    loader needs `n_routed_experts` set even then). `q_lora_rank=None` (a plain q_proj), and the rope and nope
    head dims differ (vLLM's config convertor rewrites them when they are equal).
    """
    if nope_dim == MLA_ROPE_DIM:
        raise ValueError(f"nope_dim must differ from the rope dim {MLA_ROPE_DIM} (vLLM's convertor rewrites it)")
    spec = model_spec(
        arch="deepseek_v2",
        num_layers=num_layers,
        hidden=hidden,
        num_heads=num_heads,
        nope_dim=nope_dim,
        v_dim=v_dim,
        intermediate=intermediate,
        vocab=vocab,
        max_positions=max_positions,
        init_std=init_std,
        seed=seed,
        dtype=dtype,
    )
    common = decoder_keywords(
        vocab=vocab,
        hidden=hidden,
        intermediate=intermediate,
        num_layers=num_layers,
        num_heads=num_heads,
        max_positions=max_positions,
        init_std=init_std,
        dtype=dtype,
    )

    def make(out: Path) -> None:
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config = DeepseekV2Config(
            **common,
            moe_intermediate_size=intermediate // 4,
            num_key_value_heads=num_heads,
            kv_lora_rank=MLA_KV_LORA_RANK,
            qk_rope_head_dim=MLA_ROPE_DIM,
            qk_nope_head_dim=nope_dim,
            v_head_dim=v_dim,
            q_lora_rank=None,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=num_layers,
            moe_layer_freq=1,
        )
        save_seeded(DeepseekV2ForCausalLM, config, seed, out)

    return build_once(out_dir, spec, overwrite, make)


def build_tiny_sliding_llama(
    out_dir: str | Path,
    *,
    num_layers: int = 4,
    sliding_window: int = 64,
    hidden: int = 256,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    head_dim: int = 32,
    intermediate: int = 512,
    vocab: int = 1024,
    max_positions: int = 4096,
    init_std: float = 0.2,
    seed: int = 0,
    dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
    """A tiny Llama whose layers alternate sliding-window and full attention (`layer_types`: layer 0 sliding,
    layer 1 full, ...), seeded weights, idempotent like `build_tiny_model`. With vLLM's hybrid KV-cache manager
    on, its KV cache is two groups (sliding-window layers, full-attention layers) aliasing one pool."""
    if head_dim not in CPU_HEAD_SIZES:
        raise ValueError(f"head_dim must be one of {CPU_HEAD_SIZES} (vLLM's CPU attention), got {head_dim}")
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    spec = model_spec(
        arch="llama_sliding",
        num_layers=num_layers,
        sliding_window=sliding_window,
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
    common = decoder_keywords(
        vocab=vocab,
        hidden=hidden,
        intermediate=intermediate,
        num_layers=num_layers,
        num_heads=num_heads,
        max_positions=max_positions,
        init_std=init_std,
        dtype=dtype,
    )

    def make(out: Path) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**common, num_key_value_heads=num_kv_heads, head_dim=head_dim)
        config.layer_types = layer_types  # vLLM's Llama reads it per layer (kept by LlamaConfig in transformers 5)
        config.sliding_window = sliding_window
        save_seeded(LlamaForCausalLM, config, seed, out)
        saved = json.loads((out / "config.json").read_text())
        if saved.get("layer_types") != layer_types or saved.get("sliding_window") != sliding_window:
            raise ValueError("the saved config.json lost layer_types or sliding_window")

    return build_once(out_dir, spec, overwrite, make)


def build_tiny_nemotron_h(
    out_dir: str | Path,
    *,
    pattern: str = "M*M*M*M*",
    hidden: int = 256,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    head_dim: int = 32,
    mamba_heads: int = 8,
    mamba_head_dim: int = 32,
    n_groups: int = 4,
    state_size: int = 16,
    intermediate: int = 512,
    vocab: int = 1024,
    max_positions: int = 4096,
    init_std: float = 0.2,
    seed: int = 0,
    dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
    """A tiny NemotronH (a Mamba2 / attention hybrid) in `out_dir` with seeded weights; idempotent like
    `build_tiny_model`. `pattern` has one letter per layer: M a Mamba2 layer, * an attention layer, - an MLP.
    vLLM serves it on CPU with `--no-enable-prefix-caching`; its cache holds Mamba state pages beside the
    attention KV (two KV-cache groups with the hybrid KV-cache manager on)."""
    kinds = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
    if not pattern or set(pattern) - set(kinds):
        raise ValueError(f"pattern must be letters of {sorted(kinds)}, got {pattern!r}")
    spec = model_spec(
        arch="nemotron_h",
        pattern=pattern,
        hidden=hidden,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        mamba_heads=mamba_heads,
        mamba_head_dim=mamba_head_dim,
        n_groups=n_groups,
        state_size=state_size,
        intermediate=intermediate,
        vocab=vocab,
        max_positions=max_positions,
        init_std=init_std,
        seed=seed,
        dtype=dtype,
    )

    def make(out: Path) -> None:
        import torch
        from transformers import NemotronHConfig, NemotronHForCausalLM

        config = NemotronHConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            layers_block_type=[kinds[c] for c in pattern],
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate,
            mamba_num_heads=mamba_heads,
            mamba_head_dim=mamba_head_dim,
            n_groups=n_groups,
            ssm_state_size=state_size,
            conv_kernel=4,
            chunk_size=64,
            max_position_embeddings=max_positions,
            initializer_range=init_std,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
            dtype=dtype,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = NemotronHForCausalLM(config).to(getattr(torch, dtype)).eval()
        out.mkdir(parents=True, exist_ok=True)
        (out / STAMP).unlink(missing_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as saved:  # transformers saves model.* as backbone.*
            names = {k.replace("backbone.", "model.", 1) for k in saved.keys()}  # noqa: SIM118 - not a dict
        missing = sorted(set(model.state_dict()) - names)
        if missing:  # see save_seeded: vLLM would not notice
            raise ValueError(f"weights missing from the saved model: {missing[:5]}")

    return build_once(out_dir, spec, overwrite, make)
