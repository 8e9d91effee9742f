"""Disaggregated KV transfer without vLLM: real worker processes, real side channel, real NIXL.

One process per prefill worker and one per decode worker, each with its own NIXL agent. Every process
derives the same reference KV for the whole model from a seed; prefill workers fill their stage's layers and
their heads into vLLM's CPU layout, the decode workers handshake, read one request's scattered blocks through
the plan and check every byte they hold against the reference. Each request has its own token and prompt hash,
in the prefill worker's hold and in the decode side's params, as the connector passes them. The prefill workers
report every request they free, how (readers' notifications, aborts, lease expiry) and their lease counters,
after the decode workers have exited; `release_problems` checks that against what was held. This is what the
connector does inside vLLM, minus vLLM.

With `prefill_device`/`decode_device` set to CUDA devices the buffers live in GPU memory: NIXL registers VRAM,
and a decode worker on the same host reads through CUDA IPC with the gather kernel (config.gpu_peer_copy). A
comma-separated list gives each worker its own device, in worker order (one GPU per worker).
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import dataclass

from kvbridge.core.config import BridgeConfig
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank
from kvbridge.serving.launcher import free_base_port

_LOOPBACK_ENV = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "self,sm,cma,tcp", "VLLM_HOST_IP": "127.0.0.1"}


@dataclass(frozen=True)
class Scenario:
    prefill: ParallelLayout
    decode: ParallelLayout
    geometry: KVGeometry
    num_blocks: int
    request_blocks: int
    seed: int = 0
    prefill_device: str = "cpu"  # or "cuda:0,cuda:1": one per worker, in worker order (repeated if short)
    decode_device: str = "cpu"
    config: BridgeConfig | None = None  # the side-channel port is set by run_transfer
    repeats: int = 1  # requests with the same blocks, loaded one after another (timing)
    concurrent: int = 1  # after the first request: how many loads a decode worker keeps in flight at once
    layer_tensors: bool = False  # one KV allocation per layer (vLLM on GPU) instead of one for all layers
    held: bool = True  # False: the prefill side holds no request (it was freed), so every claim is refused
    wrong: str = ""  # "token" or "prompt_hash": the decode side's params carry another one, so every claim is refused
    unread: int = 0  # more requests held that no decode worker loads: never released before their lease expires

    def __post_init__(self) -> None:
        if self.wrong not in ("", "token", "prompt_hash"):
            raise ValueError(f"wrong must be '', 'token' or 'prompt_hash', got {self.wrong!r}")

    def device(self, side: str, rank: WorkerRank) -> str:
        """The device of worker `rank` of the "prefill" or "decode" side."""
        layout, text = (self.prefill, self.prefill_device) if side == "prefill" else (self.decode, self.decode_device)
        devices = text.split(",")
        return devices[list(layout.workers()).index(rank) % len(devices)]

    def blocks(self) -> tuple[list[int], list[int]]:
        """A request's scattered block ids on each side (seeded, never adjacent by construction)."""
        import numpy as np

        rng = np.random.default_rng(self.seed)
        src = rng.permutation(self.num_blocks)[: self.request_blocks]
        dst = rng.permutation(self.num_blocks)[: self.request_blocks]
        return src.tolist(), dst.tolist()


def _reference(scenario: Scenario, device: str = "cpu"):
    """The whole model's KV, the same in every process (generated on `device`: same seed, same numbers)."""
    import torch

    g = scenario.geometry
    gen = torch.Generator(device=device).manual_seed(scenario.seed)
    shape = (g.num_layers, scenario.num_blocks, g.num_kv_heads, g.block_size, 2 * g.head_size)
    return torch.randn(shape, generator=gen, dtype=torch.float32, device=device)


def _env(scenario: Scenario) -> dict[str, str]:
    if "cuda" in scenario.prefill_device + scenario.decode_device:
        return {**_LOOPBACK_ENV, "UCX_TLS": "cuda_ipc,cuda_copy,sm,self,tcp"}
    return _LOOPBACK_ENV


