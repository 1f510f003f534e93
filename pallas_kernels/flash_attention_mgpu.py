"""FlashAttention for Hopper (sm90) in Pallas Mosaic GPU: forward, dQ and dK/dV kernels.

The structure is FlashAttention-3's (Shah et al. 2024): every thread block runs three
warpgroups. A producer warpgroup, cut to 40 registers, streams K/V tiles (forward, dQ) or
Q/dO/LSE/delta tiles (dK/dV) into a ring of shared-memory slots with TMA bulk copies that
complete on barriers; two consumer warpgroups, raised to 232 registers, each own 64 query
(or key) rows and run the tile matmuls on the tensor core with `wgmma`, freeing a slot
through a "consumed" barrier that the producer waits on before refilling it. In the forward
pass the two consumers ping-pong through a schedule barrier so that one's softmax (exp2 on
the multi-function unit) overlaps the other's matmuls, and P is fed to the second matmul
from registers. Causal tiles above the diagonal are never loaded; only the diagonal tiles,
the ragged last key tile and (with segment ids) every tile run the masked step.

The algorithm is the one of `flash_attention.py` (online softmax in base 2, LSE saved,
probabilities recomputed in the backward pass, delta = rowsum(dO * O) precomputed): the
public entry point there dispatches here on an sm90 GPU for bf16/fp16 with head dim 64 or
128, and keeps the Triton kernels as the portable path. Grouped-query attention: the dK/dV
kernel loops over every query head of its K/V head, so dK and dV are summed in the kernel.

Sequences are padded to whole tiles (keys past kv_len are masked, padded query rows get
dO = 0), so any length runs. `regs=False` stages P and dS through shared memory instead of
registers: slower, but Mosaic GPU's CPU interpreter runs it (see `_mgpu.py`).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mgpu import (
    COL,
    ROW,
    SMEM_LIMIT,
    WGMMA,
    interpret_params,
    smem_bytes,
    tiled_smem,
)

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_COMPUTE_WGS = 2  # consumer warpgroups per block; warpgroup 2 is the producer


@dataclasses.dataclass(frozen=True)
class MosaicBlockSizes:
    """Tiles of the three Mosaic GPU kernels (rows per consumer warpgroup)."""

    block_q: int = 64  # forward: query rows per consumer warpgroup (a block holds two)
    block_kv: int = 128  # forward: key rows per pipeline step
    stages: int = 2  # forward: K/V tiles in flight
    block_q_dq: int = 64  # dQ kernel: query rows per consumer warpgroup
    block_kv_dq: int = 64  # dQ kernel: key rows per pipeline step
    block_q_dkv: int = 64  # dK/dV kernel: query rows per pipeline step
    block_kv_dkv: int = 64  # dK/dV kernel: key rows per consumer warpgroup
    stages_bwd: int = 2  # backward kernels: tiles in flight

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("stages"):
                if value < 1:
                    raise ValueError(f"MosaicBlockSizes.{f.name}={value}: use >= 1.")
            elif value % 64:
                raise ValueError(f"MosaicBlockSizes.{f.name}={value}: use a multiple of 64 "
                                 "(wgmma rows and 128-byte swizzled tiles).")

    @classmethod
    def for_head_dim(cls, head_dim: int) -> MosaicBlockSizes:
        """Defaults: 64-row consumers, 128-key forward tiles, as FlashAttention-3 uses."""
        if head_dim <= 64:
            return cls(stages=3)
        return cls()

    def check_smem(self, head_dim: int, regs: bool):
        """Raises if a kernel's shared memory would exceed what one sm90 block has
        (bf16/fp16 tiles; regs=False adds the P / dS staging buffers)."""
        d, w, h = head_dim, _COMPUTE_WGS, jnp.float16
        staged = lambda shape: [] if regs else [(shape, h)]
        need = {
            "forward": smem_bytes(((w, self.block_q, d), h), ((2 * self.stages, self.block_kv, d), h),
                                  ((w, self.block_q), jnp.float32),
                                  *staged((w, self.block_q, self.block_kv))),
            "dq": smem_bytes(((2 * w, self.block_q_dq, d), h),
                             ((2 * self.stages_bwd, self.block_kv_dq, d), h),
                             *staged((w, self.block_q_dq, self.block_kv_dq))),
            "dkv": smem_bytes(((2 * w, self.block_kv_dkv, d), h),
                              ((2 * self.stages_bwd, self.block_q_dkv, d), h),
                              ((2 * self.stages_bwd, self.block_q_dkv), jnp.float32),
                              *staged((w, self.block_kv_dkv, self.block_q_dkv))),
        }
        for name, n in need.items():
            if n > SMEM_LIMIT - 8192:  # barriers and alignment take a few KiB more
                raise ValueError(f"MosaicBlockSizes: the {name} kernel needs {n} bytes of shared "
                                 f"memory at head_dim={head_dim}; shrink its tiles or stages.")


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Everything static about one call (hashable: it keys the compile cache)."""

    causal: bool
    sm_scale: float
    blocks: MosaicBlockSizes
    q_len: int
    kv_len: int
    groups: int  # query heads per kv head
    segments: bool
    regs: bool  # P and dS from registers (GPU); False stages them in shared memory
    interpret: bool

    @property
    def q_pad(self) -> int:
        b = self.blocks
        tile = math.lcm(_COMPUTE_WGS * b.block_q, _COMPUTE_WGS * b.block_q_dq, b.block_q_dkv)
        return -(-self.q_len // tile) * tile

    @property
    def kv_pad(self) -> int:
        b = self.blocks
        tile = math.lcm(b.block_kv, b.block_kv_dq, _COMPUTE_WGS * b.block_kv_dkv)
        return -(-self.kv_len // tile) * tile


# ---------------------------------------------------------------------------------------
# Helpers shared by the three kernels.

def _bcast_rows(x, shape):
    return lax.broadcast_in_dim(x, shape, [0])


def _bcast_cols(x, shape):
    return lax.broadcast_in_dim(x, shape, [1])


def _iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)


def _cdiv(a, b: int):
    return lax.div(a + (b - 1), b)


def _kv_steps(cfg: MosaicConfig, pos_first, pos_last, bk: int, *, length: bool = True):
    """Key tiles [0, n_full) are visible to every query in [pos_first, pos_last] and need no
    mask; [n_full, n_end) need one; tiles from n_end on are skipped (causal). length=False:
    the ragged last tile needs no mask (its padded keys are zero and add nothing to dQ)."""
    n_end = -(-cfg.kv_len // bk)  # Python ints stay literals
    n_full = cfg.kv_len // bk if length else n_end
    if cfg.causal:
        n_end = jnp.minimum(n_end, _cdiv(pos_last + 1, bk))
        n_full = jnp.minimum(n_full, lax.div(pos_first + 1, bk))
    if cfg.segments:
        n_full = 0
    if cfg.causal:
        n_full = jnp.minimum(n_full, n_end)
    return n_full, n_end


def _needs_mask(cfg: MosaicConfig, bk: int) -> bool:
    return cfg.causal or cfg.segments or cfg.kv_len % bk != 0


def _visible(cfg: MosaicConfig, q_pos, k_pos, q_seg, kv_seg, *, length: bool):
    """(query, key) pairs that may attend; all operands broadcast to the tile shape."""
    ok = None
    conj = lambda a, b: b if a is None else jnp.logical_and(a, b)
    if cfg.causal:
        ok = conj(ok, k_pos <= q_pos)
    if length:
        ok = conj(ok, k_pos < cfg.kv_len)
    if cfg.segments:
        ok = conj(ok, q_seg == kv_seg)
    return ok


def _drain(n_steps, stages: int, *free_barriers):
    """The producer waits until the consumers release the last slots it filled, so that
    every barrier phase is observed before the block exits (jax 0.11.2's interpreter checks
    this at deallocation; on the GPU it only delays the producer's exit)."""
    @pl.loop(jnp.maximum(n_steps - stages, 0), n_steps)
    def _(j):
        for bar in free_barriers:
            plgpu.barrier_wait(bar.at[lax.rem(j, stages)])


def _compiler_params():
    return plgpu.CompilerParams(approx_math=True)


def _unpack(refs, cfg: MosaicConfig, n_in: int):
    """Splits a kernel's refs into (qoff, inputs..., qseg, kvseg) and the rest."""
    refs = list(refs)
    qoff, ins = refs[0], refs[1:n_in]
    rest = refs[n_in:]
    if cfg.segments:
        qseg, kvseg, rest = rest[0], rest[1], rest[2:]
    else:
        qseg = kvseg = None
    return qoff, ins, qseg, kvseg, rest


# ---------------------------------------------------------------------------------------
# Forward.

def _forward(cfg: MosaicConfig, q, k, v, qoff, q_seg, kv_seg):
    """O [B, q_pad, N, D] and the base-2 LSE [B, N, q_pad] on padded inputs."""
    b, tp, n, d = q.shape
    bq, bk, st = cfg.blocks.block_q, cfg.blocks.block_kv, cfg.blocks.stages
    dtype, g = q.dtype, cfg.groups
    n_qt = tp // (_COMPUTE_WGS * bq)
    scale2 = cfg.sm_scale * _LOG2E  # logits in base 2: exp(x) = exp2(x * log2 e)

    def kernel(*refs):
        qoff_ref, (q_ref, k_ref, v_ref), qseg_ref, kvseg_ref, rest = _unpack(refs, cfg, 4)
        o_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem, p_smem = rest[:7]
        q_bar, k_bar, v_bar, k_free, v_free, sched = rest[7:]
        qi = lax.axis_index("q")
        if cfg.causal:  # the longest rows first: a better tail
            qi = n_qt - 1 - qi
        h, bi, wg = lax.axis_index("h"), lax.axis_index("b"), lax.axis_index("wg")
        q_off = qoff_ref[0]
        block_lo = qi * (_COMPUTE_WGS * bq)
        n_full, n_end = _kv_steps(cfg, q_off + block_lo, q_off + block_lo + _COMPUTE_WGS * bq - 1, bk)

        def schedule():  # the two consumers alternate: one's softmax under the other's matmuls
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        @pl.when(wg < _COMPUTE_WGS)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
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
                        kv_seg = _bcast_cols(plgpu.load(kvseg_ref.at[bi, pl.ds(j * bk, bk)],
                                                        layout=COL, optimized=False), s.shape)
                    ok = _visible(cfg, q_off + q_row + _iota(s.shape, 0), j * bk + _iota(s.shape, 1),
                                  None if q_seg is None else _bcast_rows(q_seg, s.shape), kv_seg,
                                  length=cfg.kv_len % bk != 0)
                    s = jnp.where(ok, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1) * scale2)
                # A row that has seen no key keeps m = -inf; shift it by 0 so exp2 gives 0.
                m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
                alpha = jnp.exp2(m - m_use)  # rescales what was summed under the old max
                p = jnp.exp2(s * scale2 - _bcast_rows(m_use, s.shape))
                acc = acc * _bcast_rows(alpha, acc.shape)
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

            carry = (plgpu.layout_cast(jnp.zeros((bq, d), jnp.float32), WGMMA),
                     plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), ROW),
                     plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), ROW))
            carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False), carry)
            if _needs_mask(cfg, bk):
                carry = lax.fori_loop(n_full, n_end, functools.partial(step, masked=True), carry)
            acc, m, l = carry
            pl.when(wg == 0)(schedule)

            seen = l > 0.0  # rows with no visible key give 0 and an LSE of +inf (P = 0 later)
            inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
            q_tile[...] = (acc * _bcast_rows(inv, acc.shape)).astype(dtype)
            lse_smem.at[wg][...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)) * (1 / _LN2),
                                             jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_tile, o_ref.at[bi, pl.ds(q_row, bq), h])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[bi, h, pl.ds(q_row, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == _COMPUTE_WGS)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            kvh = lax.div(h, jnp.int32(g))

            @pl.loop(0, n_end)
            def _(j):
                slot = lax.rem(j, st)
                rows = pl.ds(j * bk, bk)

                @pl.when(j >= st)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])

                plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, kvh], k_smem.at[slot], k_bar.at[slot])

                @pl.when(j >= st)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])

                plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, kvh], v_smem.at[slot], v_bar.at[slot])

            _drain(n_end, st, k_free, v_free)

    w = _COMPUTE_WGS
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
    args = [qoff, q, k, v] + ([q_seg, kv_seg] if cfg.segments else [])
    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((b, tp, n, d), dtype),
                  jax.ShapeDtypeStruct((b, n, tp), jnp.float32)),
        scratch_types=scratch,
        grid=(n_qt, n, b),
        grid_names=("q", "h", "b"),
        num_threads=w + 1,
        thread_name="wg",
        compiler_params=_compiler_params(),
        interpret=interpret_params(cfg.interpret),
    )(*args)


