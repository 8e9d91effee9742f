"""Different block sizes on prefill and decode (`core.token_runs`): applying the descriptors to real byte buffers
moves every token of the load to where a token-by-token copy puts it, and nothing else, for any pair of block
sizes, TP/PP pair, page format (rows in any named layout, vLLM's CPU_ATTN pages, MLA's one latent plane), partial
last blocks and blocks already cached on the decode side."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.core.descriptors import Descriptors, worker_descriptors
from kvbridge.core.errors import IncompatiblePeerError, RequestParamsError
from kvbridge.core.memory import PAGE_CPU_ATTN, PAGE_ROWS, WorkerMemory, synthesize_memory
from kvbridge.core.plan import make_plan
from kvbridge.core.token_runs import TokenSpan, chunks, span_of, worker_token_descriptors
from kvbridge.core.topology import KVGeometry, ParallelLayout


def memory(layout: str, page_format: str, geometry: KVGeometry, layers, heads: int, blocks: int) -> WorkerMemory:
    mem = synthesize_memory(layout, geometry, layers, heads, blocks, 0)
    layers_ = tuple(dataclasses.replace(lk, page_format=page_format, itemsize=geometry.itemsize) for lk in mem.layers)
    return WorkerMemory(mem.regions, layers_)


def element_addrs(lk, blocks: np.ndarray, offsets: np.ndarray, head: int) -> np.ndarray:
    """Byte address of every (token, plane, channel) element, token by token, from the format's definition."""
    item = lk.itemsize
    if lk.page_format == PAGE_CPU_ATTN:
        hs, n = lk.row_bytes // 2 // item, lk.block_size
        c = np.arange(hs)[None, :]
        page = (lk.addr + blocks * lk.block_stride + head * lk.head_stride)[:, None]
        k = page + (c * n + offsets[:, None]) * item
        v = page + n * hs * item + (offsets[:, None] * hs + c) * item
        return np.stack([k, v], axis=1)
    c = np.arange(lk.row_bytes // item)[None, None, :] * item
    p = np.arange(lk.num_planes)[None, :, None] * lk.plane_stride
    base = lk.addr + blocks * lk.block_stride + head * lk.head_stride + offsets * lk.token_stride
    return base[:, None, None] + p + c


def apply(descs: Descriptors, src: np.ndarray, dst: np.ndarray) -> None:
    for s, d, n in zip(descs.src_addr.tolist(), descs.dst_addr.tolist(), descs.length.tolist(), strict=True):
        assert s >= 0 and s + n <= src.size and d >= 0 and d + n <= dst.size, "descriptor outside a buffer"
        dst[d : d + n] = src[s : s + n]


def check_load(
    prefill: str,
    decode: str,
    geometry: KVGeometry,
    src_bs: int,
    dst_bs: int,
    prompt: int,
    cached: int,
    fmt: tuple[str, str],
    seed: int,
    mutate=None,
) -> None:
    """A prompt of `prompt` tokens in blocks of `src_bs` on the prefill, `dst_bs` on the decode, whose first
    `cached` decode blocks are cached: after the descriptors, every decode worker holds each token of the rest of
    the prompt where a token-by-token copy puts it, and no other byte of its buffer changed."""
    layout, page_format = fmt
    p, d = ParallelLayout.parse(prefill), ParallelLayout.parse(decode)
    plan = make_plan(p, d, geometry)
    gp, gd = (dataclasses.replace(geometry, block_size=b) for b in (src_bs, dst_bs))
    rng = np.random.default_rng(seed)
    n_src, n_dst = -(-prompt // src_bs), -(-prompt // dst_bs)
    src_all = rng.permutation(n_src + 3)[:n_src]
    dst_all = rng.permutation(n_dst + 3)[:n_dst]
    heads, layers = geometry.num_kv_heads, geometry.num_layers
    sources, buffers = {}, {}
    for pw in p.workers():
        sources[pw] = memory(
            layout, page_format, gp, p.stage_layers(layers, pw.pp), len(p.kv_heads(heads, pw.tp)), n_src + 3
        )
        buffers[pw] = rng.integers(0, 256, sources[pw].regions[0].nbytes, dtype=np.uint8)
    first = cached * dst_bs
    src_pos, dst_pos, span = span_of(prompt, first, src_bs, dst_bs)
    read_from = src_all  # the prefill's block list as the load names it (the oracle keeps src_all)
    if mutate is not None:
        src_pos, dst_pos, span, read_from = mutate(src_pos, dst_pos, span, src_all)
    for dw in d.workers():
        my_layers, my_heads = d.stage_layers(layers, dw.pp), d.kv_heads(heads, dw.tp)
        dst = memory(layout, page_format, gd, my_layers, len(my_heads), n_dst + 3)
        buf = np.full(dst.regions[0].nbytes, 0xAB, dtype=np.uint8)
        descs = worker_token_descriptors(
            plan, dw, dst, sources, read_from[src_pos.start : src_pos.stop], dst_all[dst_pos.start : dst_pos.stop], span
        )
        for pw, ds in descs.items():
            apply(ds, buffers[pw], buf)
        touched = np.zeros(buf.size, dtype=bool)
        tokens = np.arange(first, prompt)
        for layer in my_layers:
            for head in my_heads:
                pw = next(
                    r.prefill_worker
                    for r in plan.reads_of(dw)
                    if layer in r.layers and r.kv_heads[0] <= head < r.kv_heads[1]
                )
                s_lk, d_lk = sources[pw].layer(layer), dst.layer(layer)
                s_at = element_addrs(
                    s_lk, src_all[tokens // src_bs], tokens % src_bs, head - p.kv_heads(heads, pw.tp).start
                )
                d_at = element_addrs(d_lk, dst_all[tokens // dst_bs], tokens % dst_bs, head - my_heads.start)
                for k in range(geometry.itemsize):
                    assert np.array_equal(buf[d_at + k], buffers[pw][s_at + k]), f"{dw} layer {layer} head {head}"
                    touched[(d_at + k).ravel()] = True
        assert (buf[~touched] == 0xAB).all(), "bytes outside the load changed"


FORMATS = [
    ("LBHNC", PAGE_CPU_ATTN),
    ("LBHNC", PAGE_ROWS),
    ("LBNHC", PAGE_ROWS),
    ("KV_NHD", PAGE_ROWS),
    ("BLHNC", PAGE_ROWS),
]
PAIRS = [
    ("pp=1,tp=1", "pp=1,tp=2"),
    ("pp=2,tp=1", "pp=1,tp=2"),
    ("pp=1,tp=2", "pp=2,tp=1"),
    ("pp=1,tp=4", "pp=1,tp=1"),
    ("pp=2,tp=2", "pp=1,tp=4"),
    ("pp=1,tp=1", "pp=1,tp=1"),
]


@st.composite
def loads(draw):
    prefill, decode = draw(st.sampled_from(PAIRS))
    fmt = draw(st.sampled_from(FORMATS))
    heads = draw(st.sampled_from([1, 2, 4]))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "uint8"]))
    geometry = KVGeometry(num_layers=4, num_kv_heads=heads, head_size=draw(st.sampled_from([2, 4])), dtype=dtype)
    src_bs, dst_bs = draw(st.sampled_from([1, 2, 4, 8, 16])), draw(st.sampled_from([1, 2, 4, 8, 16, 32]))
    prompt = draw(st.integers(1, 70))
    cached = draw(st.integers(0, (prompt - 1) // dst_bs))  # decode blocks of the prompt already cached
    return prefill, decode, geometry, src_bs, dst_bs, prompt, cached, fmt, draw(st.integers(0, 2**16))


@given(loads())
def test_every_token_lands_where_a_token_by_token_copy_puts_it(case):
    check_load(*case)


@pytest.mark.parametrize("src_bs,dst_bs", [(16, 128), (128, 16), (32, 128), (128, 32), (16, 48), (48, 16)])
@pytest.mark.parametrize("pair", [("pp=2,tp=1", "pp=1,tp=2"), ("pp=1,tp=2", "pp=2,tp=1")])
def test_cpu_block_size_pairs_with_a_partial_last_block_and_a_prefix_hit(src_bs, dst_bs, pair):
    geometry = KVGeometry(num_layers=4, num_kv_heads=4, head_size=4, dtype="float32")
    check_load(*pair, geometry, src_bs, dst_bs, 300, 0, ("LBHNC", PAGE_CPU_ATTN), 1)
    check_load(*pair, geometry, src_bs, dst_bs, 300, 1, ("LBHNC", PAGE_CPU_ATTN), 2)


@pytest.mark.parametrize("pair", [("pp=1,tp=2", "pp=1,tp=1"), ("pp=2,tp=1", "pp=1,tp=2"), ("pp=1,tp=1", "pp=2,tp=1")])
def test_mla_latent_geometry(pair):
    """MLA's page (one latent plane of 576 channels, no V, held whole by every TP rank) between block sizes: vLLM's
    CPU MLA forces block 16 on both sides (so this is not run end to end), the core covers the geometry."""
    geometry = KVGeometry(num_layers=4, num_kv_heads=1, head_size=576, head_size_v=0, dtype="bfloat16")
    check_load(*pair, geometry, 16, 64, 150, 0, ("LBHNC", PAGE_ROWS), 3)
    check_load(*pair, geometry, 64, 16, 150, 2, ("LBHNC", PAGE_ROWS), 4)


def test_chunks_cut_the_span_at_every_block_end_of_either_side():
    si, so, di, do, n = chunks(TokenSpan(20, src_start=3, dst_start=0), 4, 8)
    assert n.tolist() == [1, 4, 3, 1, 4, 3, 1, 3] and int(n.sum()) == 20
    assert si.tolist() == [0, 1, 2, 2, 3, 4, 4, 5] and so.tolist() == [3, 0, 0, 3, 0, 0, 3, 0]
    assert di.tolist() == [0, 0, 0, 1, 1, 1, 2, 2] and do.tolist() == [0, 1, 5, 0, 1, 5, 0, 1]


def test_span_of_a_prefix_hit_reads_only_the_rest():
    src, dst, span = span_of(300, 128, 16, 128)  # decode caches its first 128-token block
    assert (src, dst, span) == (range(8, 19), range(1, 3), TokenSpan(172, 0, 0))
    src, dst, span = span_of(300, 32, 128, 32)
    assert (src, dst, span) == (range(0, 3), range(1, 10), TokenSpan(268, 32, 0))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s, d, span, src: (s, d, TokenSpan(span.num_tokens, span.src_start + 1, span.dst_start), src),
        lambda s, d, span, src: (s, d, span, np.roll(src, 1)),  # another block's tokens
    ],
    ids=["offset-by-one", "wrong-block"],
)
def test_negative_control_a_wrong_token_to_block_mapping_is_noticed(mutate):
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_size=4, dtype="float32")
    with pytest.raises((AssertionError, RequestParamsError)):
        check_load("pp=1,tp=1", "pp=1,tp=2", geometry, 16, 128, 100, 0, ("LBHNC", PAGE_CPU_ATTN), 5, mutate=mutate)


def test_negative_control_cpu_attn_pages_read_as_rows_are_noticed():
    """The CPU_ATTN format matters: the same pages taken as rows (what their tensor's shape says) put K wrong."""
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_size=4, dtype="float32")

    def as_rows(s, d, span, src):
        return s, d, span, src

    import kvbridge.core.token_runs as tr

    real = tr.planes
    try:
        tr.planes = lambda lk: real(dataclasses.replace(lk, page_format=PAGE_ROWS))
        with pytest.raises(AssertionError):
            check_load("pp=1,tp=1", "pp=1,tp=1", geometry, 16, 32, 100, 0, ("LBHNC", PAGE_CPU_ATTN), 6, as_rows)
    finally:
        tr.planes = real


