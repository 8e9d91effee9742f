"""What an operator checking a deployment wants to see of a plan: who talks, what moves, at what cost."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbridge.core.descriptors import read_descriptors
from kvbridge.core.memory import synthesize_memory
from kvbridge.core.plan import Read, TransferPlan


@dataclass(frozen=True)
class ReadCost:
    read: Read
    bytes_per_token: int
    descriptors_contiguous: int
    descriptors_scattered: int


def read_costs(plan: TransferPlan, kv_layout: str, tokens: int) -> list[ReadCost]:
    """Bytes per token and descriptor counts of each read, for a request of `tokens` tokens whose blocks
    are contiguous on both sides (best case) or all non-adjacent (worst case)."""
    g = plan.geometry
    blocks = max(1, -(-tokens // g.block_size))
    contiguous = np.arange(blocks)
    scattered = np.arange(blocks) * 2
    out = []
    for read in plan:
        pw, dw = read.prefill_worker, read.decode_worker
        p_heads = plan.prefill.kv_heads(g.num_kv_heads, pw.tp)
        d_heads = plan.decode.kv_heads(g.num_kv_heads, dw.tp)
        src = synthesize_memory(kv_layout, g, read.layers, len(p_heads), 2 * blocks, 1 << 40)
        dst = synthesize_memory(kv_layout, g, read.layers, len(d_heads), 2 * blocks, 1 << 46)
        counts = [
            len(read_descriptors(read, src, p_heads.start, dst, d_heads.start, ids, ids))
            for ids in (contiguous, scattered)
        ]
        out.append(ReadCost(read, g.kv_bytes_per_token(len(read.layers), read.num_heads), *counts))
    return out


def preferred_kv_layout(plan: TransferPlan) -> str:
    """LBNHC (vLLM's GPU default) when every read takes whole workers' heads, else head-outer LBHNC."""
    heads = plan.geometry.num_kv_heads
    partial = any(
        read.num_heads != len(plan.decode.kv_heads(heads, read.decode_worker.tp))
        or read.num_heads != len(plan.prefill.kv_heads(heads, read.prefill_worker.tp))
        for read in plan
    )
    return "LBHNC" if partial else "LBNHC"


def _span(layers: tuple[int, ...]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])


def plan_json(plan: TransferPlan, costs: list[ReadCost], kv_layout: str, tokens: int) -> dict:
    return {
        "prefill": str(plan.prefill),
        "decode": str(plan.decode),
        "kv_layout": kv_layout,
        "tokens": tokens,
        "transfers": [
            {
                "decode_worker": {"pp": c.read.decode_worker.pp, "tp": c.read.decode_worker.tp},
                "prefill_worker": {"pp": c.read.prefill_worker.pp, "tp": c.read.prefill_worker.tp},
                "layers": list(c.read.layers),
                "kv_heads": list(c.read.kv_heads),
                "bytes_per_token": c.bytes_per_token,
                "descriptors_contiguous": c.descriptors_contiguous,
                "descriptors_scattered": c.descriptors_scattered,
            }
            for c in costs
        ],
    }


def plan_text(plan: TransferPlan, costs: list[ReadCost], kv_layout: str, tokens: int) -> str:
    g = plan.geometry
    lines = [
        f"prefill {plan.prefill}  ->  decode {plan.decode}",
        f"model: {g.num_layers} layers, {g.num_kv_heads} KV heads x {g.head_size}, {g.dtype}, "
        f"block {g.block_size} tokens; KV layout {kv_layout}; descriptors for {tokens} tokens",
        "",
        f"{'decode':>10} {'<- prefill':>11} {'layers':>8} {'kv heads':>9} {'bytes/token':>12} "
        f"{'descs (contig)':>15} {'descs (scattered)':>18}",
    ]
    for c in costs:
        lines.append(
            f"{c.read.decode_worker!s:>10} {c.read.prefill_worker!s:>11} {_span(c.read.layers):>8} "
            f"{c.read.kv_heads[0]:>4}-{c.read.kv_heads[1] - 1:<4} {c.bytes_per_token:>12,} "
            f"{c.descriptors_contiguous:>15,} {c.descriptors_scattered:>18,}"
        )
    total = sum(c.bytes_per_token for c in costs)
    idle = [str(w) for w in plan.prefill.workers() if not plan.readers_of(w)]
    lines += [
        "",
        f"{len(costs)} reads; {total:,} bytes per token in all ({total * tokens / 2**20:,.1f} MiB for {tokens} tokens)",
    ]
    if idle:
        lines.append(f"prefill workers nobody reads from (replicas): {', '.join(idle)}")
    return "\n".join(lines)
