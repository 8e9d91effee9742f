"""Fragmented-block NIXL throughput across block size, TP ratio and request length.

One request's KV read by decode worker 0 from the prefill workers it needs, over NIXL between two processes,
scattered blocks on both sides, four ways side by side (each timed from "block ids in hand" to "bytes in place",
so the host work of building descriptors or indices is inside the time):

  kvbridge     kvbridge's per-request path: coalesced descriptors (`worker_descriptors`), `NixlTransport.read`
               (NIXL `initialize_xfer`), one READ per prefill worker read
  nixlconn     NixlConnector's strategy as it posts it: each peer's descriptor lists prepared once with one
               descriptor per (block, layer) (per plane too where K and V are separate planes), a request named by
               indices (`make_prepped_xfer`). Modelled with kvbridge's PreparedTable over per-layer segments (the
               same lists NixlConnector builds for this layout), not NixlConnector's own code
  strided      the same prepared lists given to NIXL 1.5.1 as strided (Nx5: address, length, device, stride,
               count) rows, one row per (layer, plane) segment instead of one per block; a request still names
               every (block, layer) run by index (NIXL expands a strided row into `count` entries)
  anchor       the same bytes per READ as one contiguous descriptor: what the transport does without fragmentation

Memory is host DRAM (`--mem DRAM`, UCX self,sm,cma,tcp between the processes: cma is one process_vm_readv per
descriptor) or GPU memory on one GPU (`--mem VRAM`: UCX's software emulation over tcp/lo on one GPU, see
docs/benchmarks/nixl-descriptors.md). All prefill workers of a pair live in the prefill process (one NIXL agent,
one READ per worker, as the decode worker posts them). Every kvbridge, nixlconn and strided READ is checked byte
for byte on its first and last repetition.

    python3 bench/nixl_curve.py --out DIR                 # writes DIR/nixl-curve-<stamp>.json
    python3 bench/nixl_curve.py --render FILE.json        # bench/nixl_curve.md and bench/nixl_curve.png

On a machine with NVIDIA GPUs, NIXL 1.5.1 (nixl-cu13) refuses to create its UCX backend with UCX_TLS=self,sm,cma,tcp
("NVIDIA GPU(s) are present, but this setting does not enable CUDA memory support"): run the DRAM case there with
UCX_TLS=self,sm,cma,tcp,cuda_copy in the environment (docs/benchmarks/nixl-descriptors.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvbridge.core.descriptors import Descriptors, PreparedTable, worker_descriptors  # noqa: E402
from kvbridge.core.memory import Region, WorkerMemory, layout_nbytes, synthesize_memory  # noqa: E402
from kvbridge.core.plan import make_plan  # noqa: E402
from kvbridge.core.segments import worker_segments  # noqa: E402
from kvbridge.core.topology import KVGeometry, ParallelLayout, WorkerRank  # noqa: E402
from kvbridge.transport.backoff import Backoff  # noqa: E402
from kvbridge.transport.nixl import NixlTransport  # noqa: E402
from kvbridge.transport.nixl_config import TransportConfig  # noqa: E402
from kvbridge.transport.nixl_prepared import PreparedLists  # noqa: E402

PAIRS = {"same": ("tp=1", "tp=1"), "2:1": ("tp=2", "tp=1"), "1:2": ("tp=1", "tp=2"), "4:1": ("tp=4", "tp=1")}
"""TP ratio (prefill:decode) -> layouts; decode worker 0 is measured."""
DECODE = WorkerRank(0, 0)
VARIANTS = ("kvbridge", "nixlconn", "strided", "anchor")


def geometry(args, block_size: int) -> KVGeometry:
    return KVGeometry(args.layers, args.kv_heads, args.head_size, "bfloat16", block_size)


def num_blocks(args, block_size: int) -> int:
    """Blocks per worker: twice the largest request, so scattered ids have room."""
    return 2 * -(-max(args.tokens) // block_size) + 8


def total_bytes(args) -> int:
    """One side's buffer: every block size's layout fits (bytes per block scale with the block size)."""
    return max(
        layout_nbytes(geometry(args, bs), args.layers, args.kv_heads, num_blocks(args, bs)) for bs in args.block_sizes
    )


def memories(args, text: str, block_size: int, base: int) -> dict[WorkerRank, WorkerMemory]:
    """Each worker of a layout, carved one after the other out of one buffer at `base`; every worker's region is
    the whole buffer (registered once)."""
    whole = Region(base, total_bytes(args), 0)
    layout = ParallelLayout.parse(text)
    g = geometry(args, block_size)
    out, offset = {}, 0
    for rank in layout.workers():
        heads = layout.kv_heads(args.kv_heads, rank.tp)
        layers = list(layout.stage_layers(args.layers, rank.pp))
        n = num_blocks(args, block_size)
        mem = synthesize_memory(args.layout, g, layers, len(heads), n, base + offset)
        out[rank] = WorkerMemory((whole,), mem.layers)
        offset += layout_nbytes(g, len(layers), len(heads), n)
    return out


# -- memory -------------------------------------------------------------------------------------------


class Buffer:
    """One side's buffer: numpy in DRAM, torch on cuda:0 in VRAM; `bytes_at` reads back for checks."""

    def __init__(self, nbytes: int, mem: str, seed: int | None) -> None:
        self.mem = mem
        if mem == "DRAM":
            rng = np.random.default_rng(seed or 0)
            self.array = (
                rng.integers(0, 256, nbytes, dtype=np.uint8) if seed is not None else np.zeros(nbytes, np.uint8)
            )
            self.addr = self.array.ctypes.data
        else:
            import torch

            gen = torch.Generator(device="cuda:0").manual_seed(seed or 0)
            self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
            if seed is not None:
                self.tensor.random_(0, 256, generator=gen)
            torch.cuda.synchronize()
            self.addr = self.tensor.data_ptr()
        self.nbytes = nbytes

    def memory(self) -> WorkerMemory:
        return WorkerMemory((Region(self.addr, self.nbytes, 0),), ())

    def view(self) -> np.ndarray:
        if self.mem == "DRAM":
            return self.array
        return self.tensor.cpu().numpy()

    def clear(self) -> None:
        if self.mem == "DRAM":
            self.array[:] = 0
        else:
            self.tensor.zero_()


