"""A decode step's SwiGLU MLP as one persistent Mosaic GPU kernel (Hopper, sm90).

y[B, D] = (silu(h @ w_gate^T) * (h @ w_up^T)) @ w_down^T for a few rows h [B, D] (B <= 64),
with w_gate_up [2F, D] (gate rows then up rows, the decode layout's `w_gate_up_GD`) and
w_down [D, F], bf16 or fp16, fp32 accumulation; y comes back in fp32 (the caller casts).

Why one kernel: at batch 1 XLA runs the MLP as three kernels (gate|up product, SwiGLU, down
product), and each pays a fixed 2-3 us (launch, the first copy's latency, the tail) that a
whole 1b layer's ~24 us floor cannot hide (benchmarks/README.md, issue 19). Here one block
per SM streams both products' weights through one shared-memory ring: the weights do not
depend on the activations, so once a block's producer warpgroup has issued its gate|up
copies it fills the ring's free slots with its first down weight tiles (`prefetch`) and only
then waits at the grid-wide barrier between the phases; the down phase's *input* chunks are
what wait for it.

Work: phase 1 units are row tiles of `rows` gate rows and the `rows` up rows that pair with
them, over all of K = D, ending in the SwiGLU (written as the bf16 hidden [B, F] to global
memory, as XLA's SwiGLU rounds it); phase 2 units are (tile of 2 * rows rows of w_down, a K
range of F / splits), whose fp32 partial products are added into y with TMA reduce-add.
Units are dealt round-robin over the blocks, phase 2 continuing where phase 1 stopped, so the
blocks without gate|up work take the down units first. Each block walks its units' kc-wide
steps through a `stages`-slot ring: slot = two [rows, kc] weight tiles (one mbarrier) and the
activation chunk [B8, kc] (another) at the start of a 64-row window (wgmma's A is 64 rows; as
in `matvec_mgpu`, the rows past B8 reach only accumulator rows that are never stored).

The barrier: every block's consumer, after its phase 1 stores have landed (and block 0's
zeroing of y), fences and adds 1 to a global semaphore; a producer issues its first phase 2
activation copy only once the semaphore reads the block count. Every block must be resident
at once (one block per SM: the ring takes most of the shared memory), so `blocks` is at
most the SM count. Mosaic GPU's CPU interpreter runs grid points one after another and has
no global semaphores, so `interpret=True` runs one block (the barrier is then the block's
own mbarrier between its consumer and producer, which the GPU path also keeps).

Measured on an H200 (benchmarks/README.md, issue 19): 1b at batch 1 21.9 us of kernel time a
layer (3.14 TB/s), faster than XLA's GEMM form of the MLP (30.4 us a layer in a chain) but no
faster than a decode step's own (row reductions): a whole 1b step 1.094 ms with it against
1.096 without, a 350m step slower (0.620 against 0.528 ms). Its ring alone streams at 4.1
TB/s (`experiments/probe_tma_stream.py`): what is lost is in the phases (at 1b 88 gate|up
units on 132 SMs, a drained wgmma pipeline and an epilogue per unit, the barrier). A tested
building block, not on the decode path.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mgpu import SMEM_LIMIT, fence, launch, sm_count, smem_bytes, tiled_smem

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
MAX_BATCH = 64
_M = 64  # rows of the activation tile (wgmma M; the batch takes the first B8)
ROWS = (8, 16, 32, 64)  # rows of a weight tile (wgmma N)
_STEP_BYTES = 16 * 1024  # the default kc makes a ring step's two weight tiles about this big
_MAX_STAGES = 16
_SMEM_SLACK = 2048


@dataclasses.dataclass(frozen=True)
class MlpBlockSizes:
    """Tiling of the persistent MLP kernel; None picks a default from the shapes."""

    kc: int | None = None  # columns of K per ring step (a multiple of 64); None: `default_kc`
    stages: int | None = None  # ring slots (>= 2); None: as many as shared memory holds
    rows: int | None = None  # rows of a weight tile (8, 16, 32 or 64); None: `default_rows`
    splits: int | None = None  # K ranges of the down product; None: `default_splits`
    blocks: int | None = None  # persistent blocks; None: the SM count (1 in the interpreter)
    prefetch: bool = True  # fill free ring slots with down weights before the phase barrier

    def __post_init__(self):
        if self.kc is not None and (self.kc < 64 or self.kc % 64):
            raise ValueError(f"MlpBlockSizes.kc={self.kc}: use a multiple of 64.")
        if self.stages is not None and self.stages < 2:
            raise ValueError(f"MlpBlockSizes.stages={self.stages}: use >= 2.")
        if self.rows is not None and self.rows not in ROWS:
            raise ValueError(f"MlpBlockSizes.rows={self.rows}: use one of {ROWS} or None.")
        for name in ("splits", "blocks"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"MlpBlockSizes.{name}={v}: use >= 1 or None.")
        if self.kc and self.stages:
            check_smem(self.kc, self.stages, self.rows or max(ROWS), 8)


def x_rows(stages: int, B8: int) -> int:
    """Rows of the activation ring. Slot s's wgmma operand is the 64-row window starting at row
    s * B8: its first B8 rows are slot s's chunk, the rest other slots' chunks (or, past the
    last slot, never written), which reach only accumulator rows that are never stored. So the
    ring takes (stages - 1) * B8 + 64 rows instead of stages * 64."""
    return (stages - 1) * B8 + _M


def smem_need(kc: int, stages: int, rows: int, B8: int) -> int:
    """Shared memory of one block: the weight ring (two tiles a slot), the activation ring and
    the two epilogues' staging tiles."""
    return smem_bytes(((stages, 2, rows, kc), jnp.bfloat16), ((x_rows(stages, B8), kc), jnp.bfloat16),
                      ((_M, rows), jnp.bfloat16), ((2, _M, rows), jnp.float32))


