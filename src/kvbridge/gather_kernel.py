"""The Triton kernel behind `kvbridge.gpu_gather` (its own module: importing it imports Triton).

Program (i, k) copies table row k's run of block pair i, computing both addresses from the block ids:
`src + row[0] + ids[i] * row[2]` to `dst + row[1] + ids[num_pairs + i] * row[3]`, `row[4]` words, all in int32
words; `src` and `dst` are base pointers, and an offset may lead into another allocation (another region).
`ALIGN` (words) tells Triton the addresses' alignment so it can use 16-byte accesses; `EVEN` says every run is a
multiple of `TILE` words, so no masks are needed. (Streaming cache hints, `.cg` loads and `.cs` stores, were
measured on nvidia-h200-x2 and gained nothing: bench/GPU_RESULTS.md.)
"""

from __future__ import annotations

import triton
import triton.language as tl


def gather_runs(src, dst, ids, table, num_pairs, TILE: tl.constexpr, ALIGN: tl.constexpr, EVEN: tl.constexpr):
    i = tl.program_id(0)
    row = table + tl.program_id(1) * 5
    src_block = tl.load(ids + i).to(tl.int64)
    dst_block = tl.load(ids + num_pairs + i).to(tl.int64)
    a = tl.multiple_of(tl.load(row) + src_block * tl.load(row + 2), ALIGN)
    b = tl.multiple_of(tl.load(row + 1) + dst_block * tl.load(row + 3), ALIGN)
    words = tl.load(row + 4)
    for start in range(0, words, TILE):
        offs = start + tl.arange(0, TILE)
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
