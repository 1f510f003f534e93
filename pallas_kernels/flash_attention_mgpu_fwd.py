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

from pallas_kernels._mgpu import (
    LN2,
    LOG2E,
    ROW,
    launch,
    named_barrier,
    softmax_start,
    tiled_smem,
)
from pallas_kernels.flash_attention_mgpu_common import (
    COMPUTE_WGS,
    MosaicConfig,
    TileSchedule,
    bcast_rows,
    consumers,
    end_wait,
    kv_steps,
    mask_rows_by_keys,
    needs_mask,
    own_tiles_at,
    producer,
    stream_tiles_kv,
    unpack,
    with_segments,
)

_SCHED_BARRIER = 4  # hardware named barriers 4 and 5: the consumers' turns (named_schedule)


class PingPong:
    """The two consumers' turns on the tensor core, so that one's softmax runs under the
    other's matmuls. Named form (FlashAttention-3's; `sched` None): consumer w waits its turn
    on hardware barrier 4 + w, which the other consumer's arrival opens. mbarrier form (the
    interpreter's): one barrier of two arrivals that both consumers meet on."""

    def __init__(self, wg, sched):
        self.wg, self.sched = wg, sched

    def _meet(self):
        plgpu.barrier_arrive(self.sched)
        plgpu.barrier_wait(self.sched)

    def _let_other_go(self):
        named_barrier("arrive", _SCHED_BARRIER + 1 - self.wg, 2 * 128)

    def start(self):  # consumer 1 lets consumer 0 take the first turn
        pl.when(self.wg == 1)(self.wait_turn if self.sched is None else self._meet)

    def matmul_issued(self):  # after Q K^T is issued
        (self._let_other_go if self.sched is None else self._meet)()

    def softmax_done(self):
        if self.sched is not None:
            plgpu.barrier_arrive(self.sched)

    def wait_turn(self):  # before P V is issued
        if self.sched is None:
            named_barrier("sync", _SCHED_BARRIER + self.wg, 2 * 128)
        else:
            plgpu.barrier_wait(self.sched)

    def end(self):  # consumer 0 gives the last turn back: both made the same number of calls
        pl.when(self.wg == 0)(self._let_other_go if self.sched is None else self._meet)


