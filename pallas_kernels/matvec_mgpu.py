"""Decode-step weight matrix-vector products for Hopper (sm90) in Pallas Mosaic GPU.

y[B, N] = x[B, K] @ w[N, K]^T with w stored output-major (K minor, as the decode path keeps
it), bf16 or fp16, accumulated in fp32. At decode batch sizes (B <= 64) the op only streams
w: its time is w's bytes over HBM bandwidth. On an H200 XLA's own reduction reaches
1.8-2.7 TB/s on the model's shapes and a Pallas Triton kernel 2.1 TB/s (too few bytes in
flight per SM), against ~4.3 TB/s that a read-only stream gets. This kernel keeps enough
bytes in flight the way `paged_attention_mgpu` streams KV pages (4.1 TB/s): TMA bulk copies
into a shared-memory ring of `stages` slots, a producer warpgroup issuing them and a consumer
warpgroup feeding the tensor core.

Grid: one block per (tile of n_tile rows of w, K split). A block walks its K range in chunks
of kc columns; step j's slot j % stages holds w[tile, chunk] [n_tile, kc] and x[:, chunk]
in the first B8 rows (B rounded up to 8; TMA reads zeros past x's last row) of a 64-row tile. The consumer's wgmma takes that
x tile as A [64, kc] and the w slot seen transposed as B [kc, n_tile] (as the paged kernel's
S = Q K^T takes K), into one fp32 accumulator [64, n_tile] for the whole K range; it keeps
one wgmma in flight and frees the previous step's slot. Rows past B8 of the x tiles are
never written: a matmul's rows are independent, so what they hold only reaches accumulator
rows that are never stored. (The tensor core does 64/B times the useful math: at n_tile 128
it could take ~15 TB/s of weights, far above HBM.)

Output: with one split the block's rows 0..B-1 leave in x's dtype through an untiled
shared-memory tile (a TMA copy of exactly B rows); with several the blocks write fp32
partials [splits, B, N] that `matvec_mgpu` sums in XLA (`matvec_mgpu_partials` returns them
unsummed, for a consumer that sums them itself).

`interpret=True` runs Mosaic GPU's CPU interpreter (see `_mgpu.py`).

Measured on the H200 (`benchmarks/README.md`, issue 19): 3.60 TB/s on the 1b gate|up
product (46 MB; XLA 3.14), 2.55 on down (23 MB; XLA 2.16), but slower than XLA's one-row
reduction on every product under ~10 MB: a kernel's fixed cost of 2-3 us (launch, first
copy, epilogue) dominates there. A decode step through it was slower (1b 1.106 against
1.065 ms, 350m 0.699 against 0.511), so the decode path does not use it (that path is in
commit 123ede2); it stays as a tested building block with its benchmark.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mgpu import SMEM_LIMIT, launch, sm_count, smem_bytes, tiled_smem

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
N_TILES = (64, 128)  # 256 fails Mosaic GPU's layout inference on jax 0.12 (untiled output)
MAX_BATCH = 64  # rows of one wgmma tile: the batch takes its first rows
_ROWS = 64
_SMEM_SLACK = 2048  # shared memory left to Mosaic GPU (barriers, alignment)
_SM_SMEM = 228 * 1024  # shared memory of one SM (each block also takes 1 KiB the system reserves)
# The splits' cost model (`_time_us`), rough H200 guesses, not fitted: HBM read bandwidth, the
# most one SM streams in fair shares of it, a block's fixed time (its first copy's latency, the
# epilogue) and the XLA sum of split partials (a kernel launch). Measured
# (benchmarks/matvec_mgpu_h200.json, batch 1) its picks are the fastest of five tilings on
# three of the eight decode products and within 12% of the fastest on the other five.
_HBM_BPS = 4.3e12
_SM_RATE = 2.0
_BLOCK_US = 1.0
_SPLIT_US = 2.0


@dataclasses.dataclass(frozen=True)
class MatvecBlockSizes:
    """Tiling of the Mosaic GPU matvec; None picks a default from the shapes."""

    n_tile: int = 128  # rows of w per block (64 or 128; the wgmma's N)
    kc: int = 128  # columns of K per pipeline step (a multiple of 64)
    stages: int = 4  # slots of the shared-memory ring (>= 2: a slot is freed a step late)
    splits: int | None = None  # blocks along K (a divisor of K / kc); None: `default_splits`

    def __post_init__(self):
        if self.n_tile not in N_TILES:
            raise ValueError(f"MatvecBlockSizes.n_tile={self.n_tile}: use one of {N_TILES}.")
        if self.kc < 64 or self.kc % 64:
            raise ValueError(f"MatvecBlockSizes.kc={self.kc}: use a multiple of 64.")
        if self.stages < 2:  # the consumer frees a slot a step late (one wgmma in flight)
            raise ValueError(f"MatvecBlockSizes.stages={self.stages}: use >= 2.")
        if self.splits is not None and self.splits < 1:
            raise ValueError(f"MatvecBlockSizes.splits={self.splits}: use >= 1 or None.")
        need = _smem_need(self.n_tile, self.kc, self.stages)
        if need > SMEM_LIMIT - _SMEM_SLACK:
            raise ValueError(f"MatvecBlockSizes.stages={self.stages}: {need} bytes of shared memory at "
                             f"n_tile={self.n_tile}, kc={self.kc} (at most {SMEM_LIMIT - _SMEM_SLACK}); "
                             "use fewer stages or a smaller kc.")

    @property
    def tag(self) -> str:
        """A short name, e.g. n128_kc128_st4 (with _s2 for splits=2)."""
        return f"n{self.n_tile}_kc{self.kc}_st{self.stages}" + (f"_s{self.splits}" if self.splits else "")


def _smem_need(n_tile: int, kc: int, stages: int) -> int:
    """Shared memory of one block: the w and x rings and the fp32 output staging (the larger
    of the two outputs, so that one check covers both)."""
    return smem_bytes(((stages, n_tile, kc), jnp.bfloat16), ((stages, _ROWS, kc), jnp.bfloat16),
                      ((_ROWS, n_tile), jnp.float32))


def _time_us(tiles: int, chunks: int, splits: int, sizes: MatvecBlockSizes, sms: int) -> float:
    """The cost model's time of one call: waves of as many blocks as the SMs hold at once (shared
    memory decides how many fit on one), each block `_BLOCK_US` plus its steps, a step at the
    HBM share of the wave's blocks but no faster than `_SM_RATE` fair shares per SM; plus
    `_SPLIT_US` for the partials' sum when split."""
    per_sm = max(1, _SM_SMEM // (_smem_need(sizes.n_tile, sizes.kc, sizes.stages) + 1024))
    blocks, steps = tiles * splits, chunks // splits
    fair_step_us = sizes.n_tile * sizes.kc * 2 / (_HBM_BPS / sms) * 1e6  # a step at 1/sms of HBM
    t = _SPLIT_US if splits > 1 else 0.0
    for first in range(0, blocks, sms * per_sm):
        m = min(sms * per_sm, blocks - first)
        t += _BLOCK_US + steps * fair_step_us * max(-(-m // sms) / _SM_RATE, m / sms)
    return t


def default_splits(tiles: int, chunks: int, sizes: MatvecBlockSizes | None = None,
                   sms: int | None = None) -> int:
    """Blocks along K for `tiles` row tiles of `chunks` kc-steps each: the divisor of `chunks`
    that the cost model (`_time_us`) says finishes first. Few tiles want splits (so that enough
    SMs stream), but every split costs a block's latency and, when > 1, an XLA sum."""
    sms = sms or sm_count()
    sizes = sizes or MatvecBlockSizes()
    divisors = [s for s in range(1, chunks + 1) if chunks % s == 0]
    return min(divisors, key=lambda s: (_time_us(tiles, chunks, s, sizes, sms), s))


def default_block_sizes(B: int, N: int, K: int) -> MatvecBlockSizes:
    """The defaults for x [B, K] @ w [N, K]^T: n_tile 128 (64 when N is not a multiple of 128),
    kc 128 (64 when K is not a multiple of 128), 4 stages, splits by `default_splits`."""
    del B  # the tiling does not depend on it: w's bytes are the work
    n_tile = 128 if N % 128 == 0 else 64
    kc = 128 if K % 128 == 0 else 64
    sizes = MatvecBlockSizes(n_tile=n_tile, kc=kc)
    return dataclasses.replace(sizes, splits=default_splits(N // n_tile, K // kc, sizes))


def supports(x_shape, w_shape, dtype) -> bool:
    """Whether the kernel takes x [B, K] @ w [N, K]^T of this dtype (`resolve_block_sizes`'s
    rules: B <= 8 or a multiple of 8 up to 64, K and N multiples of 64, bf16 or fp16)."""
    try:
        resolve_block_sizes(jax.ShapeDtypeStruct(x_shape, dtype), jax.ShapeDtypeStruct(w_shape, dtype))
    except ValueError:
        return False
    return True


def resolve_block_sizes(x_BK, w_NK, sizes: MatvecBlockSizes | None = None) -> MatvecBlockSizes:
    """The block sizes a call on x_BK, w_NK (arrays or jax.ShapeDtypeStruct) runs with, splits
    resolved (None: `default_block_sizes`); raises a ValueError naming what does not fit."""
    if x_BK.ndim != 2 or w_NK.ndim != 2 or x_BK.shape[1] != w_NK.shape[1]:
        raise ValueError(f"matvec_mgpu: x_BK {x_BK.shape} and w_NK {w_NK.shape}: want [B, K] and [N, K].")
    if x_BK.dtype != w_NK.dtype or jnp.dtype(x_BK.dtype) not in map(jnp.dtype, SUPPORTED_DTYPES):
        raise ValueError(f"matvec_mgpu: dtypes x {x_BK.dtype}, w {w_NK.dtype}: want both bf16 or both fp16.")
    (B, K), N = x_BK.shape, w_NK.shape[0]
    if B < 1:
        raise ValueError(f"matvec_mgpu: batch B={B}: want at least one row.")
    if B > MAX_BATCH:
        raise ValueError(f"matvec_mgpu: batch B={B} > {MAX_BATCH} (one wgmma tile); split the batch.")
    if B > 8 and B % 8:
        raise ValueError(f"matvec_mgpu: batch B={B}: use B <= 8 or a multiple of 8 (pad x's rows).")
    if K % 64 or N % 64:
        raise ValueError(f"matvec_mgpu: N={N}, K={K}: both must be multiples of 64.")
    if sizes is None:
        return default_block_sizes(B, N, K)
    if N % sizes.n_tile:
        raise ValueError(f"MatvecBlockSizes.n_tile={sizes.n_tile} does not divide N={N}; use one that does "
                         "(default_block_sizes picks it).")
    if K % sizes.kc:
        raise ValueError(f"MatvecBlockSizes.kc={sizes.kc} does not divide K={K}; use one that does.")
    chunks = K // sizes.kc
    if sizes.splits is None:
        return dataclasses.replace(sizes, splits=default_splits(N // sizes.n_tile, chunks, sizes))
    if chunks % sizes.splits:
        raise ValueError(f"MatvecBlockSizes.splits={sizes.splits} does not divide K/kc={chunks}; use a divisor.")
    return sizes


def _kernel_call(x_BK, w_NK, sizes: MatvecBlockSizes, interpret: bool, partials: bool):
    """y [B, N] in x's dtype with one split (unless `partials`), else fp32 partials
    [splits, B, N]."""
    B, K = x_BK.shape
    B8 = -(-B // 8) * 8  # x rows per copy: TMA fills the rows past B with zeros
    N = w_NK.shape[0]
    dtype = x_BK.dtype
    nt, kc, st, splits = sizes.n_tile, sizes.kc, sizes.stages, sizes.splits
    steps = K // kc // splits  # pipeline steps of one block
    final = splits == 1 and not partials
    out_dtype = dtype if final else jnp.float32

    def kernel(x_ref, w_ref, y_ref, x_smem, w_smem, y_smem, full, free):
        tile, split, wg = lax.axis_index("n"), lax.axis_index("k"), lax.axis_index("wg")
        rows = pl.ds(tile * nt, nt)
        step0 = split * steps  # the block's first chunk of K
        # x's copy of B8 rows runs past its end when B < B8 (TMA reads zeros there); a traced
        # start (0) keeps such a slice clear of any static bounds check.
        row0 = tile - tile

        @pl.when(wg == 1)
        def _producer():
            @pl.loop(0, steps)
            def _(j):
                slot = lax.rem(j, st)
                pl.when(j >= st)(lambda: plgpu.barrier_wait(free.at[slot]))  # its last wgmma is done
                cols = pl.ds((step0 + j) * kc, kc)
                # One TMA copy each: tiled, a box is [rows / 8, kc / 64, 8, 64] (<= 256 per dimension).
                plgpu.copy_gmem_to_smem(w_ref.at[rows, cols], w_smem.at[slot], full.at[slot])
                plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(row0, B8), cols], x_smem.at[slot, pl.ds(0, B8)],
                                        full.at[slot])

            @pl.loop(max(steps - st, 0), steps)
            def _(j):  # the last slots' release: every barrier phase is observed
                plgpu.barrier_wait(free.at[lax.rem(j, st)])

        @pl.when(wg == 0)
        def _consumer():
            def k_loop(acc_ref):
                @pl.loop(0, steps)
                def _(j):
                    slot = lax.rem(j, st)
                    plgpu.barrier_wait(full.at[slot])
                    plgpu.wgmma(acc_ref, x_smem.at[slot], w_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma_wait(1)  # step j - 1's wgmma is done: its slot is free
                    pl.when(j > 0)(lambda: plgpu.barrier_arrive(free.at[lax.rem(j + st - 1, st)]))

                plgpu.wgmma_wait(0)
                plgpu.barrier_arrive(free.at[(steps - 1) % st])
                return acc_ref[...]

            acc = pl.run_scoped(k_loop, plgpu.ACC((_ROWS, nt), jnp.float32))
            y_smem[...] = acc.astype(out_dtype)
            plgpu.commit_smem()
            dst = y_ref.at[pl.ds(0, B), rows] if final else y_ref.at[split, pl.ds(0, B), rows]
            plgpu.copy_smem_to_gmem(y_smem.at[pl.ds(0, B)], dst)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out_shape = (B, N) if final else (splits, B, N)
    scratch = (
        tiled_smem((st, _ROWS, kc), dtype),  # x chunks: rows 0..B8-1 of each slot
        tiled_smem((st, nt, kc), dtype),  # w tiles
        plgpu.SMEM((_ROWS, nt), out_dtype),  # output staging, untiled: a TMA copy of B rows
        plgpu.Barrier(num_arrivals=2, num_barriers=st),  # slot filled (its w and x copies)
        plgpu.Barrier(num_barriers=st),  # slot free again
    )
    return launch(kernel, (x_BK, w_NK), out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
                  scratch=scratch, grid=(N // nt, splits), grid_names=("n", "k"), num_threads=2,
                  interpret=interpret, manual_barriers=True, name="matvec")


def _prepare(x_BK, w_NK, block_sizes, interpret, partials):
    sizes = resolve_block_sizes(x_BK, w_NK, block_sizes)
    return _kernel_call(x_BK, w_NK, sizes, interpret, partials), sizes


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def matvec_mgpu_partials(x_BK, w_NK, *, block_sizes: MatvecBlockSizes | None = None,
                         interpret: bool = False):
    """fp32 partial products [splits, B, N] of x_BK [B, K] @ w_NK [N, K]^T, one per K split
    (their sum is the product; [1, B, N] with one split), for a consumer that sums them itself."""
    return _prepare(x_BK, w_NK, block_sizes, interpret, partials=True)[0]


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def matvec_mgpu(x_BK, w_NK, *, block_sizes: MatvecBlockSizes | None = None,
                interpret: bool = False):
    """y_BN = x_BK [B, K] @ w_NK [N, K]^T in x's dtype, accumulated in fp32 (bf16 or fp16,
    B <= 64). With splits > 1 the kernel's fp32 partials are summed in XLA."""
    out, sizes = _prepare(x_BK, w_NK, block_sizes, interpret, partials=False)
    return out if sizes.splits == 1 else out.sum(axis=0).astype(x_BK.dtype)