def _worker_kv(scenario: Scenario, layout: ParallelLayout, rank: WorkerRank, fill, device: str = "cpu"):
    """A worker's KV in vLLM 0.32's layout on `device`: one [blocks, heads, block_size, 2*head_size] tensor per
    layer, in one allocation (vLLM on CPU) or one each (`scenario.layer_tensors`, as vLLM allocates on GPU). Returns
    the per-layer tensors, the memory description and its regions as tensors (as the connector builds them), and
    the worker's layers and heads."""
    import torch

    from kvbridge.transport.torch_memory import memory_from_tensors, region_tensors

    g = scenario.geometry
    layers = layout.stage_layers(g.num_layers, rank.pp)
    heads = layout.kv_heads(g.num_kv_heads, rank.tp)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    shape = (scenario.num_blocks, len(heads), g.block_size, 2 * g.head_size)
    if scenario.layer_tensors:
        tensors = [torch.empty(shape, device=dev) for _ in layers]
    else:
        tensors = list(torch.empty((len(layers), *shape), device=dev).unbind(0))
    for layer, t in zip(layers, tensors, strict=True):
        if fill is not None:
            t.copy_(fill[layer, :, heads.start : heads.stop])
        else:
            t.fill_(float("nan"))
    caches = {f"layers.{layer}": t for layer, t in zip(layers, tensors, strict=True)}
    memory = memory_from_tensors(caches, lambda name: int(name.split(".")[1]))
    return tensors, memory, region_tensors(caches, memory), layers, heads


def request_ids(scenario: Scenario) -> list[str]:
    """The prefill engine's requests that the decode workers load, one per repeat, all on the same blocks."""
    return [f"prefill-req-{i}" for i in range(scenario.repeats)]


def held_ids(scenario: Scenario) -> list[str]:
    """What every prefill worker holds: the loaded requests and the unread ones (nothing if not `held`)."""
    if not scenario.held:
        return []
    return request_ids(scenario) + [f"prefill-unread-{i}" for i in range(scenario.unread)]


def request_secrets(scenario: Scenario, request_id: str) -> tuple[str, str]:
    """(token, prompt hash) of a request, the same in every process (derived from the seed and the id)."""
    from kvbridge.wire.params import prompt_hash

    token = hashlib.sha256(f"kvbridge-scenario/{scenario.seed}/{request_id}".encode()).hexdigest()[:32]
    return token, prompt_hash([scenario.seed, *request_id.encode()])


def _params(scenario: Scenario, source, request_id: str):
    """The decode side's kv_transfer_params for one request (with a wrong token or prompt hash if asked)."""
    import msgspec

    token, digest = request_secrets(scenario, request_id)
    if scenario.wrong == "token":
        token = token[::-1]
    elif scenario.wrong == "prompt_hash":
        digest = digest[::-1]
    return msgspec.structs.replace(source, remote_request_id=request_id, remote_token=token, remote_prompt_hash=digest)


def _prefill_main(scenario, rank, config, engine_id, ready, finished, stop):
    os.environ.update(_env(scenario))
    from kvbridge.core.identity import WorkerIdentity
    from kvbridge.runtime.prefill_worker import PrefillWorker

    device = scenario.device("prefill", rank)
    tensors, memory, regions, _, _ = _worker_kv(scenario, scenario.prefill, rank, _reference(scenario, device), device)
    ident = WorkerIdentity(engine_id, scenario.prefill, 0, rank, scenario.geometry)
    ipc = ()
    cuda = regions[0].is_cuda
    if cuda and config.gpu_peer_copy == "auto":
        from kvbridge.transport.cuda_ipc import export_region

        ipc = tuple(export_region(r) for r in regions)
    worker = PrefillWorker(ident, memory, config, "VRAM" if cuda else "DRAM", ipc=ipc, regions=regions).start()
    try:
        blocks = tuple(scenario.blocks()[0])
        for request_id in held_ids(scenario):
            token, digest = request_secrets(scenario, request_id)
            worker.hold(request_id, (blocks,), token, digest)
        ready.put(("ready", str(rank)))
        start = time.monotonic()
        released: list[str] = []  # in the order freed; a request freed twice appears twice
        expired = 0
        at = None
        while True:
            last = stop.is_set()  # one more round after the stop: nothing freed until then is lost
            ids, n = worker.finished()
            if ids:
                at = time.monotonic() - start
                released += sorted(ids)
                expired += n
                finished.put(("released", str(rank), sorted(ids)))
            if last:
                break
            time.sleep(0.01)
        report = {"released": released, "expired": expired, "at": at, "counts": worker.lease_counts()}
        if worker.stager is not None:  # the staged path: what it gathered, and whether every slot came back
            stager = worker.stager
            report["staging"] = {
                "gathered_bytes": stager.gathered_bytes,
                "sessions": stager.sessions,
                "free_slots": stager.free_slots,
                "num_slots": stager.num_slots,
                "buffer_bytes": stager.buffer.nbytes,
                "refused": stager.refused,
            }
        finished.put(("final", str(rank), report))
    finally:
        worker.close()
        del tensors, regions


