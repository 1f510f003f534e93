"""The backward kernels of Mosaic GPU FlashAttention (`flash_attention_mgpu.py` has the
design): dQ loops over key tiles; dK/dV loops over query tiles and every query head of its
K/V head (the GQA sum, done in the kernel).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mgpu import COL, LOG2E, ROW, WGMMA, launch, tiled_smem
from pallas_kernels.flash_attention_mgpu_common import (
    COMPUTE_WGS,
    MosaicConfig,
    TileSchedule,
    bcast_cols,
    bcast_rows,
    cdiv,
    consumers,
    dq_parts,
    drain,
    end_wait,
    iota,
    kv_steps,
    mask_rows_by_keys,
    own_tiles_at,
    pass_steps,
    producer,
    stream_tiles_kv,
    unpack,
    visible,
    wgmma_from,
    with_segments,
)


def backward_dq(cfg: MosaicConfig, q, k, v, qoff, q_seg, kv_seg, lse, do, delta, *, o=None):
    """dQ [B, q_pad, N, D]: per query tile, S = Q K^T, dP = dO V^T, dS = P (dP - delta),
    dQ += dS K over the visible key tiles. With `cfg.persistent_dq` one block per SM runs
    the tiles of a `TileSchedule` (the forward's): the K/V ring carries on from tile to tile,
    the next tile's Q and dO are loaded once this tile's last matmul has read them, and dQ
    leaves through its own shared tile, so the next tile's loads run under this epilogue.

    With `cfg.delta_in_dq` (then `o` is the padded output and `delta` None) each consumer
    also loads its O rows beside dO and computes delta = rowsum(dO * O) in fp32 itself,
    instead of an XLA pass over dO and O before the kernel; returns (dQ, delta [B, N,
    q_pad]), delta for the dK/dV kernel."""
    b, tp, n, d = q.shape
    bq, bk, st = cfg.blocks.block_q_dq, cfg.blocks.block_kv_dq, cfg.blocks.stages_bwd
    dtype, g = q.dtype, cfg.groups
    n_qt = tp // (COMPUTE_WGS * bq)
    order = TileSchedule(b, n, n_qt, cfg.causal, cfg.persistent_dq, cfg.sms)
    scale2 = cfg.sm_scale * LOG2E
    own_steps = cfg.causal and cfg.blocks.own_causal_steps
    own_delta = cfg.delta_in_dq
    if own_delta != (o is not None and delta is None):
        raise ValueError("backward_dq: pass o (and delta=None) exactly when cfg.delta_in_dq.")

    def kernel(*refs):
        qoff_ref, ins, qseg_ref, kvseg_ref, rest = unpack(refs, cfg, 7)
        q_ref, k_ref, v_ref, do_ref, lse_ref, row_ref = ins  # row_ref: O (own_delta) or delta
        o_ref, delta_ref = (row_ref, None) if own_delta else (None, row_ref)
        if own_delta:
            dq_ref, delta_out, rest = rest[0], rest[1], rest[2:]
        else:
            dq_ref, rest = rest[0], rest[1:]
        q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, o_smem, delta_smem = rest[:8]
        qdo_bar, k_bar, v_bar, free = rest[8:]
        if dq_smem is None:  # one tile per block: dQ leaves through the Q tile
            dq_smem = q_smem
        blk, wg = lax.axis_index(order.grid_name), lax.axis_index("wg")
        n_mine = order.n_mine(blk)
        q_off = qoff_ref[0]

        def steps_of(qi):
            block_lo = qi * (COMPUTE_WGS * bq)
            return kv_steps(cfg, q_off + block_lo, q_off + block_lo + COMPUTE_WGS * bq - 1, bk,
                            length=False)

        @consumers(wg, cfg.blocks.consumer_regs_bwd)
        def _consumer():
            q_tile, do_tile, dq_tile = q_smem.at[wg], do_smem.at[wg], dq_smem.at[wg]

            def load_own(i):  # this block's i-th tile's Q and dO rows (and O's)
                own = [(q_ref, q_smem), (do_ref, do_smem)] + ([(o_ref, o_smem)] if own_delta else [])
                own_tiles_at(order, blk, i, own, wg, bq, qdo_bar)

            load_own(0)

            def run_tile(i, tile, done):
                bi, h, qi = tile
                n_full, n_end = steps_of(qi)
                q_row = qi * (COMPUTE_WGS * bq) + wg * bq
                n_mine_end = n_end  # the steps this consumer computes; the rest it passes
                if own_steps:  # its own rows' steps: the first consumer sees fewer keys
                    n_full, n_mine_end = kv_steps(cfg, q_off + q_row, q_off + q_row + bq - 1, bk,
                                                  length=False)
                rows = pl.ds(q_row, bq)
                lse_r = plgpu.load(lse_ref.at[bi, h, rows], layout=ROW, optimized=False)
                if not own_delta:
                    delta_r = plgpu.load(delta_ref.at[bi, h, rows], layout=ROW, optimized=False)
                q_seg = None
                if cfg.segments:
                    q_seg = plgpu.load(qseg_ref.at[bi, rows], layout=ROW, optimized=False)
                plgpu.barrier_wait(qdo_bar.at[wg])
                if own_delta:  # delta = rowsum(dO * O) in fp32, out for the dK/dV kernel
                    do_r = plgpu.load(do_tile, layout=WGMMA).astype(jnp.float32)
                    o_r = plgpu.load(o_smem.at[wg], layout=WGMMA).astype(jnp.float32)
                    delta_r = jnp.sum(do_r * o_r, axis=1)
                    # the last tile's delta copy was waited on before its dQ tile was written
                    delta_smem.at[wg][...] = delta_r
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(delta_smem.at[wg], delta_out.at[bi, h, rows])

                def run(dq_acc):
                    def step(j, carry, masked: bool):
                        slot = lax.rem(done + j, st)
                        plgpu.barrier_wait(k_bar.at[slot])
                        plgpu.barrier_wait(v_bar.at[slot])

                        def s_dp(s_acc, dp_acc):
                            plgpu.wgmma(s_acc, q_tile, k_smem.at[slot].transpose((1, 0)))
                            plgpu.wgmma(dp_acc, do_tile, v_smem.at[slot].transpose((1, 0)))
                            return s_acc[...], dp_acc[...]

                        acc_t = plgpu.ACC((bq, bk), jnp.float32)
                        s, dp = pl.run_scoped(s_dp, acc_t, acc_t)
                        if masked:  # padded keys are zero: they add 0 to dQ (no length mask)
                            s = mask_rows_by_keys(cfg, s, q_off + q_row, j * bk, q_seg, kvseg_ref, bi,
                                                  length=False)
                        p = jnp.exp2(s * scale2 - bcast_rows(lse_r, s.shape))
                        ds = (p * (dp - bcast_rows(delta_r, s.shape))).astype(dtype)
                        wgmma_from(dq_acc, ds, k_smem.at[slot], None if cfg.regs else ds_smem.at[wg])
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(free.at[slot])
                        return carry

                    lax.fori_loop(0, n_full, functools.partial(step, masked=False), 0)
                    if cfg.causal or cfg.segments:
                        lax.fori_loop(n_full, n_mine_end, functools.partial(step, masked=True), 0)
                    if own_steps:  # keys past this consumer's last row: they add 0 to its dQ
                        pass_steps(n_mine_end, n_end, lambda j: lax.rem(done + j, st),
                                   (k_bar, v_bar), free)
                    return dq_acc[...]

                dq = pl.run_scoped(run, plgpu.ACC((bq, d), jnp.float32))
                # Every matmul of this tile has read Q and dO: the next tile's may land there.
                pl.when(i + 1 < n_mine)(lambda: load_own(i + 1))
                if cfg.persistent_dq:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's dQ has left
                dq_tile[...] = (dq * cfg.sm_scale).astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(dq_tile, dq_ref.at[bi, rows, h])
                return n_end

            order.loop(blk, run_tile)
            end_wait(cfg)

        @producer(wg, cfg.blocks.consumer_regs_bwd)
        def _producer():
            stream_tiles_kv(order, blk, lambda qi: steps_of(qi)[1], k_ref, v_ref, k_smem, v_smem,
                            k_bar, v_bar, free, free, groups=g, bk=bk, stages=st)

    w = COMPUTE_WGS
    scratch = (
        tiled_smem((w, bq, d), dtype),  # Q tiles (and dQ's way out, one tile per block)
        tiled_smem((w, bq, d), dtype),  # dO tiles
        tiled_smem((st, bk, d), dtype),
        tiled_smem((st, bk, d), dtype),
        None if cfg.regs else tiled_smem((w, bq, bk), dtype),  # dS, when staged in smem
        tiled_smem((w, bq, d), dtype) if cfg.persistent_dq else None,  # dQ tiles on their way out
        tiled_smem((w, bq, d), dtype) if own_delta else None,  # O tiles (delta)
        plgpu.SMEM((w, bq), jnp.float32) if own_delta else None,  # delta rows on their way out
        plgpu.Barrier(num_arrivals=3 if own_delta else 2, num_barriers=w),  # Q, dO (O) loaded
        plgpu.Barrier(num_barriers=st),  # K slot filled
        plgpu.Barrier(num_barriers=st),  # V slot filled
        plgpu.Barrier(num_arrivals=w, num_barriers=st),  # K/V slot free again
    )
    args = with_segments(cfg, [qoff, q, k, v, do, lse, o if own_delta else delta], q_seg, kv_seg)
    out_type = jax.ShapeDtypeStruct(q.shape, dtype)
    if own_delta:
        out_type = (out_type, jax.ShapeDtypeStruct(lse.shape, jnp.float32))
    return launch(kernel, args, out_type=out_type, scratch=scratch,
                  grid=(order.blocks,), grid_names=(order.grid_name,), num_threads=w + 1,
                  interpret=cfg.interpret, manual_barriers=cfg.blocks.manual_barriers_bwd,
                  name="flash_attention_bwd_dq")


def backward_dq_from_ds(cfg: MosaicConfig, k, ds_t, qoff, q_shape, dtype):
    """dQ [B, q_pad, N, D] = scale * dS K from the dS^T tiles `backward_dkv(ds_out=True)` stored
    ([B, N, kv_pad, q_pad]): one tile matmul a (query, key) tile pair and no recomputation, so
    the kernel is bound by reading dS. One block per (batch, head, 2 x bq query rows); its
    producer streams each visible key tile's K rows and both consumers' dS^T tiles into a ring;
    each consumer adds dS [bq, bk] K [bk, D] (dS^T read transposed from shared memory). Masked
    entries of dS are zero (and padded keys' K rows are), so nothing is masked here; under a
    causal mask each consumer reads only the key tiles its own rows see, which are the tiles
    the dK/dV kernel stored for them."""
    b, tp, n, d = q_shape
    bq, bk, st = cfg.blocks.block_q_dkv, cfg.blocks.block_kv_dkv, cfg.blocks.stages_dq_ds
    w, g = COMPUTE_WGS, cfg.groups
    if tp % (w * bq):
        raise ValueError(f"backward_dq_from_ds: {tp} query rows are not whole tiles of {w} x "
                         f"block_q_dkv={bq}; pad them with MosaicBlockSizes.pads.")
    order = TileSchedule(b, n, tp // (w * bq), cfg.causal, False, cfg.sms)

    def kernel(qoff_ref, k_ref, ds_ref, dq_ref, k_smem, ds_smem, dq_smem, k_bar, ds_bar, free):
        blk, wg = lax.axis_index(order.grid_name), lax.axis_index("wg")
        bi, h, qi = order.tile_at(blk, 0)
        q_off, block_lo = qoff_ref[0], qi * (w * bq)
        _, n_end = kv_steps(cfg, q_off + block_lo, q_off + block_lo + w * bq - 1, bk, length=False)

        @consumers(wg)
        def _consumer():
            q_row = block_lo + wg * bq
            _, n_mine = kv_steps(cfg, q_off + q_row, q_off + q_row + bq - 1, bk, length=False)

            def run(acc):
                def step(j, carry):  # the matmul of step j in flight, step j - 1's slot freed
                    slot = lax.rem(j, st)
                    plgpu.barrier_wait(k_bar.at[slot])
                    plgpu.barrier_wait(ds_bar.at[slot])
                    plgpu.wgmma(acc, ds_smem.at[slot, wg].transpose((1, 0)), k_smem.at[slot])
                    plgpu.wgmma_wait(1)

                    @pl.when(j > 0)
                    def _():
                        plgpu.barrier_arrive(free.at[lax.rem(j - 1, st)])
                    return carry

                lax.fori_loop(0, n_mine, step, 0)
                plgpu.wgmma_wait(0)

                @pl.when(n_mine > 0)
                def _():
                    plgpu.barrier_arrive(free.at[lax.rem(n_mine - 1, st)])
                # keys past this consumer's last row: their dS^T tiles were never stored
                pass_steps(n_mine, n_end, lambda j: lax.rem(j, st), (k_bar, ds_bar), free)
                return acc[...]

            dq = pl.run_scoped(run, plgpu.ACC((bq, d), jnp.float32))
            tile = dq_smem.at[wg]
            tile[...] = (dq * cfg.sm_scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tile, dq_ref.at[bi, pl.ds(q_row, bq), h])
            end_wait(cfg)

        @producer(wg)
        def _producer():
            kvh = lax.div(h, jnp.int32(g))

            @pl.loop(0, n_end)
            def _(j):
                slot = lax.rem(j, st)

                @pl.when(j >= st)
                def _():
                    plgpu.barrier_wait(free.at[slot])

                keys = pl.ds(j * bk, bk)
                plgpu.copy_gmem_to_smem(k_ref.at[bi, keys, kvh], k_smem.at[slot], k_bar.at[slot])
                for c in range(w):
                    plgpu.copy_gmem_to_smem(ds_ref.at[bi, h, keys, pl.ds(block_lo + c * bq, bq)],
                                            ds_smem.at[slot, c], ds_bar.at[slot])

            drain(n_end, st, free)

    scratch = (
        tiled_smem((st, bk, d), dtype),  # K tiles
        tiled_smem((st, w, bk, bq), dtype),  # both consumers' dS^T tiles
        tiled_smem((w, bq, d), dtype),  # dQ tiles on their way out
        plgpu.Barrier(num_barriers=st),  # K slot filled
        plgpu.Barrier(num_arrivals=w, num_barriers=st),  # dS^T slot filled
        plgpu.Barrier(num_arrivals=w, num_barriers=st),  # slot free again
    )
    return launch(kernel, [qoff, k, ds_t], out_type=jax.ShapeDtypeStruct(q_shape, dtype),
                  scratch=scratch, grid=(order.blocks,), grid_names=(order.grid_name,),
                  num_threads=w + 1, interpret=cfg.interpret, manual_barriers=True,
                  name="flash_attention_bwd_dq_from_ds")


def backward_dkv(cfg: MosaicConfig, q, k, v, qoff, q_seg, kv_seg, lse, do, delta, *,
                 with_dq: bool = False, ds_out: bool = False):
    """dK, dV [B, kv_pad, K, D]: per key tile, over every query tile and every query head of
    its group: S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta),
    dK += dS^T Q. Summing over the group here is the GQA reduction, done in the kernel.

    with_dq=True returns (dQ, dK, dV): each step also computes the query tile's dQ share dS K
    over the block's 2 x bk keys, so S and dP are not recomputed in a dQ kernel: 5 tile
    matmuls a (query, key) pair instead of 7, as FlashAttention-2/3 do. FlashAttention-3's
    split: both consumers store their dS^T rows into a shared tile (double-buffered by step
    parity), meet on a barrier, and each computes half of dQ's columns from all 2 x bk keys
    (head dim 64: the whole tile, the consumers taking turns by step), so each (query tile,
    key block) adds one fp32 tile into dQ, not one per consumer. dQ is summed over key blocks
    in fp32 in global memory: on the GPU by TMA reduce-add copies into one zero-initialised
    buffer; the interpreter has no TMA reductions, so there each key block copies its share
    into a slot of its own and XLA sums the slots.

    ds_out=True returns (dK, dV, dS^T [B, N, kv_pad, q_pad]): each consumer also stores every
    dS^T tile it computes, for `backward_dq_from_ds` (tiles it passes, which its keys do not
    see, stay unwritten; that kernel does not read them)."""
    b, tp, n, d = q.shape
    sp, kh = k.shape[1], k.shape[2]
    bq, bk, st = cfg.blocks.block_q_dkv, cfg.blocks.block_kv_dkv, cfg.blocks.stages_bwd
    dtype, g = q.dtype, cfg.groups
    n_kt, n_q = sp // (COMPUTE_WGS * bk), tp // bq
    scale2 = cfg.sm_scale * LOG2E
    atomic = not cfg.interpret  # dQ by TMA reduce-add into one buffer (the interpreter has none)
    w = COMPUTE_WGS
    parts = dq_parts(d)  # dQ column parts a step: one per consumer (D 128), or one (D 64)
    dq_cols = d // parts
    heads_major = cfg.blocks.dq_heads_major
    persistent = cfg.persistent_dkv
    if with_dq and ds_out:
        raise ValueError("backward_dkv: with_dq and ds_out are two forms of the backward; pass one.")
    if persistent and with_dq:
        raise ValueError("backward_dkv: the fused backward (with_dq) has no persistent grid; "
                         "resolve persistent_dkv with MosaicBlockSizes.resolve_persistent_dkv.")
    # dQ shares need both consumers' dS^T every step: the fused form runs the block's steps
    own_steps = cfg.causal and cfg.blocks.own_causal_steps and not with_dq
    # Key blocks of one (batch, kv head); causal: the lowest sees the most query tiles
    order = TileSchedule(b, kh, n_kt, cfg.causal, persistent, cfg.sms, longest_high=False)

    def kernel(*refs):
        qoff_ref, ins, qseg_ref, kvseg_ref, rest = unpack(refs, cfg, 8 if with_dq else 7)
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins[:6]
        dq_ref = ins[6] if with_dq else None
        if ds_out:
            ds_ref, rest = rest[2], rest[:2] + rest[3:]
        dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, p_smem = rest[:9]
        ds_smem, dq_smem, dkv_smem, ds_bar, kv_bar, q_bar, do_bar, free = rest[9:]
        blk, wg = lax.axis_index(order.grid_name), lax.axis_index("wg")
        n_mine = order.n_mine(blk)
        q_off = qoff_ref[0]

        def span(block_lo, block_hi):
            """(first step, first unmasked step, end) of keys [block_lo, block_hi] (a key
            block, or one consumer's rows of it). Steps run over (query tile i, group head j),
            j fastest; step = i * g + j."""
            if cfg.causal:  # query tiles ending before the first key see none of them
                i_start = jnp.minimum(lax.div(jnp.maximum(block_lo - q_off, 0), bq), n_q)
                i_full = jnp.maximum(jnp.minimum(cdiv(jnp.maximum(block_hi - q_off, 0), bq), n_q),
                                     i_start)
            else:
                i_start, i_full = 0, 0
            if cfg.segments:
                i_full = n_q
            return i_start * g, i_full * g, n_q * g

        def block_span(ki):  # key block ki's steps, what its producer streams
            block_lo = ki * (COMPUTE_WGS * bk)
            return span(block_lo, block_lo + COMPUTE_WGS * bk - 1)

        @consumers(wg, cfg.blocks.consumer_regs_bwd)
        def _consumer():
            k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
            p_tile = None if p_smem is None else p_smem.at[wg]

            def load_own(i):  # this block's i-th key block's K and V rows
                own_tiles_at(order, blk, i, [(k_ref, k_smem), (v_ref, v_smem)], wg, bk, kv_bar)

            load_own(0)

            def run_tile(i_tile, tile, done):
                bi, kvh, ki = tile
                s_start, s_full, s_end = block_span(ki)
                k_row = ki * (COMPUTE_WGS * bk) + wg * bk
                s_mine = s_start  # the first step this consumer computes; those before it it passes
                if own_steps:  # its own keys' steps: the second consumer sees fewer queries
                    s_mine, s_full, _ = span(k_row, k_row + bk - 1)
                rows = pl.ds(k_row, bk)
                kv_seg = None
                if cfg.segments:
                    kv_seg = plgpu.load(kvseg_ref.at[bi, rows], layout=ROW, optimized=False)
                plgpu.barrier_wait(kv_bar.at[wg])

                def dq_share(s_idx, dk_acc, ds_t, slot):
                    """dK += dS^T Q; dS^T into the shared tile; once both consumers' rows are
                    there, this consumer's columns of dQ += dS K over the block's keys, out to
                    global memory (the slot is freed once dK and dQ have read Q and K)."""
                    i, j = lax.div(s_idx, jnp.int32(g)), lax.rem(s_idx, jnp.int32(g))
                    buf = lax.rem(s_idx - s_start, 2)
                    ds_own = ds_smem.at[buf, wg]
                    ds_own[...] = ds_t
                    plgpu.commit_smem()
                    plgpu.wgmma(dk_acc, ds_t if cfg.regs else ds_own, q_smem.at[slot])
                    plgpu.barrier_arrive(ds_bar.at[buf])
                    plgpu.barrier_wait(ds_bar.at[buf])  # both consumers' dS^T rows are stored
                    # D 128: this consumer's half of the columns; D 64: the whole tile, by turns
                    cols = pl.ds(wg * dq_cols, dq_cols) if parts == w else pl.ds(0, d)

                    def scoped(dq_acc):
                        for owner in range(w):  # dS [bq, 2 bk] K [2 bk, cols], one owner's keys a time
                            plgpu.wgmma(dq_acc, ds_smem.at[buf, owner].transpose((1, 0)),
                                        k_smem.at[owner, :, cols])
                        plgpu.wgmma_wait(0)
                        return dq_acc[...]

                    def share():
                        dq = pl.run_scoped(scoped, plgpu.ACC((bq, dq_cols), jnp.float32))
                        plgpu.barrier_arrive(free.at[slot])
                        dq_tile, q_rows, h = dq_smem.at[wg], pl.ds(i * bq, bq), kvh * g + j
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # its last share has left
                        dq_tile[...] = dq
                        plgpu.commit_smem()
                        dst = dq_ref if atomic else dq_ref.at[ki]
                        dst = dst.at[bi, h, q_rows] if heads_major else dst.at[bi, q_rows, h]
                        plgpu.copy_smem_to_gmem(dq_tile, dst.at[:, cols],
                                                reduction_op="add" if atomic else None)

                    if parts == w:
                        share()
                    else:
                        turn = lax.rem(s_idx - s_start, w) == wg
                        pl.when(turn)(share)

                        @pl.when(jnp.logical_not(turn))
                        def _():
                            plgpu.wgmma_wait(0)  # dK has read Q
                            plgpu.barrier_arrive(free.at[slot])

                def run(dk_acc, dv_acc):
                    def step(s_idx, carry, masked: bool):
                        slot = lax.rem(done + s_idx - s_start, st)
                        i = lax.div(s_idx, jnp.int32(g))
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
                                          length=False)  # padded keys' rows are dropped (zero in dQ)
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
                            p_tile[...] = p16
                            plgpu.commit_smem()

                            def dp_scoped(acc):
                                plgpu.wgmma(acc, v_tile, do_smem.at[slot].transpose((1, 0)))
                                plgpu.wgmma(dv_acc, p_tile, do_smem.at[slot])
                                plgpu.wgmma_wait(0)
                                return acc[...]

                        dp_t = pl.run_scoped(dp_scoped, plgpu.ACC((bk, bq), jnp.float32))
                        delta_c = plgpu.load(delta_smem.at[slot], layout=COL)
                        ds_t = (p_t * (dp_t - bcast_cols(delta_c, s_t.shape))).astype(dtype)
                        if with_dq:
                            dq_share(s_idx, dk_acc, ds_t, slot)
                            return carry
                        wgmma_from(dk_acc, ds_t, q_smem.at[slot], p_tile)
                        if ds_out:  # dS^T out under the matmul, through a tile by step parity
                            ds_tile = ds_smem.at[lax.rem(s_idx - s_mine, 2), wg]
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # its last store has read it
                            ds_tile[...] = ds_t
                            plgpu.commit_smem()
                            h = kvh * g + lax.rem(s_idx, jnp.int32(g))
                            plgpu.copy_smem_to_gmem(ds_tile, ds_ref.at[bi, h, pl.ds(k_row, bk),
                                                                       pl.ds(i * bq, bq)])
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(free.at[slot])
                        return carry

                    if own_steps:  # queries before this consumer's first key: they add 0
                        pass_steps(s_start, s_mine, lambda s_idx: lax.rem(done + s_idx - s_start, st),
                                   (q_bar, do_bar), free)
                    if cfg.causal or cfg.segments:
                        lax.fori_loop(s_mine, s_full, functools.partial(step, masked=True), 0)
                    lax.fori_loop(s_full, s_end, functools.partial(step, masked=False), 0)
                    return dk_acc[...], dv_acc[...]

                acc_t = plgpu.ACC((bk, d), jnp.float32)
                dk, dv = pl.run_scoped(run, acc_t, acc_t)
                if with_dq:  # the other consumer's last dQ matmul has read this one's K tile
                    plgpu.barrier_arrive(ds_bar.at[2])
                    plgpu.barrier_wait(ds_bar.at[2])
                # Every matmul of this block has read K and V: the next block's may land there.
                pl.when(i_tile + 1 < n_mine)(lambda: load_own(i_tile + 1))
                dk_tile, dv_tile = (dkv_smem.at[0, wg], dkv_smem.at[1, wg]) if persistent else (k_tile, v_tile)
                if persistent:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last block's dK, dV have left
                dk_tile[...] = (dk * cfg.sm_scale).astype(dtype)
                dv_tile[...] = dv.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(dk_tile, dk_ref.at[bi, rows, kvh], commit_group=False)
                plgpu.copy_smem_to_gmem(dv_tile, dv_ref.at[bi, rows, kvh], commit_group=False)
                plgpu.commit_smem_to_gmem_group()
                return s_end - s_start

            order.loop(blk, run_tile)
            end_wait(cfg)

        @producer(wg, cfg.blocks.consumer_regs_bwd)
        def _producer():
            def feed(i_tile, tile, done):
                bi, kvh, ki = tile
                s_start, _, s_end = block_span(ki)

                @pl.loop(s_start, s_end)
                def _(s_idx):
                    pos = done + s_idx - s_start  # steps into this block's ring
                    slot = lax.rem(pos, st)
                    i, j = lax.div(s_idx, jnp.int32(g)), lax.rem(s_idx, jnp.int32(g))
                    h = kvh * g + j
                    rows = pl.ds(i * bq, bq)

                    @pl.when(pos >= st)
                    def _():
                        plgpu.barrier_wait(free.at[slot])

                    plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, h], q_smem.at[slot], q_bar.at[slot])
                    plgpu.copy_gmem_to_smem(lse_ref.at[bi, h, rows], lse_smem.at[slot], q_bar.at[slot])
                    plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, h], do_smem.at[slot], do_bar.at[slot])
                    plgpu.copy_gmem_to_smem(delta_ref.at[bi, h, rows], delta_smem.at[slot],
                                            do_bar.at[slot])
                return s_end - s_start

            drain(order.loop(blk, feed), st, free)

    scratch = (
        tiled_smem((w, bk, d), dtype),  # K tiles (then dK tiles, one block per key block)
        tiled_smem((w, bk, d), dtype),  # V tiles (then dV tiles)
        tiled_smem((st, bq, d), dtype),  # Q
        tiled_smem((st, bq, d), dtype),  # dO
        plgpu.SMEM((st, bq), jnp.float32),  # LSE
        plgpu.SMEM((st, bq), jnp.float32),  # delta
        None if cfg.regs else tiled_smem((w, bk, bq), dtype),  # P^T (and dS^T) staged in smem
        # dS^T of both consumers (with_dq), or each consumer's on its way out (ds_out)
        tiled_smem((2, w, bk, bq), dtype) if with_dq or ds_out else None,
        tiled_smem((w, bq, dq_cols), jnp.float32) if with_dq else None,  # a dQ share, leaving
        tiled_smem((2, w, bk, d), dtype) if persistent else None,  # dK, dV tiles on their way out
        # dS^T stored (by step parity); [2]: both consumers' last dQ matmul done (K tiles free)
        plgpu.Barrier(num_arrivals=w, num_barriers=3) if with_dq else None,
        plgpu.Barrier(num_arrivals=2, num_barriers=w),  # K and V loaded
        plgpu.Barrier(num_arrivals=2, num_barriers=st),  # Q and LSE slot filled
        plgpu.Barrier(num_arrivals=2, num_barriers=st),  # dO and delta slot filled
        plgpu.Barrier(num_arrivals=w, num_barriers=st),  # slot free again
    )
    inputs = [qoff, q, k, v, do, lse, delta]
    if with_dq:
        acc_shape = (b, n, tp, d) if heads_major else (b, tp, n, d)
        dq_acc = jax.new_ref(jnp.zeros(acc_shape if atomic else (n_kt, *acc_shape), jnp.float32))
        inputs.append(dq_acc)
    out = jax.ShapeDtypeStruct((b, sp, kh, d), dtype)
    outs = (out, out, jax.ShapeDtypeStruct((b, n, sp, tp), dtype)) if ds_out else (out, out)
    res = launch(kernel, with_segments(cfg, inputs, q_seg, kv_seg), out_type=outs,
                 scratch=scratch, grid=(order.blocks,), grid_names=(order.grid_name,),
                 num_threads=w + 1, interpret=cfg.interpret,
                 manual_barriers=cfg.blocks.manual_barriers_bwd,
                 name="flash_attention_bwd_dqkv" if with_dq else "flash_attention_bwd_dkv")
    if not with_dq:
        return res
    dk, dv = res
    dq = jax.freeze(dq_acc)
    dq = dq if atomic else dq.sum(axis=0)
    if heads_major:
        dq = dq.transpose(0, 2, 1, 3)
    return (dq * cfg.sm_scale).astype(dtype), dk, dv
