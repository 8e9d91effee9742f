"""Selective disaggregation with real vLLM servers (a prefill and a decode kvbridge server, one core each) behind
the `kvbridge proxy` command: a conversation's first turn goes through the prefill server and its KV reaches the
decode server through kvbridge; its second turn, a few new tokens on top, goes straight to that decode server,
which serves the first turn's tokens from its own prefix cache (`local_cache_hit`); both outputs are token-identical
to the aggregated server's."""

from __future__ import annotations

import importlib.util
import sys

import httpx
import pytest

from kvbridge.serving.launcher import complete, metric_sum, metrics, running
from kvbridge.serving.tiny_model import build_tiny_model
from support.e2e_support import SOURCE, Place, layout_servers, prompts
from support.proxy import proxy_process, wait_for

BLOCK = 32  # vLLM CPU attention takes multiples of 32
THRESHOLD = 64


def tokens(url: str, source: str) -> float:
    return metric_sum(metrics(url), SOURCE, source=source)


def decisions(proxy_url: str, path: str) -> float:
    text = httpx.get(proxy_url + "/metrics", timeout=5).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f'{_DECISIONS}{{path="{path}"'))


_DECISIONS = "kvbridge_proxy_decisions_total"


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_second_turn_goes_straight_to_the_decode_holding_the_first(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    places = {"prefill": Place(1, 1, "0"), "decode": Place(1, 1, "1")}
    servers = layout_servers(model, tmp_path, places, block_size=BLOCK)
    with running(list(servers.values())):
        prefill, decode = servers["prefill"], servers["decode"]
        cmd = [sys.executable, "-m", "kvbridge.serving.cli", "proxy", "--prefill", prefill.url, "--decode", decode.url]
        cmd += ["--port", "0", "--log-level", "warning", "--disaggregation", "selective"]
        cmd += ["--direct-below-tokens", str(THRESHOLD), "--prefix-block-tokens", str(BLOCK)]
        with proxy_process(cmd) as url:
            first, new = prompts(25, (300, 20))
            reply1 = complete(url, first, 8, timeout=120)
            out1 = reply1["choices"][0]["token_ids"]
            loaded = tokens(decode.url, "external_kv_transfer")
            assert loaded >= len(first) - BLOCK, "the first turn's KV did not reach the decode through kvbridge"
            assert decisions(url, "disaggregated") == 1

            second = [*first, *out1, *new]  # the conversation so far, then the new turn
            before = {s: tokens(decode.url, s) for s in ("local_cache_hit", "local_compute", "external_kv_transfer")}
            prefilled_before = tokens(prefill.url, "local_compute") + tokens(prefill.url, "local_cache_hit")
            out2 = complete(url, second, 8, timeout=120)["choices"][0]["token_ids"]
            assert decisions(url, "direct") == 1
            wait_for(lambda: tokens(decode.url, "local_cache_hit") > before["local_cache_hit"], timeout=10)
            hit = tokens(decode.url, "local_cache_hit") - before["local_cache_hit"]
            computed = tokens(decode.url, "local_compute") - before["local_compute"]
            print(
                f"second turn: {len(second)} prompt tokens, {hit:.0f} from the decode's cache, {computed:.0f} computed"
            )
            assert hit >= (len(first) // BLOCK) * BLOCK  # the first turn's full blocks, at least
            assert hit + computed == len(second)
            assert tokens(decode.url, "external_kv_transfer") == before["external_kv_transfer"]  # nothing loaded
            assert tokens(prefill.url, "local_compute") + tokens(prefill.url, "local_cache_hit") == prefilled_before

        # the aggregated server: the prefill server answering alone (no kv_transfer_params), salted so that its
        # own prefix cache from the first turn plays no part
        alone = [
            complete(prefill.url, p, 8, timeout=120, cache_salt="alone")["choices"][0]["token_ids"]
            for p in (first, second)
        ]
        assert [out1, out2] == alone