def test_block_lists_must_hold_exactly_the_spans_blocks():
    geometry = KVGeometry(num_layers=2, num_kv_heads=1, head_size=4, dtype="float32")
    p = ParallelLayout.parse("pp=1,tp=1")
    plan = make_plan(p, p, geometry)
    src = memory("LBHNC", PAGE_ROWS, dataclasses.replace(geometry, block_size=16), range(2), 1, 8)
    dst = memory("LBHNC", PAGE_ROWS, dataclasses.replace(geometry, block_size=32), range(2), 1, 8)
    worker = next(iter(p.workers()))
    args = (plan, worker, dst, {worker: src})
    assert len(worker_token_descriptors(*args, [1, 2, 3], [4, 5], TokenSpan(40))[worker]) > 0
    with pytest.raises(RequestParamsError, match="source blocks"):
        worker_token_descriptors(*args, [1, 2], [4, 5], TokenSpan(40))
    with pytest.raises(RequestParamsError, match="outside"):
        worker_token_descriptors(*args, [1, 2, 9], [4, 5], TokenSpan(40))


def test_opaque_or_mixed_page_formats_are_refused_naming_page_format():
    geometry = KVGeometry(num_layers=2, num_kv_heads=1, head_size=4, dtype="float32")
    p = ParallelLayout.parse("pp=1,tp=1")
    plan = make_plan(p, p, geometry)
    worker = next(iter(p.workers()))
    g16, g32 = (dataclasses.replace(geometry, block_size=b) for b in (16, 32))
    for fs, fd in (("CPU_ATTN/amx", "CPU_ATTN/amx"), (PAGE_ROWS, PAGE_CPU_ATTN)):
        src, dst = memory("LBHNC", fs, g16, range(2), 1, 8), memory("LBHNC", fd, g32, range(2), 1, 8)
        with pytest.raises(IncompatiblePeerError, match="page_format"):
            worker_token_descriptors(plan, worker, dst, {worker: src}, [1, 2], [4], TokenSpan(20))


