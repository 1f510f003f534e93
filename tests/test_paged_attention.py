"""Paged attention kernel (interpret mode on CPU, compiled on a GPU) against the pure-jnp
reference, and a cache built by the page allocator against dense attention.

Every page slot that the query must not see (past a length, pages no sequence owns) holds NaN,
and block-table entries past a length are garbage, so a read outside the contract shows."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gendist.inference import page_allocator as pa
from pallas_kernels._mgpu import on_sm90
from pallas_kernels.paged_attention import (
    paged_attention,
    paged_attention_chunk,
    paged_attention_chunk_reference,
    paged_attention_reference,
)
from pallas_kernels.paged_attention_mgpu import PagedBlockSizes

ON_GPU = jax.default_backend() == "gpu"

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}  # fixed per dtype, never loosened
HEAD_DIM = 32


def make_cache(rng, lengths, kv_heads, page_size, dtype, spare_pages=3, head_dim=HEAD_DIM):
    """Random K/V pools with shuffled pages; everything outside the lengths is NaN/garbage."""
    batch = len(lengths)
    per_seq = max(-(-max(lengths) // page_size), 1) + 1  # one column past the longest sequence
    num_pages = batch * per_seq + spare_pages
    shape = (kv_heads, num_pages, page_size, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    live = np.zeros((num_pages, page_size), bool)
    perm = rng.permutation(num_pages)
    tables = np.empty((batch, per_seq), np.int32)
    for b, length in enumerate(lengths):
        used = -(-length // page_size)
        tables[b, :used] = perm[b * per_seq: b * per_seq + used]
        tables[b, used:] = [-1, num_pages + 5][b % 2]  # garbage past the end
        for pos in range(length):
            live[tables[b, pos // page_size], pos % page_size] = True
    k[:, ~live], v[:, ~live] = np.nan, np.nan
    return (jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(tables),
            jnp.asarray(lengths, jnp.int32))


def assert_close(out, ref, dtype):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


# (page size, GQA ratio, dtype, lengths, num_splits, block_k): odd lengths, an empty sequence,
# splits, tiles of several pages and tiles smaller than a page.
DECODE = [
    (8, 1, jnp.float32, [13, 1, 40], None, None),
    (16, 4, jnp.bfloat16, [37, 0, 16, 5], 2, 32),
    (64, 8, jnp.float32, [150, 63], 3, 32),
    (16, 8, jnp.bfloat16, [129, 31], None, None),
    (8, 4, jnp.float32, [77, 9], 4, 16),
    (64, 1, jnp.bfloat16, [65, 200], None, 16),
]


@pytest.mark.parametrize("page_size,group,dtype,lengths,splits,block_k", DECODE)
def test_decode_matches_reference(page_size, group, dtype, lengths, splits, block_k):
    rng = np.random.default_rng(page_size * 10 + group)
    kv_heads = 2
    k, v, tables, lens = make_cache(rng, lengths, kv_heads, page_size, dtype)
    q = jnp.asarray(rng.standard_normal((len(lengths), kv_heads * group, HEAD_DIM)), dtype)
    out = paged_attention(q, k, v, tables, lens, num_splits=splits, block_k=block_k)
    assert out.shape == q.shape and out.dtype == dtype
    ref = paged_attention_reference(q, k, v, tables, lens)
    assert_close(out, ref, dtype)
    assert not np.asarray(out[np.asarray(lens) == 0], np.float32).any()  # nothing to see: zeros


# Mosaic GPU decode kernel (`implementation="mosaic"`): on CPU three cases in Mosaic GPU's
# interpreter (P staged through shared memory); on an sm90 GPU all of them, compiled.
# (page size, GQA ratio, dtype, head dim, lengths, num_splits, block_k, stages, issuers)
MOSAIC_DECODE_INTERPRET = [
    (16, 4, jnp.bfloat16, 64, [37, 0, 16, 130], None, 64, 2, None),  # 4 pages a step from 4 warps
    (64, 8, jnp.float16, 128, [150, 63], 2, 64, 3, None),  # a page a step, context split in two
    (8, 2, jnp.bfloat16, 64, [45, 64, 3], None, 64, 3, 2),  # 8 pages a step, 4 from each of 2 warps
]
MOSAIC_DECODE_GPU = MOSAIC_DECODE_INTERPRET + [
    (8, 1, jnp.bfloat16, 128, [13, 1, 40, 300], None, 64, 4, None),  # 8 pages a step, G = 1
    (128, 2, jnp.bfloat16, 64, [129, 500, 7], 3, 64, 2, None),  # half a page a step
    (16, 64, jnp.float16, 128, [1000, 17], None, 128, 2, None),  # 64 query heads per kv head
    (16, 64, jnp.float16, 128, [1000, 17], None, 128, 2, 1),  # the same from one thread
    (32, 4, jnp.bfloat16, 128, [2049, 4000, 1], 5, 128, 2, None),
]


@pytest.mark.skipif(ON_GPU and not on_sm90(), reason="Mosaic GPU needs an sm90 GPU (or the CPU interpreter)")
@pytest.mark.parametrize("page_size,group,dtype,head_dim,lengths,splits,block_k,stages,issuers",
                         MOSAIC_DECODE_GPU if ON_GPU else MOSAIC_DECODE_INTERPRET)
def test_mosaic_decode_matches_reference(page_size, group, dtype, head_dim, lengths, splits,
                                         block_k, stages, issuers):
    rng = np.random.default_rng(page_size * 10 + group)
    kv_heads = 2
    k, v, tables, lens = make_cache(rng, lengths, kv_heads, page_size, dtype, head_dim=head_dim)
    q = jnp.asarray(rng.standard_normal((len(lengths), kv_heads * group, head_dim)), dtype)
    sizes = PagedBlockSizes(block_k=block_k, stages=stages, num_splits=splits, issuers=issuers)
    out = paged_attention(q, k, v, tables, lens, implementation="mosaic", mosaic_block_sizes=sizes)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, paged_attention_reference(q, k, v, tables, lens), dtype)
    assert not np.asarray(out[np.asarray(lens) == 0], np.float32).any()


# Stream-K schedules on few blocks, so that a block runs several segments (the K/V ring, Q and
# the block-table buffers carry across them) and items are split between blocks (merged):
# (PagedBlockSizes fields, lengths, split, inner): 4 sequences x 2 KV heads = 8 items of
# 64-token units; split: whether the plan splits items between blocks; inner: whether a
# segment's block-table slice is narrower than the table (it starts inside it).
STREAM = [(dict(units_per_block=6), [300, 21, 130, 0], True, False),
          (dict(max_blocks=3, split_items=False), [130, 64, 1, 99], False, False),
          (dict(max_blocks=1), [33, 130, 0, 7], False, False),
          (dict(units_per_block=11), [1000, 5, 0, 700], True, True)]


@pytest.mark.skipif(ON_GPU and not on_sm90(), reason="Mosaic GPU needs an sm90 GPU (or the CPU interpreter)")
@pytest.mark.parametrize("fields,lengths,split,inner", STREAM)
def test_mosaic_stream_schedule_matches_reference(fields, lengths, split, inner):
    from pallas_kernels import paged_attention_mgpu as pam

    rng = np.random.default_rng(len(fields) + lengths[0])
    k, v, tables, lens = make_cache(rng, lengths, 2, 16, jnp.bfloat16, head_dim=64)
    q = jnp.asarray(rng.standard_normal((len(lengths), 4, 64)), jnp.bfloat16)
    sizes = PagedBlockSizes(block_k=64, stages=2, **fields)
    plan = pam._plan(4, 2, 2, tables.shape[1], 16, 64, sizes, False, True)
    assert plan.max_segments >= 2  # several segments per block
    assert (plan.width > 1) == split and (plan.table_slice < plan.columns) == inner
    out = paged_attention(q, k, v, tables, lens, implementation="mosaic", mosaic_block_sizes=sizes)
    assert_close(out, paged_attention_reference(q, k, v, tables, lens), jnp.bfloat16)
    assert not np.asarray(out[np.asarray(lens) == 0], np.float32).any()


def test_stream_schedule_splits_only_few_long_sequences():
    """Schedules on 132 SMs: every unit of work goes to exactly one block. The default keeps
    items whole when that leaves few SMs idle (512 items of 32 units: 128 blocks of 4) and
    splits them when there are few, long ones (64 items of 256 units); split_items=True gives
    the most even shares, False whole items only."""
    from pallas_kernels import paged_attention_mgpu as pam

    def plan(batch, ctx, kv_heads, page, split_items=None):
        p = pam._plan(batch, kv_heads, 4, ctx // page, page, 128,
                      PagedBlockSizes(max_blocks=132, split_items=split_items), True, False)
        pieces = sorted(piece for pair in p.pieces for piece in pair)
        assert len(pieces) == len(set(pieces)) and p.blocks <= 132
        assert p.share * p.blocks >= p.total > p.share * (p.blocks - 1)
        return p

    assert plan(64, 4096, 8, 16).width == 1
    # schedule(): every token of every (sequence, KV head) in exactly one block's segments
    from pallas_kernels.paged_attention_mgpu import schedule
    for batch, ctx, sizes in [(5, 300, PagedBlockSizes(split_items=True)), (3, 1000, PagedBlockSizes(64, 2))]:
        seen = np.zeros((batch, 2, ctx), int)
        for segments in schedule(batch, 2, 4, ctx // 4, 4, 64, sizes, sms=7):
            for b_, k_, first, tokens in segments:
                seen[b_, k_, first:first + tokens] += 1
        assert (seen == 1).all()
    assert plan(8, 32768, 8, 16).width > 1
    for shape in [(64, 4096, 8, 16), (8, 32768, 8, 16), (128, 2048, 32, 64)]:
        even, whole = plan(*shape, split_items=True), plan(*shape, split_items=False)
        assert even.share == -(-even.total // 132) and whole.width == 1, shape


@pytest.mark.skipif(ON_GPU, reason="the interpreter's race detector")
def test_mosaic_decode_has_no_shared_memory_race():
    """With its own barriers only (`PagedBlockSizes.manual_barriers`, the default) the kernel
    has no shared-memory race in the interpreter: pages from 4 warps, a partial last block
    whose stale V rows are zeroed in place, and two blocks each running several segments
    (the K/V ring, Q and the block-table buffers reused across them, a final O leaving under
    the next segment's), one item split between them."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    from pallas_kernels._mgpu import detecting_races

    rng = np.random.default_rng(11)
    k, v, tables, lens = make_cache(rng, [70, 21, 50, 40], 1, 16, jnp.bfloat16, head_dim=64)
    q = jnp.asarray(rng.standard_normal((4, 3, 64)), jnp.bfloat16)  # a shape no other test traces
    from pallas_kernels import paged_attention_mgpu as pam
    # 4 items of 2 units on 2 blocks: block 0 has two whole items, then half of the third.
    sizes = PagedBlockSizes(block_k=64, units_per_block=5)
    plan = pam._plan(4, 1, 3, tables.shape[1], 16, 64, sizes, False, True)
    assert plan.blocks == 2 and plan.max_segments == 3 and plan.width == 2
    with detecting_races():
        out = paged_attention(q, k, v, tables, lens, implementation="mosaic",
                              mosaic_block_sizes=sizes)
        jax.block_until_ready(out)
    assert not interpret_pallas_call.get_races().races_found
    assert_close(out, paged_attention_reference(q, k, v, tables, lens), jnp.bfloat16)


def test_mosaic_is_picked_only_on_sm90():
    rng = np.random.default_rng(1)
    k, v, tables, lens = make_cache(rng, [20], 1, 16, jnp.bfloat16, head_dim=64)
    q = jnp.asarray(rng.standard_normal((1, 4, 64)), jnp.bfloat16)
    hlo = paged_attention.lower(q, k, v, tables, lens).as_text()
    assert ("mosaic_gpu" in hlo) == (ON_GPU and on_sm90())
    with pytest.raises(ValueError, match="implementation='triton'"):
        paged_attention(q[..., :32], k[..., :32], v[..., :32], tables, lens, implementation="mosaic")
    with pytest.raises(ValueError, match="issuers=3"):
        PagedBlockSizes(block_k=128, issuers=3)


# (page size, GQA ratio, dtype, tokens, lengths, positions kind, num_splits, block_k)
CHUNK = [
    (8, 4, jnp.float32, 5, [19, 40], "start", None, None),
    (16, 1, jnp.bfloat16, 7, [33, 60, 9], "scattered", None, None),
    (64, 8, jnp.float32, 3, [130, 70], "start", 2, 16),
    (16, 4, jnp.bfloat16, 6, [50, 21], "scattered", 3, 64),
]


@pytest.mark.parametrize("page_size,group,dtype,steps,lengths,kind,splits,block_k", CHUNK)
def test_chunk_matches_reference(page_size, group, dtype, steps, lengths, kind, splits, block_k):
    rng = np.random.default_rng(steps * 100 + page_size)
    kv_heads = 2
    k, v, tables, lens = make_cache(rng, lengths, kv_heads, page_size, dtype)
    batch = len(lengths)
    q = jnp.asarray(rng.standard_normal((batch, steps, kv_heads * group, HEAD_DIM)), dtype)
    if kind == "start":  # chunked prefill: the chunk is the last `steps` cached tokens
        where = dict(q_start_B=jnp.asarray([n - steps for n in lengths], jnp.int32))
    else:  # arbitrary positions, including one that sees nothing (-1) and one past the length
        pos = rng.integers(0, max(lengths) + 3, size=(batch, steps)).astype(np.int32)
        pos[0, 0] = -1
        where = dict(q_positions_BT=jnp.asarray(pos))
    out = paged_attention_chunk(q, k, v, tables, lens, num_splits=splits, block_k=block_k, **where)
    assert out.shape == q.shape
    ref = paged_attention_chunk_reference(q, k, v, tables, lens, **where)
    assert_close(out, ref, dtype)
    if kind == "scattered":
        assert not np.asarray(out[0, 0], np.float32).any()


def test_decode_equals_chunk_of_one_token():
    rng = np.random.default_rng(7)
    k, v, tables, lens = make_cache(rng, [23, 8], 2, 8, jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 4, HEAD_DIM)), jnp.float32)
    one = paged_attention_chunk(q[:, None], k, v, tables, lens, q_start_B=lens - 1)[:, 0]
    assert_close(paged_attention(q, k, v, tables, lens), one, jnp.float32)


