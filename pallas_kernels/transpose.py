"""A matrix transpose in tiles, for the float8 operands of FP8 GEMMs.

cuBLASLt's FP8 GEMMs on Hopper take both operands with the contracted axis minor ("TN"), so
of an FP8 product's three GEMMs, the forward needs the weight transposed and the weight
gradient needs both the input and the output gradient transposed (its contraction runs over
the tokens). XLA inserts those transposes as its own kernels, and for one-byte elements
they are slow: in the 8B layer shape's FP8 step they took 8 ms of 103 (7.7%), the 16 MB
weight transposes reading and writing at 0.3 TB/s (`benchmarks/profile_8b_fp8_nvidia_h200.json`).

This kernel moves one (bm, bn) tile per program: a coalesced load of rows, `.T` on the
registers (Triton stages it through shared memory), a coalesced store of the tile's
columns as rows. Any dtype; made for float8.
"""
from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from pallas_kernels._compat import dividing_block, resolve_interpret, triton_params

BLOCK = (128, 128)  # (rows, columns) of an input tile: the best over the FP8 step shapes (H200)
NUM_WARPS = 8


def block_for(shape: tuple[int, int], block: tuple[int, int] = BLOCK) -> tuple[int, int] | None:
    """The tile for a [M, N] input: `block`, each side shrunk (halving, not below 16) until
    it divides its axis; None where no such tile exists (the caller transposes with XLA)."""
    out = tuple(dividing_block(n, b) for n, b in zip(shape, block, strict=True))
    return None if None in out else out


def _kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...].T


@functools.partial(jax.jit, static_argnames=("block", "num_warps", "interpret"))
def transpose(x_MN, *, block: tuple[int, int] = BLOCK, num_warps: int = NUM_WARPS,
              interpret: bool | None = None):
    """x [M, N] -> x.T [N, M] in (bm, bn) tiles, `block` shrunk to divide the axes
    (`block_for`); raises ValueError when no tile of 16 or more divides them."""
    if x_MN.ndim != 2:
        raise ValueError(f"transpose takes a matrix; got shape {x_MN.shape}")
    tile = block_for(x_MN.shape, block)
    if tile is None:
        raise ValueError(f"transpose: shape {x_MN.shape} has an axis that no tile of 16 or "
                         "more divides; use jnp.transpose")
    (M, N), (bm, bn) = x_MN.shape, tile
    return pl.pallas_call(
        _kernel, grid=(M // bm, N // bn),
        in_specs=[pl.BlockSpec((bm, bn), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((bn, bm), lambda i, j: (j, i)),
        out_shape=jax.ShapeDtypeStruct((N, M), x_MN.dtype),
        compiler_params=triton_params(num_warps, 1),
        interpret=resolve_interpret(interpret),
    )(x_MN)