def test_equal_block_sizes_keep_their_whole_page_descriptors():
    """The equal-size path is unchanged: 8 consecutive blocks of a (block, head)-page layout cost one descriptor
    per layer, 4 scattered blocks one per (layer, block), as before."""
    geometry = KVGeometry(num_layers=4, num_kv_heads=2, head_size=4, dtype="float32", block_size=16)
    p = ParallelLayout.parse("pp=1,tp=1")
    plan = make_plan(p, p, geometry)
    worker = next(iter(p.workers()))
    src = memory("LBHNC", PAGE_CPU_ATTN, geometry, range(4), 2, 16)
    dst = memory("LBHNC", PAGE_CPU_ATTN, geometry, range(4), 2, 16)
    blocks = list(range(2, 10))
    whole = worker_descriptors(plan, worker, dst, {worker: src}, blocks, blocks)[worker]
    assert len(whole) == 4  # one run per layer (LBHNC: a layer's consecutive blocks are back to back)
    scattered = [5, 2, 9, 0]
    whole = worker_descriptors(plan, worker, dst, {worker: src}, scattered, scattered)[worker]
    assert len(whole) == 16  # one run per (layer, block): a block's heads are back to back
    tokens = worker_token_descriptors(plan, worker, dst, {worker: src}, scattered, scattered, TokenSpan(64))[worker]
    # whole chunks merge back into whole pages: the token path costs no more descriptors on equal sizes
    assert tokens.nbytes == whole.nbytes and len(tokens) == len(whole)


