"""Different block sizes on the two sides: the byte runs of a token range, not of block pairs.

With equal block sizes a request's blocks pair up one to one and whole pages are copied (`segments`). With a
prefill block of Bp tokens and a decode block of Bd, token t lies in prefill block t // Bp at offset t % Bp and in
decode block t // Bd at offset t % Bd: the token range is cut at every multiple of Bp and of Bd into chunks that
lie in one block on each side, and each chunk's tokens are copied where each side's page keeps them.

Where a page keeps token n of a (block, head) depends on the attention backend, not only on the tensor's strides,
so each layer names its page format (`LayerKV.page_format`):
- `PAGE_ROWS` (""): the strides are the truth: plane p, token n is a row of `row_bytes` at
  `p * plane_stride + n * token_stride`.
- `PAGE_CPU_ATTN` ("cpu_attn"): vLLM 0.32's CPU_ATTN pages (ISAs vec and vec16, checked with vLLM's own
  `cpu_attn_reshape_and_cache` in tests/unit/test_token_runs.py): each (block, head) page of N tokens holds K
  channel-major
  ([head_size][N]: channel c of token n at `(c * N + n) * itemsize`), then V token-major ([N][head_size]), whatever
  the tensor's [blocks, heads, N, 2 * head_size] shape says.
Any other name is opaque: its pages are copied whole, so both block sizes must be equal.

Each chunk costs one run per (layer, plane, head) where tokens are rows on both sides, one per channel where they
are channel-major (CPU_ATTN's K); runs that continue each other are merged afterwards (`Descriptors.coalesced`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.core.arrays import ParallelArrays
from kvbridge.core.descriptors import Descriptors, _int64
from kvbridge.core.errors import IncompatiblePeerError, RequestParamsError
from kvbridge.core.memory import PAGE_CPU_ATTN, PAGE_ROWS, LayerKV, WorkerMemory
from kvbridge.core.plan import TransferPlan
from kvbridge.core.segments import check_blocks
from kvbridge.core.topology import WorkerRank

TOKEN_FORMATS = (PAGE_ROWS, PAGE_CPU_ATTN)
"""Page formats whose tokens can be addressed one by one."""

VERIFIED_FORMATS = (PAGE_CPU_ATTN,)
"""Formats checked against their backend's kernel (tests/unit/test_token_runs.py): the only ones whose block sizes the
handshake lets differ. PAGE_ROWS is what strides say, unchecked for any real backend (GPU backends are not run
here), so a worker that does not name its format gets whole-page copies and equal block sizes only."""


@dataclass(frozen=True)
class TokenSpan:
    """`num_tokens` consecutive tokens: the first at offset `src_start` of the first source block and at offset
    `dst_start` of the first destination block (the block lists start at the first block the span touches)."""

    num_tokens: int
    src_start: int = 0
    dst_start: int = 0

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or self.src_start < 0 or self.dst_start < 0:
            raise RequestParamsError(f"a token span needs non-negative fields, got {self}")

    def blocks(self, start: int, block_size: int) -> int:
        """Blocks of `block_size` a list starting at token offset `start` needs to hold the span."""
        return -(-(start + self.num_tokens) // block_size) if self.num_tokens else 0


def chunks(span: TokenSpan, src_block_size: int, dst_block_size: int) -> tuple[np.ndarray, ...]:
    """(source block index, source offset, destination block index, destination offset, tokens) per chunk: the
    span cut wherever a block ends on either side, in token order."""
    n = span.num_tokens
    if n == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, z, z
    cuts = [np.zeros(1, dtype=np.int64), np.array([n], dtype=np.int64)]
    for start, size in ((span.src_start, src_block_size), (span.dst_start, dst_block_size)):
        first = size - start % size  # the first block end after token 0 of the span
        cuts.append(np.arange(first, n, size, dtype=np.int64))
    edges = np.unique(np.concatenate(cuts))
    begin, length = edges[:-1], np.diff(edges)
    s, d = begin + span.src_start, begin + span.dst_start
    return s // src_block_size, s % src_block_size, d // dst_block_size, d % dst_block_size, length


@dataclass(frozen=True, eq=False)
class TokenSegments(ParallelArrays):
    """Parallel int64 arrays, one entry per (layer, plane, head[, channel]) run of a chunk: the chunk's tokens
    [o, o + L) of block b are `L * unit[k]` bytes from `src_addr[k] + b * src_block_stride[k] + o *
    src_token_stride[k]` (likewise on the destination). `token_stride == unit` on both sides keeps a chunk in
    one run; otherwise each token is a run of its own."""

    src_addr: np.ndarray
    dst_addr: np.ndarray
    src_block_stride: np.ndarray
    dst_block_stride: np.ndarray
    src_token_stride: np.ndarray
    dst_token_stride: np.ndarray
    unit: np.ndarray
    src_region: np.ndarray
    dst_region: np.ndarray

    def __len__(self) -> int:
        return len(self.unit)


def planes(lk: LayerKV) -> list[tuple[int, int, int, int]]:
    """Each plane of one (block, head) page as (byte offset, token stride, channel stride, channels), channels of
    `lk.itemsize` bytes; IncompatiblePeerError for a page format whose tokens cannot be addressed."""
    if lk.page_format == PAGE_ROWS:
        item = lk.itemsize
        return [(p * lk.plane_stride, lk.token_stride, item, lk.row_bytes // item) for p in range(lk.num_planes)]
    if lk.page_format == PAGE_CPU_ATTN:
        item, half = lk.itemsize, lk.row_bytes // 2
        channels, n = half // item, lk.block_size
        return [(0, item, n * item, channels), (n * half, half, item, channels)]
    raise IncompatiblePeerError(
        f"layer {lk.layer} page_format", "one of " + ", ".join(map(repr, TOKEN_FORMATS)), lk.page_format
    )


def layer_token_segments(src: LayerKV, dst: LayerKV, src_head: int, dst_head: int, num_heads: int) -> TokenSegments:
    """Runs copying tokens of heads [src_head, +num_heads) of one layer into [dst_head, ...): one per (plane, head)
    where both sides keep tokens as rows, one per (plane, head, channel) where both keep them channel-major."""
    if (src.row_bytes, src.num_planes, src.itemsize) != (dst.row_bytes, dst.num_planes, dst.itemsize):
        raise IncompatiblePeerError(
            f"layer {src.layer} (row_bytes, num_planes, itemsize)",
            (dst.row_bytes, dst.num_planes, dst.itemsize),
            (src.row_bytes, src.num_planes, src.itemsize),
        )
    if not (src_head >= 0 and src_head + num_heads <= src.num_heads):
        raise IncompatiblePeerError(f"layer {src.layer} heads", src.num_heads, (src_head, num_heads))
    if not (dst_head >= 0 and dst_head + num_heads <= dst.num_heads):
        raise IncompatiblePeerError(f"layer {dst.layer} heads", dst.num_heads, (dst_head, num_heads))
    item = src.itemsize
    per_run = ("src_addr", "dst_addr", "src_token_stride", "dst_token_stride", "unit")
    cols: dict[str, list[int]] = {f: [] for f in per_run}
    for (s_off, s_tok, s_ch, channels), (d_off, d_tok, d_ch, d_channels) in zip(planes(src), planes(dst), strict=True):
        if channels != d_channels:
            raise IncompatiblePeerError(f"layer {src.layer} channels", d_channels, channels)
        if s_ch == item and d_ch == item:  # token rows on both sides
            runs = [(0, 0, channels * item)]
        elif s_tok == item and d_tok == item:  # channel-major on both sides: tokens of one channel are contiguous
            runs = [(c * s_ch, c * d_ch, item) for c in range(channels)]
        else:
            raise IncompatiblePeerError(f"layer {src.layer} page_format", dst.page_format, src.page_format)
        for h in range(num_heads):
            for s_c, d_c, unit in runs:
                cols["src_addr"].append(src.addr + (src_head + h) * src.head_stride + s_off + s_c)
                cols["dst_addr"].append(dst.addr + (dst_head + h) * dst.head_stride + d_off + d_c)
                cols["src_token_stride"].append(s_tok)
                cols["dst_token_stride"].append(d_tok)
                cols["unit"].append(unit)
    k = len(cols["unit"])
    cols["src_block_stride"] = [src.block_stride] * k
    cols["dst_block_stride"] = [dst.block_stride] * k
    cols["src_region"] = [src.region] * k
    cols["dst_region"] = [dst.region] * k
    return TokenSegments(**{f: np.asarray(v, dtype=np.int64).reshape(k) for f, v in cols.items()})


def expand_tokens(
    segments: TokenSegments,
    src_blocks: Sequence[int] | np.ndarray,
    dst_blocks: Sequence[int] | np.ndarray,
    span: TokenSpan,
    src_block_size: int,
    dst_block_size: int,
    src_num_blocks: int,
    dst_num_blocks: int,
) -> Descriptors:
    """Every run of the span's chunks (segment-major), uncoalesced. RequestParamsError unless each block list
    holds exactly the blocks the span touches, inside its buffer."""
    s_blocks, d_blocks = _int64(src_blocks), _int64(dst_blocks)
    for name, blocks, start, size, total in (
        ("source", s_blocks, span.src_start, src_block_size, src_num_blocks),
        ("destination", d_blocks, span.dst_start, dst_block_size, dst_num_blocks),
    ):
        if blocks.ndim != 1 or blocks.size != span.blocks(start, size):
            raise RequestParamsError(
                f"{blocks.size} {name} blocks of {size} tokens for {span.num_tokens} tokens from offset {start} "
                f"(needs {span.blocks(start, size)})"
            )
        check_blocks(name, blocks, total)
    si, so, di, do, length = chunks(span, src_block_size, dst_block_size)
    if not (len(segments) and length.size):
        return Descriptors.empty()
    whole = (segments.src_token_stride == segments.unit) & (segments.dst_token_stride == segments.unit)
    parts = []
    if whole.any():
        parts.append(_runs(segments.select(whole), s_blocks[si], so, d_blocks[di], do, length))
    if (~whole).any():  # one run per token
        tokens = np.repeat(np.arange(length.size), length)
        step = np.arange(tokens.size) - np.repeat(np.cumsum(length) - length, length)
        ones = np.ones(tokens.size, dtype=np.int64)
        parts.append(
            _runs(
                segments.select(~whole),
                s_blocks[si][tokens],
                so[tokens] + step,
                d_blocks[di][tokens],
                do[tokens] + step,
                ones,
            )
        )
    return Descriptors.concat(parts)


def _runs(seg: TokenSegments, s_block, s_off, d_block, d_off, length) -> Descriptors:
    n = length.size
    return Descriptors(
        (
            seg.src_addr[:, None] + seg.src_block_stride[:, None] * s_block + seg.src_token_stride[:, None] * s_off
        ).ravel(),
        (
            seg.dst_addr[:, None] + seg.dst_block_stride[:, None] * d_block + seg.dst_token_stride[:, None] * d_off
        ).ravel(),
        (seg.unit[:, None] * length[None, :]).ravel(),
        np.repeat(seg.src_region, n),
        np.repeat(seg.dst_region, n),
    )


def check_token_formats(src: WorkerMemory | Sequence[LayerKV], dst: WorkerMemory | Sequence[LayerKV]) -> None:
    """IncompatiblePeerError unless both sides' pages are of one format whose tokens can be addressed."""
    formats = {lk.page_format for lk in (*_layers(src), *_layers(dst))}
    if len(formats) != 1 or not formats <= set(TOKEN_FORMATS):
        raise IncompatiblePeerError(
            "page_format",
            sorted({lk.page_format for lk in _layers(dst)}),
            sorted({lk.page_format for lk in _layers(src)}),
        )


