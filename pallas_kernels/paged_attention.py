"""PagedAttention: attention over a KV cache stored in fixed-size pages (Kwon et al. 2023, vLLM).

The cache is a pool of pages `pages_KPZH` shared by all sequences; sequence b owns the pages
listed in `block_tables[b]`, so memory is reserved one page at a time instead of one maximum
length at a time. This file holds one Pallas (Triton-lowered) kernel serving two entry points:

* `paged_attention`: decode, one query token per sequence; the query sees key positions
  `< lengths[b]`.
* `paged_attention_chunk`: several query tokens per sequence (chunked prefill, speculative
  verification), causal by absolute position: query at position p sees keys `<= p` and
  `< lengths[b]`.

One program handles every query row (token x head) of one KV head, so the G = N/K query heads
of a GQA group share each K/V load: the kernel is bandwidth bound and reads each page once per
row block. Long contexts are split over pages (flash-decoding); every split keeps a running
max and sum in base 2 and the splits are merged with a log-sum-exp rescaling.

K/V tiles are gathered token by token straight into [block_k, H] (a page id per token), not
as [pages, Z, H] reshaped: with the reshape between load and dot the same kernel read 1.4 TB/s
on an H200, without it 2.4-2.7 TB/s at batch 64, context 4096, 32q/8kv heads, page 16, where
JAX's own Pallas paged op reads 1.6 (experiments/bench_paged_attention.py, benchmarks/paged_decode.md).

On a Hopper GPU `paged_attention` dispatches to the Mosaic GPU kernel of
`paged_attention_mgpu.py` (TMA page copies, wgmma); this kernel stays the portable path and
serves `paged_attention_chunk` everywhere.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import paged_attention_mgpu as mgpu
from pallas_kernels._mgpu import on_sm90

# Finite "minus infinity": exp2(NEG - m) underflows to 0 without producing inf - inf = nan.
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2E = math.log2(math.e)
# Enough programs to fill an H200 (132 SMs) a few times over; fewer means split the pages.
_TARGET_PROGRAMS = 1024
_DEFAULT_BLOCK_K = 64  # tokens per inner step


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the kernel; None picks a default from the shapes."""

    pages_per_compute_block: int | None = None  # pages gathered per inner step (block_k = this * Z)
    block_k: int | None = None  # or tokens per inner step directly (may be less than a page)
    num_splits: int | None = None  # flash-decoding splits of the page range, merged by LSE
    block_rows: int | None = None  # query rows (tokens x group heads) per program, power of 2
    num_warps: int = 4  # Triton warps per program (GPU only)
    num_stages: int = 3  # Triton software-pipeline depth of the page loop (GPU only)


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_cache(k_pages, v_pages, block_tables, lengths, batch: int, head_dim: int, dtype):
    """Shape and dtype checks shared by both entry points; errors name the field and the fix."""
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [kv_heads, num_pages, page_size, head_dim]; got shape {k_pages.shape}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must have the same shape "
            "[kv_heads, num_pages, page_size, head_dim]; allocate both pools from one config")
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages dtype {k_pages.dtype} != v_pages dtype {v_pages.dtype}; store both in one dtype")
    _, _, page_size, head_dim_kv = k_pages.shape
    if head_dim_kv != head_dim:
        raise ValueError(
            f"head_dim mismatch: q has {head_dim}, k_pages/v_pages have {head_dim_kv}; "
            "the pools' last axis must equal the query head dim")
    if dtype != k_pages.dtype:
        raise ValueError(f"q dtype {dtype} != k_pages dtype {k_pages.dtype}; cast q to the cache dtype")
    if not _pow2(page_size):
        raise ValueError(f"page_size={page_size} must be a power of two (Triton tiles); use 8, 16, 32, 64 ...")
    if not _pow2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim={head_dim} must be a power of two >= 16 (tensor-core tiles); pad the heads")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [batch={batch}, pages_per_sequence]; got shape {block_tables.shape}")
    if block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables dtype must be int32, got {block_tables.dtype}; use .astype(jnp.int32)")
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must have shape (batch,)=({batch},); got {lengths.shape}")
    if lengths.dtype != jnp.int32:
        raise ValueError(f"lengths dtype must be int32, got {lengths.dtype}; use .astype(jnp.int32)")


