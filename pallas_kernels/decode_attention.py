"""One decode step's attention in one kernel: RoPE, the KV-cache write and attention fused.

A decode step at small batch is dominated by small kernels, not bytes: on an H200 a 350m
batch-1 step ran ~330 kernels, and per layer the attention part alone was four or more of
them (RoPE + padding of q, RoPE + write of k, write of v, the paged kernel, and for a split
context its merge; `benchmarks/decode.md`). This kernel does that part of a layer
in one launch, for one new token per sequence:

* it reads the fused q|k|v projection [B, N+2K, H] as it comes out of the decode layout's
  one matrix-vector product (no slices materialised between the two);
* rotates q and the new k (NeoX RoPE, pairs (x[:H/2], x[H/2:]), angles given as cos/sin);
* writes the rotated k and v into row `pos[b]` of the contiguous per-sequence cache
  [K, B, S, H] in place (the cache buffers are aliased to the outputs);
* attends the G = N/K query heads of a GQA group to positions 0 … pos[b]: the cache rows
  below pos are streamed in blocks of `block_k` tokens with an online softmax (base 2), the
  new token is taken from registers (the row just written is never read back).

Grid (B, K, splits): one program per sequence, KV head and context split (flash-decoding:
with few sequences the context is split so that the grid fills the GPU; the splits' partial
results are merged by a log-sum-exp in XLA). Split 0 writes the new row and starts from the
new token. On an H200 one program per (sequence, head) over a 320-slot cache cost 6.6 µs
per call at 350m batch 1 (8.3 µs at 1b): the loop over the context is latency, not bytes.
G = 1 (multi-head attention) runs as elementwise products and row sums; G > 1 pads the
group to 16 rows for the tensor core.

The reference is the unfused path: `apply_rope`, a row write and softmax attention in jnp
(`decode_attention_reference`). Rounding follows it: q and k are rotated in fp32 and cast
to the cache dtype before the products, which accumulate in fp32.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import (
    dot_f32,
    next_pow2,
    plgpu,
    precision_for,
    resolve_interpret,
    triton_params,
)
from pallas_kernels.paged_attention import merge_splits

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp2(_NEG - m) is 0, never nan
_LOG2E = math.log2(math.e)


def _rope(x1, x2, c, s, dtype):
    """Rotated halves (x1 c - x2 s, x2 c + x1 s) in fp32, cast to `dtype`."""
    x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    return (x1 * c - x2 * s).astype(dtype), (x2 * c + x1 * s).astype(dtype)


def _kernel(qkv_ref, pos_ref, cos_ref, sin_ref, k_in, v_in, *out_refs,
            num_heads, group, rows, block_k, split_tokens, scale_log2, precision):
    kh, split = pl.program_id(1), pl.program_id(2)
    capacity, head_dim = k_in.shape
    h2 = head_dim // 2
    dt = k_in.dtype
    pos = jnp.clip(pos_ref[0], 0, capacity - 1)
    c, s = cos_ref[...], sin_ref[...]  # [1, H/2] fp32

    # The new token's k and v (rows N + kh and N + K + kh of q|k|v), k rotated; split 0
    # writes them into the cache.
    kv_heads = (qkv_ref.shape[0] - num_heads) // 2
    k_row, v_row = num_heads + kh, num_heads + kv_heads + kh
    k1, k2 = _rope(qkv_ref[pl.ds(k_row, 1), pl.ds(0, h2)], qkv_ref[pl.ds(k_row, 1), pl.ds(h2, h2)],
                   c, s, dt)
    v_new = qkv_ref[pl.ds(v_row, 1), :].astype(dt)  # [1, H]
    o_ref, k_out, v_out = out_refs[0], out_refs[-2], out_refs[-1]

    @pl.when(split == 0)
    def _write():
        k_out[pl.ds(pos, 1), pl.ds(0, h2)] = k1
        k_out[pl.ds(pos, 1), pl.ds(h2, h2)] = k2
        v_out[pl.ds(pos, 1), :] = v_new

    # The group's query rows, rotated; rows >= group (padding for the tensor core) are 0.
    r = jnp.arange(rows, dtype=jnp.int32)
    live = r < group
    q_rows = jnp.where(live, kh * group + r, 0)[:, None]
    d2 = jnp.arange(h2, dtype=jnp.int32)[None, :]
    q1 = plgpu.load(qkv_ref.at[q_rows, d2], mask=live[:, None], other=0)
    q2 = plgpu.load(qkv_ref.at[q_rows, d2 + h2], mask=live[:, None], other=0)
    q1, q2 = _rope(q1, q2, c, s, dt)  # [rows, H/2]

    # Split 0's online softmax starts from the new token (m = its logit, l = 1, acc = its
    # v); the others start empty. Split `split` reads cache rows [lo, hi), all below pos.
    f32 = jnp.float32
    s_new = (jnp.sum(q1.astype(f32) * k1.astype(f32), axis=1)
             + jnp.sum(q2.astype(f32) * k2.astype(f32), axis=1)) * scale_log2  # [rows]
    first = (split == 0).astype(f32)  # 1.0 or 0.0 (arithmetic: Triton's select wants
    init = (jnp.broadcast_to(v_new.astype(f32) * first, (rows, head_dim)),  # equal shapes)
            s_new * first + _NEG * (1.0 - first), jnp.zeros((rows,), f32) + first)
    lo = split * split_tokens
    hi = jnp.minimum(lo + split_tokens, pos)
    t_off = jnp.arange(block_k, dtype=jnp.int32)

    def body(i, carry):
        acc, m, l = carry
        start = lo + i * block_k
        valid = start + t_off < hi
        mask_h = valid[:, None]
        ka = plgpu.load(k_in.at[pl.ds(start, block_k), pl.ds(0, h2)], mask=mask_h, other=0)
        kb = plgpu.load(k_in.at[pl.ds(start, block_k), pl.ds(h2, h2)], mask=mask_h, other=0)
        v = plgpu.load(v_in.at[pl.ds(start, block_k), :], mask=mask_h, other=0)
        if rows == 1:  # one query row: products and row sums, no tensor-core tile
            logit = (jnp.sum(ka.astype(f32) * q1.astype(f32), axis=1)
                     + jnp.sum(kb.astype(f32) * q2.astype(f32), axis=1))[None, :]
        else:
            logit = (dot_f32(q1, ka, trans_b=True, precision=precision)
                     + dot_f32(q2, kb, trans_b=True, precision=precision))
        logit = jnp.where(valid[None, :], logit * scale_log2, _NEG)  # [rows, block_k]
        m_new = jnp.maximum(m, logit.max(axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.where(valid[None, :], jnp.exp2(logit - m_new[:, None]), 0.0)
        l = l * alpha + p.sum(axis=1)
        if rows == 1:
            pv = jnp.sum(p.astype(dt).astype(f32)[0][:, None] * v.astype(f32), axis=0)[None, :]
        else:
            pv = dot_f32(p.astype(dt), v, precision=precision)
        return acc * alpha[:, None] + pv, m_new, l

    acc, m, l = lax.fori_loop(0, pl.cdiv(jnp.maximum(hi - lo, 0), block_k), body, init)
    if len(out_refs) == 3:  # one split: the normalised output
        o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)  # [rows, H], padding rows too
    else:  # per split: unnormalised output, running max and sum (`paged_attention.merge_splits`)
        m_ref, l_ref = out_refs[1], out_refs[2]
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def parse_tiling(tag: str) -> dict:
    """Keyword arguments of `decode_attention` from a tag such as "bk128_sp1_w4_st3" (block_k,
    num_splits, num_warps, num_stages; any subset, in any order; "" for the defaults)."""
    names = {"bk": "block_k", "sp": "num_splits", "w": "num_warps", "st": "num_stages"}
    out = {}
    for part in filter(None, tag.split("_")):
        key = part.rstrip("0123456789")
        if key not in names or key == part:
            raise ValueError(f"decode attention tiling {tag!r}: parts are bk<N>, sp<N>, w<N>, "
                             "st<N> joined by '_' (e.g. 'bk128_sp1_w4_st3')")
        out[names[key]] = int(part[len(key):])
    return out


def default_splits(batch: int, kv_heads: int, capacity: int, block_k: int) -> int:
    """Context splits that give about two waves of an H200's 132 SMs, at least one block of
    `block_k` cache slots per split."""
    return max(1, min(-(-capacity // block_k), 264 // (batch * kv_heads)))


def default_tiling(batch: int, kv_heads: int, capacity: int) -> dict:
    """The tiling measured best in whole decode steps on an H200 (`decode_floor.py` variants
    fast@<tiling>, `benchmarks/decode.md`): few sequences x heads: 64-slot blocks, the context
    split (`default_splits`), 4 warps, 2 stages (350m and 1b at batch 1: 0.504 and 1.101 ms
    per step, against 0.536-0.593 and 1.141-1.176 for four other tilings); enough of them to
    fill the GPU without splits: 32-slot blocks, 2 warps, 3 stages (1b at batch 64: 1.784
    against 1.934 ms)."""
    if default_splits(batch, kv_heads, capacity, 64) > 1:
        return dict(block_k=64, num_warps=4, num_stages=2)
    return dict(block_k=32, num_splits=1, num_warps=2, num_stages=3)


def supports(head_dim: int) -> bool:
    """Whether the kernel takes this head dim: a power of two >= 32 (RoPE halves of >= 16)."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0


