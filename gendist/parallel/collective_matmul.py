"""Collective matmuls: sequence-parallel tensor parallelism with its communication in the loop.

Under sequence parallelism (Korthikanti et al. 2022) a column-parallel matmul starts with an
all-gather of the sequence shards and a row-parallel matmul ends with a reduce-scatter of
the partial sums. Written as one collective and one matmul, the matmul waits for the whole
collective. Written as a ring of `n - 1` `ppermute` steps (n = the `tensor` axis size), each
step's transfer is independent of that step's partial product, so the two can run at once:
the collective matmul of Wang et al. 2023 ("Overlap communication with dependent
computation via decomposition", ASPLOS), which MaxText and Megatron-LM (`tp_comm_overlap`)
use, and which the JAX docs' shard_map guide shows ("collective matrix multiplication").

    all_gather_matmul      x [B, T/n, D] (this device's sequence shard), weights [D, ...]
                           -> x_gathered @ w, [B, T, ...] each: at step k this device
                           multiplies the shard it holds (that of device i + k) while it
                           passes it on to device i - 1
    matmul_reduce_scatter  a [B, T, ...] (full sequence, partial sums), w [..., D]
                           -> sum over devices of (a @ w), this device's [B, T/n, D]: an
                           accumulator travels the ring, each device adding the product of
                           the sequence chunk the accumulator is headed for

Plain JAX autodiff differentiates them: the transpose of a ppermute is the reverse
ppermute, so the backward is again a ring of transfers interleaved with the partial
products (the transposed collective matmul), and no all-gather or reduce-scatter appears.
Unidirectional rings; the loop is unrolled in Python (n is the tensor size, 2-8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _contract(x, w, dims: int):
    """x's last `dims` axes against w's first `dims` axes."""
    return jnp.tensordot(x, w.astype(x.dtype), axes=dims)


def all_gather_matmul(x_BSD: jax.Array, ws: tuple, axis: str, n: int) -> tuple:
    """(all_gather(x, seq) @ w for w in ws), with the gather as n - 1 ppermutes that overlap
    the partial products. `x_BSD` is this device's sequence shard; each w is [D, ...]."""
    if n == 1:
        return tuple(_contract(x_BSD, w, 1) for w in ws)
    me = jax.lax.axis_index(axis)
    S = x_BSD.shape[1]
    to_left = [(j, (j - 1) % n) for j in range(n)]
    outs = [jnp.zeros((x_BSD.shape[0], n * S, *w.shape[1:]), x_BSD.dtype) for w in ws]
    chunk = x_BSD
    for k in range(n):
        # Issue the transfer of the shard held now before computing with it.
        nxt = jax.lax.ppermute(chunk, axis, to_left) if k < n - 1 else None
        start = ((me + k) % n) * S  # the shard of device me + k
        outs = [jax.lax.dynamic_update_slice_in_dim(o, _contract(chunk, w, 1), start, axis=1)
                for o, w in zip(outs, ws, strict=True)]
        chunk = nxt
    return tuple(outs)


def matmul_reduce_scatter(a: jax.Array, w: jax.Array, dims: int, axis: str, n: int
                          ) -> jax.Array:
    """psum_scatter(a @ w, seq) with the reduce-scatter as n - 1 ppermutes of an
    accumulator that overlap the partial products. `a` is [B, T, *contracted] with the
    full sequence; w contracts a's last `dims` axes."""
    if n == 1:
        return _contract(a, w, dims)
    me = jax.lax.axis_index(axis)
    S = a.shape[1] // n
    to_right = [(j, (j + 1) % n) for j in range(n)]

    def partial(k):
        # At step k this device adds the chunk of device me - k - 1 (mod n): the
        # accumulator it holds then arrives at its owner after the remaining steps.
        c = (me + n - 1 - k) % n
        return _contract(jax.lax.dynamic_slice_in_dim(a, c * S, S, axis=1), w, dims)

    acc = partial(0)
    for k in range(1, n):
        acc = jax.lax.ppermute(acc, axis, to_right) + partial(k)
    return acc