def _paged_kernel(
    # inputs
    q_ref,  # [block_r, H]
    qpos_ref,  # [block_r] absolute positions of the rows, or None for decode
    k_ref,  # [P, Z, H] one KV head's page pool
    v_ref,  # [P, Z, H]
    bt_ref,  # [pages_per_sequence (padded)]
    len_ref,  # [1]
    # outputs
    o_ref,  # [block_r, H]
    *lse_refs,  # m, l: [block_r] each, only when the pages are split
    scale_log2: float,
    block_k: int,
    split_tokens: int,
    capacity: int,
    precision,
):
    split = pl.program_id(3)
    block_r, head_dim = q_ref.shape
    num_pages, page_size, _ = k_ref.shape
    causal = qpos_ref is not None

    length = jnp.clip(len_ref[0], 0, capacity)
    if causal:
        qpos = qpos_ref[...]
        kv_end = jnp.minimum(length, jnp.max(qpos) + 1)
    else:
        kv_end = length
    lo = split * split_tokens
    hi = jnp.minimum(lo + split_tokens, kv_end)
    num_blocks = pl.cdiv(jnp.maximum(hi - lo, 0), block_k)
    q = q_ref[...]
    offsets = jnp.arange(block_k, dtype=jnp.int32)
    dims = jnp.arange(head_dim, dtype=jnp.int32)[None, :]

    def fetch(i):
        # Gather straight into a [block_k, H] tile, one page id per token (repeats hit in
        # cache): no reshape between load and dot (see the module docstring). Masked:
        # positions >= length are never read, so stale or NaN contents of a page (a freed
        # page's old owner) cannot reach the result.
        pos = lo + i * block_k + offsets
        valid = pos < hi
        page_ids = plgpu.load(bt_ref.at[pos // page_size], mask=valid, other=0)
        index = (jnp.clip(page_ids, 0, num_pages - 1)[:, None], (pos % page_size)[:, None], dims)
        mask = jnp.broadcast_to(valid[:, None], (block_k, head_dim))
        return plgpu.load(k_ref.at[index], mask=mask, other=0), plgpu.load(v_ref.at[index], mask=mask, other=0)

    def attend(i, k, v, acc, m, l):
        pos = lo + i * block_k + offsets
        valid = pos < hi
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale_log2
        if causal:
            seen = valid[None, :] & (pos[None, :] <= qpos[:, None])
        else:
            seen = jnp.broadcast_to(valid[None, :], s.shape)
        s = jnp.where(seen, s, _NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        if causal:  # a row may see nothing in this block: then m_new == _NEG and p would be 1
            p = jnp.where(seen, p, 0.0)
        l = l * alpha + p.sum(axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, l

    init = (jnp.zeros((block_r, head_dim), jnp.float32),
            jnp.full((block_r,), _NEG, jnp.float32),
            jnp.zeros((block_r,), jnp.float32))
    acc, m, l = lax.fori_loop(0, num_blocks, lambda i, c: attend(i, *fetch(i), *c), init)
    if lse_refs:
        m_ref, l_ref = lse_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
    else:
        inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
        o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)


def _plan(capacity: int, page_size: int, programs: int, sizes: BlockSizes):
    """Static tiling in tokens: (block_k, tokens per split, splits)."""
    if sizes.pages_per_compute_block is not None and sizes.block_k is not None:
        raise ValueError("pass pages_per_compute_block or block_k, not both")
    block_k = sizes.block_k
    if sizes.pages_per_compute_block is not None:
        block_k = sizes.pages_per_compute_block * page_size
    if block_k is None:
        block_k = min(_DEFAULT_BLOCK_K, max(16, _next_pow2(capacity)))
    if not _pow2(block_k) or block_k < 16:
        raise ValueError(f"block_k = pages_per_compute_block * page_size = {block_k} must be a power "
                         "of two >= 16 (tensor-core tile); pick pages_per_compute_block accordingly")
    blocks = pl.cdiv(capacity, block_k)
    splits = sizes.num_splits
    if splits is None:
        splits = min(pl.cdiv(_TARGET_PROGRAMS, programs), max(1, blocks // 4))
    if splits < 1:
        raise ValueError(f"num_splits={splits} must be >= 1")
    split_tokens = pl.cdiv(blocks, min(splits, blocks)) * block_k
    return block_k, split_tokens, pl.cdiv(capacity, split_tokens)  # no split without tokens


def _paged_call(q_BKRH, qpos_BR, k_pages, v_pages, block_tables, lengths, *, block_r, sm_scale,
                sizes: BlockSizes, interpret: bool):
    """Runs the kernel on rows already grouped per KV head; returns [B, K, R, H] in q's dtype."""
    batch, kv_heads, rows, head_dim = q_BKRH.shape
    _, num_pages, page_size, _ = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    row_blocks = rows // block_r
    capacity = pages_per_seq * page_size
    block_k, split_tokens, splits = _plan(capacity, page_size, batch * kv_heads * row_blocks, sizes)
    padded = pl.cdiv(splits * split_tokens, page_size)
    if padded != pages_per_seq:  # every page index the kernel forms stays in bounds
        block_tables = jnp.pad(block_tables, ((0, 0), (0, padded - pages_per_seq)))

    precision = lax.Precision.HIGHEST if q_BKRH.dtype == jnp.float32 else lax.Precision.DEFAULT
    kernel = functools.partial(
        _paged_kernel, scale_log2=sm_scale * _LOG2E, block_k=block_k,
        split_tokens=split_tokens, capacity=capacity, precision=precision)
    causal = qpos_BR is not None
    if not causal:
        kernel = functools.partial(lambda q, *rest, _k: _k(q, None, *rest), _k=kernel)

    grid = (batch, kv_heads, row_blocks, splits)
    in_specs = [pl.BlockSpec((None, None, block_r, head_dim), lambda b, k, r, s: (b, k, r, 0))]
    if causal:
        in_specs.append(pl.BlockSpec((None, block_r), lambda b, k, r, s: (b, r)))
    in_specs += [
        pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, k, r, s: (k, 0, 0, 0)),
        pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, k, r, s: (k, 0, 0, 0)),
        pl.BlockSpec((None, padded), lambda b, k, r, s: (b, 0)),
        pl.BlockSpec((1,), lambda b, k, r, s: (b,)),
    ]
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct(q_BKRH.shape, q_BKRH.dtype)
        out_specs = pl.BlockSpec((None, None, block_r, head_dim), lambda b, k, r, s: (b, k, r, 0))
    else:
        row_spec = pl.BlockSpec((None, None, None, block_r), lambda b, k, r, s: (s, b, k, r))
        out_shape = [jax.ShapeDtypeStruct((splits, *q_BKRH.shape), jnp.float32),
                     jax.ShapeDtypeStruct((splits, batch, kv_heads, rows), jnp.float32),
                     jax.ShapeDtypeStruct((splits, batch, kv_heads, rows), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, block_r, head_dim), lambda b, k, r, s: (s, b, k, r, 0)),
                     row_spec, row_spec]
    args = [q_BKRH] + ([qpos_BR] if causal else []) + [k_pages, v_pages, block_tables, lengths]
    out = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, name=f"paged_attention_bk{block_k}_splits{splits}",
        compiler_params=plgpu.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages),
    )(*args)
    if splits == 1:
        return out
    return merge_splits(*out).astype(q_BKRH.dtype)


