"""The MLA model's end-to-end pairs (tiny DeepSeek-V2 through kvbridge) for tests/e2e/test_e2e_mla.py: the model,
the four `kv_both` servers, the pairs and their arithmetic classes, one pair's run and its transfer checks, and the
reference: vLLM's own NixlConnector servers and their output for a prompt.

MLA caches one latent per (layer, token): [kv_c 512 | k_pe 64] in float32, no V, block size 16 (vLLM's CPU MLA
forces it), the same on every TP rank. The model's greedy output depends on the computation path (docs/models.md),
so a pair's reference is an output of the same arithmetic: a pipeline split does not change a layer's arithmetic, a
TP split does, so pairs with the same (prefill TP, decode TP) agree token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvbridge.serving.launcher import RequestFailed, VllmServer, free_base_port, free_port, metrics
from kvbridge.testing.tiny_models import MLA_KV_LORA_RANK, MLA_ROPE_DIM, build_tiny_deepseek_v2
from support.e2e_support import FOUR, SOURCE, UNCHECKED, Leg, delta, disaggregated, layout_servers

NUM_LAYERS = 4
BLOCK = 16
LATENT_BYTES = (MLA_KV_LORA_RANK + MLA_ROPE_DIM) * 4  # one token of one layer, float32
PROMPT_LENGTHS = (37, 90)  # 3 and 6 blocks, the last ones partial
PROMPT_SEED = 20261201
MAX_TOKENS = 8
MAX_MODEL_LEN = 1024
# DeepSeek-V2 on vLLM's CPU backend: block 16 (forced anyway), no prefix caching (forced off for CPU MLA);
# CPU_MLA also on hosts with AMX, where vLLM would pick the bf16-only AMX_MLA.
MLA_ARGS = ("--no-enable-prefix-caching", "--attention-backend", "CPU_MLA")
SERVERS = {**FOUR, "pp2": FOUR["pp2"].but(kv=UNCHECKED)}  # pp2: the negative control's prefill

# Each arithmetic class (prefill TP, decode TP) and its pairs of the four servers; the first pair of a class is its
# reference in tests/e2e/test_e2e_mla.py.
CLASSES = {
    "tp1->tp1": [
        ("pp1a", "pp1b"),  # pp1 -> pp1
        ("pp2", "pp1a"),  # pp2 -> pp1
    ],
    "tp2->tp1": [
        ("tp2", "pp1b"),  # tp2 -> tp1: layers 0-1 from prefill rank 0, 2-3 from rank 1
        ("tp2", "pp2"),  # tp2 -> pp2: stage 0 reads from prefill rank 0, stage 1 from rank 1
    ],
    "tp1->tp2": [
        ("pp1b", "tp2"),  # pp1 -> tp2: each decode rank reads the whole latent (pp1b: on another core than tp2)
        ("pp2", "tp2"),  # pp2 -> tp2: each decode rank reads the whole latent of each stage
    ],
}
PAIRS = [pair for pairs in CLASSES.values() for pair in pairs]
CLASS_OF = {pair: name for name, pairs in CLASSES.items() for pair in pairs}


def build_model(root: Path) -> Path:
    return build_tiny_deepseek_v2(root / "model", num_layers=NUM_LAYERS)


def mla_servers(model: Path, root: Path) -> dict[str, VllmServer]:
    """The four `kv_both` kvbridge servers of `SERVERS` (not started: pass them to `running`)."""
    return layout_servers(
        model, root, SERVERS, prefix="mla-", args=MLA_ARGS, block_size=BLOCK, max_model_len=MAX_MODEL_LEN
    )


def wrong_blocks(params: dict) -> dict:
    """Every remote block id replaced by the first: the decode loads the prompt's first 16 latents into every block.
    (Reversing the block order would not do: attention over latents whose rope is already applied does not depend
    on their order.)"""
    return dict(params, remote_block_ids=[params["remote_block_ids"][0]] * len(params["remote_block_ids"]))


def mla_leg(prefill: VllmServer, decode: VllmServer, prompt: list[int], edit=None) -> Leg:
    return disaggregated(prefill, decode, prompt, MAX_TOKENS, edit)


@dataclass(frozen=True)
class PairRun:
    """One pair's legs over a batch and the decode server's metrics just before and after them."""

    prefill: str
    decode: str
    batch: list[list[int]]
    legs: list[Leg]
    before: dict
    after: dict

    @property
    def tokens(self) -> list[list[int]]:
        return [leg.tokens for leg in self.legs]

    def moved_bytes(self) -> float:
        return delta(self.before, self.after, "vllm:kvbridge_bytes_total")


class PairRuns:
    """Each pair's run over the batch, made once when first asked for and kept for the module's other tests."""

    def __init__(self, servers: dict[str, VllmServer], batch: list[list[int]]) -> None:
        self.servers = servers
        self.batch = batch
        self._runs: dict[tuple[str, str], PairRun] = {}

    def __call__(self, prefill: str, decode: str) -> PairRun:
        if (prefill, decode) not in self._runs:
            p, d = self.servers[prefill], self.servers[decode]
            before = metrics(d.url)
            legs = [mla_leg(p, d, prompt) for prompt in self.batch]
            self._runs[prefill, decode] = PairRun(prefill, decode, self.batch, legs, before, metrics(d.url))
        return self._runs[prefill, decode]


def check_transfer(run: PairRun) -> None:
    """The decode server loaded every prompt token through kvbridge from a prefill of the pair's layout, computed
    none, and moved each (layer, block) of the latent once per decode worker."""
    for leg in run.legs:
        assert leg.params["remote_layout"].startswith(SERVERS[run.prefill].layout)
    moved = delta(run.before, run.after, SOURCE, source="external_kv_transfer")
    assert moved == sum(map(len, run.batch)), "the decode server did not load every prompt token through kvbridge"
    assert delta(run.before, run.after, SOURCE, source="local_compute") == 0, "the decode server recomputed tokens"
    # Every decode worker holds the whole latent of its stage's layers (TP replicates it): each (layer, block)
    # is read once per decode TP rank, from one prefill worker (a latent read from two prefill TP ranks would
    # double it).
    blocks = sum(-(-len(prompt) // BLOCK) for prompt in run.batch)
    decode_tp = SERVERS[run.decode].tp
    assert run.moved_bytes() == decode_tp * NUM_LAYERS * blocks * BLOCK * LATENT_BYTES


# vLLM's NixlConnector gives its UCX backend 4 threads unless told otherwise (`num_threads`), beside NIXL's progress
# thread, which polls without pause; with the reference's four workers on 2 cores the machine ran at 60-78% system
# time. Without the extra threads (as kvbridge's own transport runs) a worker made half the system calls, and the same
# KV moves.
NIXL_EXTRA = {"num_threads": 0}

# A pair's two NixlConnector servers never share a core: NixlConnector's handshakes time out when they do (a CI run
# saw pp1->tp2 recompute a prompt with n2 on "0|1" beside n1a on "0"). n1b (core 0) is the decode of the first two
# pairs and the prefill of the third. {name: (tp, cores)}
NIXL_SERVERS = {"n1a": (1, "1"), "n1b": (1, "0"), "n2": (2, "1|1")}
NIXL_PAIRS = {"tp1->tp1": ("n1a", "n1b"), "tp2->tp1": ("n2", "n1b"), "tp1->tp2": ("n1b", "n2")}  # by CLASSES' keys


def nixl_server(model: Path, name: str, cores: str, root: Path, tp: int) -> VllmServer:
    """A `kv_both` server with vLLM's own NixlConnector, for the reference (not started)."""
    return VllmServer(
        model,
        port=free_port(),
        tp=tp,
        cpu_bind=cores,
        block_size=BLOCK,
        max_model_len=MAX_MODEL_LEN,
        extra_args=MLA_ARGS,
        kv_transfer_config={
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": NIXL_EXTRA,
            # A failed handshake (NixlConnector's waits 5 s for an answer) recomputes the prompt: with "fail" the
            # request fails and vLLM 0.32's engine shuts down (seen once on 2 loaded cores).
            "kv_load_failure_policy": "recompute",
        },
        env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_base_port(8))},
        name=f"mla-nixl-{name}",
        log_path=root / f"nixl-{name}.log",
    )