# ---------------------------------------------------------------------------------------
# Backward: dQ (loops over key tiles) and dK/dV (loops over query tiles and group heads).

def _dq(cfg: MosaicConfig, q, k, v, qoff, q_seg, kv_seg, lse, do, delta):
    """dQ [B, q_pad, N, D]: per query tile, S = Q K^T, dP = dO V^T, dS = P (dP - delta),
    dQ += dS K over the visible key tiles."""
    b, tp, n, d = q.shape
    bq, bk, st = cfg.blocks.block_q_dq, cfg.blocks.block_kv_dq, cfg.blocks.stages_bwd
    dtype, g = q.dtype, cfg.groups
    n_qt = tp // (_COMPUTE_WGS * bq)
    scale2 = cfg.sm_scale * _LOG2E

    def kernel(*refs):
        qoff_ref, ins, qseg_ref, kvseg_ref, rest = _unpack(refs, cfg, 7)
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
        dq_ref, q_smem, do_smem, k_smem, v_smem, ds_smem = rest[:6]
        qdo_bar, k_bar, v_bar, free = rest[6:]
        qi = lax.axis_index("q")
        if cfg.causal:
            qi = n_qt - 1 - qi
        h, bi, wg = lax.axis_index("h"), lax.axis_index("b"), lax.axis_index("wg")
        q_off = qoff_ref[0]
        block_lo = qi * (_COMPUTE_WGS * bq)
        n_full, n_end = _kv_steps(cfg, q_off + block_lo, q_off + block_lo + _COMPUTE_WGS * bq - 1, bk,
                                  length=False)

        @pl.when(wg < _COMPUTE_WGS)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            q_row = block_lo + wg * bq
            rows = pl.ds(q_row, bq)
            q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, h], q_tile, qdo_bar.at[wg])
            plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, h], do_tile, qdo_bar.at[wg])
            lse_r = plgpu.load(lse_ref.at[bi, h, rows], layout=ROW, optimized=False)
            delta_r = plgpu.load(delta_ref.at[bi, h, rows], layout=ROW, optimized=False)
            q_seg = None
            if cfg.segments:
                q_seg = plgpu.load(qseg_ref.at[bi, rows], layout=ROW, optimized=False)
            plgpu.barrier_wait(qdo_bar.at[wg])

            def run(dq_acc):
                def step(j, carry, masked: bool):
                    slot = lax.rem(j, st)
                    plgpu.barrier_wait(k_bar.at[slot])
                    plgpu.barrier_wait(v_bar.at[slot])

                    def s_dp(s_acc, dp_acc):
                        plgpu.wgmma(s_acc, q_tile, k_smem.at[slot].transpose((1, 0)))
                        plgpu.wgmma(dp_acc, do_tile, v_smem.at[slot].transpose((1, 0)))
                        return s_acc[...], dp_acc[...]

                    acc_t = plgpu.ACC((bq, bk), jnp.float32)
                    s, dp = pl.run_scoped(s_dp, acc_t, acc_t)
                    if masked:
                        kv_seg = None
                        if cfg.segments:
                            kv_seg = _bcast_cols(plgpu.load(kvseg_ref.at[bi, pl.ds(j * bk, bk)],
                                                            layout=COL, optimized=False), s.shape)
                        ok = _visible(cfg, q_off + q_row + _iota(s.shape, 0), j * bk + _iota(s.shape, 1),
                                      None if q_seg is None else _bcast_rows(q_seg, s.shape), kv_seg,
                                      length=False)  # padded keys are zero: they add 0 to dQ
                        s = jnp.where(ok, s, -jnp.inf)
                    p = jnp.exp2(s * scale2 - _bcast_rows(lse_r, s.shape))
                    ds = (p * (dp - _bcast_rows(delta_r, s.shape))).astype(dtype)
                    if cfg.regs:
                        plgpu.wgmma(dq_acc, ds, k_smem.at[slot])
                    else:
                        ds_tile = ds_smem.at[wg]
                        ds_tile[...] = ds
                        plgpu.commit_smem()
                        plgpu.wgmma(dq_acc, ds_tile, k_smem.at[slot])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(free.at[slot])
                    return carry

                lax.fori_loop(0, n_full, functools.partial(step, masked=False), 0)
                if cfg.causal or cfg.segments:
                    lax.fori_loop(n_full, n_end, functools.partial(step, masked=True), 0)
                return dq_acc[...]

            dq = pl.run_scoped(run, plgpu.ACC((bq, d), jnp.float32))
            q_tile[...] = (dq * cfg.sm_scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[bi, rows, h])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == _COMPUTE_WGS)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            kvh = lax.div(h, jnp.int32(g))

            @pl.loop(0, n_end)
            def _(j):
                slot = lax.rem(j, st)
                rows = pl.ds(j * bk, bk)

                @pl.when(j >= st)
                def _():
                    plgpu.barrier_wait(free.at[slot])

                plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, kvh], k_smem.at[slot], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, kvh], v_smem.at[slot], v_bar.at[slot])

            _drain(n_end, st, free)

    w = _COMPUTE_WGS
    scratch = (
        tiled_smem((w, bq, d), dtype),  # Q tiles, then dQ tiles
        tiled_smem((w, bq, d), dtype),  # dO tiles
        tiled_smem((st, bk, d), dtype),
        tiled_smem((st, bk, d), dtype),
        None if cfg.regs else tiled_smem((w, bq, bk), dtype),  # dS, when staged in smem
        plgpu.Barrier(num_arrivals=2, num_barriers=w),  # Q and dO loaded
        plgpu.Barrier(num_barriers=st),  # K slot filled
        plgpu.Barrier(num_barriers=st),  # V slot filled
        plgpu.Barrier(num_arrivals=w, num_barriers=st),  # K/V slot free again
    )
    args = [qoff, q, k, v, do, lse, delta] + ([q_seg, kv_seg] if cfg.segments else [])
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        scratch_types=scratch,
        grid=(n_qt, n, b),
        grid_names=("q", "h", "b"),
        num_threads=w + 1,
        thread_name="wg",
        compiler_params=_compiler_params(),
        interpret=interpret_params(cfg.interpret),
    )(*args)