def merge_splits(o_SBKRH, m_SBKR, l_SBKR):
    """Log-sum-exp merge of per-split partial results (unnormalised output, running max and
    sum; base 2, as in the kernels). Rows that saw nothing (sum 0) come out 0."""
    m_max = m_SBKR.max(axis=0)
    w = jnp.exp2(m_SBKR - m_max[None])
    l_tot = (w * l_SBKR).sum(axis=0)
    o = (w[..., None] * o_SBKRH).sum(axis=0)
    inv = jnp.where(l_tot > 0, 1.0 / jnp.where(l_tot > 0, l_tot, 1.0), 0.0)
    return o * inv[..., None]


def _resolve(sm_scale, head_dim, interpret):
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return scale, interpret


IMPLEMENTATIONS = ("triton", "mosaic")


def _pick_implementation(implementation, q, k_pages, triton_tiling: bool, interpret: bool) -> str:
    """None: Mosaic GPU when compiling on an sm90 GPU for a cache it takes (and no Triton
    tiling was asked for); Triton otherwise, the portable path."""
    heads, head_dim = q.shape[1:]
    kv_heads, _, page_size, _ = k_pages.shape
    ok = mgpu.supports(q.dtype, head_dim, page_size, heads // kv_heads)
    if implementation is None:
        return "mosaic" if ok and not interpret and not triton_tiling and on_sm90() else "triton"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; use one of {IMPLEMENTATIONS} or None")
    if implementation == "mosaic" and not ok:
        raise ValueError(f"implementation='mosaic' takes bfloat16/float16 with head_dim in "
                         f"{mgpu.SUPPORTED_HEAD_DIMS}, page_size a power of two >= 8 and at most 64 "
                         f"query heads per kv head; use implementation='triton'")
    return implementation


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "pages_per_compute_block", "num_splits", "interpret", "block_k", "num_warps",
    "num_stages", "implementation", "mosaic_block_sizes"))
