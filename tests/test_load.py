"""Load through the proxy: 500 requests at concurrency 32 against a prefill PP=2 / decode PP=1 pair.

Every answer must equal the aggregated run of its prompt, and afterwards both servers' KV cache usage must be
back to its baseline: no request leaks blocks on either side (held prefill blocks are freed by the decode
side's notifications, decode blocks when requests finish).
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvbridge.serving.launcher import VllmServer, complete, free_base_port, free_port, kvbridge_config, metrics, running
from kvbridge.serving.tiny_model import build_tiny_model

pytestmark = pytest.mark.vllm

REQUESTS, CONCURRENCY, DISTINCT = 500, 32, 50


def kv(role: str) -> dict:
    return kvbridge_config(role, side_channel_port=free_base_port(2), lease_s=60)


def test_500_requests_at_concurrency_32_through_the_proxy(tmp_path):
    model = build_tiny_model(tmp_path / "model")
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
    with running((prefill, decode)), ThreadPoolExecutor(CONCURRENCY) as pool, proxy_log:
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
            prompts = [[rng.randrange(1, 1000) for _ in range(rng.randrange(20, 400))] for _ in range(DISTINCT)]
            references = list(pool.map(lambda p: complete(prefill.url, p, 8)["choices"][0]["token_ids"], prompts))
            base_p, base_d = prefill.kv_usage(), decode.kv_usage()
            order = [i % DISTINCT for i in range(REQUESTS)]
            rng.shuffle(order)
            t0 = time.monotonic()
            answers = list(
                pool.map(lambda i: complete(url, prompts[i], 8, timeout=300)["choices"][0]["token_ids"], order)
            )
            elapsed = time.monotonic() - t0
            wrong = sum(answers[k] != references[i] for k, i in enumerate(order))
            assert wrong == 0, f"{wrong} of {REQUESTS} answers differ from the aggregated run"
            print(f"\n{REQUESTS} requests at concurrency {CONCURRENCY} in {elapsed:.1f} s")
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