def _dkv(cfg: MosaicConfig, q, k, v, qoff, q_seg, kv_seg, lse, do, delta):
    """dK, dV [B, kv_pad, K, D]: per key tile, over every query tile and every query head of
    its group: S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta),
    dK += dS^T Q. Summing over the group here is the GQA reduction, done in the kernel."""
    b, tp, n, d = q.shape
    sp, kh = k.shape[1], k.shape[2]
    bq, bk, st = cfg.blocks.block_q_dkv, cfg.blocks.block_kv_dkv, cfg.blocks.stages_bwd
    dtype, g = q.dtype, cfg.groups
    n_kt, n_q = sp // (_COMPUTE_WGS * bk), tp // bq
    scale2 = cfg.sm_scale * _LOG2E

    def kernel(*refs):
        qoff_ref, ins, qseg_ref, kvseg_ref, rest = _unpack(refs, cfg, 7)
        q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
        dk_ref, dv_ref, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem = rest[:9]
        kv_bar, q_bar, do_bar, free = rest[9:]
        ki, kvh = lax.axis_index("k"), lax.axis_index("h")
        bi, wg = lax.axis_index("b"), lax.axis_index("wg")
        q_off = qoff_ref[0]
        block_lo = ki * (_COMPUTE_WGS * bk)
        block_hi = block_lo + _COMPUTE_WGS * bk - 1
        # Steps run over (query tile i, group head j), j fastest; step = i * g + j.
        if cfg.causal:  # query tiles ending before the block's first key see none of it
            i_start = jnp.minimum(lax.div(jnp.maximum(block_lo - q_off, 0), bq), n_q)
            i_full = jnp.maximum(jnp.minimum(_cdiv(jnp.maximum(block_hi - q_off, 0), bq), n_q), i_start)
        else:
            i_start, i_full = 0, 0
        if cfg.segments:
            i_full = n_q
        s_start, s_full, s_end = i_start * g, i_full * g, n_q * g

        @pl.when(wg < _COMPUTE_WGS)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            k_row = block_lo + wg * bk
            rows = pl.ds(k_row, bk)
            k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
            plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, kvh], k_tile, kv_bar.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, kvh], v_tile, kv_bar.at[wg])
            kv_seg = None
            if cfg.segments:
                kv_seg = plgpu.load(kvseg_ref.at[bi, rows], layout=ROW, optimized=False)
            plgpu.barrier_wait(kv_bar.at[wg])

            def run(dk_acc, dv_acc):
                def step(s_idx, carry, masked: bool):
                    slot = lax.rem(s_idx - s_start, st)
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
                            q_seg = _bcast_cols(plgpu.load(qseg_ref.at[bi, pl.ds(i * bq, bq)],
                                                           layout=COL, optimized=False), s_t.shape)
                        ok = _visible(cfg, q_off + i * bq + _iota(s_t.shape, 1), k_row + _iota(s_t.shape, 0),
                                      q_seg, None if kv_seg is None else _bcast_rows(kv_seg, s_t.shape),
                                      length=False)  # padded keys' rows are dropped
                        s_t = jnp.where(ok, s_t, -jnp.inf)
                    p_t = jnp.exp2(s_t * scale2 - _bcast_cols(lse_c, s_t.shape))
                    p16 = p_t.astype(dtype)
                    plgpu.barrier_wait(do_bar.at[slot])
                    if cfg.regs:
                        def dp_scoped(acc):
                            plgpu.wgmma(acc, v_tile, do_smem.at[slot].transpose((1, 0)))
                            plgpu.wgmma(dv_acc, p16, do_smem.at[slot])
                            return plgpu.wgmma_accumulator_load(acc, wait_n=1)  # dP^T, not dV
                    else:
                        ds_tile = ds_smem.at[wg]
                        ds_tile[...] = p16
                        plgpu.commit_smem()

                        def dp_scoped(acc):
                            plgpu.wgmma(acc, v_tile, do_smem.at[slot].transpose((1, 0)))
                            plgpu.wgmma(dv_acc, ds_tile, do_smem.at[slot])
                            plgpu.wgmma_wait(0)
                            return acc[...]

                    dp_t = pl.run_scoped(dp_scoped, plgpu.ACC((bk, bq), jnp.float32))
                    delta_c = plgpu.load(delta_smem.at[slot], layout=COL)
                    ds_t = (p_t * (dp_t - _bcast_cols(delta_c, s_t.shape))).astype(dtype)
                    if cfg.regs:
                        plgpu.wgmma(dk_acc, ds_t, q_smem.at[slot])
                    else:
                        ds_tile[...] = ds_t
                        plgpu.commit_smem()
                        plgpu.wgmma(dk_acc, ds_tile, q_smem.at[slot])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(free.at[slot])
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

        @pl.when(wg == _COMPUTE_WGS)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")

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

            _drain(s_end - s_start, st, free)

    w = _COMPUTE_WGS
    scratch = (
        tiled_smem((w, bk, d), dtype),  # K tiles, then dK tiles
        tiled_smem((w, bk, d), dtype),  # V tiles, then dV tiles
        tiled_smem((st, bq, d), dtype),  # Q
        tiled_smem((st, bq, d), dtype),  # dO
        plgpu.SMEM((st, bq), jnp.float32),  # LSE
        plgpu.SMEM((st, bq), jnp.float32),  # delta
        None if cfg.regs else tiled_smem((w, bk, bq), dtype),  # P^T / dS^T staged in smem
        plgpu.Barrier(num_arrivals=2, num_barriers=w),  # K and V loaded
        plgpu.Barrier(num_arrivals=2, num_barriers=st),  # Q and LSE slot filled
        plgpu.Barrier(num_arrivals=2, num_barriers=st),  # dO and delta slot filled
        plgpu.Barrier(num_arrivals=w, num_barriers=st),  # slot free again
    )
    args = [qoff, q, k, v, do, lse, delta] + ([q_seg, kv_seg] if cfg.segments else [])
    out = jax.ShapeDtypeStruct((b, sp, kh, d), dtype)
    return plgpu.kernel(
        kernel,
        out_type=(out, out),
        scratch_types=scratch,
        grid=(n_kt, kh, b),
        grid_names=("k", "h", "b"),
        num_threads=w + 1,
        thread_name="wg",
        compiler_params=_compiler_params(),
        interpret=interpret_params(cfg.interpret),
    )(*args)


