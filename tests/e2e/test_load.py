"""Load through the proxy against a prefill PP=2 / decode PP=1 pair: 64 requests at concurrency 16 in `make e2e`,
500 at concurrency 32 in `make e2e-long` (the same test, sized by its parameter).

Every prompt is distinct (no two share a first block), so the decode server's prefix cache cannot stand in for
the transfer: its `prompt_tokens_by_source{source="external_kv_transfer"}` must grow by every prompt token, and
its `local_compute` not at all. Every answer must equal the aggregated run of its prompt (computed on the
prefill server, which then serves the prefill legs from its own prefix cache), and afterwards both servers' KV
cache usage must be back to its baseline: no request leaks blocks on either side (held prefill blocks are freed
by the decode side's notifications, decode blocks when requests finish).
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvbridge.serving.launcher import (
    VllmServer,
    complete,
    free_base_port,
    free_port,
    kvbridge_config,
    metric_sum,
    metrics,
    post_json,
    running,
)

pytestmark = pytest.mark.vllm

SIZES = [
    pytest.param(64, 16, id="64-at-16"),
    pytest.param(500, 32, id="500-at-32", marks=pytest.mark.long),
]
SOURCE = "vllm:prompt_tokens_by_source_total"


def kv(role: str) -> dict:
    return kvbridge_config(role, side_channel_port=free_base_port(2), lease_s=60)


def aggregated(url: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy 8-token outputs of `prompts` run on one server, many prompts per request (vLLM batches them)."""
    body = {"prompt": prompts, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    choices = post_json(url + "/v1/completions", body, timeout=300)["choices"]
    assert sorted(c["index"] for c in choices) == list(range(len(prompts)))
    return [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]


def prompt_tokens(url: str) -> tuple[float, float]:
    """(prompt tokens loaded through the connector, prompt tokens computed locally) so far, from /metrics."""
    m = metrics(url)
    return metric_sum(m, SOURCE, source="external_kv_transfer"), metric_sum(m, SOURCE, source="local_compute")


@pytest.mark.parametrize(("requests", "concurrency"), SIZES)
def test_requests_at_concurrency_through_the_proxy(tmp_path, tiny_model, requests, concurrency):
    model = tiny_model
    prefill = VllmServer(
        model,
        port=free_port(),
        pp=2,
        cpu_bind="0|0",
        kv_transfer_config=kv("kv_producer"),
        name="load-prefill",
        log_path=tmp_path / "prefill.log",
    )
    decode = VllmServer(
        model,
        port=free_port(),
        cpu_bind="1",
        kv_transfer_config=kv("kv_consumer"),
        name="load-decode",
        log_path=tmp_path / "decode.log",
    )
    proxy = None
    proxy_log = open(tmp_path / "proxy.log", "wb")  # noqa: SIM115 - closed below, also on failure
    with running((prefill, decode)), ThreadPoolExecutor(concurrency) as pool, proxy_log:
        port = free_port()
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvbridge.serving.cli",
                "proxy",
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
                "--port",
                str(port),
            ],
            stdout=proxy_log,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                try:
                    metrics(url)
                    break
                except OSError:
                    assert time.monotonic() < deadline and proxy.poll() is None, "the proxy did not start"
                    time.sleep(0.2)
            rng = random.Random(5)
            prompts = [[rng.randrange(1, 1000) for _ in range(rng.randrange(20, 400))] for _ in range(requests)]
            assert len({tuple(p[:16]) for p in prompts}) == requests, "prompts must not share a prefix"
            t0 = time.monotonic()
            chunks = [prompts[i : i + 25] for i in range(0, requests, 25)]
            references = [r for chunk in pool.map(lambda c: aggregated(prefill.url, c), chunks) for r in chunk]
            print(f"\naggregated references in {time.monotonic() - t0:.1f} s")
            base_p, base_d = prefill.kv_usage(), decode.kv_usage()
            loaded0, computed0 = prompt_tokens(decode.url)
            t0 = time.monotonic()
            answers = list(pool.map(lambda p: complete(url, p, 8, timeout=300)["choices"][0]["token_ids"], prompts))
            elapsed = time.monotonic() - t0
            wrong = sum(a != r for a, r in zip(answers, references, strict=True))
            assert wrong == 0, f"{wrong} of {requests} answers differ from the aggregated run"
            want = sum(len(p) for p in prompts)
            deadline = time.monotonic() + 10  # vLLM publishes these with its periodic stats
            while (now := prompt_tokens(decode.url))[0] - loaded0 < want and time.monotonic() < deadline:
                time.sleep(0.2)
            loaded, computed = now[0] - loaded0, now[1] - computed0
            print(f"{requests} requests at concurrency {concurrency} in {elapsed:.1f} s, {loaded:.0f} tokens loaded")
            assert loaded == want, f"the decode server loaded {loaded:.0f} of {want} prompt tokens through kvbridge"
            assert computed == 0, f"the decode server computed {computed:.0f} prompt tokens itself"
            ok = False
            for _ in range(60):
                if prefill.kv_usage() == base_p and decode.kv_usage() == base_d:
                    ok = True
                    break
                time.sleep(0.5)
            assert ok, (
                f"blocks leaked: prefill usage {prefill.kv_usage()} (was {base_p}),"
                f" decode {decode.kv_usage()} ({base_d})"
            )
        except BaseException:
            print(
                "--- proxy log tail ---\n" + (tmp_path / "proxy.log").read_text(errors="replace")[-6000:],
                file=sys.stderr,
            )
            raise
        finally:
            proxy.terminate()
            proxy.wait(10)