def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None,
                    pages_per_compute_block=None, num_splits=None, interpret=None, block_k=None,
                    num_warps=4, num_stages=3, implementation=None, mosaic_block_sizes=None):
    """Decode attention of one query token per sequence against a paged KV cache.

    q [B, N, H]; k_pages, v_pages [K, P, Z, H]; block_tables [B, pages_per_sequence] int32 (page
    ids into P); lengths [B] int32, the number of valid tokens (the query sees positions < length;
    length 0 gives zeros). Returns [B, N, H]. `interpret=None` interprets off-GPU.
    implementation: "triton" (this file's kernel), "mosaic" (`paged_attention_mgpu`, Hopper,
    tiled by `mosaic_block_sizes`; interpreted on a CPU) or None: Mosaic GPU on an sm90 GPU
    unless block_k / pages_per_compute_block ask for a Triton tiling, Triton otherwise.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, heads, head_dim]; got shape {q.shape}")
    batch, heads, head_dim = q.shape
    _check_cache(k_pages, v_pages, block_tables, lengths, batch, head_dim, q.dtype)
    kv_heads = k_pages.shape[0]
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads} (GQA groups)")
    scale, interpret = _resolve(sm_scale, head_dim, interpret)
    triton_tiling = block_k is not None or pages_per_compute_block is not None
    if _pick_implementation(implementation, q, k_pages, triton_tiling, interpret) == "mosaic":
        sizes = mosaic_block_sizes or mgpu.PagedBlockSizes(num_splits=num_splits)
        return mgpu.paged_attention_mgpu(q, k_pages, v_pages, block_tables, lengths, sm_scale=scale,
                                         block_sizes=sizes, regs=not interpret, interpret=interpret)
    group = heads // kv_heads
    block_r = max(16, _next_pow2(group))
    q_BKGH = q.reshape(batch, kv_heads, group, head_dim)
    if block_r != group:
        q_BKGH = jnp.pad(q_BKGH, ((0, 0), (0, 0), (0, block_r - group), (0, 0)))
    sizes = BlockSizes(pages_per_compute_block, block_k, num_splits, block_r, num_warps, num_stages)
    o = _paged_call(q_BKGH, None, k_pages, v_pages, block_tables, lengths, block_r=block_r,
                    sm_scale=scale, sizes=sizes, interpret=interpret)
    return o[:, :, :group].reshape(batch, heads, head_dim)


def _positions(batch, steps, q_positions_BT, q_start_B):
    if (q_positions_BT is None) == (q_start_B is None):
        raise ValueError("pass exactly one of q_positions_BT [batch, tokens] or q_start_B [batch]")
    if q_positions_BT is None:
        if q_start_B.shape != (batch,) or q_start_B.dtype != jnp.int32:
            raise ValueError(f"q_start_B must be int32 of shape ({batch},); got {q_start_B.dtype}{q_start_B.shape}")
        return q_start_B[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
    if q_positions_BT.shape != (batch, steps) or q_positions_BT.dtype != jnp.int32:
        raise ValueError(f"q_positions_BT must be int32 of shape ({batch}, {steps}); "
                         f"got {q_positions_BT.dtype}{q_positions_BT.shape}")
    return q_positions_BT


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "pages_per_compute_block", "num_splits", "block_rows", "interpret", "block_k",
    "num_warps", "num_stages"))
def paged_attention_chunk(q_BTNH, k_pages, v_pages, block_tables, lengths, q_positions_BT=None,
                          q_start_B=None, *, sm_scale=None, pages_per_compute_block=None,
                          num_splits=None, block_rows=None, interpret=None, block_k=None,
                          num_warps=4, num_stages=3):
    """Attention of T query tokens per sequence against a paged cache, causal by position.

    Query (b, t) at position p = q_positions_BT[b, t] (or q_start_B[b] + t) sees keys at
    positions <= p and < lengths[b]; write the chunk's own K/V into the pages first. Rows that
    see no key return zeros. Returns [B, T, N, H].
    """
    if q_BTNH.ndim != 4:
        raise ValueError(f"q_BTNH must be [batch, tokens, heads, head_dim]; got shape {q_BTNH.shape}")
    batch, steps, heads, head_dim = q_BTNH.shape
    _check_cache(k_pages, v_pages, block_tables, lengths, batch, head_dim, q_BTNH.dtype)
    kv_heads = k_pages.shape[0]
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads} (GQA groups)")
    pos_BT = _positions(batch, steps, q_positions_BT, q_start_B)
    scale, interpret = _resolve(sm_scale, head_dim, interpret)
    group = heads // kv_heads
    rows = steps * group
    block_r = block_rows or min(64, max(16, _next_pow2(rows)))
    if not _pow2(block_r) or block_r < 16:
        raise ValueError(f"block_rows={block_r} must be a power of two >= 16")
    padded = pl.cdiv(rows, block_r) * block_r
    # Rows ordered (token, group head) so that one program serves a GQA group across tokens.
    q_BKRH = q_BTNH.reshape(batch, steps, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q_BKRH = q_BKRH.reshape(batch, kv_heads, rows, head_dim)
    qpos_BR = jnp.repeat(pos_BT, group, axis=1)
    if padded != rows:
        q_BKRH = jnp.pad(q_BKRH, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
        qpos_BR = jnp.pad(qpos_BR, ((0, 0), (0, padded - rows)), constant_values=-1)
    sizes = BlockSizes(pages_per_compute_block, block_k, num_splits, block_r, num_warps, num_stages)
    o = _paged_call(q_BKRH, qpos_BR, k_pages, v_pages, block_tables, lengths, block_r=block_r,
                    sm_scale=scale, sizes=sizes, interpret=interpret)
    o = o[:, :, :rows].reshape(batch, kv_heads, steps, group, head_dim).transpose(0, 2, 1, 3, 4)
    return o.reshape(batch, steps, heads, head_dim)


# ----------------------------------------------------------------------------- references


def gather_pages(pages_KPZH, block_tables):
    """Contiguous view [B, pages_per_sequence * Z, K, H] of each sequence's pages."""
    kv_heads, _, page_size, head_dim = pages_KPZH.shape
    batch, pages_per_seq = block_tables.shape
    x = pages_KPZH[:, block_tables]  # [K, B, pages, Z, H]
    return x.reshape(kv_heads, batch, pages_per_seq * page_size, head_dim).transpose(1, 2, 0, 3)