# ---------------------------------------------------------------------------------------
# Differentiable wrapper.

def _pad_seq(x, length: int, value=0):
    if x is None or x.shape[1] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    return jnp.pad(x, widths, constant_values=value)


def _padded(cfg: MosaicConfig, q, k, v, q_seg, kv_seg):
    q, k, v = _pad_seq(q, cfg.q_pad), _pad_seq(k, cfg.kv_pad), _pad_seq(v, cfg.kv_pad)
    return q, k, v, _pad_seq(q_seg, cfg.q_pad, -1), _pad_seq(kv_seg, cfg.kv_pad, -2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg: MosaicConfig, q, k, v, qoff, q_seg, kv_seg):
    return _flash_fwd(cfg, q, k, v, qoff, q_seg, kv_seg)[0]


def _flash_fwd(cfg: MosaicConfig, q, k, v, qoff, q_seg, kv_seg):
    qp, kp, vp, qsp, kvsp = _padded(cfg, q, k, v, q_seg, kv_seg)
    o, lse = _forward(cfg, qp, kp, vp, qoff, qsp, kvsp)
    o = o[:, : cfg.q_len]
    # Residuals are O(seq): the inputs, the output and one fp32 LSE per query row.
    return o, (q, k, v, qoff, q_seg, kv_seg, o, lse)


