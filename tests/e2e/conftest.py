"""What the end-to-end modules share in one run: the tiny model, built once, and the pool of running vLLM servers,
keyed by their configuration (`support.server_pool`), so that consecutive modules whose servers agree start them
once (test_e2e_vllm.py and test_e2e_vllm_smoke.py: the smoke's two servers are two of the four)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.serving.tiny_model import build_tiny_model
from support.e2e_support import write_ttft_report
from support.server_pool import ServerPool

MAX_IDLE_WORKERS_ENV = "KVBRIDGE_E2E_IDLE_WORKERS"
"""How many worker processes of idle servers the pool keeps for later modules (default 8; 0: stop at once)."""


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The default tiny model (`build_tiny_model()`: Qwen2, 4 layers, 4 KV heads), built once per run."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def server_pool(tmp_path_factory) -> Iterator[ServerPool]:
    pool = ServerPool(tmp_path_factory.mktemp("servers"), int(os.environ.get(MAX_IDLE_WORKERS_ENV, "8")))
    try:
        yield pool
    finally:
        pool.close()
        print(f"\nvLLM server pool: {pool.started} started, {pool.reused} reused")


@pytest.fixture(scope="module", autouse=True)
def idle_servers_stop_before_other_servers_start(request, server_pool):
    """A module that starts its own servers gets the cores and memory to itself: the pool's idle servers stop."""
    if not any("server_pool" in item.fixturenames for item in request.session.items if item.module is request.module):
        server_pool.release_idle()


@pytest.fixture(scope="module")
def ttft_log(request) -> Iterator[list[dict]]:
    """The module's pairs' TTFT rows (`support.e2e_support.log_ttft` appends), written at the module's end with its
    `TTFT_REPORT` (family, model, prompt lengths, ...) when KVBRIDGE_TTFT_OUT is set (`write_ttft_report`)."""
    report = getattr(request.module, "TTFT_REPORT", None)
    if report is None:
        pytest.fail(f"{request.module.__name__} uses ttft_log but defines no TTFT_REPORT")
    rows: list[dict] = []
    yield rows
    write_ttft_report(rows, **report)
