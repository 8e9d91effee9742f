"""What the end-to-end modules share: the four-server layout, prompts, the disaggregated leg, metric deltas, the
TTFT report. Each module keeps its own model, block size and oracles.

The layout: four `kv_both` kvbridge servers started once per run (`server_pool`), so every pair reuses them, a
pair's prefill and decode servers on different cores (while a prefill server holds a request's blocks vLLM steps
it continuously and its workers spin; on a 2-core machine a decode server sharing the core would starve):

    pp2  pp=2 (core 0)     pp1a pp=1 (core 1)     tp2  tp=2 (core 1)     pp1b pp=1 (core 0)
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.serving.launcher import (
    VllmServer,
    complete,
    complete_streaming,
    free_base_port,
    free_port,
    kvbridge_config,
    metric_sum,
)

SOURCE = "vllm:prompt_tokens_by_source_total"


@dataclass(frozen=True)
class Place:
    """One server of a layout: its parallel sizes, the cores of its workers, extra vLLM arguments and extra
    connector config."""

    pp: int
    tp: int
    cores: str
    args: tuple[str, ...] = field(default=())
    kv: Mapping[str, Any] = field(default_factory=dict)

    def but(self, **changes: Any) -> Place:
        return dataclasses.replace(self, **changes)

    @property
    def layout(self) -> str:
        return f"pp={self.pp},tp={self.tp}"


FOUR = {"pp2": Place(2, 1, "0|0"), "pp1a": Place(1, 1, "1"), "tp2": Place(1, 2, "1|1"), "pp1b": Place(1, 1, "0")}
UNCHECKED = {"check_blocks": False}
"""For a negative control's prefill server: its claims do not bind the block order, so edited params can load
wrong blocks (which the check refuses otherwise, also without a deployment key)."""


def layout_servers(
    model: Path,
    root: Path,
    places: Mapping[str, Place] = FOUR,
    prefix: str = "",
    args: tuple[str, ...] = (),
    kv: Mapping[str, Any] | None = None,
    **server: Any,
) -> dict[str, VllmServer]:
    """One `kv_both` kvbridge server per place (not started: pass them to `running`). `args` go to every server
    before its place's own; `kv` adds to each connector config (lease 30 s unless given), the place's own `kv` after
    it; `server` goes to VllmServer."""
    extra = {"lease_s": 30.0, **(kv or {})}
    return {
        name: VllmServer(
            model,
            port=free_port(),
            pp=p.pp,
            tp=p.tp,
            cpu_bind=p.cores,
            extra_args=(*args, *p.args),
            kv_transfer_config=kvbridge_config(
                "kv_both", side_channel_port=free_base_port(p.pp * p.tp), **{**extra, **p.kv}
            ),
            name=f"{prefix}{name}",
            log_path=root / f"{name}.log",
            **server,
        )
        for name, p in places.items()
    }


def seed_of(*names: str) -> int:
    """A seed per parameter set, the same on every run (str hash() changes with PYTHONHASHSEED)."""
    return zlib.crc32(" -> ".join(names).encode()) % 10_000


def prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(n)] for n in lengths]


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.25) -> bool:
    """Whether `predicate` holds within `timeout` seconds. A server that does not answer one poll in time (a
    /metrics request timed out on a loaded 2-core machine while a decode generated at full speed beside it) is
    asked again until the deadline: what is checked is the condition, not one request's latency. If the last poll
    failed too, its error is raised (a server that died says so rather than failing the condition)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return True
            failed = None
        except OSError as exc:  # TimeoutError and connection errors of one poll (serving.http_client)
            failed = exc
        if time.monotonic() >= deadline:
            if failed is not None:
                raise failed
            return False
        time.sleep(interval)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


def prefill_params(prefill: VllmServer, prompt: list[int], timeout: float = 120, **fields: Any) -> dict:
    """The prefill leg: the prompt prefilled for a remote decode; returns its kv_transfer_params. `fields` go to
    the request body (a `cache_salt` binds the params: the decode leg must carry the same one)."""
    first = complete(prefill.url, prompt, 1, kv_transfer_params={"do_remote_decode": True}, timeout=timeout, **fields)
    params = first["kv_transfer_params"]
    assert params and params["do_remote_prefill"] is True, first
    return params


