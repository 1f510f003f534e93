"""The output layer of a decode step in one kernel: the final RMSNorm and the logits of a few
rows against the whole token table.

At batch 1 the output layer is a matrix-vector product that reads the table once: for
Llama-3.2-1B's tied 128,256 x 2,048 table 525 MB of a 2,472 MB step (`benchmarks/decode.md`).
XLA runs it as the norm's two small kernels and a reduction over the table's rows. Here each
program owns `block_v` rows of the table: it computes the norm of the rows of x itself (a few
KB, from L2), then streams its rows of the table in `block_d`-wide chunks and writes their
fp32 logits: one row of x as multiply-adds on the CUDA cores, more rows through the tensor
cores (padded to 16, the smallest MMA tile). Thousands of programs keep the reads in flight;
the table is read once.

Same math as `decode_block.head_logits`: x rounded to the table's dtype, normed in fp32,
scaled by the gain, rounded again, then products accumulated in fp32.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._compat import dividing_block, resolve_interpret, triton_params

ROWS = 16  # rows of x as the tensor cores take them (the smallest MMA tile); up to 16 rows in
BLOCK_V = 64  # rows of the table a program owns
BLOCK_D = 256  # columns streamed a loop step (block_v x block_d x 2 bytes a pipeline stage)


def supports(rows: int, vocab: int, width: int) -> bool:
    """Whether the kernel takes `rows` rows of x against a [vocab, width] table: up to 16
    rows, and tiles of 16 or more dividing the vocabulary and the width (the caller keeps
    XLA's output layer otherwise)."""
    return 0 < rows <= ROWS and None not in (dividing_block(vocab, BLOCK_V), dividing_block(width, BLOCK_D))


def _kernel(x_ref, g_ref, w_ref, o_ref, *, eps: float, block_d: int, width: int):
    steps = width // block_d
    dt = w_ref.dtype

    def chunk(ref, k):
        return ref[:, pl.ds(pl.multiple_of(k * block_d, block_d), block_d)]

    def sum_sq(k, acc):
        x = chunk(x_ref, k).astype(dt).astype(jnp.float32)
        return acc + jnp.sum(x * x, axis=1, keepdims=True)

    ss = lax.fori_loop(0, steps, sum_sq, jnp.zeros((x_ref.shape[0], 1), jnp.float32))
    inv = lax.rsqrt(ss / width + eps)

    def product(k, acc):
        x = chunk(x_ref, k).astype(dt).astype(jnp.float32)
        h = (x * inv * chunk(g_ref, k).astype(jnp.float32)).astype(dt)
        w = chunk(w_ref, k)
        if x_ref.shape[0] == 1:  # [1, bd] x [bv, bd]: multiply-adds, no MMA padding
            return acc + jnp.sum(w.astype(jnp.float32) * h.astype(jnp.float32), axis=1)[None]
        return acc + lax.dot_general(h, w, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)

    o_ref[...] = lax.fori_loop(0, steps, product,
                               jnp.zeros((x_ref.shape[0], w_ref.shape[0]), jnp.float32))


@functools.partial(jax.jit, static_argnames=("eps", "block_v", "block_d", "num_warps",
                                             "num_stages", "interpret"))
def head_logits(x_RD, gain_D, table_VD, *, eps: float, block_v: int = BLOCK_V,
                block_d: int = BLOCK_D, num_warps: int = 4, num_stages: int = 3,
                interpret: bool | None = None):
    """fp32 logits [R, V] of rows x [R, D] (R <= 16; any float dtype) through the final
    RMSNorm (gain [D], `eps`) and the token table [V, D] (tied embeddings, or the decode
    layout's `head_VD`). `block_v` and `block_d` are halved until they divide V and D."""
    R, D = x_RD.shape
    V = table_VD.shape[0]
    if table_VD.shape[1] != D or gain_D.shape != (D,):
        raise ValueError(f"head_logits: x {x_RD.shape}, gain {gain_D.shape} and table "
                         f"{table_VD.shape} disagree on the width")
    bv, bd = dividing_block(V, block_v), dividing_block(D, block_d)
    if not (0 < R <= ROWS) or bv is None or bd is None:
        raise ValueError(f"head_logits: {R} rows, vocabulary {V}, width {D}: the kernel takes "
                         f"1-{ROWS} rows and a vocabulary and width with a divisor of 16 or "
                         "more; use decode_block.head_logits")
    Rk = 1 if R == 1 else ROWS  # one row as it is; more padded to the MMA tile
    x = jnp.zeros((Rk, D), jnp.float32).at[:R].set(x_RD.astype(jnp.float32))
    whole = lambda shape: pl.BlockSpec(shape, lambda v: (0, 0))  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, eps=float(eps), block_d=bd, width=D),
        grid=(V // bv,),
        in_specs=[whole((Rk, D)), whole((1, D)), pl.BlockSpec((bv, D), lambda v: (v, 0))],
        out_specs=pl.BlockSpec((Rk, bv), lambda v: (0, v)),
        out_shape=jax.ShapeDtypeStruct((Rk, V), jnp.float32),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=resolve_interpret(interpret), name="head_logits",
    )(x, gain_D.reshape(1, D), table_VD)
    return out[:R]