def transport_config(args) -> TransportConfig:
    if args.mem == "VRAM":
        return TransportConfig(ucx_tls=None, ucx_net_devices="lo")
    return TransportConfig()


def prefill_main(args) -> None:
    work = Path(args.dir)
    buf = Buffer(total_bytes(args), args.mem, args.seed)
    with NixlTransport("curve-prefill", transport_config(args)) as transport:
        transport.register(buf.memory(), args.mem)
        (work / "prefill.addr").write_text(str(buf.addr))
        (work / "prefill.meta.tmp").write_bytes(transport.agent_metadata())
        os.replace(work / "prefill.meta.tmp", work / "prefill.meta")
        backoff = Backoff(first_s=10e-6, cap_s=200e-6)  # the target's progress serves emulated GETs
        while not (work / "stop").exists():
            if transport.notifications():
                backoff.reset()
            backoff.sleep()


# -- the decode side ----------------------------------------------------------------------------------


def strided_prepare(transport: NixlTransport, peer: str, table: PreparedTable, mem: str) -> PreparedLists:
    """`transport.prepare`'s lists, given to NIXL as Nx5 strided rows (one per segment, `count` = blocks)."""
    agent = transport._require()  # bench only: the transport has no strided path (it would post the same indices)
    s = table.segments
    local = np.stack(
        [
            s.dst_addr,
            s.length,
            np.zeros_like(s.length),
            s.dst_block_stride,
            np.full_like(s.length, table.dst_num_blocks),
        ],
        axis=1,
    ).astype(np.uint64)
    remote = np.stack(
        [
            s.src_addr,
            s.length,
            np.zeros_like(s.length),
            s.src_block_stride,
            np.full_like(s.length, table.src_num_blocks),
        ],
        axis=1,
    ).astype(np.uint64)
    prepared = PreparedLists(peer, table)
    prepared._local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, mem)
    prepared._remote = agent.prep_xfer_dlist(peer, remote, mem)
    return prepared


def exact(descs: Descriptors, ref: np.ndarray, dst: np.ndarray, src_base: int, dst_base: int) -> bool:
    s0, d0 = descs.src_addr - src_base, descs.dst_addr - dst_base
    for s, d, n in zip(s0.tolist(), d0.tolist(), descs.length.tolist(), strict=True):
        if not np.array_equal(dst[d : d + n], ref[s : s + n]):
            return False
    return True