@dataclass(frozen=True)
class Leg:
    """One disaggregated request: the decode's greedy tokens, the params it was given, its time to first token
    (prefill leg + decode leg to its first token)."""

    tokens: list[int]
    params: dict
    ttft_s: float


def disaggregated(
    prefill: VllmServer,
    decode: VllmServer,
    prompt: list[int],
    max_tokens: int = 8,
    edit: Callable[[dict], dict] | None = None,
    **fields: Any,
) -> Leg:
    """Prefill on one server, decode (streaming) on the other; `edit` changes the params in between; `fields` go
    to both legs' request bodies (e.g. `cache_salt`, which kvbridge binds the params to)."""
    t0 = time.monotonic()
    params = prefill_params(prefill, prompt, **fields)
    prefill_s = time.monotonic() - t0
    if edit is not None:
        params = edit(params)
    tokens, first_s = complete_streaming(
        decode.url, prompt, max_tokens, kv_transfer_params=params, timeout=120, **fields
    )
    return Leg(tokens, params, prefill_s + first_s)


def aggregated_leg(
    server: VllmServer, prompt: list[int], max_tokens: int = 8, **fields: Any
) -> tuple[list[int], float]:
    """The server answering the prompt on its own (no connector in the request), streaming: (its greedy tokens,
    seconds to its first token)."""
    return complete_streaming(server.url, prompt, max_tokens, timeout=120, **fields)


def ttft_row(
    prefill: VllmServer, decode: VllmServer, pd_s: list[float], aggregated_s: list[float], **extra: Any
) -> dict[str, Any]:
    """One pair's row for `write_ttft_report`, in ms per prompt and the medians: PD TTFT (prefill leg + decode leg
    to its first token) and the aggregated TTFT (the decode server answering the same prompt on its own, measured
    after the PD legs, so both are warm)."""
    pd = [round(x * 1000, 1) for x in pd_s]
    agg = [round(x * 1000, 1) for x in aggregated_s]
    return {
        "prefill": f"pp={prefill.pp},tp={prefill.tp}",
        "decode": f"pp={decode.pp},tp={decode.tp}",
        "servers": f"{prefill.name} -> {decode.name}",
        "ttft_ms": pd,
        "median_ttft_ms": round(statistics.median(pd), 1),
        "aggregated_ttft_ms": agg,
        "median_aggregated_ttft_ms": round(statistics.median(agg), 1),
        **extra,
    }


def log_ttft(
    log: list[dict],
    label: str,
    prefill: VllmServer,
    decode: VllmServer,
    batch: list[list[int]],
    pd_s: list[float],
    max_tokens: int,
    fields: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A pair's TTFT: the decode server's aggregated TTFT measured on the same prompts (`aggregated_leg`, with
    `fields` in each request), the row (`ttft_row`, `extra` in it) appended to `log` and printed under `label`."""
    alone = [aggregated_leg(decode, prompt, max_tokens, **(fields or {}))[1] for prompt in batch]
    row = ttft_row(prefill, decode, pd_s, alone, **extra)
    print(f"{label}: TTFT ms {row['ttft_ms']}, aggregated {row['aggregated_ttft_ms']}")
    log.append(row)
    return row


def write_ttft_report(rows: list[dict], **meta: Any) -> None:
    """With KVBRIDGE_TTFT_OUT=path, the pairs' TTFT rows are written there as JSON with the command, host and
    commit; where path is a directory, to `ttft-<family>-<UTC stamp>.json` in it (`meta` must name the family).
    `bench/ttft_matrix.py` makes one table of such files."""
    path = os.environ.get("KVBRIDGE_TTFT_OUT")
    if not path or not rows:
        return
    target = Path(path)
    if target.is_dir():
        target = target / f"ttft-{meta['family']}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    report = {
        "command": f"KVBRIDGE_TTFT_OUT={path} " + " ".join(["python", "-m", "pytest", *sys.argv[1:]]),
        "host": f"{platform.machine()}, {os.cpu_count()} cores, {_cpu_model()}",
        "commit": _commit(),
        "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **meta,
        "pairs": rows,
    }
    with open(target, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((x.split(":", 1)[1].strip() for x in f if x.startswith("model name")), "cpu unknown")
    except OSError:
        return "cpu unknown"


def _commit() -> str:
    """The tree's commit, "+dirty" with uncommitted changes (where git runs; "unknown" elsewhere)."""
    here = Path(__file__).parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
