"""RMSNorm of a few rows in one kernel, optionally after the residual add (decode steps).

XLA compiles `gendist.models.layers.rms_norm` of one decode token into two kernels on a GPU:
a reduction for the sum of squares and an elementwise kernel for the scaling, which it does
not fuse into the matrix-vector product that follows (`benchmarks/decode.md`).
At batch 1 each costs a launch and little else, twice per layer. This kernel does both in
one program per row: read the row once, sum its squares in fp32, scale, cast back. Given the
residual branch's output too, it also does the residual add before the norm (XLA ran that
add as one more kernel: it does not fuse it into the matrix-vector reduction before it).

Same math as `rms_norm`: y = x · rsqrt(mean(x²) + eps) · scale in fp32, cast to x's dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._compat import resolve_interpret, triton_params


def supports(width: int) -> bool:
    """Whether the kernel takes rows of this width: a power of two (one Triton tile); the
    decode path keeps `layers.rms_norm` for other widths."""
    return width >= 16 and width & (width - 1) == 0


def _norm(x, scale_ref, o_ref, eps):
    x = x.astype(jnp.float32)  # [1, D]
    inv = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / x.shape[1] + eps)
    o_ref[...] = (x * inv * scale_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def _norm_kernel(x_ref, scale_ref, o_ref, *, eps: float):
    _norm(x_ref[...], scale_ref, o_ref, eps)


def _add_norm_kernel(x_ref, d_ref, scale_ref, sum_ref, o_ref, *, eps: float):
    s = (x_ref[...].astype(jnp.float32) + d_ref[...].astype(jnp.float32)).astype(sum_ref.dtype)
    sum_ref[...] = s
    _norm(s, scale_ref, o_ref, eps)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "interpret"))
def rms_norm(x_RD, scale_D, residual_RD=None, *, eps: float, num_warps: int = 4,
             interpret: bool | None = None):
    """RMSNorm over the last axis of x [..., D] with gain scale [D], in x's dtype.

    With `residual_RD` (x's shape): the residual add first, in the same kernel; returns
    (x + residual in x's dtype, its RMSNorm), as `s = x + r; rms_norm(s)` would.
    """
    D = x_RD.shape[-1]
    if scale_D.shape != (D,):
        raise ValueError(f"scale has shape {scale_D.shape}; expected ({D},), the last axis of x")
    if not supports(D):
        raise ValueError(f"rms_norm kernel: width {D} is not a power of two >= 16; use "
                         "gendist.models.layers.rms_norm")
    if residual_RD is not None and residual_RD.shape != x_RD.shape:
        raise ValueError(f"residual {residual_RD.shape} must have x's shape {x_RD.shape}")
    rows = x_RD.reshape(-1, D)
    R = rows.shape[0]
    row = pl.BlockSpec((1, D), lambda r: (r, 0))
    gain = pl.BlockSpec((1, D), lambda r: (0, 0))
    out = jax.ShapeDtypeStruct((R, D), x_RD.dtype)
    common = dict(grid=(R,), interpret=resolve_interpret(interpret),
                  compiler_params=triton_params(num_warps, 1))
    if residual_RD is None:
        h = pl.pallas_call(functools.partial(_norm_kernel, eps=float(eps)), in_specs=[row, gain],
                           out_specs=row, out_shape=out, name="rms_norm", **common,
                           )(rows, scale_D.reshape(1, D))
        return h.reshape(x_RD.shape)
    s, h = pl.pallas_call(functools.partial(_add_norm_kernel, eps=float(eps)),
                          in_specs=[row, row, gain], out_specs=[row, row], out_shape=[out, out],
                          name="add_rms_norm", **common,
                          )(rows, residual_RD.reshape(-1, D), scale_D.reshape(1, D))
    return s.reshape(x_RD.shape), h.reshape(x_RD.shape)
