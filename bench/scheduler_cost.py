"""Per-step cost of kvbridge's scheduler-side connector work with many concurrent requests.

Drives `kvbridge.vllm.scheduler_side.SchedulerSide` (the code vLLM's scheduler calls every step) with plain
stand-ins for vLLM's Request and KVCacheBlocks (the scheduler side only reads a few attributes of them):
N decode requests arrive with prefill kv_transfer_params, each is matched, allocated and loaded, and N prefill
requests finish and are held. Reports the time per step (get_num_new_matched_tokens + update_state_after_alloc
for the step's new requests, build_connector_meta, request_finished) and per request.

    .venv/bin/python bench/scheduler_cost.py [--requests 256] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from vllm.v1.request import RequestStatus

from kvbridge.core.config import BridgeConfig
from kvbridge.vllm.scheduler_side import SchedulerSide


@dataclass
class Request:  # the attributes SchedulerSide reads of vllm.v1.request.Request
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict | None
    status: RequestStatus = RequestStatus.RUNNING
    num_computed_tokens: int = 0


@dataclass
class Blocks:  # the method SchedulerSide calls on vllm.v1.core.kv_cache_manager.KVCacheBlocks
    ids: list[int] = field(default_factory=list)

    def get_block_ids(self) -> tuple[list[int]]:
        return (self.ids,)


def vllm_config(role: str) -> SimpleNamespace:
    kv = SimpleNamespace(engine_id="bench", is_kv_producer=role != "kv_consumer", is_kv_consumer=role != "kv_producer")
    pc = SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1, data_parallel_index=0)
    return SimpleNamespace(kv_transfer_config=kv, parallel_config=pc, cache_config=SimpleNamespace(block_size=16))


def prefill_params(i: int, tokens: int) -> dict:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-engine",
        "remote_request_id": f"p-{i}",
        "remote_block_ids": list(range(i * 600, i * 600 + -(-tokens // 16))),
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "remote_layout": "pp=2,tp=1",
        "tp_size": 1,
        "pp_size": 2,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256, help="concurrent requests")
    ap.add_argument("--tokens", type=int, default=8192, help="prompt length")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()

    decode = SchedulerSide(vllm_config("kv_consumer"), BridgeConfig(keyless_exposes_kv_to_local_processes=True))
    prefill = SchedulerSide(vllm_config("kv_producer"), BridgeConfig(keyless_exposes_kv_to_local_processes=True))
    prompt = list(range(args.tokens))
    per_step, per_request = [], []
    for step in range(args.steps):
        batch = [Request(f"d-{step}-{i}", prompt, prefill_params(i, args.tokens)) for i in range(args.requests)]
        finished = [
            Request(
                f"p-{step}-{i}", prompt, {"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED, args.tokens
            )
            for i in range(args.requests)
        ]
        blocks = Blocks(list(range(-(-args.tokens // 16))))
        t0 = time.perf_counter()
        for req in batch:
            n, is_async = decode.get_num_new_matched_tokens(req, 0)
            decode.update_state_after_alloc(req, blocks, n)
        meta = decode.build_connector_meta()
        for req in finished:
            prefill.request_finished(req, blocks.ids)
        prefill.build_connector_meta()
        elapsed = time.perf_counter() - t0
        assert len(meta.loads) == args.requests and is_async
        per_step.append(elapsed)
        per_request.append(elapsed / (2 * args.requests))
    idle = []
    for _ in range(args.steps):  # a step with nothing new: what every engine step pays
        t0 = time.perf_counter()
        decode.build_connector_meta()
        prefill.build_connector_meta()
        idle.append(time.perf_counter() - t0)
    result = {
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": {"platform": platform.platform(), "nproc": os.cpu_count()},
        "requests_per_step": args.requests,
        "prompt_tokens": args.tokens,
        "step_with_all_new_ms_median": 1000 * statistics.median(per_step),
        "per_request_us_median": 1e6 * statistics.median(per_request),
        "idle_step_us_median": 1e6 * statistics.median(idle),
    }
    print(
        f"{args.requests} new decode loads + {args.requests} finished prefills in one step "
        f"({args.tokens}-token prompts): {result['step_with_all_new_ms_median']:.2f} ms "
        f"({result['per_request_us_median']:.1f} us per request); a step with nothing new: "
        f"{result['idle_step_us_median']:.2f} us"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"scheduler-cost-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