def check_smem(kc: int, stages: int, rows: int, B8: int):
    need = smem_need(kc, stages, rows, B8)
    if need > SMEM_LIMIT - _SMEM_SLACK:
        raise ValueError(f"MlpBlockSizes.stages={stages}: {need} bytes of shared memory at kc={kc}, "
                         f"rows={rows}, batch rows {B8} (at most {SMEM_LIMIT - _SMEM_SLACK}); use "
                         "fewer stages or a smaller kc.")


def default_rows(F: int, blocks: int) -> int:
    """Rows of a weight tile: the most (up to 64) that still give at least one gate|up unit
    for every other block. Measured on an H200 (benchmarks/README.md, issue 19): fewer,
    larger units win over a phase that keeps every block busy (1b, F 5632: 64 rows, 88 units
    on 132 blocks, 26.4 us a layer against 30.4 at 16 rows, 352 units; 350m, F 2816: 32 rows,
    16.4 against 20.0 at 8 rows): each unit pays its ring's fill and its epilogue."""
    fits = [r for r in ROWS if F % r == 0]
    good = [r for r in fits if 2 * (F // r) >= blocks]
    return max(good) if good else min(fits)


def default_kc(D: int, F: int, rows: int) -> int:
    """K per ring step: two weight tiles of about `_STEP_BYTES`, each row a contiguous piece of
    kc * 2 bytes of HBM (wider pieces stream better), at most 256 (the activation tile's
    64-row window grows with kc), dividing D and F."""
    kc = min(256, max(64, _STEP_BYTES // (2 * rows * 2)))
    while kc > 64 and (D % kc or F % kc):
        kc //= 2
    return kc


def default_stages(kc: int, rows: int, B8: int) -> int:
    """As many ring slots as shared memory holds (at most 16)."""
    st = 2
    while st < _MAX_STAGES and smem_need(kc, st + 1, rows, B8) <= SMEM_LIMIT - _SMEM_SLACK:
        st += 1
    return st


def default_splits(D: int, F: int, kc: int, blocks: int, rows: int = 64) -> int:
    """K ranges of the down product: the divisor of F / kc whose units, dealt round-robin after
    the gate|up units, leave the busiest block the fewest down steps (ties: fewer splits)."""
    chunks, tiles = F // kc, D // (2 * rows)

    def busiest(s):
        units = tiles * s
        return -(-units // blocks) * (chunks // s)

    return min((s for s in range(1, chunks + 1) if chunks % s == 0), key=lambda s: (busiest(s), s))


_TAG = re.compile(r"(?:kc(\d+))?(?:_?st(\d+))?(?:_?r(\d+))?(?:_?s(\d+))?(?:_?b(\d+))?(_?nopf)?$")


def parse_sizes(tag: str) -> MlpBlockSizes:
    """`MlpBlockSizes` from a tag such as "kc64_st10_r64" (kc, stages, rows, splits, blocks,
    then "nopf" for prefetch off; any subset in this order, "" for the defaults)."""
    m = _TAG.match(tag)
    if m is None:
        raise ValueError(f"mlp tiling {tag!r}: want kc<N>_st<N>_r<N>_s<N>_b<N>[_nopf], any "
                         "subset in this order (e.g. 'kc64_st10_r64'), or '' for the defaults.")
    kc, st, r, s, b = (int(v) if v else None for v in m.groups()[:5])
    return MlpBlockSizes(kc=kc, stages=st, rows=r, splits=s, blocks=b, prefetch=not m.group(6))


def check(h_BD, w_gate_up_GD, w_down_DF):
    """Raises a ValueError naming what does not fit the kernel; returns (B, D, F)."""
    shapes = (h_BD.shape, w_gate_up_GD.shape, w_down_DF.shape)
    wrong = ValueError(f"mlp_mgpu: h {shapes[0]}, w_gate_up {shapes[1]}, w_down {shapes[2]}: "
                       "want [B, D], [2F, D], [D, F].")
    if any(len(s) != 2 for s in shapes):
        raise wrong
    (B, D), (G, D2), (D3, F) = shapes
    if (G, D2, D3) != (2 * F, D, D):
        raise wrong
    dts = {jnp.dtype(a.dtype) for a in (h_BD, w_gate_up_GD, w_down_DF)}
    if len(dts) != 1 or dts.pop() not in map(jnp.dtype, SUPPORTED_DTYPES):
        raise ValueError("mlp_mgpu: h and both weights must share one dtype, bf16 or fp16.")
    if not 1 <= B <= MAX_BATCH or (B > 8 and B % 8):
        raise ValueError(f"mlp_mgpu: batch B={B}: use 1..8 or a multiple of 8 up to {MAX_BATCH}.")
    if D % 128 or F % 64:
        raise ValueError(f"mlp_mgpu: D={D} must be a multiple of 128 and F={F} of 64.")
    return B, D, F


def supports(h_shape, D: int, F: int, dtype) -> bool:
    """Whether `mlp_mgpu` takes h of this shape with these widths and dtype."""
    try:
        check(jax.ShapeDtypeStruct(h_shape, dtype), jax.ShapeDtypeStruct((2 * F, D), dtype),
              jax.ShapeDtypeStruct((D, F), dtype))
    except ValueError:
        return False
    return True


def _kernel_call(h_BD, w_gu, w_down, sizes: MlpBlockSizes, blocks: int, interpret: bool):
    B, D = h_BD.shape
    F = w_down.shape[1]
    B8 = -(-B // 8) * 8
    dtype = h_BD.dtype
    R = sizes.rows or default_rows(F, blocks)
    kc = sizes.kc or default_kc(D, F, R)
    if D % kc or F % kc:
        raise ValueError(f"MlpBlockSizes.kc={kc} must divide D={D} and F={F}.")
    st = sizes.stages or default_stages(kc, R, B8)
    check_smem(kc, st, R, B8)
    splits = sizes.splits or default_splits(D, F, kc, blocks, R)
    if (F // kc) % splits:
        raise ValueError(f"MlpBlockSizes.splits={splits} does not divide F/kc={F // kc}.")
    U1, steps1 = F // R, D // kc  # gate|up units and their steps
    tiles2 = D // (2 * R)
    U2, steps2 = tiles2 * splits, F // kc // splits  # down units and their steps
    NB = blocks
    grid_sync = NB > 1
    prefetch = sizes.prefetch

    def counts(b):
        n1 = jnp.maximum(0, (U1 - b + NB - 1) // NB)
        first2 = lax.rem(b - U1 % NB + NB, NB)  # the first down unit dealt to block b
        n2 = jnp.maximum(0, (U2 - first2 + NB - 1) // NB)
        return n1, first2, n2

    def kernel(h_ref, wgu_ref, wd_ref, y_ref, hid_ref, x_smem, w_smem, hid_smem, y_smem,
               w_full, x_full, free, phase1_done):
        b, wg = lax.axis_index("b"), lax.axis_index("wg")
        n1, first2, n2 = counts(b)
        row0 = b - b  # a traced 0: the B8-row copies run past B (TMA reads zeros there)
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR(())) if grid_sync else None

        def unit1(i):  # block b's i-th gate|up unit: its 64 gate rows
            return (b + i * NB) * R

        def unit2(i):  # block b's i-th down unit: (first row, first column)
            u = first2 + i * NB
            return lax.rem(u, tiles2) * (2 * R), (u // tiles2) * (steps2 * kc)

        @pl.when(wg == 1)
        def _producer():
            def fill_w(j, w0, w1):  # ring step j's two weight tiles, once its slot is free
                slot = lax.rem(j, st)
                pl.when(j >= st)(lambda: plgpu.barrier_wait(free.at[slot]))
                plgpu.copy_gmem_to_smem(w0, w_smem.at[slot, 0], w_full.at[slot])
                plgpu.copy_gmem_to_smem(w1, w_smem.at[slot, 1], w_full.at[slot])

            def fill_x(j, x_src):  # ring step j's activation chunk (after its weights' wait)
                slot = lax.rem(j, st)
                plgpu.copy_gmem_to_smem(x_src, x_smem.at[pl.ds(slot * B8, B8)], x_full.at[slot])

            @pl.loop(0, n1)
            def _(i):
                r = unit1(i)

                @pl.loop(0, steps1)
                def _(k):
                    cols = pl.ds(k * kc, kc)
                    j = i * steps1 + k
                    fill_w(j, wgu_ref.at[pl.ds(r, R), cols], wgu_ref.at[pl.ds(F + r, R), cols])
                    fill_x(j, h_ref.at[pl.ds(row0, B8), cols])

            base, total2 = n1 * steps1, n2 * steps2

            def down_w(j2):  # the down phase's j2-th step: its weight tiles
                r, c0 = unit2(j2 // steps2)
                cols = pl.ds(c0 + lax.rem(j2, steps2) * kc, kc)
                fill_w(base + j2, wd_ref.at[pl.ds(r, R), cols], wd_ref.at[pl.ds(r + R, R), cols])

            def down_x(j2):  # ... and its input chunk of the hidden activations
                _, c0 = unit2(j2 // steps2)
                cols = pl.ds(c0 + lax.rem(j2, steps2) * kc, kc)
                fill_x(base + j2, hid_ref.at[pl.ds(row0, B8), cols])

            # The down weights do not depend on phase 1: fill the ring's free slots with them
            # now, so the weight stream runs on through the barrier and the other blocks' tails.
            pre = jnp.minimum(total2, st) if prefetch else 0
            pl.loop(0, pre)(down_w)
            # The down phase reads the hidden activations every block wrote: wait for this
            # block's consumer (its stores landed), then for every block (the semaphore).
            plgpu.barrier_wait(phase1_done)
            if grid_sync:
                pl.semaphore_wait(sem, NB, decrement=False)
                fence("fence.proxy.async.global;")  # the TMA reads after see those writes
            pl.loop(0, pre)(down_x)

            @pl.loop(pre, total2)
            def _(j2):
                down_w(j2)
                down_x(j2)

            total = base + total2

            @pl.loop(jnp.maximum(total - st, 0), total)
            def _(j):  # the last slots' release: every barrier phase is observed
                plgpu.barrier_wait(free.at[lax.rem(j, st)])

        @pl.when(wg == 0)
        def _consumer():
            def products(j0, steps):  # two [64, R] accumulators over `steps` ring steps
                def k_loop(acc0, acc1):
                    @pl.loop(0, steps)
                    def _(k):
                        j = j0 + k
                        slot = lax.rem(j, st)
                        plgpu.barrier_wait(w_full.at[slot])
                        plgpu.barrier_wait(x_full.at[slot])
                        x = x_smem.at[pl.ds(slot * B8, _M)]  # this slot's window (`x_rows`)
                        plgpu.wgmma(acc0, x, w_smem.at[slot, 0].transpose((1, 0)))
                        plgpu.wgmma(acc1, x, w_smem.at[slot, 1].transpose((1, 0)))
                        plgpu.wgmma_wait(2)  # step j - 1's pair is done: its slot is free
                        pl.when(k > 0)(lambda: plgpu.barrier_arrive(free.at[lax.rem(j + st - 1, st)]))

                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(free.at[lax.rem(j0 + steps - 1, st)])
                    return acc0[...], acc1[...]

                return pl.run_scoped(k_loop, plgpu.ACC((_M, R), jnp.float32),
                                     plgpu.ACC((_M, R), jnp.float32))

            if splits > 1:
                @pl.when(b == 0)
                def _zero_y():  # y is summed into with TMA reduce-add: block 0 zeroes it first
                    y_smem[0] = jnp.zeros((_M, R), jnp.float32)
                    plgpu.commit_smem()

                    @pl.loop(0, D // R)
                    def _(c):
                        plgpu.copy_smem_to_gmem(y_smem.at[0, pl.ds(0, B)],
                                                y_ref.at[pl.ds(0, B), pl.ds(c * R, R)])

                    plgpu.wait_smem_to_gmem(0)

            @pl.loop(0, n1)
            def _(i):
                g, u = products(i * steps1, steps1)
                g = g.astype(dtype).astype(jnp.float32)  # XLA rounds the product to the dtype
                u = u.astype(dtype).astype(jnp.float32)
                hidden = (g / (1.0 + jnp.exp(-g))) * u  # silu(gate) * up
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last unit's copy read it
                hid_smem[...] = hidden.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(hid_smem.at[pl.ds(0, B)],
                                        hid_ref.at[pl.ds(0, B), pl.ds(unit1(i), R)])

            plgpu.wait_smem_to_gmem(0)  # this block's hidden rows (and y's zeros) have landed
            if grid_sync:
                fence("fence.proxy.async.global; fence.acq_rel.gpu;")
                pl.semaphore_signal(sem, 1)
            plgpu.barrier_arrive(phase1_done)
            base = n1 * steps1

            @pl.loop(0, n2)
            def _(i):
                r, _ = unit2(i)
                a0, a1 = products(base + i * steps2, steps2)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                y_smem[0] = a0
                y_smem[1] = a1
                plgpu.commit_smem()
                for half, acc_rows in ((0, r), (1, r + R)):
                    plgpu.copy_smem_to_gmem(y_smem.at[half, pl.ds(0, B)],
                                            y_ref.at[pl.ds(0, B), pl.ds(acc_rows, R)],
                                            reduction_op="add" if splits > 1 else None)

            plgpu.wait_smem_to_gmem(0)

    scratch = (
        tiled_smem((x_rows(st, B8), kc), dtype),  # activation chunks: slot s at rows s * B8
        tiled_smem((st, 2, R, kc), dtype),  # two weight tiles a slot
        plgpu.SMEM((_M, R), dtype),  # a gate|up unit's hidden, untiled: a copy of B rows
        plgpu.SMEM((2, _M, R), jnp.float32),  # a down unit's two partial tiles
        plgpu.Barrier(num_arrivals=2, num_barriers=st),  # slot's weight tiles landed
        plgpu.Barrier(num_barriers=st),  # slot's activation chunk landed
        plgpu.Barrier(num_barriers=st),  # slot free again
        plgpu.Barrier(),  # the consumer's phase 1 stores landed
    )
    out = (jax.ShapeDtypeStruct((B, D), jnp.float32), jax.ShapeDtypeStruct((B, F), dtype))
    return launch(kernel, (h_BD, w_gu, w_down), out_type=out, scratch=scratch, grid=(NB,),
                  grid_names=("b",), num_threads=2, interpret=interpret, manual_barriers=True,
                  name="decode_mlp")


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def mlp_mgpu(h_BD, w_gate_up_GD, w_down_DF, *, block_sizes: MlpBlockSizes | None = None,
             interpret: bool = False):
    """fp32 y [B, D] = SwiGLU MLP of h [B, D] (module docstring), one persistent kernel."""
    check(h_BD, w_gate_up_GD, w_down_DF)
    sizes = block_sizes or MlpBlockSizes()
    blocks = sizes.blocks or (1 if interpret else sm_count())
    if interpret and (blocks != 1 or (sizes.splits or 1) != 1):
        raise ValueError(f"MlpBlockSizes(blocks={sizes.blocks}, splits={sizes.splits}): the "
                         "interpreter runs one block and one K range (it has no global semaphores "
                         "or TMA reduce-add, and runs blocks one after another).")
    return _kernel_call(h_BD, w_gate_up_GD, w_down_DF, sizes, blocks, interpret)[0]


def reference(h_BD, w_gate_up_GD, w_down_DF):
    """The decode path's math in XLA: products rounded to the dtype, SwiGLU, fp32 result of
    the down product (its sum rounded as the kernel's is not)."""
    u = jnp.einsum("BD,GD->BG", h_BD, w_gate_up_GD, preferred_element_type=jnp.float32)
    u = u.astype(h_BD.dtype).astype(jnp.float32)
    g, up = jnp.split(u, 2, axis=-1)
    hidden = (jax.nn.silu(g) * up).astype(h_BD.dtype)
    return jnp.einsum("BF,DF->BD", hidden, w_down_DF, preferred_element_type=jnp.float32)
