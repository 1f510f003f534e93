"""FlashAttention for Hopper (sm90) in Pallas Mosaic GPU: the differentiable entry point.

The kernels live in `flash_attention_mgpu_fwd.py` (forward) and `flash_attention_mgpu_bwd.py`
(dQ, dK/dV), their tile sizes, static config and shared body helpers in
`flash_attention_mgpu_common.py`; this module pads, wires them into a `custom_vjp` and checks
the inputs.

The structure is FlashAttention-3's (Shah et al. 2024): every thread block runs three
warpgroups. A producer warpgroup, cut to 40 registers (24 in the fused backward), streams K/V
tiles (forward, dQ) or Q/dO/LSE/delta tiles (dK/dV) into a ring of shared-memory slots with TMA
bulk copies that complete on barriers; two consumer warpgroups, raised to 232 registers (240 in
the fused backward, FlashAttention-3's split), each own 64 query
(or key) rows and run the tile matmuls on the tensor core with `wgmma`, freeing a slot
through a "consumed" barrier that the producer waits on before refilling it. In the forward
pass the two consumers ping-pong (on two hardware named barriers when compiling, an
mbarrier in the interpreter) so that one's softmax (exp2 on the multi-function unit)
overlaps the other's matmuls, and P is fed to the second matmul from registers. The forward
grid is persistent: one block per SM loops over the query tiles,
its next tile's loads under this tile's epilogue (with a causal mask, over pairs of one head's tiles
whose key steps sum to the same, at head dim 128: `TileSchedule`); at head dim 128 up to 2k keys the dQ kernel runs on the same
schedule (the dK/dV kernel can, `persistent_dkv`, but measured slower). The kernels set their own barriers
(`_mgpu.launch(manual_barriers=True)`), checked by the interpreter's race detector in the
tests; each kernel ends waiting only until its last TMA stores have read shared memory.
Causal tiles above the diagonal are never loaded; only the diagonal tiles, the ragged last
key tile and (with segment ids) every tile run the masked step; in the two backward kernels
each consumer computes only the steps its own 64 rows see and passes the rest of its block's
ring (`own_causal_steps`).

The algorithm is the one of `flash_attention.py` (online softmax in base 2, LSE saved,
probabilities recomputed in the backward pass, delta = rowsum(dO * O) computed once per query
row: by the dQ kernel from O rows it loads beside dO, `delta_in_dq`, and else by XLA): the
public entry point there dispatches here on an sm90 GPU for bf16/fp16 with head dim 64 or
128, and keeps the Triton kernels as the portable path. Grouped-query attention: the dK/dV
kernel loops over every query head of its K/V head, so dK and dV are summed in the kernel.
`MosaicBlockSizes(fused_bwd=True)` computes dQ in that kernel too (5 tile matmuls a pair
instead of 7, dQ summed by TMA reduce-add: `backward_dkv(with_dq=True)`); by default it runs
at head dim 128 from 8k keys on, where it measured faster on the H200, and the two kernels
elsewhere. `ds_in_hbm` trades memory for the dQ kernel's recomputation: the dK/dV kernel
stores every dS^T tile (bf16) to global memory and a memory-bound kernel computes dQ = dS K
from them (`backward_dq_from_ds`; 6 tile matmuls a pair, delta by XLA). Its buffer is
batch x heads x keys x queries x 2 bytes, O(S^2) like attention without FlashAttention, so by
default it runs only when that is at most 4 GiB (compiling, head dim 128), and before the
fused backward's rule: the 1b step's 2k x 24 x 16 heads (3.2 GB), not 16k (8.6 GB a sequence).

Sequences are padded to whole tiles (keys past kv_len are masked, padded query rows get
dO = 0), so any length runs. `regs=False` stages P and dS through shared memory instead of
registers: slower, but Mosaic GPU's CPU interpreter runs it (see `_mgpu.py`).
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_kernels._flash_vjp import make_flash, pad_seq
from pallas_kernels._mgpu import sm_count
from pallas_kernels.flash_attention_mgpu_bwd import backward_dkv, backward_dq, backward_dq_from_ds
from pallas_kernels.flash_attention_mgpu_common import MosaicBlockSizes, MosaicConfig
from pallas_kernels.flash_attention_mgpu_fwd import forward

SUPPORTED_HEAD_DIMS = (64, 128)
INTERPRET_SMS = 2  # the persistent grid in the interpreter: 2 blocks, so each runs several tiles
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)


def _padded(cfg: MosaicConfig, q, k, v, q_seg, kv_seg):
    q, k, v = pad_seq(q, cfg.q_pad), pad_seq(k, cfg.kv_pad), pad_seq(v, cfg.kv_pad)
    return q, k, v, pad_seq(q_seg, cfg.q_pad, -1), pad_seq(kv_seg, cfg.kv_pad, -2)


def _backward(cfg: MosaicConfig, q, k, v, qoff, q_seg, kv_seg, lse, do, delta, o):
    if cfg.blocks.fused_bwd:
        return backward_dkv(cfg, q, k, v, qoff, q_seg, kv_seg, lse, do, delta(), with_dq=True)
    if cfg.blocks.ds_in_hbm:  # dK/dV (and dS^T out), then dQ = dS K
        dk, dv, ds_t = backward_dkv(cfg, q, k, v, qoff, q_seg, kv_seg, lse, do, delta(), ds_out=True)
        return backward_dq_from_ds(cfg, k, ds_t, qoff, q.shape, q.dtype), dk, dv
    if cfg.delta_in_dq:  # the dQ kernel computes delta from the O rows it loads beside dO
        dq, delta_p = backward_dq(cfg, q, k, v, qoff, q_seg, kv_seg, lse, do, None, o=o)
    else:
        delta_p = delta()
        dq = backward_dq(cfg, q, k, v, qoff, q_seg, kv_seg, lse, do, delta_p)
    dk, dv = backward_dkv(cfg, q, k, v, qoff, q_seg, kv_seg, lse, do, delta_p)
    return dq, dk, dv


_flash_jit = make_flash(_padded, forward, _backward)  # jitted, cfg static


def supports(dtype, head_dim: int) -> bool:
    """Whether these kernels take inputs of this dtype and head dim."""
    return jnp.dtype(dtype) in map(jnp.dtype, SUPPORTED_DTYPES) and head_dim in SUPPORTED_HEAD_DIMS


def flash_attention_mgpu(q_BTNH, k_BSKH, v_BSKH, *, causal: bool = False,
                         sm_scale: float | None = None, q_offset=0, q_segment_ids=None,
                         kv_segment_ids=None, block_sizes: MosaicBlockSizes | None = None,
                         regs: bool | None = None, interpret: bool = False):
    """Mosaic GPU FlashAttention with `flash_attention.flash_attention`'s semantics.

    Inputs are checked by the caller (`flash_attention` dispatches here); its oracle is
    `flash_attention.mha_reference`. q_segment_ids [batch, q_len] and kv_segment_ids
    [batch, kv_len] int32 go together. interpret=True runs Mosaic GPU's CPU interpreter;
    regs=None feeds P/dS from registers when compiling and through shared memory when
    interpreting.
    """
    t, n, h = q_BTNH.shape[1:]
    s, kh = k_BSKH.shape[1:3]
    if not supports(q_BTNH.dtype, h):
        raise ValueError(f"flash_attention_mgpu: dtype {q_BTNH.dtype} / head_dim={h} unsupported; "
                         f"use one of {SUPPORTED_DTYPES} with head_dim in {SUPPORTED_HEAD_DIMS}.")
    blocks = block_sizes or MosaicBlockSizes.for_head_dim(h)
    regs = (not interpret) if regs is None else bool(regs)
    b = q_BTNH.shape[0]
    blocks = dataclasses.replace(blocks, ds_in_hbm=blocks.resolve_ds_in_hbm(
        h, regs, b * n, t, s, jnp.dtype(q_BTNH.dtype).itemsize))
    blocks = dataclasses.replace(blocks, fused_bwd=blocks.resolve_fused_bwd(h, s, regs))
    persistent = blocks.resolve_persistent(h, regs, bool(causal), t)
    persistent_dq = blocks.resolve_persistent_dq(h, regs, bool(causal), t, s)
    persistent_dkv = blocks.resolve_persistent_dkv(h, regs)
    blocks.check_smem(h, regs, persistent, persistent_dq, persistent_dkv)
    cfg = MosaicConfig(
        causal=bool(causal), sm_scale=float(1 / math.sqrt(h) if sm_scale is None else sm_scale),
        blocks=blocks, q_len=t, kv_len=s, groups=n // kh,
        segments=q_segment_ids is not None, regs=regs, interpret=bool(interpret),
        persistent=persistent, persistent_dq=persistent_dq, persistent_dkv=persistent_dkv,
        sms=INTERPRET_SMS if interpret else sm_count())
    qoff = jnp.asarray(q_offset, jnp.int32).reshape(1)
    q_seg = kv_seg = None
    if cfg.segments:
        q_seg, kv_seg = q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)
    return _flash_jit(cfg, q_BTNH, k_BSKH, v_BSKH, qoff, q_seg, kv_seg)
