"""The fused backward kernel of Mosaic GPU FlashAttention: dQ, dK and dV from one pass.

`flash_attention_mgpu_bwd.py` runs two kernels, dQ (S, dP, dQ += dS K: 3 tile matmuls) and
dK/dV (S^T, dP^T, dV += P^T dO, dK += dS^T Q: 4), so S and dP are computed twice: 7 tile
matmuls per (query tile, key tile) pair. Here the dK/dV kernel also computes that pair's
share of dQ, dS K, from the dS^T it already has (staged in shared memory and read there
transposed): 5 matmuls, as FlashAttention-2/3 do (Dao 2023; Shah et al. 2024). Every key
block adds into every query row's dQ, so dQ is summed in fp32 in global memory: on the GPU
by TMA reduce-add copies (`cp.reduce.async.bulk`) into one zero-initialised buffer; the CPU
interpreter has no TMA reductions, so there each consumer warpgroup of each key block copies
its share into a slot of its own and XLA sums the slots (same kernel, same math, more memory).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mgpu import COL, LOG2E, ROW, launch, tiled_smem
from pallas_kernels.flash_attention_mgpu_common import (
    COMPUTE_WGS,
    MosaicConfig,
    bcast_cols,
    bcast_rows,
    cdiv,
    consumers,
    drain,
    iota,
    own_tiles,
    producer,
    unpack,
    visible,
    with_segments,
)


def backward_fused(cfg: MosaicConfig, q, k, v, qoff, q_seg, kv_seg, lse, do, delta):
    """(dQ [B, q_pad, N, D], dK, dV [B, kv_pad, K, D]) on padded inputs: per key tile, over
    every query tile and every query head of its group, the dK/dV kernel's steps plus
    dQ[query tile] += dS K (summed over the key tiles in fp32, see the module docstring)."""
    b, tp, n, d = q.shape
    sp, kh = k.shape[1], k.shape[2]
    bq, bk, st = cfg.blocks.block_q_dkv, cfg.blocks.block_kv_dkv, cfg.blocks.stages_bwd
    dtype, g = q.dtype, cfg.groups
    n_kt, n_q = sp // (COMPUTE_WGS * bk), tp // bq
    scale2 = cfg.sm_scale * LOG2E
    atomic = not cfg.interpret  # TMA reduce-add into one buffer (the interpreter has none)

    def kernel(*refs):
        qoff_ref, ins, qseg_ref, kvseg_ref, rest = unpack(refs, cfg, 8)
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = ins
        dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem = rest[:8]
        ds_smem, dq_smem, kv_bar, q_bar, do_bar, free = rest[8:]
        ki, kvh = lax.axis_index("k"), lax.axis_index("h")
        bi, wg = lax.axis_index("b"), lax.axis_index("wg")
        q_off = qoff_ref[0]
        block_lo = ki * (COMPUTE_WGS * bk)
        block_hi = block_lo + COMPUTE_WGS * bk - 1
        # Steps run over (query tile i, group head j), j fastest; step = i * g + j.
        if cfg.causal:  # query tiles ending before the block's first key see none of it
            i_start = jnp.minimum(lax.div(jnp.maximum(block_lo - q_off, 0), bq), n_q)
            i_full = jnp.maximum(jnp.minimum(cdiv(jnp.maximum(block_hi - q_off, 0), bq), n_q), i_start)
        else:
            i_start, i_full = 0, 0
        if cfg.segments:
            i_full = n_q
        s_start, s_full, s_end = i_start * g, i_full * g, n_q * g

        @consumers(wg)
        def _consumer():
            k_row = block_lo + wg * bk
            rows, (k_tile, v_tile) = own_tiles([(k_ref, k_smem), (v_ref, v_smem)], wg, k_row,
                                               bk, bi, kvh, kv_bar)
            ds_tile, dq_tile = ds_smem.at[wg], dq_smem.at[wg]
            kv_seg = None
            if cfg.segments:
                kv_seg = plgpu.load(kvseg_ref.at[bi, rows], layout=ROW, optimized=False)
            plgpu.barrier_wait(kv_bar.at[wg])

            def run(dk_acc, dv_acc):
                def step(s_idx, carry, masked: bool):
                    slot = lax.rem(s_idx - s_start, st)
                    i, j = lax.div(s_idx, jnp.int32(g)), lax.rem(s_idx, jnp.int32(g))
                    plgpu.barrier_wait(q_bar.at[slot])

                    def st_scoped(acc):
                        plgpu.wgmma(acc, k_tile, q_smem.at[slot].transpose((1, 0)))
                        return acc[...]

                    s_t = pl.run_scoped(st_scoped, plgpu.ACC((bk, bq), jnp.float32))
                    lse_c = plgpu.load(lse_smem.at[slot], layout=COL)
                    if masked:
                        q_seg = None
                        if cfg.segments:
                            q_seg = bcast_cols(plgpu.load(qseg_ref.at[bi, pl.ds(i * bq, bq)],
                                                           layout=COL, optimized=False), s_t.shape)
                        ok = visible(cfg, q_off + i * bq + iota(s_t.shape, 1), k_row + iota(s_t.shape, 0),
                                      q_seg, None if kv_seg is None else bcast_rows(kv_seg, s_t.shape),
                                      length=False)  # padded keys' rows are zero: they add 0 to dQ
                        s_t = jnp.where(ok, s_t, -jnp.inf)
                    p_t = jnp.exp2(s_t * scale2 - bcast_cols(lse_c, s_t.shape))
                    p16 = p_t.astype(dtype)
                    plgpu.barrier_wait(do_bar.at[slot])
                    if cfg.regs:
                        def dp_scoped(acc):
                            plgpu.wgmma(acc, v_tile, do_smem.at[slot].transpose((1, 0)))
                            plgpu.wgmma(dv_acc, p16, do_smem.at[slot])
                            return plgpu.wgmma_accumulator_load(acc, wait_n=1)  # dP^T, not dV
                    else:
                        ds_tile[...] = p16  # P^T staged for the interpreter
                        plgpu.commit_smem()

                        def dp_scoped(acc):
                            plgpu.wgmma(acc, v_tile, do_smem.at[slot].transpose((1, 0)))
                            plgpu.wgmma(dv_acc, ds_tile, do_smem.at[slot])
                            plgpu.wgmma_wait(0)
                            return acc[...]

                    dp_t = pl.run_scoped(dp_scoped, plgpu.ACC((bk, bq), jnp.float32))
                    delta_c = plgpu.load(delta_smem.at[slot], layout=COL)
                    ds_t = (p_t * (dp_t - bcast_cols(delta_c, s_t.shape))).astype(dtype)
                    plgpu.wgmma_wait(0)  # dV's matmul has read P^T (from registers or ds_tile)
                    ds_tile[...] = ds_t  # dS^T: the left operand of dK, and read transposed, of dQ
                    plgpu.commit_smem()

                    def dk_dq_scoped(dq_acc):
                        plgpu.wgmma(dk_acc, ds_tile, q_smem.at[slot])  # dK += dS^T Q
                        plgpu.wgmma(dq_acc, ds_tile.transpose((1, 0)), k_tile)  # dQ_i = dS K
                        plgpu.wgmma_wait(0)
                        return dq_acc[...]

                    dq = pl.run_scoped(dk_dq_scoped, plgpu.ACC((bq, d), jnp.float32))
                    plgpu.barrier_arrive(free.at[slot])  # Q, dO, LSE, delta of this slot are read
                    h = kvh * g + j
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's dQ has left
                    dq_tile[...] = dq
                    plgpu.commit_smem()
                    q_rows = pl.ds(i * bq, bq)
                    if atomic:
                        plgpu.copy_smem_to_gmem(dq_tile, dq_ref.at[bi, q_rows, h], reduction_op="add")
                    else:
                        plgpu.copy_smem_to_gmem(dq_tile, dq_ref.at[ki * COMPUTE_WGS + wg, bi, q_rows, h])
                    return carry

                if cfg.causal or cfg.segments:
                    lax.fori_loop(s_start, s_full, functools.partial(step, masked=True), 0)
                lax.fori_loop(s_full, s_end, functools.partial(step, masked=False), 0)
                return dk_acc[...], dv_acc[...]

            acc_t = plgpu.ACC((bk, d), jnp.float32)
            dk, dv = pl.run_scoped(run, acc_t, acc_t)
            k_tile[...] = (dk * cfg.sm_scale).astype(dtype)
            v_tile[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[bi, rows, kvh], commit_group=False)
            plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[bi, rows, kvh], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

        @producer(wg)
        def _producer():

            @pl.loop(s_start, s_end)
            def _(s_idx):
                slot = lax.rem(s_idx - s_start, st)
                i, j = lax.div(s_idx, jnp.int32(g)), lax.rem(s_idx, jnp.int32(g))
                h = kvh * g + j
                rows = pl.ds(i * bq, bq)

                @pl.when(s_idx - s_start >= st)
                def _():
                    plgpu.barrier_wait(free.at[slot])

                plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, h], q_smem.at[slot], q_bar.at[slot])
                plgpu.copy_gmem_to_smem(lse_ref.at[bi, h, rows], lse_smem.at[slot], q_bar.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, h], do_smem.at[slot], do_bar.at[slot])
                plgpu.copy_gmem_to_smem(delta_ref.at[bi, h, rows], delta_smem.at[slot], do_bar.at[slot])

            drain(s_end - s_start, st, free)

    w = COMPUTE_WGS
    scratch = (
        tiled_smem((w, bk, d), dtype),  # K tiles, then dK tiles
        tiled_smem((w, bk, d), dtype),  # V tiles, then dV tiles
        tiled_smem((st, bq, d), dtype),  # Q
        tiled_smem((st, bq, d), dtype),  # dO
        plgpu.SMEM((st, bq), jnp.float32),  # LSE
        plgpu.SMEM((st, bq), jnp.float32),  # delta
        tiled_smem((w, bk, bq), dtype),  # dS^T (and P^T when staged)
        tiled_smem((w, bq, d), jnp.float32),  # this step's dQ share on its way out
        plgpu.Barrier(num_arrivals=2, num_barriers=w),  # K and V loaded
        plgpu.Barrier(num_arrivals=2, num_barriers=st),  # Q and LSE slot filled
        plgpu.Barrier(num_arrivals=2, num_barriers=st),  # dO and delta slot filled
        plgpu.Barrier(num_arrivals=w, num_barriers=st),  # slot free again
    )
    dq_shape = (b, tp, n, d) if atomic else (n_kt * w, b, tp, n, d)
    dq_acc = jax.new_ref(jnp.zeros(dq_shape, jnp.float32))
    args = with_segments(cfg, [qoff, q, k, v, do, lse, delta, dq_acc], q_seg, kv_seg)
    out = jax.ShapeDtypeStruct((b, sp, kh, d), dtype)
    dk, dv = launch(kernel, args, out_type=(out, out), scratch=scratch,
                    grid=(n_kt, kh, b), grid_names=("k", "h", "b"), num_threads=w + 1,
                    interpret=cfg.interpret, manual_barriers=cfg.blocks.manual_barriers_bwd)
    dq = jax.freeze(dq_acc)
    if not atomic:
        dq = dq.sum(axis=0)
    return (dq * cfg.sm_scale).astype(dtype), dk, dv
