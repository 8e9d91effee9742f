"""Real vLLM CPU servers (kvbridge.serving.launcher) serving the tiny model (kvbridge.serving.tiny_model).

The `vllm` tests start real servers: PP=1 and PP=2 (started together) must give token-identical greedy outputs in
float32, and the model must not be degenerate; two servers that cannot start (started together) must each fail
`wait_ready` at once with their log tail, and `running` must stop both. The other tests are fast and need no vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import random
import signal
import time
from pathlib import Path

import pytest

from kvbridge.serving.launcher import (
    PP_COMPILATION_CONFIG,
    ServerError,
    VllmServer,
    complete,
    cpu_binding,
    live_group_members,
    metric_sum,
    metrics,
    parse_prometheus,
    running,
    series_labels,
)
from kvbridge.serving.tiny_model import STAMP, build_tiny_model

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

MAX_TOKENS = 8
READY_TIMEOUT_S = 300


def _prompts(count: int = 4, vocab: int = 1024, seed: int = 1234) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(40, 100))] for _ in range(count)]


PROMPTS = _prompts()


def _serve_and_generate(model: Path, log_dir: Path, pps: tuple[int, ...] = (1, 2)) -> dict[int, dict]:
    """Start one server per PP size together, generate for every prompt on each, read their metrics, stop them
    (also on failure). PP=1 runs on core 1 and PP=2 on both, so that neither waits for the other's first core."""
    servers = {
        pp: VllmServer(
            model, pp=pp, name=f"pp{pp}tp1", cpu_offset=1 if pp == 1 else 0, log_path=log_dir / f"pp{pp}.log"
        )
        for pp in pps
    }
    runs = {}
    with running(list(servers.values()), READY_TIMEOUT_S):
        for pp, server in servers.items():
            started = time.monotonic()
            replies = [complete(server.url, p, MAX_TOKENS, ignore_eos=True) for p in PROMPTS]
            generate_s = time.monotonic() - started
            runs[pp] = {"startup_s": server.ready_after_s, "replies": replies, "metrics": metrics(server.url)}
            print(f"  {server.name}: {len(PROMPTS)} requests in {generate_s:.2f} s", flush=True)
    for server in servers.values():
        print(f"  {server.name}: ready after {server.ready_after_s:.1f} s", flush=True)
        assert server.process is not None and server.process.poll() is not None
    return runs