def decode_main(args, child: subprocess.Popen | None = None) -> list[dict]:
    work = Path(args.dir)
    while not (work / "prefill.meta").exists():
        if child is not None and child.poll() is not None:
            raise RuntimeError(f"the prefill process exited ({child.returncode}) before publishing its metadata")
        time.sleep(0.05)
    nbytes = total_bytes(args)
    src_base = int((work / "prefill.addr").read_text())
    ref = Buffer(nbytes, args.mem, args.seed).view() if args.check else None  # the prefill buffer's contents
    dst = Buffer(nbytes, args.mem, None)
    rng = np.random.default_rng(args.seed + 1)
    cases = []
    with NixlTransport("curve-decode", transport_config(args)) as transport:
        transport.register(dst.memory(), args.mem)
        peer = transport.add_peer((work / "prefill.meta").read_bytes())
        t_start = time.monotonic()
        contexts = {}  # (block size, ratio) -> plan, memories, tables, prepared lists: made once, reused
        for bs in args.block_sizes:
            g = geometry(args, bs)
            nb = num_blocks(args, bs)
            for ratio in args.ratios:
                p_text, d_text = PAIRS[ratio]
                plan = make_plan(ParallelLayout.parse(p_text), ParallelLayout.parse(d_text), g)
                sources = memories(args, p_text, bs, src_base)
                dst_mem = memories(args, d_text, bs, dst.addr)[DECODE]
                t0 = time.perf_counter()
                segments = worker_segments(plan, DECODE, dst_mem, sources)
                tables = {r: PreparedTable(s, nb, nb) for r, s in segments.items() if len(s)}
                prepared = {r: transport.prepare(peer, t, dst_mem, sources[r]) for r, t in tables.items()}
                prep_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                strided = {r: strided_prepare(transport, peer, t, args.mem) for r, t in tables.items()}
                strided_s = time.perf_counter() - t0
                contexts[bs, ratio] = (plan, sources, dst_mem, tables, prepared, strided, prep_s, strided_s)
        for tokens in args.tokens:  # request length outermost: a run cut by --budget-s keeps whole lengths
            for (bs, ratio), (plan, sources, dst_mem, tables, prepared, strided, prep_s, strided_s) in contexts.items():
                if time.monotonic() - t_start > args.budget_s:
                    print(f"budget of {args.budget_s:g} s spent: stopping before bs={bs} {ratio} {tokens}")
                    break
                case = measure(
                    args,
                    transport,
                    peer,
                    plan,
                    sources,
                    dst_mem,
                    tables,
                    prepared,
                    strided,
                    tokens,
                    bs,
                    rng,
                    ref,
                    dst,
                    src_base,
                )
                case.update(
                    ratio=ratio,
                    prefill=PAIRS[ratio][0],
                    decode=PAIRS[ratio][1],
                    block_size=bs,
                    prep_s=prep_s,
                    strided_prep_s=strided_s,
                    prep_entries=sum(t.src_entries for t in tables.values()),
                )
                cases.append(case)
                print(line(case), flush=True)
        for _plan, _s, _d, _t, prepared, strided, _p, _ss in contexts.values():
            for p in [*prepared.values(), *strided.values()]:
                transport.unprepare(p)
    return cases