def forward(cfg: MosaicConfig, q, k, v, qoff, q_seg, kv_seg):
    """O [B, q_pad, N, D] and the base-2 LSE [B, N, q_pad] on padded inputs.

    A tile is 2 x block_q query rows of one (batch, head): consumer warpgroup w owns rows
    w * block_q of it. Without `cfg.persistent` the grid has one block per tile. With it the
    grid has `cfg.sms` blocks and block i runs tiles i, i + sms, ... (in (batch, head, q tile)
    order, so neighbouring SMs stream the same K/V through L2; with a causal mask pairs of
    one head's tiles: `TileSchedule`): the K/V ring and every barrier carry on from one tile
    to the next, the next tile's Q copy is issued as soon as this tile's last Q K^T is done,
    and O leaves through its own shared tile, so the next tile's loads run under this tile's
    epilogue instead of after it (FlashAttention-3's persistent schedule).
    """
    b, tp, n, d = q.shape
    bq, bk, st = cfg.blocks.block_q, cfg.blocks.block_kv, cfg.blocks.stages
    dtype, g = q.dtype, cfg.groups
    n_qt = tp // (COMPUTE_WGS * bq)
    order = TileSchedule(b, n, n_qt, cfg.causal, cfg.persistent, cfg.sms)
    scale2 = cfg.sm_scale * LOG2E  # logits in base 2: exp(x) = exp2(x * log2 e)

    def kernel(*refs):
        qoff_ref, (q_ref, k_ref, v_ref), qseg_ref, kvseg_ref, rest = unpack(refs, cfg, 4)
        o_ref, lse_ref, q_smem, o_smem, k_smem, v_smem, lse_smem, p_smem = rest[:8]
        if o_smem is None:  # one tile per block: O leaves through the Q tile
            o_smem = q_smem
        q_bar, k_bar, v_bar, k_free, v_free, sched = rest[8:]
        wg = lax.axis_index("wg")
        q_off = qoff_ref[0]
        blk = lax.axis_index(order.grid_name)
        n_mine = order.n_mine(blk)

        def steps_of(qi):
            block_lo = qi * (COMPUTE_WGS * bq)
            return kv_steps(cfg, q_off + block_lo, q_off + block_lo + COMPUTE_WGS * bq - 1, bk)

        turns = PingPong(wg, None if cfg.named_schedule else sched)

        @consumers(wg)
        def _consumer():
            q_tile, o_tile = q_smem.at[wg], o_smem.at[wg]

            def load_q(i):  # this block's i-th tile's Q rows
                own_tiles_at(order, blk, i, [(q_ref, q_smem)], wg, bq, q_bar)

            load_q(0)

            def run_tile(i, tile, done):
                bi, h, qi = tile
                n_full, n_end = steps_of(qi)
                q_row = qi * (COMPUTE_WGS * bq) + wg * bq
                q_seg = None
                if cfg.segments:
                    q_seg = plgpu.load(qseg_ref.at[bi, pl.ds(q_row, bq)], layout=ROW, optimized=False)
                plgpu.barrier_wait(q_bar.at[wg])
                plgpu.barrier_wait(k_bar.at[lax.rem(done, st)])
                turns.start()

                def step(j, carry, masked: bool):
                    acc, m, l = carry
                    slot = lax.rem(done + j, st)

                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                        turns.matmul_issued()
                        return acc_ref[...]

                    s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
                    plgpu.barrier_arrive(k_free.at[slot])
                    if masked:
                        s = mask_rows_by_keys(cfg, s, q_off + q_row, j * bk, q_seg, kvseg_ref, bi,
                                              length=cfg.kv_len % bk != 0)
                    m_new = jnp.maximum(m, s.max(axis=1) * scale2)
                    # A row that has seen no key keeps m = -inf; shift it by 0 so exp2 gives 0.
                    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
                    alpha = jnp.exp2(m - m_use)  # rescales what was summed under the old max
                    p = jnp.exp2(s * scale2 - bcast_rows(m_use, s.shape))
                    acc = acc * bcast_rows(alpha, acc.shape)
                    l = l * alpha + p.sum(axis=1)
                    p16 = p.astype(dtype)
                    acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                    turns.softmax_done()
                    plgpu.barrier_wait(v_bar.at[slot])
                    turns.wait_turn()  # the tensor core is ours again

                    def wait_next_k():  # the next tile's first K slot is waited in run_tile
                        @pl.when(j + 1 < n_end)
                        def _():
                            plgpu.barrier_wait(k_bar.at[lax.rem(done + j + 1, st)])

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
                turns.end()
                # Every Q K^T of this tile is done: the next tile's Q may land in q_tile now.
                pl.when(i + 1 < n_mine)(lambda: load_q(i + 1))

                seen = l > 0.0  # rows with no visible key give 0 and an LSE of +inf (P = 0 later)
                inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
                lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)) * (1 / LN2), jnp.inf)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's O has left
                o_tile[...] = (acc * bcast_rows(inv, acc.shape)).astype(dtype)
                lse_smem.at[wg][...] = lse
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_tile, o_ref.at[bi, pl.ds(q_row, bq), h], commit_group=False)
                plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[bi, h, pl.ds(q_row, bq)],
                                        commit_group=False)
                plgpu.commit_smem_to_gmem_group()
                return n_end

            order.loop(blk, run_tile)
            end_wait(cfg)

        @producer(wg)
        def _producer():
            stream_tiles_kv(order, blk, lambda qi: steps_of(qi)[1], k_ref, v_ref, k_smem, v_smem,
                            k_bar, v_bar, k_free, v_free, groups=g, bk=bk, stages=st)

    w = COMPUTE_WGS
    scratch = (
        tiled_smem((w, bq, d), dtype),  # Q tiles
        tiled_smem((w, bq, d), dtype) if cfg.persistent else None,  # O tiles on their way out
        tiled_smem((st, bk, d), dtype),
        tiled_smem((st, bk, d), dtype),
        plgpu.SMEM((w, bq), jnp.float32),  # LSE rows
        None if cfg.regs else tiled_smem((w, bq, bk), dtype),  # P, when staged in smem
        plgpu.Barrier(num_barriers=w),  # Q loaded
        plgpu.Barrier(num_barriers=st),  # K slot filled
        plgpu.Barrier(num_barriers=st),  # V slot filled
        plgpu.Barrier(num_arrivals=w, num_barriers=st),  # K slot free again
        plgpu.Barrier(num_arrivals=w, num_barriers=st),  # V slot free again
        None if cfg.named_schedule else plgpu.Barrier(num_arrivals=w),  # the consumers' turns
    )
    args = with_segments(cfg, [qoff, q, k, v], q_seg, kv_seg)
    return launch(kernel, args, out_type=(jax.ShapeDtypeStruct((b, tp, n, d), dtype),
                                          jax.ShapeDtypeStruct((b, n, tp), jnp.float32)),
                  scratch=scratch, grid=(order.blocks,), grid_names=(order.grid_name,),
                  num_threads=w + 1, interpret=cfg.interpret, manual_barriers=True,
                  name="flash_attention_fwd")
