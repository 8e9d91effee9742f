"""A tiny Qwen2-architecture model with seeded random weights, for real-vLLM tests, the demo and benchmarks.

vLLM loads it with `load_format=auto` (safetensors + config.json). By default no tokenizer is written, so
servers run with `--skip-tokenizer-init` and take prompts as token ids. With `tokenizer=True` a byte-level BPE
tokenizer of the model's vocab size is written too (`tokenizer.json`, `tokenizer_config.json` with a ChatML-like
chat template), trained with the `tokenizers` library on a fixed corpus in this file, so the same run always
gives the same tokenizer; vLLM then serves text prompts and chat without `--skip-tokenizer-init`. The tokenizer
does not touch the weights: they depend on the seed only. The weights are real (not `load_format=dummy`), so
every TP shard sees the same model and greedy outputs can be compared across layouts (in float32).

Defaults: 4 layers, hidden 256, 8 attention heads, 4 KV heads, head_dim 32 (vLLM's CPU attention supports head
sizes 32, 64, 80, ...), so TP 1/2/4 split the KV heads evenly and PP 1/2/4 split the layers. Weights are drawn
with std 0.2 rather than HF's 0.02: with 0.02 greedy generation falls into 1-2 token loops.

    python -m kvbridge.serving.tiny_model OUT_DIR [--num-layers N] [--tokenizer] [--overwrite]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

STAMP = "kvbridge_tiny_model.json"
# vllm/v1/attention/backends/cpu_attn.py: CPUAttentionBackend.get_supported_head_sizes() in vLLM 0.32
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_STAMP_VERSION = 1
_TOKENIZER_VERSION = 1
"""Part of the stamp when a tokenizer is asked for: bump it when the corpus or the training changes."""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Token ids 0, 1, 2. `<|endoftext|>` is bos and pad, `<|im_end|>` eos (the end of a chat turn)."""
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """
A key-value cache holds, for every layer of a transformer, the keys and values of the tokens seen so far. When a
prompt arrives, the prefill computes the whole cache in one pass; each decode step then adds one token and reads
all the cache again. Prefill is bound by compute, decode by memory bandwidth, so a deployment may run them on
different machines: a prefill server computes the prompt's cache, a decode server reads it over the network and
generates the answer. The cache is split into blocks of sixteen tokens; a request owns a list of block ids.
Pipeline parallel servers split the layers into stages, tensor parallel servers split the attention heads into
ranks, and data parallel servers run several engines side by side. Moving a cache between two layouts means
reading, for each decode worker, the layers and heads it owns from the prefill workers that hold them.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick daft
zebras jump! Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly.
def transfer(blocks, source, target):
    for block in blocks:
        target.write(block, source.read(block))
    return len(blocks)
class Lease:
    def __init__(self, request_id, expires):
        self.request_id = request_id
        self.expires = expires
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096 8192 3.14159 2.71828 1e-6 0x7f
Punctuation and symbols: ( ) [ ] { } < > = + - * / % & | ^ ~ ! ? , . ; : ' " ` @ # $ _ \\ and newlines.
User: What is the capital of France? Assistant: The capital of France is Paris.
User: Write a haiku about autumn. Assistant: Red leaves drift and fall, the river carries them home, cold wind
in the pines.
User: Summarize the meeting. Assistant: The team agreed to ship on Friday, to fix the two open bugs first, and
to meet again next week to plan the release after that.
Once upon a time there was a small robot who wanted to learn every language in the world. It read books in the
morning, listened to songs in the afternoon and wrote letters to its friends every evening.
Weather report: cloudy skies over the northern mountains, light rain expected near the coast, temperatures
between twelve and nineteen degrees, winds from the southwest, clearing by Thursday with sunshine everywhere.
Recipe: whisk three eggs with flour, sugar, butter and a pinch of salt; bake for thirty minutes until golden;
serve warm with honey, cinnamon, fresh strawberries or chocolate sauce.
History: ancient libraries gathered scrolls on astronomy, medicine, geometry, philosophy and poetry; scholars
copied, translated and debated them for centuries, through empires, revolutions, plagues and discoveries.
Science: photosynthesis converts sunlight, water and carbon dioxide into glucose and oxygen; electrons move
through membranes, enzymes catalyze reactions, and chlorophyll absorbs mostly blue and red wavelengths.
Travel: the overnight train leaves the central station at eleven, crosses bridges, tunnels and vineyards, and
arrives by breakfast in a harbour town famous for lighthouses, seafood, markets and narrow cobblestone alleys.
"""


