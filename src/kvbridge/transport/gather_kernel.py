"""The Triton kernel behind `kvbridge.transport.gpu_gather` (its own module: importing it imports Triton).

Program (i, k) copies table rows k*ROWS .. k*ROWS+ROWS-1 of block pairs i*BLOCKS .. i*BLOCKS+BLOCKS-1, computing
every address from the block ids: `src + row[0] + ids[p] * row[2]` to `dst + row[1] + ids[num_pairs + p] * row[3]`,
`row[4]` words, all in int32 words; `src` and `dst` are base pointers, and an offset may lead into another
allocation (another region). Several runs per program keep enough bytes in flight per thread when runs are short
(1 KiB per token when heads are split); the host pads the pairs and rows so that no program needs a mask for them,
and groups rows only when their runs have one length. `ALIGN` (words) tells Triton the addresses' alignment so it
can use 16-byte accesses; `EVEN` says every run is a multiple of `TILE` words, so no masks are needed at all.
(Streaming cache hints, `.cg` loads and `.cs` stores, were measured on nvidia-h200-x2 and gained nothing:
docs/benchmarks/gpu-one-node.md.)
"""

from __future__ import annotations

import triton
import triton.language as tl


def gather_runs(
    src,
    dst,
    ids,
    table,
    num_pairs,
    TILE: tl.constexpr,
    ALIGN: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCKS: tl.constexpr,
    ROWS: tl.constexpr,
):
    pairs = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    rows = table + (tl.program_id(1) * ROWS + tl.arange(0, ROWS)) * 5
    src_block = tl.load(ids + pairs).to(tl.int64)
    dst_block = tl.load(ids + num_pairs + pairs).to(tl.int64)
    a = tl.load(rows)[None, :] + src_block[:, None] * tl.load(rows + 2)[None, :]
    b = tl.load(rows + 1)[None, :] + dst_block[:, None] * tl.load(rows + 3)[None, :]
    a = tl.multiple_of(a, [ALIGN, ALIGN])[:, :, None]
    b = tl.multiple_of(b, [ALIGN, ALIGN])[:, :, None]
    words = tl.load(table + tl.program_id(1) * ROWS * 5 + 4)  # every row of a group has this length
    for start in range(0, words, TILE):
        offs = start + tl.arange(0, TILE)[None, None, :]
        if EVEN:
            tl.store(dst + b + offs, tl.load(src + a + offs))
        else:
            mask = offs < words
            tl.store(dst + b + offs, tl.load(src + a + offs, mask=mask), mask=mask)


def compiled(interpret: bool):
    """The kernel for the GPU, or wrapped for Triton's CPU interpreter (chosen per call rather than by the
    TRITON_INTERPRET environment variable, so both can live in one process)."""
    # num_pairs changes with every request: specializing on it (Triton does for ints equal to 1 or divisible by
    # 16) would compile new variants at run time, blocking the transfer thread for a second each.
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(gather_runs, do_not_specialize=["num_pairs"])
    return triton.jit(gather_runs, do_not_specialize=["num_pairs"])
