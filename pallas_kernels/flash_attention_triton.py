"""The portable FlashAttention kernels: forward, dK/dV and dQ in Pallas lowered to Triton
(interpret mode on a CPU), their tile sizes (`BlockSizes`) and the custom VJP that ties them
together (`flash`). `flash_attention.flash_attention` is the public entry point: it checks
inputs, builds the static `Config` and dispatches here or to Mosaic GPU on Hopper.

Forward (Dao et al. 2022, FlashAttention; Dao 2023, FlashAttention-2): one program per
(query tile, batch, head) keeps its Q tile on chip and sweeps the K/V tiles, folding each
into fp32 accumulators with the online softmax (Milakov & Gimelshein 2018): a running row
max m, a normaliser l rescaled by 2^(m_old - m_new) whenever the max rises, and an output
accumulator rescaled the same way. Only O and the row log-sum-exp (LSE) are written; no
seq x seq matrix exists anywhere.

Backward recomputes the probabilities tile by tile from Q, K and the saved LSE
(P = 2^(S - LSE), exact, no second normalisation) instead of storing them - trading
~2x the matmuls for O(seq) memory. As in FlashAttention-2 it is two kernels: one per K/V
tile that loops over query tiles to accumulate dK and dV, and one per query tile that loops
over K/V tiles to accumulate dQ, after the precomputation delta = rowsum(dO * O), which is
the row term of the softmax Jacobian (dS = P * (dP - delta)).

Masking costs nothing where it cannot matter: tiles fully visible to every query of a tile
run an unmasked loop, and only the causal diagonal, the ragged last K tile and (with
segment ids) all tiles run the masked loop. Causal tiles above the diagonal are skipped.
Logits are kept in base 2 (scale folded with log2 e) so each exponential is one exp2.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import (
    dot_f32,
    is_pow2,
    next_pow2,
    precision_for,
    triton_params,
)
from pallas_kernels._flash_vjp import make_flash, pad_seq

_LOG2E = math.log2(math.e)
_BLOCK_FIELDS = ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and Triton launch parameters of the three kernels."""

    block_q: int = 64  # forward: query rows per program
    block_k: int = 64  # forward: key rows per loop step
    block_q_dkv: int = 64  # dK/dV kernel: query rows per loop step
    block_k_dkv: int = 64  # dK/dV kernel: key rows per program
    block_q_dq: int = 64  # dQ kernel: query rows per program
    block_k_dq: int = 64  # dQ kernel: key rows per loop step
    num_warps_fwd: int = 4  # Triton warps of the forward kernel (GPU only)
    num_stages_fwd: int = 3  # Triton pipelining depth of the forward loop (GPU only)
    num_warps_bwd: int = 4  # Triton warps of the two backward kernels (GPU only)
    num_stages_bwd: int = 2  # Triton pipelining depth of the backward loops (GPU only)

    def __post_init__(self):
        for name in _BLOCK_FIELDS:
            value = getattr(self, name)
            if not is_pow2(value) or value < 16:
                raise ValueError(f"BlockSizes.{name}={value}: use a power of two >= 16.")

    @classmethod
    def for_shape(cls, head_dim: int, dtype, *, on_gpu: bool) -> BlockSizes:
        """Defaults per head dim and dtype, tuned on an H200 (experiments/tune_attention.py).

        Shared memory bounds the tiles: fp32 tiles are twice the bytes of bf16 ones."""
        if not on_gpu:  # interpret mode: few, moderate tiles keep the Python loop short
            return cls()
        wide = jnp.dtype(dtype).itemsize >= 4
        if head_dim <= 64 and not wide:
            return cls(128, 64, 64, 64, 64, 64, 4, 3, 4, 2)
        if head_dim <= 128 and not wide:  # swept at seq 4096 (benchmarks/attention_tune_h200.json)
            return cls(128, 128, 64, 64, 64, 64, 8, 3, 4, 2)
        if head_dim <= 128:
            return cls(64, 32, 32, 64, 64, 32, 4, 2, 4, 2)
        if not wide:
            return cls(64, 32, 32, 64, 64, 32, 4, 2, 8, 1)
        return cls(32, 16, 16, 32, 32, 16, 4, 1, 4, 1)

    def clipped(self, q_len: int, kv_len: int) -> BlockSizes:
        """Shrinks tiles longer than the (power-of-two rounded) sequences."""
        fit_q = lambda b: max(16, min(b, next_pow2(q_len)))
        fit_k = lambda b: max(16, min(b, next_pow2(kv_len)))
        return dataclasses.replace(
            self, block_q=fit_q(self.block_q), block_k=fit_k(self.block_k),
            block_q_dkv=fit_q(self.block_q_dkv), block_k_dkv=fit_k(self.block_k_dkv),
            block_q_dq=fit_q(self.block_q_dq), block_k_dq=fit_k(self.block_k_dq),
        )