def paged_attention_chunk_reference(q_BTNH, k_pages, v_pages, block_tables, lengths,
                                    q_positions_BT=None, q_start_B=None, *, sm_scale=None):
    """Pure-jnp oracle for `paged_attention_chunk`: gather the pages, masked softmax in f32."""
    batch, steps, heads, head_dim = q_BTNH.shape
    kv_heads = k_pages.shape[0]
    group = heads // kv_heads
    pos_BT = _positions(batch, steps, q_positions_BT, q_start_B)
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    k_BSKH = gather_pages(k_pages, block_tables).astype(jnp.float32)
    v_BSKH = gather_pages(v_pages, block_tables).astype(jnp.float32)
    kpos_S = jnp.arange(k_BSKH.shape[1], dtype=jnp.int32)
    live_BS = kpos_S[None, :] < lengths[:, None]
    v_BSKH = jnp.where(live_BS[:, :, None, None], v_BSKH, 0.0)  # stale pages may hold NaN
    q_BTKGH = q_BTNH.astype(jnp.float32).reshape(batch, steps, kv_heads, group, head_dim)
    s = jnp.einsum("btkgh,bskh->btkgs", q_BTKGH, k_BSKH, precision=lax.Precision.HIGHEST) * scale
    seen_BTS = live_BS[:, None, :] & (kpos_S[None, None, :] <= pos_BT[:, :, None])
    seen = seen_BTS[:, :, None, None, :]
    s = jnp.where(seen, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(seen, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    l = p.sum(axis=-1, keepdims=True)
    o = jnp.einsum("btkgs,bskh->btkgh", p, v_BSKH, precision=lax.Precision.HIGHEST)
    o = jnp.where(l > 0, o / jnp.where(l > 0, l, 1.0), 0.0)
    return o.reshape(batch, steps, heads, head_dim).astype(q_BTNH.dtype)


def paged_attention_reference(q, k_pages, v_pages, block_tables, lengths, *, sm_scale=None):
    """Pure-jnp oracle for `paged_attention` (decode: the query sits at position length - 1)."""
    out = paged_attention_chunk_reference(q[:, None], k_pages, v_pages, block_tables, lengths,
                                          q_positions_BT=(lengths - 1)[:, None], sm_scale=sm_scale)
    return out[:, 0]