def write_tokenizer(out_dir: str | Path, vocab: int, max_positions: int = 4096) -> Path:
    """Train a byte-level BPE tokenizer of exactly `vocab` tokens on the fixed corpus and save it in `out_dir`
    (tokenizer.json, tokenizer_config.json). Deterministic: the same arguments give the same files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _CORPUS.splitlines()
    tokenizer.train_from_iterator([line for line in corpus if line] * 3, trainer=trainer)
    size = tokenizer.get_vocab_size()
    if size < vocab:  # the corpus ran out of merges: fill up with plain added tokens, so ids cover the model's
        tokenizer.add_tokens([f"<|extra_{i}|>" for i in range(vocab - size)])
    if tokenizer.get_vocab_size() != vocab:
        raise ValueError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, the model {vocab}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0],
        "model_max_length": max_positions,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    return out


def model_spec(**kwargs: object) -> dict[str, object]:
    """What a builder's stamp records: its arguments and the stamp version."""
    return {"stamp_version": _STAMP_VERSION, **kwargs}


def decoder_keywords(
    *,
    vocab: int,
    hidden: int,
    intermediate: int,
    num_layers: int,
    num_heads: int,
    max_positions: int,
    init_std: float,
    dtype: str,
) -> dict[str, object]:
    """What every tiny decoder's transformers config takes alike: sizes, no tied embeddings, no special tokens
    (prompts are token ids)."""
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "max_position_embeddings": max_positions,
        "initializer_range": init_std,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": dtype,
    }


def build_once(out_dir: str | Path, spec: dict[str, object], overwrite: bool, make) -> Path:
    """The steps every builder shares: a model already built with `spec` is reused; otherwise `make(out)` saves
    one and the stamp is written last (a half-written directory is never taken for a built one)."""
    out = Path(out_dir)
    if overwrite or not is_built(out, spec):
        make(out)
        (out / STAMP).write_text(json.dumps(spec, indent=1, sort_keys=True) + "\n")
    return out


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
    tokenizer: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write the model to `out_dir` (config.json + model.safetensors, and with `tokenizer` the tokenizer of
    `write_tokenizer`) and return the directory.

    Idempotent: a stamp file records the arguments; if it matches, the existing model is reused.
    `head_dim` defaults to hidden // num_heads, `intermediate` to 2 * hidden.
    """
    head_dim = head_dim if head_dim is not None else hidden // num_heads
    intermediate = intermediate if intermediate is not None else 2 * hidden
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim not in CPU_HEAD_SIZES:
        raise ValueError(f"head_dim must be one of {CPU_HEAD_SIZES} (vLLM's CPU attention), got {head_dim}")
    spec = model_spec(
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
    if tokenizer:  # only then: the stamps (and so the cached models) of token-id callers stay as they were
        spec["tokenizer"] = _TOKENIZER_VERSION
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
        from transformers import Qwen2Config, Qwen2ForCausalLM

        save_seeded(
            Qwen2ForCausalLM, Qwen2Config(**common, num_key_value_heads=num_kv_heads, head_dim=head_dim), seed, out
        )
        if tokenizer:
            write_tokenizer(out, vocab, max_positions)

    return build_once(out_dir, spec, overwrite, make)


def is_built(out: Path, spec: dict[str, object]) -> bool:
    """The model in `out` was built with exactly `spec` (its stamp says so) and its weights are there."""
    stamp = out / STAMP
    if not (stamp.is_file() and (out / "model.safetensors").is_file()):
        return False
    try:
        return json.loads(stamp.read_text()) == spec
    except (OSError, ValueError):
        return False


def save_seeded(model_class, config, seed: int, out: Path) -> None:
    """Build `model_class(config)` in the config's dtype with weights seeded by `seed` and save it to `out`,
    removing the stamp first (`build_once` writes it last)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).to(getattr(torch, str(config.dtype).removeprefix("torch."))).eval()
    out.mkdir(parents=True, exist_ok=True)
    (out / STAMP).unlink(missing_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    names = set(model.state_dict())
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as saved:
        missing = sorted(names - set(saved.keys()))
    # vLLM's "weights not initialized" check skips unquantized linear layers: a weight missing from the file
    # would leave a layer at vLLM's own initial values without any error, so check here.
    if missing and not getattr(config, "tie_word_embeddings", False):
        raise ValueError(f"weights missing from the saved model: {missing[:5]}")


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
    parser.add_argument("--tokenizer", action="store_true", help="also write a byte-level BPE tokenizer")
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
        tokenizer=args.tokenizer,
        overwrite=args.overwrite,
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
