"""RMSNorm of a few rows in one kernel, optionally after the residual add (decode steps).

XLA compiles `gendist.models.layers.rms_norm` of one decode token into two kernels on a GPU:
a reduction for the sum of squares and an elementwise kernel for the scaling, which it does
not fuse into the matrix-vector product that follows (`benchmarks/README.md`, issue 19).
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

from pallas_kernels._compat import plgpu, resolve_interpret, triton_params


def supports(width: int) -> bool:
    """Whether the kernel takes rows of this width: a power of two (one Triton tile); the
    decode path keeps `layers.rms_norm` for other widths."""
    return width >= 16 and width & (width - 1) == 0


def _norm(x, scale_ref, o_ref, eps):
    x = x.astype(jnp.float32)  # [1, D]
    inv = jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / x.shape[1] + eps)
    o_ref[...] = (x * inv * scale_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def _prefetch(w_ref, sink_ref, program, *, elems: int, chunk: int, block: int):
    """Read this program's `chunk` elements of w (the first `elems`) and keep them in L2
    (evict_last); their sum goes to a sink so that the loads are not dropped."""
    start = program * chunk
    c = jnp.arange(block, dtype=jnp.int32)

    def body(i, acc):
        idx = start + i * block + c
        w = plgpu.load(w_ref.at[pl.ds(start + i * block, block)], mask=idx < elems, other=0,
                       eviction_policy="evict_last")
        return acc + jnp.sum(w.astype(jnp.float32))

    sink_ref[...] = jnp.full((1,), jax.lax.fori_loop(0, chunk // block, body, 0.0), jnp.float32)


def _kernel(*refs, eps: float, add: bool, rows: int, prefetch: dict | None):
    """Program r < rows: the norm of row r (after the add); r >= rows: a prefetch program."""
    n_in = 2 + add + (prefetch is not None)
    ins, outs = refs[:n_in], refs[n_in:]
    x_ref, d_ref = ins[0], (ins[1] if add else None)
    scale_ref = ins[1 + add]
    r = pl.program_id(0)

    @pl.when(r < rows)
    def _norm_row():
        if add:
            sum_ref, o_ref = outs[0], outs[1]
            s = (x_ref[...].astype(jnp.float32) + d_ref[...].astype(jnp.float32)
                 ).astype(sum_ref.dtype)
            sum_ref[...] = s
            _norm(s, scale_ref, o_ref, eps)
        else:
            _norm(x_ref[...], scale_ref, outs[0], eps)

    if prefetch is not None:
        pl.when(r >= rows)(lambda: _prefetch(ins[-1], outs[-1], r - rows, **prefetch))


PREFETCH_BLOCK = 4096  # elements per load of a prefetch program (8 KiB of bf16)


@functools.partial(jax.jit, static_argnames=("eps", "num_warps", "prefetch_elems",
                                             "prefetch_programs", "interpret"))
def rms_norm(x_RD, scale_D, residual_RD=None, prefetch=None, *, eps: float,
             num_warps: int = 4, prefetch_elems: int | None = None,
             prefetch_programs: int = 128, interpret: bool | None = None):
    """RMSNorm over the last axis of x [..., D] with gain scale [D], in x's dtype.

    With `residual_RD` (x's shape): the residual add first, in the same kernel; returns
    (x + residual in x's dtype, its RMSNorm), as `s = x + r; rms_norm(s)` would.

    With `prefetch` (any array, typically the next matrix-vector product's weights): the
    kernel also runs `prefetch_programs` programs that read its first `prefetch_elems`
    elements (all by default) into L2, on the SMs the norm's few programs leave idle, so
    that the next kernel reads them from L2. Outputs are unchanged.
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
    last = lambda r: (jnp.minimum(r, R - 1), 0)  # noqa: E731 - prefetch programs reuse row R-1
    row = pl.BlockSpec((1, D), last)
    gain = pl.BlockSpec((1, D), lambda r: (0, 0))
    out = jax.ShapeDtypeStruct((R, D), x_RD.dtype)
    add = residual_RD is not None
    ins = [rows] + ([residual_RD.reshape(-1, D)] if add else []) + [scale_D.reshape(1, D)]
    in_specs = [row] * (1 + add) + [gain]
    out_specs, out_shape = [row] * (1 + add), [out] * (1 + add)
    pf, programs = None, 0
    if prefetch is not None:
        flat = prefetch.reshape(-1)
        elems = flat.shape[0] if prefetch_elems is None else min(prefetch_elems, flat.shape[0])
        programs = max(1, prefetch_programs)
        chunk = -(-elems // (programs * PREFETCH_BLOCK)) * PREFETCH_BLOCK
        pf = dict(elems=elems, chunk=chunk, block=PREFETCH_BLOCK)
        ins.append(flat)
        in_specs.append(pl.BlockSpec((flat.shape[0],), lambda r: (0,)))
        out_specs.append(pl.BlockSpec((1,), lambda r: (jnp.maximum(r - R, 0),)))
        out_shape.append(jax.ShapeDtypeStruct((programs,), jnp.float32))  # the sink
    res = pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), add=add, rows=R, prefetch=pf),
        grid=(R + programs,), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=resolve_interpret(interpret), compiler_params=triton_params(num_warps, 1),
        name=("add_rms_norm" if add else "rms_norm") + ("_prefetch" if pf else ""))(*ins)
    if add:
        return res[0].reshape(x_RD.shape), res[1].reshape(x_RD.shape)
    return res[0].reshape(x_RD.shape)