def _decode_main(scenario, rank, config, source, results, warm_barrier):
    os.environ.update(_env(scenario))
    import torch

    from kvbridge.core.identity import WorkerIdentity
    from kvbridge.runtime.decode_worker import DecodeWorker, LoadJob

    device = scenario.device("decode", rank)
    tensors, memory, regions, layers, heads = _worker_kv(scenario, scenario.decode, rank, None, device)
    ident = WorkerIdentity("demo-decode", scenario.decode, 0, rank, scenario.geometry)
    mem_type = "VRAM" if regions[0].is_cuda else "DRAM"
    worker = DecodeWorker(ident, memory, config, mem_type, regions).start()
    try:
        src, dst = scenario.blocks()
        t0 = time.monotonic()
        done: set[str] = set()
        failed: set[str] = set()
        seconds: list[float] = []
        post_seconds: list[float] = []
        gpu_seconds: list[float] = []
        phases: dict[str, list[float]] = {}  # per load, in completion order: its timeline (transfer_stats.PHASES)
        nbytes = descriptors = 0
        deadline = t0 + 60
        ids = request_ids(scenario)
        submitted = 0
        warm_start = None  # once the first load (with the handshake) is done: the rest may overlap
        while len(done) + len(failed) < len(ids) and time.monotonic() < deadline:
            finished = len(done) + len(failed)
            if finished and warm_start is None:
                # Every decode worker starts its later loads together (their first loads, with handshakes and
                # compilation, end at different times), so that their spans overlap as in a served engine.
                with contextlib.suppress(threading.BrokenBarrierError):
                    warm_barrier.wait(timeout=30)
                warm_start = time.monotonic()
            limit = 1 if not finished else scenario.concurrent
            while submitted < len(ids) and submitted - finished < limit:
                job_source = _params(scenario, source, ids[submitted])
                worker.load(LoadJob(f"decode-req-{submitted}", job_source, (tuple(dst),), (tuple(src),)))
                submitted += 1
            d, f, s = worker.results()
            done |= d
            failed |= f
            seconds += s.seconds
            post_seconds += s.post_seconds
            gpu_seconds += s.gpu_seconds
            for name, values in s.phases.items():
                phases.setdefault(name, []).extend(values)
            nbytes, descriptors = nbytes + s.bytes, descriptors + s.descriptors
            time.sleep(0.0002)
        warm_end = time.monotonic()
        warm_s = warm_end - warm_start if warm_start is not None else None
        elapsed = time.monotonic() - t0
        ok = len(done) == scenario.repeats
        ref = _reference(scenario, device)
        want = ref[layers.start : layers.stop][:, src][:, :, heads.start : heads.stop]
        exact = ok and all(torch.equal(t[dst], w) for t, w in zip(tensors, want, strict=True))
        untouched = [b for b in range(scenario.num_blocks) if b not in set(dst)]
        clean = all(bool(torch.isnan(t[untouched]).all()) for t in tensors) if untouched else True
        written = any(not bool(torch.isnan(t[dst]).all()) for t in tensors)
        results.put(
            {
                "decode_worker": str(rank),
                "ok": ok,
                "failed": bool(failed),
                "exact": exact,
                "untouched_clean": clean,
                "request_blocks_written": written,
                "bytes": nbytes // max(1, len(seconds)),
                "descriptors": descriptors // max(1, len(seconds)),
                "transfer_s": seconds[0] if seconds else None,
                "transfer_times_s": seconds,
                "post_times_s": post_seconds,
                "gpu_times_s": gpu_seconds,
                "phases_s": phases,
                "path": "cuda-ipc" if worker.reads_through_ipc(source) else "nixl",
                "elapsed_s": elapsed,
                "warm_s": warm_s,  # from the first load done to the last: repeats - 1 loads
                # the same span in CLOCK_MONOTONIC, which every process on the host shares: workers' spans compare
                "warm_window": (warm_start, warm_end) if warm_start is not None else None,
                "concurrent": scenario.concurrent,
                "staged_parts": worker.nixl.staged.staged_parts if worker.nixl.staged else 0,
                "staged_fallbacks": worker.nixl.staged.fallbacks if worker.nixl.staged else 0,
            }
        )
    finally:
        worker.close()