def measure(
    args, transport, peer, plan, sources, dst_mem, tables, prepared, strided, tokens, bs, rng, ref, dst, src_base
) -> dict:
    n = -(-tokens // bs)
    nb = num_blocks(args, bs)
    sb, db = rng.permutation(nb)[:n], rng.permutation(nb)[:n]
    descs = worker_descriptors(plan, DECODE, dst_mem, sources, sb, db)
    descs = {r: d for r, d in descs.items() if len(d)}
    nbytes = sum(d.nbytes for d in descs.values())
    anchors = {}
    for r, d in descs.items():  # the same bytes per READ, one region each (worker r's own memory, from its start)
        s0, d0 = sources[r].layers[0].addr, dst_mem.layers[0].addr  # each worker's first byte
        anchors[r] = Descriptors(*(np.array([v], dtype=np.int64) for v in (s0, d0, d.nbytes, 0, 0)))
    counts = {"kvbridge": sum(len(d) for d in descs.values()), "anchor": len(anchors)}
    counts["nixlconn"] = counts["strided"] = sum(len(t.segments) * n for t in tables.values())

    def post_kvbridge():
        built = worker_descriptors(plan, DECODE, dst_mem, sources, sb, db)  # per request, as the decode worker does
        return [transport.read(peer, d, dst_mem, sources[r], b"k") for r, d in built.items() if len(d)]

    def post_prepared(lists):
        def post():
            out = []
            for p in lists.values():
                s_idx, d_idx = p.table.indices(sb, db)
                out.append(transport.read_prepared(p, s_idx, d_idx, b"p"))
            return out

        return post

    def post_anchor():
        return [transport.read(peer, a, dst_mem, sources[r], b"a") for r, a in anchors.items()]

    ways = {
        "kvbridge": post_kvbridge,
        "nixlconn": post_prepared(prepared),
        "strided": post_prepared(strided),
        "anchor": post_anchor,
    }
    times = {w: [] for w in ways}
    ok = {w: True for w in ways if w != "anchor"}
    errors = {}
    reps = args.reps
    for rep in range(reps + 1):  # interleaved; round 0 is a warm-up
        for way, post in ways.items():
            if way in errors:
                continue
            check = args.check and way != "anchor" and rep in (0, reps)
            if check:
                dst.clear()
            try:
                t0 = time.perf_counter()
                transfers = post()
                for t in transfers:
                    transport.wait(t, args.read_timeout_s)
                s = time.perf_counter() - t0
                for t in transfers:
                    transport.release(t)
            except Exception as exc:  # a refused or timed-out READ: recorded, the other ways go on
                errors[way] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            if rep:
                times[way].append(s)
            if check:
                view = dst.view()
                ok[way] &= all(exact(d, ref, view, src_base, dst.addr) for d in descs.values())
        if rep == 1 and reps > 1 and max((statistics.median(v) for v in times.values() if v), default=0) > 2.0:
            reps = 1  # slow transport: one timed repetition
    case = {"tokens": tokens, "blocks": n, "bytes": nbytes, "reps": reps, "descriptors": counts, "errors": errors}
    for way in ways:
        if times[way]:
            med = statistics.median(times[way])
            case[way] = {"s": med, "times_s": times[way], "gbps": nbytes / med / 1e9}
            if way in ok:
                case[way]["ok"] = ok[way]
    if "anchor" in case:
        for way in ok:
            if way in case:
                case[way]["ratio_to_anchor"] = case["anchor"]["s"] / case[way]["s"]
    return case


def line(case: dict) -> str:
    parts = [f"bs={case['block_size']:3} {case['ratio']:4} {case['tokens']:6} tok {case['bytes'] / 2**20:7.0f} MiB:"]
    for way in VARIANTS:
        if way in case:
            c = case[way]
            parts.append(
                f"{way} {c['gbps']:6.2f} GB/s ({case['descriptors'][way]}{'' if c.get('ok', True) else ' BAD'})"
            )
        elif way in case["errors"]:
            parts.append(f"{way} ERROR")
    return "  ".join(parts)


# -- the run, and the table and plot --------------------------------------------------------------------


def machine(args) -> dict:
    def command(cmd: list[str]) -> str | None:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{type(exc).__name__}: {exc}"

    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    info = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu": command(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"]),
        "nixl": version("nixl-cu13") or version("nixl-cu12"),
        "load_avg": os.getloadavg(),
    }
    if args.mem == "VRAM":
        info["nvidia_smi_L"] = command(["nvidia-smi", "-L"])
    return info


