"""Real vLLM servers (a prefill server pp=2 and a decode server pp=1 started with `kvbridge serve`) behind the
`kvbridge proxy` command."""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest

from kvbridge.serving.launcher import (
    VllmServer,
    complete,
    complete_streaming,
    ensure_key_file,
    free_base_port,
    free_port,
    metric_sum,
    metrics,
)
from support.proxy import proxy_process, wait_for

# --- real vLLM servers behind the proxy -------------------------------------------------------------------

SOURCE = "vllm:prompt_tokens_by_source_total"
QUIET = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@contextmanager
def serve_process(args: list[str], out: Path) -> Iterator[subprocess.Popen]:
    """`kvbridge serve` as a user runs it; stopped with SIGTERM (it then stops vLLM's whole tree). If it
    does not exit, it is killed and so is the vLLM process group it reported."""
    with open(out, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvbridge.serving.cli", "serve", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **QUIET},
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                for line in out.read_text(errors="replace").splitlines():
                    if line.startswith("kvbridge serve: vLLM") and " pid " in line:
                        with suppress(ProcessLookupError, PermissionError):
                            os.killpg(int(line.split(" pid ")[1].split(",")[0]), signal.SIGKILL)


def wait_healthy(url: str, proc: subprocess.Popen, out: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"kvbridge serve exited with {proc.returncode}:\n{out.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not ready after {timeout} s:\n{out.read_text()[-3000:]}"
        time.sleep(0.5)


def external_tokens(url: str) -> float:
    return metric_sum(metrics(url), SOURCE, source="external_kv_transfer")


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_real_vllm_servers_behind_the_proxy(tmp_path, tiny_model):
    """Prefill pp=2 (core 0, kv_both) and decode pp=1 (core 1, `kvbridge serve --role decode`), the
    `kvbridge proxy` command in front: outputs equal the prefill server's own, every prompt token reaches the
    decode server through kvbridge, and a stopped decode server gives the client a JSON error, not a hang."""
    model = tiny_model
    key_file, _ = ensure_key_file(tmp_path / "deployment.key")  # one key for the servers and the proxy
    prefill = VllmServer(
        model,
        port=free_port(),
        pp=2,
        cpu_bind="0|0",
        kv_transfer_config={
            "kv_connector": "KVBridgeConnector",
            "kv_connector_module_path": "kvbridge.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "side_channel_port": free_base_port(2),
                "lease_s": 30,
                "auth_key_file": str(key_file),
            },
        },
        name="prefill",
        log_path=tmp_path / "prefill.log",
    )
    decode_url = f"http://127.0.0.1:{free_port()}"
    decode_args = ["--role", "decode", "--model", str(model), "--port", decode_url.rsplit(":", 1)[1]]
    decode_args += ["--platform", "cpu", "--cpu-bind", "1", "--kv-cache-gib", "1", "--dtype", "float32"]
    decode_args += ["--auth-key-file", str(key_file)]
    decode_args += ["--log-file", str(tmp_path / "decode.log"), "--", "--skip-tokenizer-init"]
    t0 = time.monotonic()
    with prefill, serve_process(decode_args, tmp_path / "serve.out") as serve:
        wait_healthy(decode_url, serve, tmp_path / "serve.out", 300)
        prefill.wait_ready(300)
        print(f"servers ready after {time.monotonic() - t0:.0f} s")
        cmd = [sys.executable, "-m", "kvbridge.serving.cli", "proxy", "--prefill", prefill.url, "--decode", decode_url]
        cmd += ["--auth-key-file", str(key_file)]
        with proxy_process([*cmd, "--port", "0", "--log-level", "warning", "--prefill-timeout", "60"]) as url:
            rng = random.Random(11)
            prompts = [[rng.randrange(1, 1000) for _ in range(n)] for n in (150, 300, 90, 200)]
            before = external_tokens(decode_url)
            got = [complete(url, p, 8, timeout=120)["choices"][0]["token_ids"] for p in prompts[:2]]
            got += [complete_streaming(url, p, 8, timeout=120)[0] for p in prompts[2:]]
            expected = [complete(prefill.url, p, 8, timeout=120)["choices"][0]["token_ids"] for p in prompts]
            assert got == expected
            moved = sum(len(p) for p in prompts)
            wait_for(lambda: external_tokens(decode_url) - before >= moved, timeout=10)
            assert external_tokens(decode_url) - before == moved
            print(f"requests done after {time.monotonic() - t0:.0f} s")

            serve.send_signal(signal.SIGTERM)  # the decode server goes away
            assert serve.wait(40) == 0
            statuses = []
            for _ in range(2):
                reply = httpx.post(url + "/v1/completions", json={"prompt": prompts[0], "max_tokens": 4}, timeout=60)
                assert reply.json()["error"]["type"] in ("bad_gateway", "service_unavailable"), reply.text
                statuses.append(reply.status_code)
            assert statuses == [502, 503]