def _flash_bwd(cfg: MosaicConfig, res, do):
    q, k, v, qoff, q_seg, kv_seg, o, lse = res
    # delta_i = sum_h dO_ih O_ih = sum_j P_ij dP_ij: the row term of the softmax Jacobian.
    delta = jnp.einsum("btnh,btnh->bnt", o.astype(jnp.float32), do.astype(jnp.float32))
    delta = jnp.pad(delta, ((0, 0), (0, 0), (0, cfg.q_pad - cfg.q_len)))
    qp, kp, vp, qsp, kvsp = _padded(cfg, q, k, v, q_seg, kv_seg)
    # Padded query rows get dO = 0 and delta = 0, so they add nothing to dK and dV.
    dop = _pad_seq(do.astype(q.dtype), cfg.q_pad)
    dq = _dq(cfg, qp, kp, vp, qoff, qsp, kvsp, lse, dop, delta)
    dk, dv = _dkv(cfg, qp, kp, vp, qoff, qsp, kvsp, lse, dop, delta)
    return dq[:, : cfg.q_len], dk[:, : cfg.kv_len], dv[:, : cfg.kv_len], None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
_flash_jit = jax.jit(_flash, static_argnums=(0,))


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
    blocks.check_smem(h, regs)
    cfg = MosaicConfig(
        causal=bool(causal), sm_scale=float(1 / math.sqrt(h) if sm_scale is None else sm_scale),
        blocks=blocks, q_len=t, kv_len=s, groups=n // kh,
        segments=q_segment_ids is not None, regs=regs, interpret=bool(interpret))
    qoff = jnp.asarray(q_offset, jnp.int32).reshape(1)
    q_seg = kv_seg = None
    if cfg.segments:
        q_seg, kv_seg = q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)
    return _flash_jit(cfg, q_BTNH, k_BSKH, v_BSKH, qoff, q_seg, kv_seg)
