"""Paged decode attention for Hopper (sm90) in Pallas Mosaic GPU.

The work is (sequence, KV head) items, each the context in units of block_k tokens. The G = N/K
query heads of an item's GQA group are packed as rows of one 64-row wgmma tile (rows past G
are zero), so every K/V byte is read once per group. The grid is one block per SM, and block
j takes the j-th of equal ranges of the flattened (item, unit) space (stream-K: Osama et al.
2023); a block's range crosses items as segments. The range may also start or end inside an
item when a cost model says that pays (few, long sequences would otherwise leave SMs idle):
the split item's pieces go out in fp32 with their base-2 log-sum-exps and a small XLA
reduction merges them (flash-decoding's merge: Dao et al. 2023); an item in one piece
writes its final O from the kernel. `PagedBlockSizes.num_splits` instead gives each block
one of `num_splits` equal slices of an item (the grid may then exceed the SMs: the launch's
waves do the scheduling).

A producer warpgroup copies a segment's slice of the block table into shared memory (the
next segment's while this one streams), then brings pages in with TMA, one bulk copy per
page (or per block_k slice of a larger page), issued by up to four warps of the producer
(small pages: 16 copies per 128-token step at page 16), into a ring of `stages` slots of
block_k tokens that carries on across segments, so that the next segment's pages load under
this one's epilogue. A slot's K is refilled as soon as the consumer's Q K^T has read it, its
V once P V has. The consumer warpgroup computes S = Q K^T and P V with wgmma and folds
them in with the online softmax (base 2). Q and O move as the group's G rows of q and of the
output viewed as [B * N, H], through untiled shared buffers (a G-row TMA copy at row b N +
kvh G: a tiled buffer would need that offset to divide its 8-row tile), so no XLA pad of the
group to 8 rows and no slice after the kernel. Q lands in such a buffer (the next segment's
under this one) and at a segment's start goes through registers into the tiled 64-row tile
that wgmma reads (rows past G zero); O leaves through its own untiled buffer.

Positions >= length are never trusted: their logits are masked and, in the one partial
block per segment, their V rows are zeroed in shared memory before the P V matmul (a stale
page may hold NaN, and 0 * NaN is NaN on the tensor core too). Page ids past the length
may be garbage; they are clamped into the pool before a copy.

The oracle is `paged_attention.paged_attention_reference`; `paged_attention.paged_attention`
dispatches here on an sm90 GPU. `regs=False` stages P through shared memory so that Mosaic
GPU's CPU interpreter runs the kernel (see `_mgpu.py`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mgpu import (
    LN2,
    LOG2E,
    SMEM_LIMIT,
    WGMMA,
    launch,
    sm_count,
    smem_bytes,
    softmax_start,
    tiled_smem,
)

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
_ROWS = 64  # query rows of one wgmma tile; the GQA group is padded to it
_TABLE_MAX = 2048  # block-table entries of one segment at most (two buffers: 16 KiB)
# The schedule's cost model, in tokens' time of one SM: a segment's start and end (Q, its
# table, the epilogue); a split item's pieces go out in fp32 and are merged by XLA (a gather,
# the combination, a scatter into the output: a few small kernels, ~4 us on the H200).
_SEGMENT_COST = 64
_MERGE_SLOWDOWN = 0.01
_MERGE_COST = 256


@dataclasses.dataclass(frozen=True)
class PagedBlockSizes:
    """Tiling of the Mosaic GPU paged kernel; None picks a default from the shapes."""

    block_k: int = 128  # tokens per pipeline step (a multiple of 64)
    stages: int = 2  # steps in flight (each block_k tokens of K and of V)
    num_splits: int | None = None  # None: one block per SM, equal shares of all the work
    # (stream-K); n: every item in n slices, one block each, as many blocks as that takes
    issuers: int | None = None  # producer warps issuing a step's copies (1, 2 or 4); None: 4 when
    # a step takes >= 4 copies (pages smaller than block_k / 4), else 1
    manual_barriers: bool = True  # no warpgroup barrier before each page copy (and around each
    # shared-memory access) but the kernel's own; False: Pallas's automatic ones
    split_items: bool | None = None  # stream-K: None, split items between blocks when the cost
    # model says it pays (few, long sequences; or an SM tail worth more than the merge);
    # True: the most even shares; False: whole items only (no merge)
    max_blocks: int | None = None  # stream-K blocks at most; None: the GPU's SM count
    stream_only: bool = False  # a probe of the page stream's own speed: the consumer waits for
    # each slot and frees it without any math (the output is then not attention: benchmarks only)
    units_per_block: int | None = None  # stream-K share of each block in units of block_k
    # tokens; None: the cost model's (`_balanced_share`)

    def __post_init__(self):
        if self.block_k % 64 or self.block_k < 64:
            raise ValueError(f"PagedBlockSizes.block_k={self.block_k}: use a multiple of 64.")
        if self.stages < 1:
            raise ValueError(f"PagedBlockSizes.stages={self.stages}: use >= 1.")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"PagedBlockSizes.num_splits={self.num_splits}: use >= 1.")
        if self.issuers not in (None, 1, 2, 4):
            raise ValueError(f"PagedBlockSizes.issuers={self.issuers}: use 1, 2, 4 or None.")
        if self.units_per_block is not None and self.units_per_block < 1:
            raise ValueError(f"PagedBlockSizes.units_per_block={self.units_per_block}: use >= 1 or None.")
        if self.max_blocks is not None and self.max_blocks < 1:
            raise ValueError(f"PagedBlockSizes.max_blocks={self.max_blocks}: use >= 1 or None.")
        if not isinstance(self.manual_barriers, bool):
            raise ValueError(f"PagedBlockSizes.manual_barriers={self.manual_barriers!r}: use True or False.")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static layout of one call: items of `item_units` units of block_k tokens; block j takes
    units [j * share, (j + 1) * share) of the flattened (item, unit) space."""

    block_k: int
    stages: int
    page_size: int
    columns: int  # the block table's width (a multiple of 4: padded if it is not)
    per_copy: int  # tokens per TMA copy: a page, or a block_k slice of a bigger page
    issuers: int  # producer warps issuing copies: copy i of a step comes from warp i % issuers
    item_units: int  # units per item; an item is (sequence, KV head, part)
    parts: int  # items per (sequence, KV head): num_splits, or more to keep a segment's table
    # slice within _TABLE_MAX entries
    pairs: int  # (sequence, KV head) pairs
    share: int  # units per block
    blocks: int
    group: int  # G: query rows of one (sequence, KV head)
    manual_barriers: bool
    regs: bool
    interpret: bool
    stream_only: bool = False

    @property
    def group_rows(self) -> int:  # G rounded up to 8: the rows of a split pair's fp32 piece
        return -(-self.group // 8) * 8

    @property
    def total(self) -> int:  # units of all items
        return self.pairs * self.parts * self.item_units

    @property
    def table_slice(self) -> int:
        """Block-table entries a segment copies: its pages from the 4-aligned one at or before
        its first (16-byte TMA slices), a multiple of 4, at most the table's width."""
        pages = -(-min(self.share, self.item_units) * self.block_k // self.page_size) + 4
        return min(-(-pages // 4) * 4, self.columns)

    def segments(self, j: int) -> list[tuple[int, int, int]]:
        """Block j's segments in order as (item, first unit, end unit) within the item (the
        kernel's `segment()`, in Python)."""
        n = self.item_units
        u0, u1 = j * self.share, min((j + 1) * self.share, self.total)
        return [(t, max(u0, t * n) - t * n, min(u1, (t + 1) * n) - t * n)
                for t in range(u0 // n, (u1 - 1) // n + 1)]

    @functools.cached_property
    def pieces(self) -> list[list[tuple[int, int]]]:
        """Per (sequence, KV head) pair: its (block, segment) pieces, in context order."""
        out = [[] for _ in range(self.pairs)]
        for j in range(self.blocks):
            for r, (t, _, _) in enumerate(self.segments(j)):
                out[t // self.parts].append((j, r))
        return out

    @property
    def width(self) -> int:  # pieces of the most split pair
        return max(map(len, self.pieces))

    @functools.cached_property
    def split_pairs(self) -> list[int]:  # pairs with more than one piece
        return [pair for pair, pieces in enumerate(self.pieces) if len(pieces) > 1]

    @property
    def max_segments(self) -> int:
        return max(r for pieces in self.pieces for _, r in pieces) + 1

    def output_slots(self) -> np.ndarray:
        """int32 [blocks, max_segments]: where segment r of block j writes: s >= 0, row s of
        the final output [pairs] (its pair's only piece); s < 0, row -1 - s of the partials
        [split pairs * width] (split-pair-major, pieces in context order)."""
        slots = np.zeros((self.blocks, self.max_segments), np.int32)
        for pair, pieces in enumerate(self.pieces):
            for j, r in pieces:
                slots[j, r] = pair
        for k, pair in enumerate(self.split_pairs):
            for p, (j, r) in enumerate(self.pieces[pair]):
                slots[j, r] = -1 - (k * self.width + p)
        return slots


def supports(dtype, head_dim: int, page_size: int, group: int) -> bool:
    """Whether this kernel takes a cache of this dtype, head dim, page size and GQA group."""
    return (jnp.dtype(dtype) in map(jnp.dtype, SUPPORTED_DTYPES) and head_dim in SUPPORTED_HEAD_DIMS
            and page_size >= 8 and page_size & (page_size - 1) == 0 and 1 <= group <= _ROWS)


def _balanced_share(items: int, item_units: int, unit: int, sms: int, split_items: bool | None) -> int:
    """Units per block for at most one block per SM, by the busiest block's time in tokens:
    its units, `_SEGMENT_COST` per segment, and when items are split across blocks (a share
    that is not a multiple of an item) `_MERGE_SLOWDOWN` more and `_MERGE_COST`. So items are
    split only when whole ones would leave enough of the GPU idle. `split_items` False: only
    multiples of an item; True: the most even shares (no merge cost)."""
    total = items * item_units
    lo = -(-total // sms)
    best = None
    for share in range(lo, 2 * max(lo, item_units) + 1):
        if split_items is False and share % item_units:
            continue
        blocks = -(-total // share)
        u0 = np.arange(blocks) * share
        u1 = np.minimum(u0 + share, total)
        segments = int(((u1 - 1) // item_units - u0 // item_units + 1).max())
        split = blocks > 1 and share % item_units != 0
        merge = split and split_items is None
        cost = share * unit * (1 + _MERGE_SLOWDOWN * merge) + _SEGMENT_COST * segments + _MERGE_COST * merge
        if best is None or cost < best[0]:
            best = (cost, share)
    return best[1]


def _plan(batch, kv_heads, group, columns, page_size, head_dim, sizes: PagedBlockSizes, regs,
          interpret) -> _Plan:
    bk = sizes.block_k
    per_copy = min(page_size, bk)
    issuers = sizes.issuers or (4 if bk // per_copy >= 4 else 1)
    units = -(-columns * page_size // bk)
    parts = max(-(-units * bk // page_size // _TABLE_MAX), min(sizes.num_splits or 1, units))
    item_units = -(-units // parts)
    pairs = batch * kv_heads
    if sizes.num_splits:
        share = item_units
    elif sizes.units_per_block:
        share = sizes.units_per_block
    else:
        share = _balanced_share(pairs * parts, item_units, bk, sizes.max_blocks or sm_count(),
                                sizes.split_items)
    blocks = -(-pairs * parts * item_units // share)
    plan = _Plan(bk, sizes.stages, page_size, -(-columns // 4) * 4, per_copy, issuers, item_units,
                 parts, pairs, share, blocks, group, sizes.manual_barriers,
                 regs, interpret, sizes.stream_only)
    need = smem_bytes(((3, _ROWS, head_dim), jnp.float16),
                      ((2 * sizes.stages, bk, head_dim), jnp.float16),
                      ((_ROWS if plan.split_pairs else 0, head_dim), jnp.float32),
                      ((2, -(-plan.table_slice // 32) * 32), jnp.int32),
                      ((0 if regs else _ROWS, bk), jnp.float16))
    if need > SMEM_LIMIT - 4096:
        raise ValueError(f"PagedBlockSizes: {need} bytes of shared memory at block_k={bk}, "
                         f"stages={sizes.stages}, head_dim={head_dim}; use fewer stages.")
    return plan


def schedule(batch: int, kv_heads: int, group: int, pages: int, page_size: int, head_dim: int = 128,
             block_sizes: PagedBlockSizes = PagedBlockSizes(), sms: int | None = None):
    """The work of each thread block of a call on block tables of `pages` columns: per block,
    its segments in order as (sequence, KV head, first token, tokens); a (sequence, KV head)
    that appears in several blocks is split between them and merged. `sms` stands in for the
    GPU's SM count (`block_sizes.max_blocks` if given)."""
    if sms is not None and block_sizes.max_blocks is None:
        block_sizes = dataclasses.replace(block_sizes, max_blocks=sms)
    plan = _plan(batch, kv_heads, group, pages, page_size, head_dim, block_sizes, True, False)
    n, bk = plan.item_units, plan.block_k
    out = []
    for j in range(plan.blocks):
        segments = []
        for t, lo, hi in plan.segments(j):
            pair, part = divmod(t, plan.parts)
            first, end = (part * n + lo) * bk, min((part * n + hi) * bk, pages * page_size)
            segments.append((pair // kv_heads, pair % kv_heads, first, max(end - first, 0)))
        out.append(segments)
    return out


def _kernel_call(plan: _Plan, q_RH, k_pages, v_pages, tables, lengths, sm_scale: float):
    """O [B * N, H] in the input dtype (final for every pair in one piece: pair p's rows
    [p G, (p + 1) G)), and the pieces of the split pairs [split pairs * width, group_rows, H]
    (fp32) with their base-2 LSE [split pairs * width, group_rows], for the merge."""
    head_dim = q_RH.shape[1]
    kv_heads, num_pages, page_size = k_pages.shape[:3]
    dtype = q_RH.dtype
    bk, st, c, rows, g = plan.block_k, plan.stages, plan.per_copy, plan.group_rows, plan.group
    copies = bk // c
    slice_len, columns = plan.table_slice, plan.columns
    table_chunks = [(lo, min(256, slice_len - lo)) for lo in range(0, slice_len, 256)]
    n, share, total = plan.item_units, plan.share, plan.total
    split = bool(plan.split_pairs)
    capacity = columns * page_size
    scale2 = sm_scale * LOG2E

    def kernel(q_ref, k_ref, v_ref, bt_ref, len_ref, slot_ref, o_ref, part_ref, lse_ref,
               q_land, q_smem, k_smem, v_smem, o_smem, part_smem, lse_smem, bt_smem, p_smem,
               q_bar, bt_bar, k_bar, v_bar, k_free, v_free):
        blk, wg = lax.axis_index("sm"), lax.axis_index("wg")
        u0 = blk * share
        u1 = jnp.minimum(u0 + share, total)
        t0 = lax.div(u0, n)
        n_seg = lax.div(u1 - 1, n) - t0 + 1

        def segment(r, length=None):
            """Segment r of this block: sequence, KV head, first token within the sequence,
            tokens to read (below `length`, the sequence's length) and pipeline steps."""
            t = t0 + r
            lo_u = jnp.maximum(u0, t * n) - t * n
            hi_u = jnp.minimum(u1, (t + 1) * n) - t * n
            pair = lax.div(t, plan.parts)
            bi, kvh = lax.div(pair, kv_heads), lax.rem(pair, kv_heads)
            first = (lax.rem(t, plan.parts) * n + lo_u) * bk
            if length is None:
                return bi, kvh, first
            n_tok = jnp.clip(length - first, 0, (hi_u - lo_u) * bk)
            return bi, kvh, first, n_tok, lax.div(n_tok + (bk - 1), bk)

        def seq_length(r):
            """The length of segment r's sequence (r clamped to the last segment): a load
            from global memory, issued a segment before it is used, off the critical path."""
            bi = segment(jnp.minimum(r, n_seg - 1))[0]
            return jnp.clip(len_ref[bi], 0, capacity)

        def table_start(first):
            """The first column of a segment's table slice: 4-aligned, at or before its first
            page, and early enough that the slice ends inside the table."""
            page = lax.div(first, page_size)
            return jnp.minimum(page - lax.rem(page, 4), columns - slice_len)

        # Two warpgroups: each thread may hold up to 255 registers, so no setmaxnreg.
        @pl.when(wg == 0)
        def _consumer():
            q_land[...] = plgpu.layout_cast(jnp.zeros((_ROWS, head_dim), dtype), WGMMA)
            plgpu.commit_smem()  # the zero rows land before any TMA fills the group's rows

            def load_q(r):  # segment r's G rows of Q into the landing buffer
                bi, kvh = segment(r)[:2]
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds((bi * kv_heads + kvh) * g, g)],
                                        q_land.at[pl.ds(0, g)], q_bar.at[0])

            load_q(0)

            def run(r, carry):
                done, length, out = carry
                next_length, next_out = seq_length(r + 1), slot_ref[blk, jnp.minimum(r + 1, n_seg - 1)]
                n_tok, n_steps = segment(r, length)[3:]
                # Segment r's Q into the tile wgmma reads (segment r - 1's Q K^T are done with it),
                # then the next segment's lands under this one.
                plgpu.barrier_wait(q_bar.at[0])
                q_smem[...] = plgpu.load(q_land, layout=WGMMA, optimized=False)
                plgpu.commit_smem()  # every thread has read the landing buffer, the tile is written
                pl.when(r + 1 < n_seg)(lambda: load_q(r + 1))
                q_tile = q_smem

                def step(j, carry):
                    acc, m, l = carry
                    slot = lax.rem(done + j, st)
                    plgpu.barrier_wait(k_bar.at[slot])
                    if plan.stream_only:
                        plgpu.barrier_wait(v_bar.at[slot])
                        plgpu.barrier_arrive(k_free.at[slot])
                        plgpu.barrier_arrive(v_free.at[slot])
                        return carry

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                        return acc_ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC((_ROWS, bk), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])  # the next K may land under this softmax
                    valid = n_tok - j * bk  # tokens of this block below the length
                    col = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=WGMMA)
                    s = jnp.where(col < valid, s, -jnp.inf)
                    m_new = jnp.maximum(m, s.max(axis=1) * scale2)
                    alpha = jnp.exp2(m - m_new)  # every row sees token 0 of the block: m_new finite
                    p = jnp.exp2(s * scale2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
                    l = l * alpha + p.sum(axis=1)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    p16 = p.astype(dtype)
                    plgpu.barrier_wait(v_bar.at[slot])
                    v_tile = v_smem.at[slot]

                    @pl.when(valid < bk)  # the partial block: stale rows may hold NaN
                    def _():
                        row = plgpu.broadcasted_iota(jnp.int32, (bk, head_dim), 0, layout=WGMMA)
                        rows_v = v_tile[...]
                        plgpu.commit_smem()  # every read is done before any write (manual barriers)
                        v_tile[...] = jnp.where(row < valid, rows_v, jnp.zeros((), dtype))
                        plgpu.commit_smem()

                    if plan.regs:
                        def pv(acc_ref):
                            plgpu.wgmma(acc_ref, p16, v_tile)

                        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                    else:
                        p_smem[...] = p16
                        plgpu.commit_smem()

                        def pv_scoped(acc_ref):
                            plgpu.wgmma(acc_ref, p_smem, v_tile)
                            return acc_ref[...]

                        acc = acc + pl.run_scoped(pv_scoped, plgpu.ACC((_ROWS, head_dim), jnp.float32))
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_new, l

                acc, m, l = lax.fori_loop(0, n_steps, step, softmax_start(_ROWS, head_dim))
                seen = l > 0.0  # nothing to see gives O = 0 and LSE = -inf (weight 0 in the merge)
                inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
                o = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last segment's O has left

                @pl.when(out >= 0)  # the pair's only piece: final
                def _():
                    o_smem[...] = o.astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, g)], o_ref.at[pl.ds(out * g, g)])

                if split:
                    @pl.when(out < 0)  # one of a split pair's pieces: fp32, with its LSE
                    def _():
                        part_smem[...] = o
                        lse_smem[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)) * (1 / LN2),
                                                  -jnp.inf)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(part_smem.at[pl.ds(0, rows)], part_ref.at[-1 - out],
                                                commit_group=False)
                        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, rows)], lse_ref.at[-1 - out],
                                                commit_group=False)
                        plgpu.commit_smem_to_gmem_group()

                return done + n_steps, next_length, next_out

            lax.fori_loop(0, n_seg, run, (jnp.int32(0), seq_length(0), slot_ref[blk, 0]))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _producer():
            def load_table(r):  # segment r's slice of the block table, into buffer r % 2
                bi, _, first = segment(r)[:3]
                buf = lax.rem(r, 2)
                for lo, size in table_chunks:  # TMA copies at most 256 elements per dimension
                    plgpu.copy_gmem_to_smem(bt_ref.at[bi, pl.ds(table_start(first) + lo, size)],
                                            bt_smem.at[buf, pl.ds(lo, size)], bt_bar.at[buf])

            load_table(0)

            def feed(r, carry):
                done, length = carry
                next_length = seq_length(r + 1)
                _, kvh, first, _, n_steps = segment(r, length)
                col0 = table_start(first)
                buf = lax.rem(r, 2)

                @pl.when(r + 1 < n_seg)
                def _():
                    plgpu.commit_smem()  # every warp has read segment r - 1's page ids
                    load_table(r + 1)

                plgpu.barrier_wait(bt_bar.at[buf])

                @pl.loop(0, n_steps)
                def _(j):
                    slot = lax.rem(done + j, st)
                    # Page ids are read at warpgroup level (warp-level code takes no smem loads),
                    # before the slot is free.
                    pages = []
                    for i in range(copies):
                        tok = first + j * bk + i * c  # within the sequence
                        pages.append((jnp.clip(bt_smem[buf, lax.div(tok, page_size) - col0], 0, num_pages - 1),
                                      lax.rem(tok, page_size)))

                    def copies_of(ref, smem, bar):  # the step's pages (or slices of a page)
                        def copy(i):
                            page, src = pages[i][0], pl.ds(pages[i][1], c)
                            plgpu.copy_gmem_to_smem(ref.at[kvh, page, src], smem.at[slot, pl.ds(i * c, c)],
                                                    bar.at[slot])

                        if plan.issuers == 1:  # one thread of the warpgroup issues every copy
                            for i in range(copies):
                                copy(i)
                        else:  # warp w issues copies w, w + issuers, ...: in parallel

                            @plgpu.warp_map
                            def _(warp):
                                for i in range(copies):
                                    pl.when(warp == i % plan.issuers)(lambda i=i: copy(i))

                    # K is free once the consumer's Q K^T is done, V once its P V is.
                    pl.when(done + j >= st)(lambda: plgpu.barrier_wait(k_free.at[slot]))
                    copies_of(k_ref, k_smem, k_bar)
                    pl.when(done + j >= st)(lambda: plgpu.barrier_wait(v_free.at[slot]))
                    copies_of(v_ref, v_smem, v_bar)

                return done + n_steps, next_length

            steps, _ = lax.fori_loop(0, n_seg, feed, (jnp.int32(0), seq_length(0)))

            @pl.loop(jnp.maximum(steps - st, 0), steps)
            def _(j):  # wait for the last slots' release: every barrier phase is observed
                plgpu.barrier_wait(k_free.at[lax.rem(j, st)])
                plgpu.barrier_wait(v_free.at[lax.rem(j, st)])

    scratch = (
        plgpu.SMEM((_ROWS, head_dim), dtype),  # the next segment's Q as it lands (untiled)
        tiled_smem((_ROWS, head_dim), dtype),  # this segment's Q, as wgmma reads it
        tiled_smem((st, bk, head_dim), dtype),
        tiled_smem((st, bk, head_dim), dtype),
        plgpu.SMEM((_ROWS, head_dim), dtype),  # O staging (untiled: G rows leave at any row)
        tiled_smem((_ROWS, head_dim), jnp.float32) if split else None,  # a piece's O staging
        plgpu.SMEM((_ROWS,), jnp.float32),  # LSE staging
        # two segments' block-table slices, each 128-byte aligned (TMA)
        plgpu.SMEM((2, -(-slice_len // 32) * 32), jnp.int32),
        None if plan.regs else tiled_smem((_ROWS, bk), dtype),  # P, when staged in smem
        plgpu.Barrier(num_barriers=1),  # Q landed
        plgpu.Barrier(num_arrivals=len(table_chunks), num_barriers=2),  # block-table slice loaded
        plgpu.Barrier(num_arrivals=copies, num_barriers=st),  # K slot filled
        plgpu.Barrier(num_arrivals=copies, num_barriers=st),  # V slot filled
        plgpu.Barrier(num_barriers=st),  # K slot free again
        plgpu.Barrier(num_barriers=st),  # V slot free again
    )
    slots = jnp.asarray(plan.output_slots())
    pieces = max(1, len(plan.split_pairs) * plan.width)
    return launch(kernel, (q_RH, k_pages, v_pages, tables, lengths, slots),
                  out_type=(jax.ShapeDtypeStruct((plan.pairs * g, head_dim), dtype),
                            jax.ShapeDtypeStruct((pieces, rows, head_dim), jnp.float32),
                            jax.ShapeDtypeStruct((pieces, rows), jnp.float32)),
                  scratch=scratch, grid=(plan.blocks,), grid_names=("sm",), num_threads=2,
                  interpret=plan.interpret, manual_barriers=plan.manual_barriers,
                  name="paged_attention")


def _merge(plan: _Plan, o_PWRH, lse_PWR):
    """[split pairs, rows, H]: each split pair's pieces combined by their base-2 log-sum-exp
    weights (a pair with fewer pieces than the widest has its missing ones at weight 0)."""
    live = np.array([[p < len(plan.pieces[pair]) for p in range(plan.width)] for pair in plan.split_pairs])
    lse = jnp.where(live[..., None], lse_PWR, -jnp.inf)
    top = lse.max(axis=1)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp2(lse - top[:, None])  # an empty piece has LSE -inf: weight 0
    total = w.sum(axis=1)
    o = (w[..., None] * jnp.where(live[..., None, None], o_PWRH, 0.0)).sum(axis=1)
    return o * jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)[..., None]


@jax.jit(static_argnames=("sm_scale", "block_sizes", "regs", "interpret"))
def paged_attention_mgpu(q, k_pages, v_pages, block_tables, lengths, *, sm_scale: float,
                         block_sizes: PagedBlockSizes = PagedBlockSizes(), regs: bool = True,
                         interpret: bool = False):
    """Decode attention of one query token per sequence against a paged KV cache.

    Same contract as `paged_attention.paged_attention` (which checks the inputs and
    dispatches here): q [B, N, H]; k_pages, v_pages [K, P, Z, H]; block_tables [B, pages]
    int32; lengths [B] int32. Returns [B, N, H].
    """
    batch, heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    group = heads // kv_heads
    plan = _plan(batch, kv_heads, group, block_tables.shape[1], page_size, head_dim, block_sizes,
                 regs, interpret)
    tables = block_tables
    if plan.columns != tables.shape[1]:  # rows of the table 16-byte aligned (TMA)
        tables = jnp.pad(tables, ((0, 0), (0, plan.columns - tables.shape[1])))
    o, part, lse = _kernel_call(plan, q.reshape(batch * heads, head_dim), k_pages, v_pages, tables,
                                lengths, sm_scale)
    if plan.split_pairs:
        n = len(plan.split_pairs)
        merged = _merge(plan, part.reshape(n, plan.width, *part.shape[1:]), lse.reshape(n, plan.width, -1))
        o = o.reshape(plan.pairs, group, head_dim).at[np.array(plan.split_pairs)].set(
            merged[:, :group].astype(o.dtype))
    return o.reshape(batch, heads, head_dim)
