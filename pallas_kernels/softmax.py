"""Row softmax in Pallas, two ways, for rows too long to hold on chip.

Each program owns `block_rows` rows and streams them from memory in `block_cols` slices, so
every pass over the row is a loop of loads from HBM.

* `safe_softmax` makes three passes: the row max, the sum of exp(x - max), then the output.
* `online_softmax` (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax")
  fuses the first two: it keeps a running max m and a normaliser l, and when a slice raises
  the max it rescales l by exp(m_old - m_new). Two passes, one fewer read of the row; the
  same rescaling lets FlashAttention (Dao et al. 2022) fold the softmax into one sweep.

`row_reads` counts the passes from the traced kernel itself (loops that load the input),
so the claim "online reads the row twice, safe three times" is checked, not asserted.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import is_pow2, next_pow2, resolve_interpret, round_up, triton_params

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Rows per program and the slice of a row loaded per loop step.

    Defaults: the best of a small sweep on an H200, bf16 (benchmarks/kernels_h200.json)."""

    block_rows: int = 2  # rows handled by one program
    block_cols: int = 2048  # columns loaded per step of each pass
    num_warps: int = 8  # Triton warps per program (GPU only)
    num_stages: int = 2  # Triton software-pipelining depth (GPU only)

    def __post_init__(self):
        for name in ("block_rows", "block_cols"):
            value = getattr(self, name)
            if not is_pow2(value):
                raise ValueError(f"BlockSizes.{name}={value}: use a power of two.")

    def clipped(self, rows: int, cols: int) -> BlockSizes:
        return dataclasses.replace(
            self, block_rows=min(self.block_rows, next_pow2(rows)),
            block_cols=max(16, min(self.block_cols, next_pow2(cols))),
        )


def softmax_reference(x: jax.Array) -> jax.Array:
    """Pure-jnp oracle over the last axis, computed in fp32."""
    return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)


def _load(x_ref, j, block_cols):
    return x_ref[:, pl.ds(j * block_cols, block_cols)].astype(jnp.float32)


def _safe_kernel(x_ref, o_ref, *, block_cols: int, num_cols: int):
    rows = x_ref.shape[0]

    def max_pass(j, m):
        return jnp.maximum(m, jnp.max(_load(x_ref, j, block_cols), axis=1))

    m = lax.fori_loop(0, num_cols, max_pass, jnp.full((rows,), -jnp.inf, jnp.float32))

    def sum_pass(j, l):
        return l + jnp.sum(jnp.exp(_load(x_ref, j, block_cols) - m[:, None]), axis=1)

    l = lax.fori_loop(0, num_cols, sum_pass, jnp.zeros((rows,), jnp.float32))
    _write_pass(x_ref, o_ref, m, l, block_cols, num_cols)


def _online_kernel(x_ref, o_ref, *, block_cols: int, num_cols: int):
    rows = x_ref.shape[0]

    def stats_pass(j, carry):
        m, l = carry
        x = _load(x_ref, j, block_cols)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        # Rescale the old normaliser to the new max (Milakov & Gimelshein 2018, alg. 3).
        l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new[:, None]), axis=1)
        return m_new, l

    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
    m, l = lax.fori_loop(0, num_cols, stats_pass, init)
    _write_pass(x_ref, o_ref, m, l, block_cols, num_cols)


def _write_pass(x_ref, o_ref, m, l, block_cols, num_cols):
    inv_l = 1.0 / l

    def body(j, carry):
        p = jnp.exp(_load(x_ref, j, block_cols) - m[:, None]) * inv_l[:, None]
        o_ref[:, pl.ds(j * block_cols, block_cols)] = p.astype(o_ref.dtype)
        return carry

    lax.fori_loop(0, num_cols, body, 0)


_KERNELS = {"safe": _safe_kernel, "online": _online_kernel}