def run_transfer(scenario: Scenario, timeout_s: float = 120.0, release_wait_s: float | None = None) -> dict:
    """Run the scenario's requests through real processes; return per-worker results and what the prefill freed.

    Returns {"decode": one result per decode worker, "prefill": one report per prefill worker (see below),
    "prefill_released": (rank, sorted ids freed, how many at lease expiry, seconds until the last) per prefill
    worker that freed anything}. A prefill worker's report: {"prefill_worker", "held" (ids), "released" (ids in
    the order freed, repeats kept), "expired", "at", "counts" (`PrefillWorker.lease_counts()`)}, made after every
    decode process has exited (so every notification and abort it sent was answered) and once every held request
    was freed or `release_wait_s` (default: until the timeout) passed; a worker that sent none is missing."""
    from kvbridge.wire.params import PrefillDone

    ctx = mp.get_context("spawn")
    base = free_base_port(scenario.prefill.workers_per_engine)
    import msgspec

    config = scenario.config or BridgeConfig(lease_s=30.0, handshake_timeout_s=5.0, transfer_timeout_s=60.0)
    config = msgspec.structs.replace(config, side_channel_port=base)
    ready, finished, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    stop = ctx.Event()
    warm_barrier = ctx.Barrier(scenario.decode.workers_per_engine)
    src, _ = scenario.blocks()
    source = PrefillDone(
        remote_engine_id="demo-prefill",
        remote_request_id="",  # set per request, with its token and prompt hash
        remote_block_ids=src,
        remote_host="127.0.0.1",
        remote_port=base,
        remote_layout=str(scenario.prefill),
        tp_size=scenario.prefill.tp,
        pp_size=scenario.prefill.pp,
    )
    prefill_ranks = [str(r) for r in scenario.prefill.workers()]
    procs: list = []
    try:
        for rank in scenario.prefill.workers():
            p = ctx.Process(
                target=_prefill_main,
                args=(scenario, rank, config, "demo-prefill", ready, finished, stop),
                daemon=True,
            )
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout_s
        for _ in scenario.prefill.workers():
            ready.get(timeout=max(1.0, deadline - time.monotonic()))
        decoders = []
        for rank in scenario.decode.workers():
            p = ctx.Process(
                target=_decode_main, args=(scenario, rank, config, source, results, warm_barrier), daemon=True
            )
            p.start()
            decoders.append(p)
        procs += decoders
        decoded = [results.get(timeout=max(1.0, deadline - time.monotonic())) for _ in scenario.decode.workers()]
        for p in decoders:  # closing, a decode worker sends its last notifications and aborts and waits for answers
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        held = set(held_ids(scenario))
        freed: dict[str, set[str]] = {rank: set() for rank in prefill_ranks}
        reports: dict[str, dict] = {}
        wait_until = deadline if release_wait_s is None else min(deadline, time.monotonic() + release_wait_s)

        def take(item: tuple) -> None:
            kind, rank, body = item
            if kind == "released":
                freed[rank] |= set(body)
            else:
                reports[rank] = {"prefill_worker": rank, "held": sorted(held), **body}

        while any(not held <= ids for ids in freed.values()) and time.monotonic() < wait_until:
            with contextlib.suppress(queue.Empty):
                take(finished.get(timeout=max(0.01, min(1.0, wait_until - time.monotonic()))))
        stop.set()
        report_deadline = time.monotonic() + 15
        while len(reports) < len(prefill_ranks) and time.monotonic() < report_deadline:
            with contextlib.suppress(queue.Empty):
                take(finished.get(timeout=1.0))
        decoded.sort(key=lambda r: r["decode_worker"])
        prefill = [reports[rank] for rank in sorted(reports)]
        released = [
            (r["prefill_worker"], sorted(r["released"]), r["expired"], r["at"]) for r in prefill if r["released"]
        ]
        return {"decode": decoded, "prefill": prefill, "prefill_released": released}
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def release_problems(scenario: Scenario, result: dict, by: str = "notification") -> list[str]:
    """What is wrong with how the prefill workers freed their requests ([] if nothing): every prefill worker must
    have reported, freed every request it held exactly once and nothing else, each of them `by` "notification"
    (every reader said it is done), "abort" (a reader gave up) or "expiry" (the lease ran out)."""
    if by not in ("notification", "abort", "expiry"):
        raise ValueError(f"by must be 'notification', 'abort' or 'expiry', got {by!r}")
    held = held_ids(scenario)
    reports = {r["prefill_worker"]: r for r in result["prefill"]}
    problems = []
    for rank in (str(w) for w in scenario.prefill.workers()):
        report = reports.get(rank)
        if report is None:
            problems.append(f"prefill worker {rank} sent no report")
            continue
        released = report["released"]
        never = sorted(set(held) - set(released))
        twice = sorted({i for i in released if released.count(i) > 1})
        stray = sorted(set(released) - set(held))
        for what, ids in (("never freed", never), ("freed more than once", twice), ("freed but never held", stray)):
            if ids:
                problems.append(f"prefill worker {rank}: {what}: {ids}")
        c, n = report["counts"], len(held)
        want = {
            "notification": {"completed": n, "aborted": 0, "expired": 0},
            "abort": {"completed": n, "aborted": n, "expired": 0},
            "expiry": {"completed": 0, "aborted": 0, "expired": n},
        }[by]
        got = {key: c[key] for key in want}
        if got != want or report["expired"] != c["expired"] or c["held"] != 0:
            problems.append(f"prefill worker {rank}: freed by {by} expected {want} (and none left held), got {c}")
    return problems