def test_cpu_attn_format_is_what_vllms_kernel_writes():
    """vLLM's own CPU_ATTN cache writer (`cpu_attn_reshape_and_cache`) fills a block-32 cache and a block-128 cache
    with the same tokens' K and V; copying the block-32 pages by the token descriptors gives the block-128 cache
    byte for byte (ISAs vec16 and vec, float32 and bfloat16)."""
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("vllm._custom_ops")

    def filled(bs: int, isa: str, dtype, blocks: np.ndarray, tokens: int, heads: int, hs: int):
        cache = torch.zeros(16, heads, bs, 2 * hs, dtype=dtype)
        kc, vc = cache.view(16, heads, bs * 2, hs).chunk(2, dim=2)
        g = torch.Generator().manual_seed(7)
        key = torch.randn(tokens, heads, hs, generator=g).to(dtype)
        value = torch.randn(tokens, heads, hs, generator=g).to(dtype)
        t = torch.arange(tokens)
        slots = torch.as_tensor(blocks, dtype=torch.long)[t // bs] * bs + t % bs
        ops.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, isa)
        return cache

    heads, hs, prompt = 2, 32, 200
    for dtype, item in ((torch.float32, 4), (torch.bfloat16, 2)):
        for (bp, isa_p), (bd, isa_d) in (
            ((16, "vec16"), (128, "vec")),
            ((128, "vec"), (32, "vec")),
            ((32, "vec"), (16, "vec16")),
        ):
            sb = np.random.default_rng(bp).permutation(16)[: -(-prompt // bp)]
            db = np.random.default_rng(bd + 1).permutation(16)[: -(-prompt // bd)]
            src, want = filled(bp, isa_p, dtype, sb, prompt, heads, hs), filled(bd, isa_d, dtype, db, prompt, heads, hs)
            dst = torch.zeros_like(want)
            geometry = KVGeometry(
                num_layers=1, num_kv_heads=heads, head_size=hs, dtype=str(dtype).removeprefix("torch.")
            )
            lay = ParallelLayout.parse("pp=1,tp=1")
            worker = next(iter(lay.workers()))
            s_mem = memory("LBHNC", PAGE_CPU_ATTN, dataclasses.replace(geometry, block_size=bp), [0], heads, 16)
            d_mem = memory("LBHNC", PAGE_CPU_ATTN, dataclasses.replace(geometry, block_size=bd), [0], heads, 16)
            assert s_mem.layers[0].itemsize == item
            descs = worker_token_descriptors(
                make_plan(lay, lay, geometry), worker, d_mem, {worker: s_mem}, sb, db, TokenSpan(prompt)
            )[worker]
            s_bytes, d_bytes = src.view(-1).view(torch.uint8).numpy(), dst.view(-1).view(torch.uint8).numpy()
            apply(descs, s_bytes, d_bytes)
            for b in db[:-1]:  # whole blocks: byte for byte
                assert torch.equal(dst[int(b)], want[int(b)]), (dtype, bp, bd, int(b))
            last, n = int(db[-1]), prompt - (len(db) - 1) * bd  # the last block holds the prompt's tail only
            w, g = want[last].view(heads, 2 * bd, hs), dst[last].view(heads, 2 * bd, hs)
            assert torch.equal(g[:, bd : bd + n], w[:, bd : bd + n])  # V rows
            kw, kg = (
                want[last].reshape(heads, -1)[:, : bd * hs].reshape(heads, hs, bd),
                dst[last].reshape(heads, -1)[:, : bd * hs].reshape(heads, hs, bd),
            )
            assert torch.equal(kg[..., :n], kw[..., :n])  # K columns