def test_allocator_cache_equals_dense_attention():
    """Sequences grown, written and forked through the allocator, read by the kernel."""
    rng = np.random.default_rng(3)
    kv_heads, heads, z = 2, 4, 8
    state = pa.init_allocator(num_pages=12, page_size=z, max_seqs=3, max_pages_per_seq=5)
    k_pages = jnp.full((kv_heads, 12, z, HEAD_DIM), jnp.nan, jnp.float32)
    v_pages = k_pages
    dense = {}  # slot -> (k [S, K, H], v [S, K, H]) written so far

    def append(slot, n):
        nonlocal state, k_pages, v_pages
        start = int(state.lengths[slot])
        state = pa.checked(pa.grow)(state, slot, n)
        kn, vn = (rng.standard_normal((n, kv_heads, HEAD_DIM)).astype(np.float32) for _ in "kv")
        pos = jnp.arange(start, start + n, dtype=jnp.int32)
        state, k_pages, v_pages = pa.checked(pa.write)(
            state, k_pages, v_pages, jnp.full((n,), slot, jnp.int32), pos, kn, vn)
        old_k, old_v = dense.get(slot, (np.zeros((0, kv_heads, HEAD_DIM)),) * 2)
        dense[slot] = (np.concatenate([old_k, kn]), np.concatenate([old_v, vn]))

    state, a = pa.checked(pa.allocate_slot)(state)
    append(int(a), 13)  # a prompt ending mid-page
    state, b = pa.checked(pa.fork)(state, a)  # parallel sample sharing the prompt's pages
    dense[int(b)] = dense[int(a)]
    append(int(a), 6)  # both continue into the shared page: copy-on-write
    append(int(b), 2)
    q = jnp.asarray(rng.standard_normal((2, heads, HEAD_DIM)), jnp.float32)
    slots = jnp.asarray([a, b])
    out = paged_attention(q, k_pages, v_pages, state.block_tables[slots], state.lengths[slots])
    for i, s in enumerate([int(a), int(b)]):
        kd, vd = dense[s]
        qg = np.asarray(q[i]).reshape(kv_heads, heads // kv_heads, HEAD_DIM)
        logits = np.einsum("kgh,skh->kgs", qg, kd) / math.sqrt(HEAD_DIM)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        want = np.einsum("kgs,skh->kgh", w / w.sum(-1, keepdims=True), vd).reshape(heads, HEAD_DIM)
        np.testing.assert_allclose(np.asarray(out[i]), want, atol=TOL[jnp.float32], rtol=TOL[jnp.float32])


def test_bad_inputs_raise_clear_errors():
    rng = np.random.default_rng(0)
    k, v, tables, lens = make_cache(rng, [9, 4], 2, 8, jnp.float32)
    q = jnp.zeros((2, 4, HEAD_DIM), jnp.float32)
    with pytest.raises(ValueError, match="same shape"):
        paged_attention(q, k, v[:, :-1], tables, lens)
    with pytest.raises(ValueError, match="head_dim mismatch"):
        paged_attention(jnp.zeros((2, 4, 2 * HEAD_DIM)), k, v, tables, lens)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_attention(jnp.zeros((2, 3, HEAD_DIM)), k, v, tables, lens)
    with pytest.raises(ValueError, match="block_tables dtype must be int32"):
        paged_attention(q, k, v, tables.astype(jnp.float32), lens)
    with pytest.raises(ValueError, match="lengths dtype must be int32"):
        paged_attention(q, k, v, tables, lens.astype(jnp.int16))
    with pytest.raises(ValueError, match="cast q"):
        paged_attention(q.astype(jnp.bfloat16), k, v, tables, lens)
    with pytest.raises(ValueError, match="page_size=12"):
        paged_attention(q, k[:, :, :6].repeat(2, 2), v[:, :, :6].repeat(2, 2), tables, lens)
    with pytest.raises(ValueError, match="block_k"):
        paged_attention(q, k, v, tables, lens, pages_per_compute_block=1)  # 8-token tiles
    with pytest.raises(ValueError, match="exactly one"):
        paged_attention_chunk(q[:, None], k, v, tables, lens)
    with pytest.raises(ValueError, match="q_positions_BT must be int32"):
        paged_attention_chunk(q[:, None], k, v, tables, lens, q_positions_BT=jnp.zeros((2, 2), jnp.int32))
