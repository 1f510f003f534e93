"""FlashAttention in Pallas: the public `flash_attention` and its reference `mha_reference`.

`flash_attention` checks its inputs and dispatches to the Mosaic GPU kernels of
`flash_attention_mgpu.py` on a Hopper GPU, or to the portable Triton-lowered kernels of
`flash_attention_triton.py` (interpret mode on a CPU), which hold the algorithm's
description (tiling, online softmax, recomputation in the backward pass). Both are tested
against `mha_reference`.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import flash_attention_mgpu as mgpu
from pallas_kernels._compat import resolve_interpret, round_up
from pallas_kernels._mgpu import on_sm90
from pallas_kernels.flash_attention_triton import BlockSizes, Config, flash

__all__ = ["BlockSizes", "SegmentIds", "flash_attention", "mha_reference", "pick_implementation"]

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class SegmentIds(NamedTuple):
    """Per-token segment ids; a query attends only to keys of its own segment."""

    q: jax.Array  # [batch, q_len] int
    kv: jax.Array  # [batch, kv_len] int


# ---------------------------------------------------------------------------------------
# Public API.

def _check_inputs(q, k, v, segment_ids, q_offset):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"flash_attention: {name} must be [batch, seq, heads, head_dim], "
                             f"got shape {x.shape}.")
    if k.shape != v.shape:
        raise ValueError(f"flash_attention: k.shape={k.shape} and v.shape={v.shape} must match.")
    (b, t, n, h), (bk, s, kh, hk) = q.shape, k.shape
    if bk != b:
        raise ValueError(f"flash_attention: batch of q ({b}) and k/v ({bk}) differ.")
    if hk != h:
        raise ValueError(f"flash_attention: head_dim of q ({h}) and k/v ({hk}) differ.")
    if h not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"flash_attention: head_dim={h} unsupported; use one of "
                         f"{SUPPORTED_HEAD_DIMS} (pad the head dim, or use mha_reference).")
    if n % kh:
        raise ValueError(f"flash_attention: kv heads ({kh}) must divide q heads ({n}) for "
                         f"grouped-query attention; change num_kv_heads.")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"flash_attention: dtypes differ (q {q.dtype}, k {k.dtype}, v "
                         f"{v.dtype}); cast them to one of float32/bfloat16/float16.")
    if q.dtype not in _DTYPES:
        raise ValueError(f"flash_attention: dtype {q.dtype} unsupported; use float32, "
                         f"bfloat16 or float16.")
    if t == 0 or s == 0:
        raise ValueError(f"flash_attention: empty sequence (q_len={t}, kv_len={s}).")
    if isinstance(q_offset, int) and q_offset < 0:
        raise ValueError(f"flash_attention: q_offset={q_offset} must be >= 0.")
    if segment_ids is not None:
        if not isinstance(segment_ids, SegmentIds):
            if t != s:
                raise ValueError("flash_attention: segment_ids as one array needs q_len == "
                                 "kv_len; pass SegmentIds(q=..., kv=...) otherwise.")
            segment_ids = SegmentIds(segment_ids, segment_ids)
        if segment_ids.q.shape != (b, t) or segment_ids.kv.shape != (b, s):
            raise ValueError(f"flash_attention: segment_ids shapes {segment_ids.q.shape}, "
                             f"{segment_ids.kv.shape} must be (batch, q_len)=({b}, {t}) and "
                             f"(batch, kv_len)=({b}, {s}).")
    return segment_ids


IMPLEMENTATIONS = ("triton", "mosaic")


def pick_implementation(implementation: str | None, dtype, head_dim: int, block_sizes,
                        interpret: bool) -> str:
    """None picks Mosaic GPU when compiling on an sm90 GPU for bf16/fp16 at head dim 64 or
    128 (and no Triton BlockSizes were given), Triton otherwise (the portable path)."""
    if implementation is None:
        mosaic = (not interpret and on_sm90() and mgpu.supports(dtype, head_dim)
                  and not isinstance(block_sizes, BlockSizes))
        return "mosaic" if mosaic else "triton"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"flash_attention: implementation={implementation!r}; use one of "
                         f"{IMPLEMENTATIONS} or None (automatic).")
    if implementation == "mosaic" and not mgpu.supports(dtype, head_dim):
        raise ValueError(f"flash_attention: implementation='mosaic' takes bfloat16/float16 with "
                         f"head_dim in {mgpu.SUPPORTED_HEAD_DIMS}, got {jnp.dtype(dtype).name} / "
                         f"{head_dim}; use implementation='triton'.")
    return implementation


def flash_attention(q_BTNH, k_BSKH, v_BSKH, *, causal: bool = False,
                    sm_scale: float | None = None, q_offset=0,
                    segment_ids: SegmentIds | jax.Array | None = None,
                    block_sizes: BlockSizes | mgpu.MosaicBlockSizes | None = None,
                    interpret: bool | None = None, implementation: str | None = None):
    """Exact softmax attention, O(seq) memory, differentiable (custom VJP).

    q_BTNH [batch, q_len, heads, head_dim]; k_BSKH, v_BSKH [batch, kv_len, kv_heads,
    head_dim] with heads % kv_heads == 0 (query head n reads kv head n // (heads/kv_heads)).
    Query i sits at absolute position q_offset + i (an int or a traced int scalar, e.g. a
    decode position); causal means key_pos <= query_pos. segment_ids: SegmentIds(q, kv)
    or one [batch, seq] array when q_len == kv_len. Rows that see no key return 0.
    interpret=None: interpret mode unless running on a GPU. implementation: "triton" (the
    kernels in this file), "mosaic" (`flash_attention_mgpu`, Hopper; interpreted on a CPU)
    or None: Mosaic GPU on an sm90 GPU where it applies, Triton otherwise.
    """
    segment_ids = _check_inputs(q_BTNH, k_BSKH, v_BSKH, segment_ids, q_offset)
    t, s, h = q_BTNH.shape[1], k_BSKH.shape[1], q_BTNH.shape[3]
    interpret = resolve_interpret(interpret)
    impl = pick_implementation(implementation, q_BTNH.dtype, h, block_sizes, interpret)
    if impl == "mosaic":
        if block_sizes is not None and not isinstance(block_sizes, mgpu.MosaicBlockSizes):
            raise ValueError("flash_attention: implementation='mosaic' takes "
                             "MosaicBlockSizes, not BlockSizes.")
        return mgpu.flash_attention_mgpu(
            q_BTNH, k_BSKH, v_BSKH, causal=causal, sm_scale=sm_scale, q_offset=q_offset,
            q_segment_ids=None if segment_ids is None else segment_ids.q,
            kv_segment_ids=None if segment_ids is None else segment_ids.kv,
            block_sizes=block_sizes, interpret=interpret)
    if isinstance(block_sizes, mgpu.MosaicBlockSizes):
        raise ValueError("flash_attention: MosaicBlockSizes apply to implementation='mosaic'; "
                         "pass BlockSizes for the Triton kernels.")
    blocks = (block_sizes or BlockSizes.for_shape(h, q_BTNH.dtype, on_gpu=not interpret)).clipped(t, s)
    q_mult = max(blocks.block_q, blocks.block_q_dkv, blocks.block_q_dq)
    kv_mult = max(blocks.block_k, blocks.block_k_dkv, blocks.block_k_dq)
    cfg = Config(
        causal=bool(causal), sm_scale=float(1 / math.sqrt(h) if sm_scale is None else sm_scale),
        blocks=blocks, q_len=t, kv_len=s, q_pad=round_up(t, q_mult), kv_pad=round_up(s, kv_mult),
        groups=q_BTNH.shape[2] // k_BSKH.shape[2], segments=segment_ids is not None,
        interpret=interpret,
    )
    qoff = jnp.asarray(q_offset, jnp.int32).reshape(1)
    q_seg = kv_seg = None
    if segment_ids is not None:
        q_seg, kv_seg = (x.astype(jnp.int32) for x in segment_ids)
    return flash(cfg, q_BTNH, k_BSKH, v_BSKH, qoff, q_seg, kv_seg)


def mha_reference(q_BTNH, k_BSKH, v_BSKH, *, causal: bool = False,
                  sm_scale: float | None = None, q_offset=0,
                  segment_ids: SegmentIds | jax.Array | None = None):
    """Pure-jnp oracle with the same semantics as `flash_attention` (fp32 math, S x S)."""
    segment_ids = _check_inputs(q_BTNH, k_BSKH, v_BSKH, segment_ids, 0)
    b, t, n, h = q_BTNH.shape
    s, kh = k_BSKH.shape[1], k_BSKH.shape[2]
    scale = 1 / math.sqrt(h) if sm_scale is None else sm_scale
    f32 = lambda x: x.astype(jnp.float32)
    q_BTKGH = f32(q_BTNH).reshape(b, t, kh, n // kh, h)
    logits_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, f32(k_BSKH),
                              precision=lax.Precision.HIGHEST) * scale
    ok = jnp.ones((b, 1, 1, t, s), bool)
    if causal:
        q_pos = jnp.asarray(q_offset, jnp.int32) + jnp.arange(t)
        ok = ok & (jnp.arange(s)[None, :] <= q_pos[:, None])[None, None, None]
    if segment_ids is not None:
        ok = ok & (segment_ids.q[:, None, None, :, None] == segment_ids.kv[:, None, None, None, :])
    logits_BKGTS = jnp.where(ok, logits_BKGTS, -jnp.inf)
    m = jnp.max(logits_BKGTS, axis=-1, keepdims=True)
    e = jnp.where(ok, jnp.exp(logits_BKGTS - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    l = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(l > 0, l, 1.0)  # rows with no visible key give 0, as the kernel does
    o_BTKGH = jnp.einsum("bkgts,bskh->btkgh", p, f32(v_BSKH), precision=lax.Precision.HIGHEST)
    return o_BTKGH.reshape(b, t, n, h).astype(q_BTNH.dtype)