def _softmax(x: jax.Array, kind: str, block_sizes: BlockSizes | None, interpret: bool | None):
    if x.ndim < 1 or x.size == 0:
        raise ValueError(f"{kind}_softmax: x must have at least one non-empty axis, got {x.shape}.")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{kind}_softmax: dtype {x.dtype} unsupported; use float32/bfloat16/float16.")
    cols = x.shape[-1]
    x_RC = x.reshape(-1, cols)
    rows = x_RC.shape[0]
    bs = (block_sizes or BlockSizes()).clipped(rows, cols)
    rp, cp = round_up(rows, bs.block_rows), round_up(cols, bs.block_cols)
    # Padded columns are -inf so they add exp(-inf) = 0 to the normaliser.
    x_RC = jnp.pad(x_RC, ((0, 0), (0, cp - cols)), constant_values=-jnp.inf)
    x_RC = jnp.pad(x_RC, ((0, rp - rows), (0, 0)))
    kernel = functools.partial(_KERNELS[kind], block_cols=bs.block_cols,
                               num_cols=cp // bs.block_cols)
    spec = pl.BlockSpec((bs.block_rows, cp), lambda i: (i, 0))
    out = pl.pallas_call(
        kernel,
        grid=(rp // bs.block_rows,),
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct((rp, cp), x.dtype),
        compiler_params=triton_params(bs.num_warps, bs.num_stages),
        interpret=resolve_interpret(interpret),
        name=f"gendist_{kind}_softmax",
    )(x_RC)
    return out[:rows, :cols].reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def safe_softmax(x: jax.Array, *, block_sizes: BlockSizes | None = None,
                 interpret: bool | None = False) -> jax.Array:
    """Softmax over the last axis in three passes over each row (max, sum, normalise)."""
    return _softmax(x, "safe", block_sizes, interpret)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def online_softmax(x: jax.Array, *, block_sizes: BlockSizes | None = None,
                   interpret: bool | None = False) -> jax.Array:
    """Softmax over the last axis in two passes (running max + rescaled sum, normalise)."""
    return _softmax(x, "online", block_sizes, interpret)


# ---------------------------------------------------------------------------------------
# Counting passes from the traced kernel.

_LOOPS = ("while", "scan")


def _loop_body_and_inputs(eqn):
    """The loop body's jaxpr and which of its invars each eqn operand becomes."""
    if eqn.primitive.name == "scan":
        return eqn.params["jaxpr"].jaxpr, list(range(len(eqn.invars)))
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    body = eqn.params["body_jaxpr"].jaxpr
    # Operands are cond consts, body consts, carry; the body sees body consts, carry.
    index = [None] * nc + list(range(nb)) + [nb + i for i in range(len(eqn.invars) - nc - nb)]
    return body, index


def _reads(jaxpr, ref) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("get", "load") and eqn.invars[0] is ref:
            return True
        if eqn.primitive.name in _LOOPS and _reads_in_loop(eqn, ref):
            return True
    return False


def row_reads(kind: str, *, cols: int = 64, block_cols: int = 16) -> int:
    """How many times the `kind` kernel ("safe" or "online") streams a row from memory:
    the number of loops in its traced body that load from the input ref."""
    if kind not in _KERNELS:
        raise ValueError(f"row_reads: kind={kind!r}; use one of {sorted(_KERNELS)}.")
    x = jax.ShapeDtypeStruct((1, cols), jnp.float32)
    blocks = BlockSizes(block_rows=1, block_cols=block_cols)
    closed = jax.make_jaxpr(lambda x: _softmax(x, kind, blocks, True))(x)
    calls = [e for e in _walk(closed.jaxpr) if e.primitive.name == "pallas_call"]
    if len(calls) != 1:
        raise RuntimeError(f"expected one pallas_call in the traced softmax, found {len(calls)}")
    kernel = calls[0].params["jaxpr"]
    x_ref = kernel.invars[0]
    return sum(
        1 for eqn in kernel.eqns
        if eqn.primitive.name in _LOOPS and _reads_in_loop(eqn, x_ref)
    )


def _reads_in_loop(eqn, ref) -> bool:
    body, index = _loop_body_and_inputs(eqn)
    return any(
        operand is ref and pos is not None and _reads(body, body.invars[pos])
        for operand, pos in zip(eqn.invars, index, strict=True)
    )


def _walk(jaxpr):
    """All eqns of a jaxpr, descending into nested jaxprs (e.g. the jit of a wrapper)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns") and eqn.primitive.name != "pallas_call":
                yield from _walk(inner)