def render(path: Path, md: Path, png: Path) -> None:
    record = json.loads(path.read_text())
    order = list(PAIRS)
    cases = sorted(record["cases"], key=lambda c: (c["block_size"], order.index(c["ratio"]), c["tokens"]))
    rows = [
        f"Source: `{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}`; {record['transport']}; "
        f"machine: {record['machine'].get('host')} ({record['machine'].get('cpu_count')} CPUs). "
        "GB/s = request bytes / median time from block ids to bytes in place (host work included); "
        "descriptor counts in parentheses; ratio = anchor time / time.",
        "",
        "| block | TP (prefill:decode) | tokens | MiB | kvbridge GB/s (descs) | NixlConnector-style prepared GB/s"
        " (descs) | strided-prepared GB/s | anchor GB/s | kvbridge / anchor | prepared / anchor | checks |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:

        def g(way, c=c):
            return f"{c[way]['gbps']:.2f}" if way in c else ("error" if way in c["errors"] else "-")

        def r(way, c=c):
            return f"{c[way]['ratio_to_anchor']:.2f}" if way in c and "ratio_to_anchor" in c[way] else "-"

        oks = [c[w].get("ok") for w in ("kvbridge", "nixlconn", "strided") if w in c]
        rows.append(
            f"| {c['block_size']} | {c['ratio']} | {c['tokens']} | {c['bytes'] / 2**20:.0f} | {g('kvbridge')} "
            f"({c['descriptors']['kvbridge']}) | {g('nixlconn')} ({c['descriptors']['nixlconn']}) | {g('strided')} | "
            f"{g('anchor')} | {r('kvbridge')} | {r('nixlconn')} | {'all exact' if all(oks) else 'MISMATCH'} |"
        )
    preps = sorted({(c["block_size"], c["ratio"], c["prep_s"], c["strided_prep_s"], c["prep_entries"]) for c in cases})
    rows += ["", "Preparing one pair's lists once (entries per side): dense rows vs strided rows:", ""]
    rows += [f"- bs={b} {r}: {e} entries, dense {p * 1e3:.1f} ms, strided {s * 1e3:.1f} ms" for b, r, p, s, e in preps]
    md.write_text("\n".join(rows) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = [r for r in PAIRS if any(c["ratio"] == r for c in cases)]
    fig, axes = plt.subplots(1, len(ratios), figsize=(4.2 * len(ratios), 4), sharey=True, squeeze=False)
    styles = {"kvbridge": "-o", "nixlconn": "--s", "anchor": ":^"}
    labels = {"kvbridge": "kvbridge coalesced", "nixlconn": "NixlConnector-style prepared", "anchor": "anchor"}
    colors = {16: "tab:red", 64: "tab:blue", 128: "tab:green"}
    for ax, ratio in zip(axes[0], ratios, strict=True):
        for bs in sorted({c["block_size"] for c in cases}):
            sel = sorted((c for c in cases if c["ratio"] == ratio and c["block_size"] == bs), key=lambda c: c["tokens"])
            for way, style in styles.items():
                pts = [(c["tokens"], c[way]["gbps"]) for c in sel if way in c]
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, ys, style, color=colors.get(bs, "k"), label=f"{labels[way]}, block {bs}", ms=4)
        ax.set_xscale("log", base=2)
        ax.set_title(f"TP {ratio} (prefill:decode)")
        ax.set_xlabel("request tokens")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("GB/s (scattered blocks)")
    axes[0][-1].legend(fontsize=6, loc="best")
    fig.suptitle(f"NIXL READ, scattered blocks: {record['transport']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {md} and {png}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["run", "prefill"], default="run")
    p.add_argument("--dir", default="")
    p.add_argument("--mem", choices=["DRAM", "VRAM"], default="DRAM")
    p.add_argument("--block-sizes", nargs="+", type=int, default=[16, 64, 128])
    p.add_argument("--ratios", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 8192, 32768])
    p.add_argument("--layers", type=int, default=28, help="Qwen2.5-7B: 28 layers, 4 KV heads, head size 128")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--layout", default="LBHNC", help="vLLM 0.32's CPU default, and what kvbridge asks for")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", dest="check", action="store_false")
    p.add_argument("--read-timeout-s", type=float, default=120.0)
    p.add_argument("--budget-s", type=float, default=400.0, help="stop starting cases after this long")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--render", type=Path, help="render a result file into bench/NAME.{md,png}")
    p.add_argument("--name", default="nixl_curve", help="NAME of --render's files")
    args = p.parse_args(argv)
    if args.render:
        render(args.render, ROOT / "bench" / f"{args.name}.md", ROOT / "bench" / f"{args.name}.png")
        return 0
    if args.role == "prefill":
        prefill_main(args)
        return 0
    passed = [a for a in (argv if argv is not None else sys.argv[1:])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as work:
        child = subprocess.Popen([sys.executable, __file__, *passed, "--role", "prefill", "--dir", work], env=env)
        try:
            args.dir = work
            cases = decode_main(args, child)
        finally:
            Path(work, "stop").touch()
            child.wait(timeout=60)
    tls = (
        "UCX_TLS left to UCX (one GPU: software emulation over tcp/lo)"
        if args.mem == "VRAM"
        else ("UCX_TLS=" + os.environ.get("UCX_TLS", TransportConfig().ucx_tls or ""))
    )
    record = {
        "command": [sys.executable, *sys.argv],
        "settings": {k: str(v) for k, v in vars(args).items()},
        "transport": f"NIXL UCX between two processes on one host, {args.mem}, {args.layout}, {tls}",
        "machine": machine(args),
        "wall_s": time.time() - t0,
        "cases": cases,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"nixl-curve-{args.mem.lower()}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"json: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
