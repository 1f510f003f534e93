"""Paged decode attention for Hopper (sm90) in Pallas Mosaic GPU.

One thread block serves one (sequence, KV head, context split): the G = N/K query heads
of the GQA group are packed as rows of one 64-row wgmma tile (rows past G are zero), so
every K/V byte is read once per group. A producer warpgroup copies the split's slice of
the block table into shared memory once, then brings pages in with TMA, one bulk copy per
page (or per block_k slice of a larger page), issued by up to four warps of the producer
(small pages: 16 copies per 128-token step at page 16), into a ring of `stages` slots of block_k
tokens, so that several pages are in flight while the consumer warpgroup computes
S = Q K^T and P V with wgmma and folds them in with the online softmax (base 2). When the
batch is small the context is split (flash-decoding: Dao et al. 2023) so the grid still
fills the GPU; each split writes its normalised output and base-2 log-sum-exp, merged by a
small XLA reduction.

Positions >= length are never trusted: their logits are masked and, in the one partial
block per split, their V rows are zeroed in shared memory before the P V matmul (a stale
page may hold NaN, and 0 * NaN is NaN on the tensor core too). Page ids past the length
may be garbage; they are clamped into the pool before a copy.

The oracle is `paged_attention.paged_attention_reference`; `paged_attention.paged_attention`
dispatches here on an sm90 GPU. `regs=False` stages P through shared memory so that Mosaic
GPU's CPU interpreter runs the kernel (see `_mgpu.py`).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mgpu import (
    LN2,
    LOG2E,
    SMEM_LIMIT,
    WGMMA,
    launch,
    smem_bytes,
    softmax_start,
    tiled_smem,
)

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
_ROWS = 64  # query rows of one wgmma tile; the GQA group is padded to it
_SMS = 132  # streaming multiprocessors of an H100/H200 SXM: one block each (shared memory)
_BLOCK_OVERHEAD = 128  # a block's start and end (Q, table, first page, output) in tokens' time


@dataclasses.dataclass(frozen=True)
class PagedBlockSizes:
    """Tiling of the Mosaic GPU paged kernel; None picks a default from the shapes."""

    block_k: int = 128  # tokens per pipeline step (a multiple of 64)
    stages: int = 2  # steps in flight (each block_k tokens of K and of V)
    num_splits: int | None = None  # context splits per sequence; None: fill the GPU in whole waves
    issuers: int | None = None  # producer warps issuing a step's copies (1, 2 or 4); None: 4 when
    # a step takes >= 4 copies (pages smaller than block_k / 4), else 1
    manual_barriers: bool = True  # no warpgroup barrier before each page copy (and around each
    # shared-memory access) but the kernel's own; False: Pallas's automatic ones

    def __post_init__(self):
        if self.block_k % 64 or self.block_k < 64:
            raise ValueError(f"PagedBlockSizes.block_k={self.block_k}: use a multiple of 64.")
        if self.stages < 1:
            raise ValueError(f"PagedBlockSizes.stages={self.stages}: use >= 1.")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"PagedBlockSizes.num_splits={self.num_splits}: use >= 1.")
        if self.issuers not in (None, 1, 2, 4):
            raise ValueError(f"PagedBlockSizes.issuers={self.issuers}: use 1, 2, 4 or None.")
        if not isinstance(self.manual_barriers, bool):
            raise ValueError(f"PagedBlockSizes.manual_barriers={self.manual_barriers!r}: use True or False.")


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static layout of one call."""

    block_k: int
    stages: int
    per_copy: int  # tokens per TMA copy: a page, or a block_k slice of a bigger page
    issuers: int  # producer warps issuing copies: copy i of a step comes from warp i % issuers
    split_tokens: int  # tokens per context split (a multiple of block_k and of 4 pages)
    splits: int
    group_rows: int  # G rounded up to 8: the output rows written per block
    manual_barriers: bool
    regs: bool
    interpret: bool


def supports(dtype, head_dim: int, page_size: int, group: int) -> bool:
    """Whether this kernel takes a cache of this dtype, head dim, page size and GQA group."""
    return (jnp.dtype(dtype) in map(jnp.dtype, SUPPORTED_DTYPES) and head_dim in SUPPORTED_HEAD_DIMS
            and page_size >= 8 and page_size & (page_size - 1) == 0 and 1 <= group <= _ROWS)