def _layers(memory: WorkerMemory | Sequence[LayerKV]) -> Sequence[LayerKV]:
    return memory.layers if isinstance(memory, WorkerMemory) else memory


def worker_token_descriptors(
    plan: TransferPlan,
    decode_worker: WorkerRank,
    dst: WorkerMemory,
    sources: dict[WorkerRank, WorkerMemory],
    src_blocks: Sequence[int] | np.ndarray,
    dst_blocks: Sequence[int] | np.ndarray,
    span: TokenSpan,
    coalesce: bool = True,
) -> dict[WorkerRank, Descriptors]:
    """`descriptors.worker_descriptors` for different block sizes: every descriptor one decode worker posts to copy
    the span's tokens, grouped by the prefill worker it reads (plan order)."""
    heads = plan.geometry.num_kv_heads
    dst_first = plan.decode.kv_heads(heads, decode_worker.tp).start
    grouped: dict[WorkerRank, list[TokenSegments]] = {}
    for read in plan.reads_of(decode_worker):
        pw = read.prefill_worker
        src_first = plan.prefill.kv_heads(heads, pw.tp).start
        head = read.kv_heads[0]
        check_token_formats(sources[pw], dst)
        grouped.setdefault(pw, []).extend(
            layer_token_segments(sources[pw].layer(n), dst.layer(n), head - src_first, head - dst_first, read.num_heads)
            for n in read.layers
        )
    out = {}
    for pw, parts in grouped.items():
        src = sources[pw]
        merged = expand_tokens(
            TokenSegments.concat(parts),
            src_blocks,
            dst_blocks,
            span,
            src.layers[0].block_size,
            dst.layers[0].block_size,
            src.num_blocks,
            dst.num_blocks,
        )
        out[pw] = merged.coalesced() if coalesce else merged
    return out


def span_of(
    num_tokens: int, first_token: int, src_block_size: int, dst_block_size: int
) -> tuple[range, range, TokenSpan]:
    """What a load of prompt tokens [first_token, num_tokens) reads: (positions in the prefill's block list,
    positions in the decode's block list, the span) for blocks of `src_block_size` / `dst_block_size` tokens
    holding the prompt from its token 0."""
    if not 0 <= first_token <= num_tokens:
        raise RequestParamsError(f"first token {first_token} outside a prompt of {num_tokens} tokens")
    src = range(first_token // src_block_size, -(-num_tokens // src_block_size))
    dst = range(first_token // dst_block_size, -(-num_tokens // dst_block_size))
    span = TokenSpan(
        num_tokens - first_token, first_token - src.start * src_block_size, first_token - dst.start * dst_block_size
    )
    return src, dst, span
