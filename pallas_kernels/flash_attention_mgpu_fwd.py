"""The forward kernel of Mosaic GPU FlashAttention (`flash_attention_mgpu.py` has the design):
O and the base-2 LSE, two consumer warpgroups ping-ponging over a ring of K/V tiles.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mgpu import COL, LN2, LOG2E, ROW, launch, softmax_start, tiled_smem
from pallas_kernels.flash_attention_mgpu_common import (
    COMPUTE_WGS,
    MosaicConfig,
    bcast_cols,
    bcast_rows,
    consumers,
    iota,
    kv_steps,
    needs_mask,
    producer,
    stream_kv,
    unpack,
    visible,
    with_segments,
)


def forward(cfg: MosaicConfig, q, k, v, qoff, q_seg, kv_seg):
    """O [B, q_pad, N, D] and the base-2 LSE [B, N, q_pad] on padded inputs."""
    b, tp, n, d = q.shape
    bq, bk, st = cfg.blocks.block_q, cfg.blocks.block_kv, cfg.blocks.stages
    dtype, g = q.dtype, cfg.groups
    n_qt = tp // (COMPUTE_WGS * bq)
    scale2 = cfg.sm_scale * LOG2E  # logits in base 2: exp(x) = exp2(x * log2 e)

    def kernel(*refs):
        qoff_ref, (q_ref, k_ref, v_ref), qseg_ref, kvseg_ref, rest = unpack(refs, cfg, 4)
        o_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem, p_smem = rest[:7]
        q_bar, k_bar, v_bar, k_free, v_free, sched = rest[7:]
        qi = lax.axis_index("q")
        if cfg.causal:  # the longest rows first: a better tail
            qi = n_qt - 1 - qi
        h, bi, wg = lax.axis_index("h"), lax.axis_index("b"), lax.axis_index("wg")
        q_off = qoff_ref[0]
        block_lo = qi * (COMPUTE_WGS * bq)
        n_full, n_end = kv_steps(cfg, q_off + block_lo, q_off + block_lo + COMPUTE_WGS * bq - 1, bk)

        def schedule():  # the two consumers alternate: one's softmax under the other's matmuls
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        @consumers(wg)
        def _consumer():
            q_row = block_lo + wg * bq
            q_tile = q_smem.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q_row, bq), h], q_tile, q_bar.at[wg])
            q_seg = None
            if cfg.segments:
                q_seg = plgpu.load(qseg_ref.at[bi, pl.ds(q_row, bq)], layout=ROW, optimized=False)
            plgpu.barrier_wait(q_bar.at[wg])
            plgpu.barrier_wait(k_bar.at[0])
            pl.when(wg == 1)(schedule)

            def step(j, carry, masked: bool):
                acc, m, l = carry
                slot = lax.rem(j, st)

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                    schedule()
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    kv_seg = None
                    if cfg.segments:
                        kv_seg = bcast_cols(plgpu.load(kvseg_ref.at[bi, pl.ds(j * bk, bk)],
                                                        layout=COL, optimized=False), s.shape)
                    ok = visible(cfg, q_off + q_row + iota(s.shape, 0), j * bk + iota(s.shape, 1),
                                  None if q_seg is None else bcast_rows(q_seg, s.shape), kv_seg,
                                  length=cfg.kv_len % bk != 0)
                    s = jnp.where(ok, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1) * scale2)
                # A row that has seen no key keeps m = -inf; shift it by 0 so exp2 gives 0.
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
                alpha = jnp.exp2(m - m_use)  # rescales what was summed under the old max
                p = jnp.exp2(s * scale2 - bcast_rows(m_use, s.shape))
                acc = acc * bcast_rows(alpha, acc.shape)
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                plgpu.barrier_arrive(sched)  # softmax done: let the other consumer's matmul go
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_wait(sched)  # the tensor core is ours again

                def wait_next_k():
                    @pl.when(j + 1 < n_end)
                    def _():
                        plgpu.barrier_wait(k_bar.at[lax.rem(j + 1, st)])

                if cfg.regs:
                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                        wait_next_k()

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                else:
                    p_tile = p_smem.at[wg]
                    p_tile[...] = p16
                    plgpu.commit_smem()

                    def pv_scoped(acc_ref):
                        plgpu.wgmma(acc_ref, p_tile, v_smem.at[slot])
                        wait_next_k()
                        return acc_ref[...]

                    acc = acc + pl.run_scoped(pv_scoped, plgpu.ACC((bq, d), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            carry = softmax_start(bq, d)
            carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
            if needs_mask(cfg, bk):
                carry = lax.fori_loop(n_full, n_end, functools.partial(step, masked=True), carry)
            acc, m, l = carry
            pl.when(wg == 0)(schedule)

            seen = l > 0.0  # rows with no visible key give 0 and an LSE of +inf (P = 0 later)
            inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
            q_tile[...] = (acc * bcast_rows(inv, acc.shape)).astype(dtype)
            lse_smem.at[wg][...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)) * (1 / LN2),
                                             jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_tile, o_ref.at[bi, pl.ds(q_row, bq), h])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[bi, h, pl.ds(q_row, bq)])
            plgpu.wait_smem_to_gmem(0)

        @producer(wg)
        def _producer():
            stream_kv(k_ref, v_ref, k_smem, v_smem, k_bar, v_bar, k_free, v_free, bi=bi,
                      kvh=lax.div(h, jnp.int32(g)), n_steps=n_end, bk=bk, stages=st)

    w = COMPUTE_WGS
    scratch = (
        tiled_smem((w, bq, d), dtype),  # Q tiles, then O tiles
        tiled_smem((st, bk, d), dtype),
        tiled_smem((st, bk, d), dtype),
        plgpu.SMEM((w, bq), jnp.float32),  # LSE rows
        None if cfg.regs else tiled_smem((w, bq, bk), dtype),  # P, when staged in smem
        plgpu.Barrier(num_barriers=w),  # Q loaded
        plgpu.Barrier(num_barriers=st),  # K slot filled
        plgpu.Barrier(num_barriers=st),  # V slot filled
        plgpu.Barrier(num_arrivals=w, num_barriers=st),  # K slot free again
        plgpu.Barrier(num_arrivals=w, num_barriers=st),  # V slot free again
        plgpu.Barrier(num_arrivals=w),  # consumers' schedule
    )
    args = with_segments(cfg, [qoff, q, k, v], q_seg, kv_seg)
    return launch(kernel, args, out_type=(jax.ShapeDtypeStruct((b, tp, n, d), dtype),
                                          jax.ShapeDtypeStruct((b, n, tp), jnp.float32)),
                  scratch=scratch, grid=(n_qt, n, b), grid_names=("q", "h", "b"),
                  num_threads=w + 1, interpret=cfg.interpret)
