"""Tiled matrix multiply in Pallas: the building block of every attention kernel.

Each program owns one (block_m, block_n) tile of the output and walks the shared K axis in
block_k slices, keeping the partial sum in an fp32 accumulator (registers on a GPU), so the
result is as accurate as an fp32 dot even for bf16 inputs. Programs are ordered in groups of
`group_m` row tiles so that neighbouring programs reuse the same B columns from L2
(the "grouped ordering" of the Triton matmul tutorial).

Shapes that are not multiples of the tiles are zero-padded, which leaves the product exact.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import (
    dot_f32,
    is_pow2,
    next_pow2,
    precision_for,
    resolve_interpret,
    round_up,
    triton_params,
)

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the output (block_m x block_n) and of the reduction (block_k).

    Defaults: the best of a small sweep on an H200, bf16 (benchmarks/kernels_h200.json)."""

    block_m: int = 128  # rows of A (and of C) per program
    block_n: int = 256  # columns of B (and of C) per program
    block_k: int = 64  # slice of the shared axis loaded per loop step
    group_m: int = 8  # row tiles per group in the L2-friendly program order
    num_warps: int = 8  # Triton warps per program (GPU only)
    num_stages: int = 3  # Triton software-pipelining depth (GPU only)

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if not is_pow2(value) or value < 16:
                raise ValueError(
                    f"BlockSizes.{name}={value}: use a power of two >= 16 (Triton tiles)."
                )
        if self.group_m < 1:
            raise ValueError(f"BlockSizes.group_m={self.group_m}: use a positive integer.")

    def clipped(self, m: int, n: int, k: int) -> BlockSizes:
        """Shrinks tiles that are larger than the (power-of-two rounded) problem."""
        fit = lambda b, size: max(16, min(b, next_pow2(size)))
        return dataclasses.replace(
            self, block_m=fit(self.block_m, m), block_n=fit(self.block_n, n),
            block_k=fit(self.block_k, k),
        )


def matmul_reference(a_MK: jax.Array, b_KN: jax.Array) -> jax.Array:
    """Pure-jnp oracle: fp32 accumulation, output in the input dtype."""
    out = jnp.dot(a_MK, b_KN, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(a_MK.dtype)


def _matmul_kernel(a_ref, b_ref, o_ref, *, block_k: int, num_k: int, precision):
    def body(kk, acc):
        a = a_ref[:, pl.ds(kk * block_k, block_k)]
        b = b_ref[pl.ds(kk * block_k, block_k), :]
        return acc + dot_f32(a, b, precision=precision)

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    acc = lax.fori_loop(0, num_k, body, acc)
    o_ref[...] = acc.astype(o_ref.dtype)


def _grouped_index(pid, num_m: int, num_n: int, group_m: int):
    """Maps a flat program id to (row tile, column tile) in groups of `group_m` rows."""
    per_group = group_m * num_n
    group = lax.div(pid, per_group)
    first_m = group * group_m
    rows_in_group = jnp.minimum(num_m - first_m, group_m)
    local = lax.rem(pid, per_group)
    return first_m + lax.rem(local, rows_in_group), lax.div(local, rows_in_group)


def _validate(a, b):
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"matmul: a and b must be 2-D, got a.shape={a.shape}, b.shape={b.shape}.")
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"matmul: a.shape[1]={a.shape[1]} must equal b.shape[0]={b.shape[0]} (the shared K axis)."
        )
    if a.dtype != b.dtype:
        raise ValueError(f"matmul: a.dtype={a.dtype} and b.dtype={b.dtype} differ; cast one of them.")
    if a.dtype not in _DTYPES:
        raise ValueError(f"matmul: dtype {a.dtype} unsupported; use float32, bfloat16 or float16.")


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def matmul(a_MK: jax.Array, b_KN: jax.Array, *, block_sizes: BlockSizes | None = None,
           interpret: bool | None = False) -> jax.Array:
    """C = A @ B with fp32 accumulation; any M, N, K (zero-padded to the tiles)."""
    _validate(a_MK, b_KN)
    m, k = a_MK.shape
    n = b_KN.shape[1]
    bs = (block_sizes or BlockSizes()).clipped(m, n, k)
    mp, np_, kp = round_up(m, bs.block_m), round_up(n, bs.block_n), round_up(k, bs.block_k)
    a = jnp.pad(a_MK, ((0, mp - m), (0, kp - k)))
    b = jnp.pad(b_KN, ((0, kp - k), (0, np_ - n)))
    num_m, num_n = mp // bs.block_m, np_ // bs.block_n

    def a_index(pid):
        return (_grouped_index(pid, num_m, num_n, bs.group_m)[0], 0)

    def b_index(pid):
        return (0, _grouped_index(pid, num_m, num_n, bs.group_m)[1])

    kernel = functools.partial(_matmul_kernel, block_k=bs.block_k, num_k=kp // bs.block_k,
                               precision=precision_for(a.dtype))
    out = pl.pallas_call(
        kernel,
        grid=(num_m * num_n,),
        in_specs=[pl.BlockSpec((bs.block_m, kp), a_index), pl.BlockSpec((kp, bs.block_n), b_index)],
        out_specs=pl.BlockSpec((bs.block_m, bs.block_n),
                               lambda pid: _grouped_index(pid, num_m, num_n, bs.group_m)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), a.dtype),
        compiler_params=triton_params(bs.num_warps, bs.num_stages),
        interpret=resolve_interpret(interpret),
        name="gendist_matmul",
    )(a, b)
    return out[:m, :n]