def nixl_reference(prefill: VllmServer, decode: VllmServer, prompt: list[int], pair: str, attempts: int = 3):
    """NixlConnector's output for `prompt`, from a run in which it transferred every prompt token.

    On 2 loaded cores NixlConnector sometimes recomputes a prompt instead (CI: tp2->pp1 moved 90 of 127 tokens:
    its handshake or read timed out), and a recomputed prompt's output is not the reference: that run is retried
    with a fresh prefill, up to `attempts` times. Its engines step continuously while they hold or await KV, and
    its API server once took over 10 s to answer /metrics in CI: a long timeout for the reference's metrics."""
    for _ in range(attempts):
        tokens = transferred_leg(prefill, decode, prompt)
        if tokens is not None:
            return tokens
        print(f"NixlConnector {pair} recomputed a {len(prompt)}-token prompt; trying again")
    print(f"NixlConnector {pair}: no reference for a {len(prompt)}-token prompt ({attempts} runs recomputed it)")
    return None


def transferred_leg(prefill: VllmServer, decode: VllmServer, prompt: list[int]) -> list[int] | None:
    """The decode's output for `prompt` if it loaded every prompt token, else None (also if the request failed)."""
    before = metrics(decode.url, timeout=90)
    try:
        tokens = mla_leg(prefill, decode, prompt).tokens
    except RequestFailed as exc:
        print(f"NixlConnector: a request failed ({exc})")
        return None
    moved = delta(before, metrics(decode.url, timeout=90), SOURCE, source="external_kv_transfer")
    return tokens if moved == len(prompt) else None
