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

from pallas_kernels._mgpu import COL, ROW, SMEM_LIMIT, WGMMA, interpret_params, smem_bytes, tiled_smem

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

    def check_smem(self, head_dim: int, itemsize: int = 2):
        """Raises if a kernel's shared memory would exceed what one sm90 block has."""
        d, w = head_dim, _COMPUTE_WGS
        need = {
            "forward": smem_bytes(((w, self.block_q, d), jnp.float16),
                                  ((2 * self.stages, self.block_kv, d), jnp.float16),
                                  ((w, self.block_q, self.block_kv), jnp.float16)),
            "dq": smem_bytes(((2 * w, self.block_q_dq, d), jnp.float16),
                             ((2 * self.stages_bwd, self.block_kv_dq, d), jnp.float16),
                             ((w, self.block_q_dq, self.block_kv_dq), jnp.float16)),
            "dkv": smem_bytes(((2 * w, self.block_kv_dkv, d), jnp.float16),
                              ((2 * self.stages_bwd, self.block_q_dkv, d), jnp.float16),
                              ((w, self.block_kv_dkv, self.block_q_dkv), jnp.float16)),
        }
        for name, n in need.items():
            if n * itemsize // 2 > SMEM_LIMIT - 2048:
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


def _kv_steps(cfg: MosaicConfig, pos_first, pos_last, bk: int):
    """Key tiles [0, n_full) are visible to every query in [pos_first, pos_last] and need no
    mask; [n_full, n_end) need one; tiles from n_end on are skipped (causal)."""
    n_end, n_full = -(-cfg.kv_len // bk), cfg.kv_len // bk  # Python ints stay literals
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
