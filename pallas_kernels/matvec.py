"""One token's matrix-vector product with its neighbours fused in: a batch-1 decode kernel.

At batch 1 a decode step is a chain of matrix-vector products, and on an H200 its time is
as much the small kernels between them as the weights they read (350m: ~13 kernels a layer,
0.65 ms a step against a 0.19 ms bytes/bandwidth floor; `benchmarks/README.md`). XLA fuses
neither an RMSNorm nor SwiGLU into the row reduction that follows it, nor the residual add
into the one before it. Here one kernel does, for y = W h with W [N, K] output-major:

* the input h from x [K]: x itself; `gain`: RMSNorm(x) * gain (the sum of squares taken by
  every program: K values, nothing next to its share of W); `swiglu`: x = [gate | up] [2K]
  and h = silu(gate) * up. h is rounded to x's dtype, as the model's norm and activation
  are, before it meets W;
* the product in fp32, `block_n` rows of W per program, streamed `block_k` columns a step;
* `residual` [N]: y + residual, rounded once.

Each program reads its rows of W once and the whole (small) input vector; W's bytes are the
kernel's time. The reference is `matvec_reference`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import is_pow2, resolve_interpret, triton_params


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_n: int = 8  # rows of W (outputs) per program
    block_k: int = 512  # columns of W loaded per step (at most; clipped to divide K)
    num_warps: int = 4  # Triton warps per program (GPU only)
    num_stages: int = 3  # Triton software-pipelining depth (GPU only)

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            if not is_pow2(getattr(self, name)):
                raise ValueError(f"matvec BlockSizes.{name}={getattr(self, name)}: use a "
                                 "power of two.")


def _divisor_block(k: int, most: int) -> int:
    """The largest power of two <= `most` dividing k (loads must be powers of two)."""
    b = most
    while b > 1 and k % b:
        b //= 2
    return b


def _hidden_f32(x, gain, inv_rms, swiglu_up, dtype):
    """The product's input in fp32, rounded through `dtype` as the model rounds it."""
    if swiglu_up is not None:
        h = jax.nn.silu(x) * swiglu_up
    elif gain is not None:
        h = x * inv_rms * gain
    else:
        return x
    return h.astype(dtype).astype(jnp.float32)


def _kernel(*refs, k: int, block_k: int, gain: bool, swiglu: bool, residual: bool, eps: float):
    x_ref, w_ref = refs[:2]
    rest = list(refs[2:])
    g_ref = rest.pop(0) if gain else None
    r_ref = rest.pop(0) if residual else None
    (o_ref,) = rest
    steps = k // block_k
    f32 = jnp.float32
    inv_rms = None
    if gain:
        def squares(j, s):
            x = x_ref[pl.ds(j * block_k, block_k)].astype(f32)
            return s + jnp.sum(x * x)
        inv_rms = lax.rsqrt(lax.fori_loop(0, steps, squares, jnp.zeros((), f32)) / k + eps)

    def body(j, acc):
        cols = pl.ds(j * block_k, block_k)
        x = x_ref[cols].astype(f32)
        up = x_ref[pl.ds(k + j * block_k, block_k)].astype(f32) if swiglu else None
        g = g_ref[cols].astype(f32) if gain else None
        h = _hidden_f32(x, g, inv_rms, up, x_ref.dtype)
        w = w_ref[:, cols].astype(f32)
        return acc + jnp.sum(w * h[None, :], axis=1)

    acc = lax.fori_loop(0, steps, body, jnp.zeros((o_ref.shape[0],), f32))
    if residual:
        acc = acc + r_ref[...].astype(f32)
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "swiglu", "block_sizes", "interpret"))
def fused_matvec(x, w_NK, *, gain=None, residual=None, eps: float = 1e-5,
                 swiglu: bool = False, block_sizes: BlockSizes | None = None,
                 interpret: bool | None = None):
    """y [N] = W h (+ residual) for one token (module docstring); x [K] ([2K] with `swiglu`),
    in x's dtype (the residual's when given)."""
    n, k = w_NK.shape
    if x.ndim != 1 or x.shape[0] != (2 * k if swiglu else k):
        raise ValueError(f"fused_matvec: x has shape {x.shape}; W is {w_NK.shape}, so x must "
                         f"be [{2 * k if swiglu else k}]" + (" ([gate | up])" if swiglu else ""))
    if gain is not None and (swiglu or gain.shape != (k,)):
        raise ValueError(f"fused_matvec: gain must be [{k}] and not combined with swiglu")
    if residual is not None and residual.shape != (n,):
        raise ValueError(f"fused_matvec: residual has shape {residual.shape}; use [{n}]")
    bs = block_sizes or BlockSizes()
    block_n = min(bs.block_n, n)
    if n % block_n or not is_pow2(block_n):
        raise ValueError(f"fused_matvec: N={n} rows must be a multiple of block_n={block_n}")
    block_k = _divisor_block(k, bs.block_k)
    if block_k < 16:
        raise ValueError(f"fused_matvec: K={k} must be a multiple of 16")
    full = lambda size: pl.BlockSpec((size,), lambda i: (0,))  # noqa: E731
    rows = pl.BlockSpec((block_n,), lambda i: (i,))
    operands, specs = [x, w_NK], [full(x.shape[0]), pl.BlockSpec((block_n, k), lambda i: (i, 0))]
    if gain is not None:
        operands.append(gain)
        specs.append(full(k))
    if residual is not None:
        operands.append(residual)
        specs.append(rows)
    out_dtype = residual.dtype if residual is not None else x.dtype
    kernel = functools.partial(_kernel, k=k, block_k=block_k, gain=gain is not None,
                               swiglu=swiglu, residual=residual is not None, eps=eps)
    return pl.pallas_call(
        kernel,
        grid=(n // block_n,),
        in_specs=specs,
        out_specs=rows,
        out_shape=jax.ShapeDtypeStruct((n,), out_dtype),
        compiler_params=triton_params(bs.num_warps, bs.num_stages),
        interpret=resolve_interpret(interpret),
        name="gendist_fused_matvec",
    )(*operands)


def matvec_reference(x, w_NK, *, gain=None, residual=None, eps: float = 1e-5,
                     swiglu: bool = False):
    """The same in jnp, rounded where the model rounds (norm / activation output, product)."""
    k = w_NK.shape[1]
    f32 = jnp.float32
    if swiglu:
        h = (jax.nn.silu(x[:k].astype(f32)) * x[k:].astype(f32)).astype(x.dtype)
    elif gain is not None:
        xf = x.astype(f32)
        h = (xf * lax.rsqrt(jnp.mean(xf * xf) + eps) * gain.astype(f32)).astype(x.dtype)
    else:
        h = x
    y = jnp.dot(w_NK.astype(f32), h.astype(f32), precision=lax.Precision.HIGHEST)
    if residual is not None:
        return (y + residual.astype(f32)).astype(residual.dtype)
    return y.astype(x.dtype)