def _default_splits(blocks: int, units: int, unit: int) -> int:
    """Context splits that finish soonest on one block per SM: whole waves of `_SMS` blocks,
    each a split of the context (units of `unit` tokens) plus `_BLOCK_OVERHEAD` tokens' time.
    A tail wave costs as much as a full one (8 x 32k tokens x 8 kv heads in 5 splits ran 320
    blocks in 3 waves, 0.79 of the bandwidth; in 2 splits: 128 blocks, one wave)."""
    def cost(splits):
        per_split = -(-units // splits)
        waves = -(-blocks * -(-units // per_split) // _SMS)
        return waves * (per_split * unit + _BLOCK_OVERHEAD), splits

    return min(cost(s) for s in range(1, units + 1))[1]


def _plan(batch, kv_heads, group, capacity, page_size, head_dim, sizes: PagedBlockSizes, regs,
          interpret) -> _Plan:
    bk = sizes.block_k
    per_copy = min(page_size, bk)
    issuers = sizes.issuers or (4 if bk // per_copy >= 4 else 1)
    unit = math.lcm(bk, 4 * page_size)  # a split's block-table slice is >= 16 bytes (TMA)
    units = -(-capacity // unit)
    splits = min(sizes.num_splits or _default_splits(batch * kv_heads, units, unit), units)
    split_tokens = -(-units // splits) * unit
    plan = _Plan(bk, sizes.stages, per_copy, issuers, split_tokens, -(-capacity // split_tokens),
                 max(8, -(-group // 8) * 8), sizes.manual_barriers, regs, interpret)
    need = smem_bytes(((_ROWS, head_dim), jnp.float16), ((2 * sizes.stages, bk, head_dim), jnp.float16),
                      ((_ROWS, head_dim), jnp.float32), ((_ROWS, bk), jnp.float16))
    if need > SMEM_LIMIT - 4096:
        raise ValueError(f"PagedBlockSizes: {need} bytes of shared memory at block_k={bk}, "
                         f"stages={sizes.stages}, head_dim={head_dim}; use fewer stages.")
    return plan


def _kernel_call(plan: _Plan, q_BKRH, k_pages, v_pages, tables, lengths, sm_scale: float):
    """Per split: normalised O [S, B, K, group_rows, H] (f32) and base-2 LSE [S, B, K, rows]."""
    batch, kv_heads, _, head_dim = q_BKRH.shape
    num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
    dtype = q_BKRH.dtype
    bk, st, c, rows = plan.block_k, plan.stages, plan.per_copy, plan.group_rows
    copies = bk // c
    split_pages = plan.split_tokens // page_size
    table_chunks = [(lo, min(256, split_pages - lo)) for lo in range(0, split_pages, 256)]
    scale2 = sm_scale * LOG2E

    def kernel(q_ref, k_ref, v_ref, bt_ref, len_ref, o_ref, lse_ref,
               q_smem, k_smem, v_smem, o_smem, lse_smem, bt_smem, p_smem,
               q_bar, bt_bar, k_bar, v_bar, free):
        si, kvh, bi = lax.axis_index("s"), lax.axis_index("k"), lax.axis_index("b")
        wg = lax.axis_index("wg")
        split_lo = si * plan.split_tokens
        length = jnp.clip(len_ref[bi], 0, tables.shape[1] * page_size)
        n_tok = jnp.clip(length - split_lo, 0, plan.split_tokens)
        n_steps = lax.div(n_tok + (bk - 1), bk)

        # Two warpgroups: each thread may hold up to 255 registers, so no setmaxnreg.
        @pl.when(wg == 0)
        def _consumer():
            q_smem[...] = plgpu.layout_cast(jnp.zeros((_ROWS, head_dim), dtype), WGMMA)
            plgpu.commit_smem()  # the zero rows land before the TMA fills the group's rows
            plgpu.copy_gmem_to_smem(q_ref.at[bi, kvh], q_smem.at[pl.ds(0, rows)], q_bar)
            plgpu.barrier_wait(q_bar)

            def step(j, carry):
                acc, m, l = carry
                slot = lax.rem(j, st)
                plgpu.barrier_wait(k_bar.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((_ROWS, bk), jnp.float32))
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
                plgpu.barrier_arrive(free.at[slot])
                return acc, m_new, l

            carry = softmax_start(_ROWS, head_dim)
            acc, m, l = lax.fori_loop(0, n_steps, step, carry)
            seen = l > 0.0  # an empty split gives O = 0 and LSE = -inf (weight 0 in the merge)
            inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
            o_smem[...] = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
            lse_smem[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)) * (1 / LN2), -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, rows)], o_ref.at[si, bi, kvh], commit_group=False)
            plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, rows)], lse_ref.at[si, bi, kvh], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _producer():
            for lo, size in table_chunks:  # TMA copies at most 256 elements per dimension
                plgpu.copy_gmem_to_smem(bt_ref.at[bi, pl.ds(si * split_pages + lo, size)],
                                        bt_smem.at[pl.ds(lo, size)], bt_bar)
            plgpu.barrier_wait(bt_bar)

            @pl.loop(0, n_steps)
            def _(j):
                slot = lax.rem(j, st)

                @pl.when(j >= st)
                def _():
                    plgpu.barrier_wait(free.at[slot])

                # Page ids are read at warpgroup level (warp-level code takes no smem loads).
                pages = []
                for i in range(copies):
                    tok = j * bk + i * c  # within the split
                    pages.append((jnp.clip(bt_smem[lax.div(tok, page_size)], 0, num_pages - 1),
                                  lax.rem(tok, page_size)))

                def copy(i):  # the step's i-th page (or slice of a page), K and V
                    page, src = pages[i][0], pl.ds(pages[i][1], c)
                    dst = pl.ds(i * c, c)
                    plgpu.copy_gmem_to_smem(k_ref.at[kvh, page, src], k_smem.at[slot, dst], k_bar.at[slot])
                    plgpu.copy_gmem_to_smem(v_ref.at[kvh, page, src], v_smem.at[slot, dst], v_bar.at[slot])

                if plan.issuers == 1:  # one thread of the warpgroup issues every copy
                    for i in range(copies):
                        copy(i)
                else:  # warp w issues copies w, w + issuers, ...: in parallel, no barrier between

                    @plgpu.warp_map
                    def _(warp):
                        for i in range(copies):
                            pl.when(warp == i % plan.issuers)(lambda i=i: copy(i))

            @pl.loop(jnp.maximum(n_steps - st, 0), n_steps)
            def _(j):  # wait for the last slots' release: every barrier phase is observed
                plgpu.barrier_wait(free.at[lax.rem(j, st)])

    scratch = (
        tiled_smem((_ROWS, head_dim), dtype),
        tiled_smem((st, bk, head_dim), dtype),
        tiled_smem((st, bk, head_dim), dtype),
        tiled_smem((_ROWS, head_dim), jnp.float32),  # O staging
        plgpu.SMEM((_ROWS,), jnp.float32),  # LSE staging
        plgpu.SMEM((split_pages,), jnp.int32),  # this split's block-table slice
        None if plan.regs else tiled_smem((_ROWS, bk), dtype),  # P, when staged in smem
        plgpu.Barrier(),  # Q loaded
        plgpu.Barrier(num_arrivals=len(table_chunks)),  # block table loaded
        plgpu.Barrier(num_arrivals=copies, num_barriers=st),  # K slot filled
        plgpu.Barrier(num_arrivals=copies, num_barriers=st),  # V slot filled
        plgpu.Barrier(num_barriers=st),  # slot free again
    )
    s = plan.splits
    return launch(kernel, (q_BKRH, k_pages, v_pages, tables, lengths),
                  out_type=(jax.ShapeDtypeStruct((s, batch, kv_heads, rows, head_dim), jnp.float32),
                            jax.ShapeDtypeStruct((s, batch, kv_heads, rows), jnp.float32)),
                  scratch=scratch, grid=(s, kv_heads, batch), grid_names=("s", "k", "b"),
                  num_threads=2, interpret=plan.interpret, manual_barriers=plan.manual_barriers)


def _merge(o_SBKRH, lse_SBKR):
    """Combines per-split outputs by their base-2 log-sum-exp weights."""
    top = lse_SBKR.max(axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp2(lse_SBKR - top[None])  # an empty split has LSE -inf: weight 0
    total = w.sum(axis=0)
    o = (w[..., None] * o_SBKRH).sum(axis=0)
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
    capacity = block_tables.shape[1] * page_size
    plan = _plan(batch, kv_heads, group, capacity, page_size, head_dim, block_sizes, regs, interpret)
    q_BKGH = q.reshape(batch, kv_heads, group, head_dim)
    if plan.group_rows != group:
        q_BKGH = jnp.pad(q_BKGH, ((0, 0), (0, 0), (0, plan.group_rows - group), (0, 0)))
    columns = plan.splits * plan.split_tokens // page_size
    tables = jnp.pad(block_tables, ((0, 0), (0, columns - block_tables.shape[1])))
    o, lse = _kernel_call(plan, q_BKGH, k_pages, v_pages, tables, lengths, sm_scale)
    o = o[0] if plan.splits == 1 else _merge(o, lse)
    return o[:, :, :group].reshape(batch, heads, head_dim).astype(q.dtype)