def check(qkv_BCH, k_KBSH, v_KBSH, pos_B, cos_Bh, sin_Bh, num_heads: int):
    """Shape and dtype checks; errors name the argument and the fix."""
    B, C, H = qkv_BCH.shape
    if k_KBSH.ndim != 4 or k_KBSH.shape != v_KBSH.shape:
        raise ValueError(f"k and v caches must both be [kv_heads, batch, slots, head_dim]; got "
                         f"{k_KBSH.shape} and {v_KBSH.shape}")
    K, Bc, S, Hc = k_KBSH.shape
    if Bc != B or Hc != H:
        raise ValueError(f"cache {k_KBSH.shape} does not match q|k|v {qkv_BCH.shape} "
                         "(batch and head_dim must agree)")
    if num_heads % K or C != num_heads + 2 * K:
        raise ValueError(f"q|k|v has {C} heads; expected num_heads + 2 * kv_heads = "
                         f"{num_heads} + 2 * {K} with num_heads a multiple of kv_heads")
    if not supports(H):
        raise ValueError(f"head_dim={H} must be a power of two >= 32 (two halves of >= 16 for "
                         "RoPE tiles); use the unfused path (LayerKVCache(fused=False))")
    if pos_B.shape != (B,) or cos_Bh.shape != (B, H // 2) or sin_Bh.shape != (B, H // 2):
        raise ValueError(f"pos must be [batch]={B} and cos/sin [batch, head_dim/2]=({B}, {H // 2}); "
                         f"got {pos_B.shape}, {cos_Bh.shape}, {sin_Bh.shape}")


@functools.partial(jax.jit, static_argnames=("num_heads", "sm_scale", "block_k", "num_splits",
                                             "num_warps", "num_stages", "interpret"))
def decode_attention(qkv_BCH, k_KBSH, v_KBSH, pos_B, cos_Bh, sin_Bh, *, num_heads: int,
                     sm_scale: float | None = None, block_k: int | None = None,
                     num_splits: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, interpret: bool | None = None):
    """(o [B, N, H], k cache, v cache) after writing the new token's rotated k and its v at
    `pos_B` and attending each sequence's new token to positions 0 … pos_B[b].

    qkv_BCH: the fused projection of the new tokens, rows q (N heads), k (K), v (K);
    k_KBSH, v_KBSH: the caches [K, B, S, H] (updated in place when donated by the caller's
    jit); pos_B int32: where each new token goes (clamped to [0, S)); cos_Bh, sin_Bh fp32
    [B, H/2]: the RoPE angles of the new tokens (`gendist.models.layers.rope_angles`).
    num_splits: programs per (sequence, KV head) over the context (flash-decoding, Dao et
    al. 2023), merged in XLA. Tiling arguments left None come from `default_tiling`
    (num_splits then from `default_splits`).
    """
    check(qkv_BCH, k_KBSH, v_KBSH, pos_B, cos_Bh, sin_Bh, num_heads)
    B, C, H = qkv_BCH.shape
    K, _, S, _ = k_KBSH.shape
    given = dict(block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                 num_stages=num_stages)
    tiling = {**default_tiling(B, K, S), **{k: v for k, v in given.items() if v is not None}}
    block_k, num_warps, num_stages = tiling["block_k"], tiling["num_warps"], tiling["num_stages"]
    num_splits = tiling.get("num_splits")
    group = num_heads // K
    rows = 1 if group == 1 else max(16, next_pow2(group))
    scale = 1.0 / math.sqrt(H) if sm_scale is None else float(sm_scale)
    splits = num_splits or default_splits(B, K, S, block_k)
    split_tokens = -(-S // (splits * block_k)) * block_k
    splits = -(-S // split_tokens)  # none empty by construction
    kernel = functools.partial(_kernel, num_heads=num_heads, group=group, rows=rows,
                               block_k=block_k, split_tokens=split_tokens,
                               scale_log2=scale * _LOG2E, precision=precision_for(k_KBSH.dtype))
    cache_spec = pl.BlockSpec((None, None, S, H), lambda b, k, s: (k, b, 0, 0))
    cache_shape = jax.ShapeDtypeStruct(k_KBSH.shape, k_KBSH.dtype)
    if splits == 1:
        o_specs = [pl.BlockSpec((None, None, rows, H), lambda b, k, s: (b, k, 0, 0))]
        o_shapes = [jax.ShapeDtypeStruct((B, K, rows, H), k_KBSH.dtype)]
    else:
        row_spec = pl.BlockSpec((None, None, None, rows), lambda b, k, s: (s, b, k, 0))
        o_specs = [pl.BlockSpec((None, None, None, rows, H), lambda b, k, s: (s, b, k, 0, 0)),
                   row_spec, row_spec]
        o_shapes = [jax.ShapeDtypeStruct((splits, B, K, rows, H), jnp.float32),
                    jax.ShapeDtypeStruct((splits, B, K, rows), jnp.float32),
                    jax.ShapeDtypeStruct((splits, B, K, rows), jnp.float32)]
    n_o = len(o_shapes)
    *o, k_new, v_new = pl.pallas_call(
        kernel, grid=(B, K, splits),
        in_specs=[pl.BlockSpec((None, C, H), lambda b, k, s: (b, 0, 0)),
                  pl.BlockSpec((1,), lambda b, k, s: (b,)),
                  pl.BlockSpec((1, H // 2), lambda b, k, s: (b, 0)),
                  pl.BlockSpec((1, H // 2), lambda b, k, s: (b, 0)),
                  cache_spec, cache_spec],
        out_specs=[*o_specs, cache_spec, cache_spec],
        out_shape=[*o_shapes, cache_shape, cache_shape],
        input_output_aliases={4: n_o, 5: n_o + 1},
        interpret=resolve_interpret(interpret),
        name=f"decode_attention_bk{block_k}_splits{splits}",
        compiler_params=triton_params(num_warps, num_stages),
    )(qkv_BCH, pos_B.astype(jnp.int32), cos_Bh.astype(jnp.float32), sin_Bh.astype(jnp.float32),
      k_KBSH, v_KBSH)
    o_BKRH = o[0] if splits == 1 else merge_splits(*o).astype(k_KBSH.dtype)
    return o_BKRH[:, :, :group].reshape(B, num_heads, H), k_new, v_new


def rope_reference(x_XH, cos_Xh, sin_Xh, dtype):
    """NeoX RoPE in jnp: the halves of x's last axis rotated in fp32 by angles that broadcast
    against them, cast to `dtype` (the kernels' rounding)."""
    x, h2 = x_XH.astype(jnp.float32), x_XH.shape[-1] // 2
    return jnp.concatenate([x[..., :h2] * cos_Xh - x[..., h2:] * sin_Xh,
                            x[..., h2:] * cos_Xh + x[..., :h2] * sin_Xh], -1).astype(dtype)


def decode_attention_reference(qkv_BCH, k_KBSH, v_KBSH, pos_B, cos_Bh, sin_Bh, *,
                               num_heads: int, sm_scale: float | None = None):
    """The unfused math in jnp: rotate, write row pos, softmax over positions <= pos."""
    B, C, H = qkv_BCH.shape
    K, _, S, _ = k_KBSH.shape
    dt = k_KBSH.dtype
    scale = 1.0 / math.sqrt(H) if sm_scale is None else float(sm_scale)

    rot = lambda x_BXH: rope_reference(x_BXH, cos_Bh[:, None, :], sin_Bh[:, None, :], dt)  # noqa: E731
    q = rot(qkv_BCH[:, :num_heads])
    k = rot(qkv_BCH[:, num_heads:num_heads + K])
    v = qkv_BCH[:, num_heads + K:].astype(dt)
    pos = jnp.clip(pos_B, 0, S - 1)
    b = jnp.arange(B)
    k_KBSH = k_KBSH.at[:, b, pos].set(jnp.moveaxis(k, 1, 0))
    v_KBSH = v_KBSH.at[:, b, pos].set(jnp.moveaxis(v, 1, 0))
    group = num_heads // K
    q_BKGH = q.reshape(B, K, group, H)
    hi = jax.lax.Precision.HIGHEST  # XLA would use TF32 for fp32 on a GPU
    logits = jnp.einsum("bkgh,kbsh->bkgs", q_BKGH, k_KBSH, precision=hi,
                        preferred_element_type=jnp.float32) * scale
    seen = jnp.arange(S)[None, :] <= pos[:, None]  # [B, S]
    logits = jnp.where(seen[:, None, None, :], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    v_seen = jnp.where(seen[None, :, :, None], v_KBSH, 0)  # slots past pos are never read
    o = jnp.einsum("bkgs,kbsh->bkgh", p.astype(dt), v_seen, precision=hi,
                   preferred_element_type=jnp.float32)
    return o.reshape(B, num_heads, H).astype(dt), k_KBSH, v_KBSH