@pytest.mark.vllm
@needs_vllm
def test_pp1_and_pp2_give_identical_greedy_tokens(tiny_model: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    runs = _serve_and_generate(tiny_model, tmp_path)
    outputs = {}
    for pp, run in runs.items():
        tokens = []
        for prompt, reply in zip(PROMPTS, run["replies"], strict=True):
            choice = reply["choices"][0]
            assert choice["prompt_token_ids"] == prompt
            assert len(choice["token_ids"]) == MAX_TOKENS
            assert reply["kv_transfer_params"] is None
            tokens.append(choice["token_ids"])
        outputs[pp] = tokens
        by_source = "vllm:prompt_tokens_by_source_total"
        assert metric_sum(run["metrics"], by_source, source="local_compute") == sum(map(len, PROMPTS))
        assert metric_sum(run["metrics"], by_source, source="external_kv_transfer") == 0
    print(f"  total {time.monotonic() - started:.1f} s; tokens: {outputs[1]}", flush=True)

    assert outputs[1] == outputs[2]
    generated = [t for seq in outputs[1] for t in seq]
    assert len(set(generated)) > len(generated) // 2, f"degenerate model output: {outputs[1]}"
    assert len({tuple(seq) for seq in outputs[1]}) == len(PROMPTS)


@pytest.fixture(scope="module")
def doomed(tmp_path_factory) -> tuple[list[VllmServer], pytest.ExceptionInfo[ServerError]]:
    """Two servers of a model that does not exist, started together through `running` (whose `wait_ready` calls
    see them die); the servers and the error `running` raised."""
    root = tmp_path_factory.mktemp("doomed")
    servers = [
        VllmServer(root / f"no-model-{i}", name=f"doomed-{i}", log_path=root / f"doomed-{i}.log") for i in range(2)
    ]
    with pytest.raises(ServerError, match="exited with code") as err, running(servers, READY_TIMEOUT_S):
        pytest.fail("running() returned with servers that cannot start")
    return servers, err


@pytest.mark.vllm
@needs_vllm
def test_wait_ready_fails_fast_with_the_log_tail_when_the_server_dies(doomed) -> None:
    _, err = doomed
    assert "exited with code" in str(err.value)
    assert "log tail" in str(err.value)


@pytest.mark.vllm
@needs_vllm
def test_running_stops_every_server_when_one_fails(doomed) -> None:
    servers, _ = doomed
    for server in servers:
        assert server.process is not None and server.process.poll() is not None


def test_stop_ends_the_whole_process_tree(tmp_path: Path) -> None:
    """A fake `python` ignoring its arguments and SIGTERM, with a child: stop() must end both."""
    fake = tmp_path / "fake-python"
    fake.write_text("#!/bin/sh\ntrap '' TERM\nsleep 300 &\necho child $!\nwait\n")
    fake.chmod(0o755)
    server = VllmServer(tmp_path, name="fake", python=str(fake), log_path=tmp_path / "fake.log").start()
    assert server.process is not None
    pgid = server.process.pid
    deadline = time.monotonic() + 10
    while "child" not in (server.log_path.read_text() if server.log_path else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(server.log_path.read_text().split("child ")[1].split()[0])
    started = time.monotonic()
    server.stop(grace=0.5, kill_after=0.5)
    assert time.monotonic() - started < 5
    assert child != pgid
    assert live_group_members(pgid) == []
    assert server.process.returncode == -signal.SIGKILL  # it ignored SIGTERM
    assert server.stop() == -signal.SIGKILL  # idempotent


def test_tiny_model_is_reused_and_matches_its_stamp(tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (4, 4, 32)
    assert not (tiny_model / "tokenizer.json").exists()
    weights = tiny_model / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert build_tiny_model(tiny_model) == tiny_model
    assert weights.stat().st_mtime_ns == mtime
    assert json.loads((tiny_model / STAMP).read_text())["seed"] == 0


def test_tiny_model_rejects_unsupported_head_dim(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head_dim"):
        build_tiny_model(tmp_path, hidden=64, num_heads=8, num_kv_heads=4)


def test_server_command_and_environment(tmp_path: Path) -> None:
    pp2 = VllmServer(tmp_path, port=8123, pp=2, kv_transfer_config={"kv_connector": "X", "kv_role": "kv_both"})
    cmd = pp2.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--enforce-eager" not in cmd
    assert json.loads(cmd[cmd.index("--compilation-config") + 1]) == PP_COMPILATION_CONFIG
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector"] == "X"
    assert "--skip-tokenizer-init" in cmd
    env = pp2.environment()
    assert env["VLLM_HOST_IP"] == "127.0.0.1"
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2
    assert "--enforce-eager" in VllmServer(tmp_path, port=8123).command()


def test_each_worker_is_bound_to_one_core_round_robin() -> None:
    assert cpu_binding(1, cpus=[0, 1]) == "0"
    assert cpu_binding(1, cpus=[0, 1], offset=1) == "1"
    assert cpu_binding(2, cpus=[0, 1]) == "0|1"
    assert cpu_binding(4, cpus=[0, 1]) == "0|1|0|1"


def test_prometheus_text_becomes_series_keyed_by_sorted_labels() -> None:
    text = "\n".join(
        [
            "# HELP vllm:prompt_tokens_by_source_total Prompt tokens",
            "# TYPE vllm:prompt_tokens_by_source_total counter",
            'vllm:prompt_tokens_by_source_total{model_name="m",engine="0",source="local_compute"} 59.0',
            'vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="local_compute"} 1.0',
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 3',
            'vllm:kv_cache_usage_perc{engine="0",model_name="a \\"b\\""} 0.25',
            "process_open_fds 12 1700000000000",
            "garbage line",
        ]
    )
    samples = parse_prometheus(text)
    name = "vllm:prompt_tokens_by_source_total"
    assert samples[f'{name}{{engine="0",model_name="m",source="local_compute"}}'] == 59.0
    assert metric_sum(samples, name, source="local_compute") == 60.0
    assert metric_sum(samples, name, source="external_kv_transfer", engine="0") == 3.0
    assert metric_sum(samples, "vllm:kv_cache_usage_perc") == 0.25
    assert samples["process_open_fds"] == 12
    assert series_labels(f'{name}{{engine="0",source="x"}}') == (name, {"engine": "0", "source": "x"})