@dataclasses.dataclass(frozen=True)
class Config:
    """Everything static about one call (hashable: it keys the compile cache)."""

    causal: bool
    sm_scale: float
    blocks: BlockSizes
    q_len: int
    kv_len: int
    q_pad: int
    kv_pad: int
    groups: int  # query heads per kv head
    segments: bool
    interpret: bool


# ---------------------------------------------------------------------------------------
# Masks and loop ranges.

def _visible(q_pos, k_pos, q_seg, kv_seg, *, causal: bool, kv_len: int | None):
    """Which (query, key) pairs may attend; operands are pre-broadcast to 2-D."""
    ok = None
    conj = lambda a, b: b if a is None else jnp.logical_and(a, b)
    if causal:
        ok = conj(ok, k_pos <= q_pos)
    if kv_len is not None:
        ok = conj(ok, k_pos < kv_len)
    if q_seg is not None:
        ok = conj(ok, q_seg == kv_seg)
    return ok


def _cdiv(a, b: int):
    return -(-a // b) if isinstance(a, int) else lax.div(a + (b - 1), b)


def _min(a, b):
    """min that stays a Python int when it can (static loop bounds for Triton)."""
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def _kv_tile_range(cfg: Config, q_first, q_last, bk: int):
    """K tiles [0, n_full) need no mask; [n_full, n_end) need one; the rest are skipped.

    q_first/q_last are the absolute positions of the tile's first and last query."""
    n_end = _cdiv(cfg.kv_len, bk)
    n_full = cfg.kv_len // bk  # the ragged last tile needs the length mask
    if cfg.causal:
        n_end = _min(n_end, _cdiv(q_last + 1, bk))  # keys past the last query: skip
        n_full = _min(n_full, lax.div(q_first + 1, bk))  # keys <= the first query
    if cfg.segments:
        n_full = 0
    return _min(n_full, n_end), n_end


def _needs_mask(cfg: Config, bk: int) -> bool:
    return cfg.causal or cfg.segments or cfg.kv_len % bk != 0


def _length(cfg: Config, bk: int):
    return cfg.kv_len if cfg.kv_len % bk else None


def _positions(start, size: int):
    return start + jnp.arange(size, dtype=jnp.int32)


# ---------------------------------------------------------------------------------------
# Forward kernel.

def _row_logits(cfg: Config, q, k, j, bk: int, q_pos, q_seg, kvseg_ref, scale, precision,
                masked: bool):
    """A query tile's base-2 logits against K tile j [bq, bk]; -inf where not visible (only
    on the masked loop). Shared by the forward and the dQ kernels, which sweep K/V tiles."""
    s = dot_f32(q, k, trans_b=True, precision=precision) * scale
    if masked:
        kv_seg = kvseg_ref[pl.ds(j * bk, bk)][None, :] if cfg.segments else None
        ok = _visible(q_pos[:, None], _positions(j * bk, bk)[None, :],
                      None if q_seg is None else q_seg[:, None], kv_seg,
                      causal=cfg.causal, kv_len=_length(cfg, bk))
        s = jnp.where(ok, s, -jnp.inf)
    return s


def _fwd_kernel(qoff_ref, q_ref, k_ref, v_ref, qseg_ref, kvseg_ref,  # inputs
                o_ref, lse_ref,  # outputs
                *, cfg: Config, precision):
    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    q_lo = pl.program_id(0) * bq
    q_offset = qoff_ref[0]
    q = q_ref[...]
    q_pos = _positions(q_offset + q_lo, bq)
    q_seg = qseg_ref[...] if cfg.segments else None
    scale = cfg.sm_scale * _LOG2E  # logits in base 2: exp(x) = exp2(x * log2 e)

    def step(j, carry, masked: bool):
        acc, m, l = carry
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        s = _row_logits(cfg, q, k, j, bk, q_pos, q_seg, kvseg_ref, scale, precision, masked)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # A row with no visible key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not nan.
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m - m_use)  # rescales what was accumulated under the old max
        p = jnp.exp2(s - m_use[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot_f32(p.astype(v.dtype), v, precision=precision)
        return acc, m_new, l

    n_full, n_end = _kv_tile_range(cfg, q_offset + q_lo, q_offset + q_lo + bq - 1, bk)
    head_dim = q_ref.shape[-1]
    carry = (jnp.zeros((bq, head_dim), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
    if _needs_mask(cfg, bk):
        carry = lax.fori_loop(n_full, n_end, functools.partial(step, masked=True), carry)
    acc, m, l = carry
    seen = l > 0.0  # rows with no visible key give 0 and an LSE of +inf (so P = 0 later)
    o_ref[...] = (acc * jnp.where(seen, 1.0 / l, 0.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log2(l), jnp.inf)


# ---------------------------------------------------------------------------------------
# Backward kernels.

def _dkdv_kernel(qoff_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref,
                 kvseg_ref,  # inputs
                 dk_ref, dv_ref,  # outputs
                 *, cfg: Config, precision):
    """One K/V tile; loops over query tiles. Works on transposed scores (keys x queries)
    so that every product is a plain A @ B or A @ B^T of loaded tiles."""
    bq, bk = cfg.blocks.block_q_dkv, cfg.blocks.block_k_dkv
    k_lo = pl.program_id(0) * bk
    q_offset = qoff_ref[0]
    k, v = k_ref[...], v_ref[...]
    k_pos = _positions(k_lo, bk)
    kv_seg = kvseg_ref[...] if cfg.segments else None
    scale = cfg.sm_scale * _LOG2E

    def step(i, carry, masked: bool):
        dk, dv = carry
        rows = pl.ds(i * bq, bq)
        q, do = q_ref[rows, :], do_ref[rows, :]
        lse, delta = lse_ref[rows], delta_ref[rows]
        s_t = dot_f32(k, q, trans_b=True, precision=precision) * scale
        if masked:
            q_seg = qseg_ref[rows][None, :] if cfg.segments else None
            ok = _visible(_positions(q_offset + i * bq, bq)[None, :], k_pos[:, None], q_seg,
                          None if kv_seg is None else kv_seg[:, None],
                          causal=cfg.causal, kv_len=None)  # padded keys' rows are dropped
            s_t = jnp.where(ok, s_t, -jnp.inf)
        p_t = jnp.exp2(s_t - lse[None, :])
        dv = dv + dot_f32(p_t.astype(do.dtype), do, precision=precision)
        dp_t = dot_f32(v, do, trans_b=True, precision=precision)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = dk + dot_f32(ds_t.astype(q.dtype), q, precision=precision)
        return dk, dv

    n_q = cfg.q_pad // bq
    if cfg.causal:  # query tiles entirely before this key tile see none of it
        i_start = lax.div(jnp.maximum(k_lo - q_offset, 0), bq)
        i_full = jnp.minimum(_cdiv(jnp.maximum(k_lo + bk - 1 - q_offset, 0), bq), n_q)
    else:
        i_start, i_full = 0, 0
    if cfg.segments:
        i_full = n_q
    head_dim = k_ref.shape[-1]
    zeros = jnp.zeros((bk, head_dim), jnp.float32)
    carry = (zeros, zeros)
    if cfg.causal or cfg.segments:
        carry = lax.fori_loop(i_start, i_full, functools.partial(step, masked=True), carry)
    dk, dv = lax.fori_loop(i_full, n_q, functools.partial(step, masked=False), carry)
    dk_ref[...] = (dk * cfg.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(qoff_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref,
               kvseg_ref,  # inputs
               dq_ref,  # output
               *, cfg: Config, precision):
    """One query tile; loops over K/V tiles like the forward pass."""
    bq, bk = cfg.blocks.block_q_dq, cfg.blocks.block_k_dq
    q_lo = pl.program_id(0) * bq
    q_offset = qoff_ref[0]
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = _positions(q_offset + q_lo, bq)
    q_seg = qseg_ref[...] if cfg.segments else None
    scale = cfg.sm_scale * _LOG2E

    def step(j, dq, masked: bool):
        k = k_ref[pl.ds(j * bk, bk), :]
        v = v_ref[pl.ds(j * bk, bk), :]
        s = _row_logits(cfg, q, k, j, bk, q_pos, q_seg, kvseg_ref, scale, precision, masked)
        p = jnp.exp2(s - lse[:, None])
        dp = dot_f32(do, v, trans_b=True, precision=precision)
        ds = p * (dp - delta[:, None])
        return dq + dot_f32(ds.astype(k.dtype), k, precision=precision)

    n_full, n_end = _kv_tile_range(cfg, q_offset + q_lo, q_offset + q_lo + bq - 1, bk)
    dq = jnp.zeros((bq, q_ref.shape[-1]), jnp.float32)
    dq = lax.fori_loop(0, n_full, functools.partial(step, masked=False), dq)
    if _needs_mask(cfg, bk):
        dq = lax.fori_loop(n_full, n_end, functools.partial(step, masked=True), dq)
    dq_ref[...] = (dq * cfg.sm_scale).astype(dq_ref.dtype)


# ---------------------------------------------------------------------------------------
# pallas_call wrappers.

def _seg_specs(cfg: Config, q_block, kv_block):
    if not cfg.segments:
        return [None, None]
    return [pl.BlockSpec((None, q_block[0]), q_block[1]),
            pl.BlockSpec((None, kv_block[0]), kv_block[1])]


def _forward(cfg: Config, q, k, v, qoff, q_seg, kv_seg):
    """Returns O [B, q_pad, N, H] and the base-2 LSE [B, N, q_pad] (fp32)."""
    b, _, n, h = q.shape
    bq, g = cfg.blocks.block_q, cfg.groups
    whole_kv = pl.BlockSpec((None, cfg.kv_pad, None, h), lambda i, b, n: (b, 0, lax.div(n, g), 0))
    q_tile = pl.BlockSpec((None, bq, None, h), lambda i, b, n: (b, i, n, 0))
    in_specs = [pl.BlockSpec((1,), lambda i, b, n: (0,)), q_tile, whole_kv, whole_kv]
    in_specs += _seg_specs(cfg, (bq, lambda i, b, n: (b, i)),
                           (cfg.kv_pad, lambda i, b, n: (b, 0)))
    blocks = cfg.blocks
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, precision=precision_for(q.dtype)),
        grid=(cfg.q_pad // bq, b, n),
        in_specs=in_specs,
        out_specs=[q_tile, pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))],
        out_shape=[jax.ShapeDtypeStruct((b, cfg.q_pad, n, h), q.dtype),
                   jax.ShapeDtypeStruct((b, n, cfg.q_pad), jnp.float32)],
        compiler_params=triton_params(blocks.num_warps_fwd, blocks.num_stages_fwd),
        interpret=cfg.interpret,
        name="gendist_flash_fwd",
    )(qoff, q, k, v, q_seg, kv_seg)


def _backward(cfg: Config, q, k, v, qoff, q_seg, kv_seg, lse, do, delta, o):
    """dQ, dK, dV on padded sequences; dK/dV summed over each kv head's query heads."""
    del o  # delta comes from XLA's pass (`make_flash`)
    delta = delta()
    b, _, n, h = q.shape
    kh, g, blocks = k.shape[2], cfg.groups, cfg.blocks
    prec = precision_for(q.dtype)
    params = triton_params(blocks.num_warps_bwd, blocks.num_stages_bwd)
    qoff_spec = pl.BlockSpec((1,), lambda i, b, n: (0,))

    # dK/dV: one program per (key tile, batch, query head).
    bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
    whole_q = pl.BlockSpec((None, cfg.q_pad, None, h), lambda j, b, n: (b, 0, n, 0))
    kv_tile = pl.BlockSpec((None, bk, None, h), lambda j, b, n: (b, j, lax.div(n, g), 0))
    whole_row = pl.BlockSpec((None, None, cfg.q_pad), lambda j, b, n: (b, n, 0))
    in_specs = [qoff_spec, whole_q, kv_tile, kv_tile, whole_q, whole_row, whole_row]
    in_specs += _seg_specs(cfg, (cfg.q_pad, lambda j, b, n: (b, 0)), (bk, lambda j, b, n: (b, j)))
    # With grouped heads each query head writes its own partial dK/dV (fp32), summed below.
    part_dtype = k.dtype if g == 1 else jnp.float32
    out_tile = pl.BlockSpec((None, bk, None, h), lambda j, b, n: (b, j, n, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg, precision=prec),
        grid=(cfg.kv_pad // bk, b, n),
        in_specs=in_specs,
        out_specs=[out_tile, out_tile],
        out_shape=[jax.ShapeDtypeStruct((b, cfg.kv_pad, n, h), part_dtype)] * 2,
        compiler_params=params,
        interpret=cfg.interpret,
        name="gendist_flash_dkdv",
    )(qoff, q, k, v, do, lse, delta, q_seg, kv_seg)
    if g > 1:
        dk = dk.reshape(b, cfg.kv_pad, kh, g, h).sum(3).astype(k.dtype)
        dv = dv.reshape(b, cfg.kv_pad, kh, g, h).sum(3).astype(v.dtype)

    # dQ: one program per (query tile, batch, query head).
    bq, bk = blocks.block_q_dq, blocks.block_k_dq
    q_tile = pl.BlockSpec((None, bq, None, h), lambda i, b, n: (b, i, n, 0))
    whole_kv = pl.BlockSpec((None, cfg.kv_pad, None, h), lambda i, b, n: (b, 0, lax.div(n, g), 0))
    row_tile = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))
    in_specs = [qoff_spec, q_tile, whole_kv, whole_kv, q_tile, row_tile, row_tile]
    in_specs += _seg_specs(cfg, (bq, lambda i, b, n: (b, i)), (cfg.kv_pad, lambda i, b, n: (b, 0)))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, precision=prec),
        grid=(cfg.q_pad // bq, b, n),
        in_specs=in_specs,
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=cfg.interpret,
        name="gendist_flash_dq",
    )(qoff, q, k, v, do, lse, delta, q_seg, kv_seg)
    return dq, dk, dv


def _padded_inputs(cfg: Config, q, k, v, q_seg, kv_seg):
    q, k, v = pad_seq(q, cfg.q_pad), pad_seq(k, cfg.kv_pad), pad_seq(v, cfg.kv_pad)
    if cfg.segments:  # padded keys are excluded by the length mask, whatever their id
        q_seg, kv_seg = pad_seq(q_seg, cfg.q_pad, -1), pad_seq(kv_seg, cfg.kv_pad, -1)
    return q, k, v, q_seg, kv_seg


flash = make_flash(_padded_inputs, _forward, _backward)  # jitted, cfg static


