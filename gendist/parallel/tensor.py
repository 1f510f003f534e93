"""Megatron tensor parallelism written out: the conjugate operators and the block they build.

Megatron-LM (Shoeybi et al. 2019, section 3) splits the MLP's first matmul by columns and
the second by rows, and attention by heads, so each block needs two all-reduces forward
and two backward. They come from two conjugate operators on the `tensor` axis:

    f: identity forward, all-reduce backward  (enters a column-parallel region)
    g: all-reduce forward, identity backward  (leaves a row-parallel region)

Sequence parallelism (Korthikanti et al. 2022) keeps the norms and residual adds on
sequence shards and splits each all-reduce into its two halves of equal total volume:

    gather_seq:  all-gather forward, reduce-scatter backward  (replaces f)
    scatter_seq: reduce-scatter forward, all-gather backward  (replaces g)

Here they are `jax.custom_vjp` functions usable under `shard_map` with JAX's varying-axes
check on (f marks its output as varying over `tensor`, so the forward moves nothing and JAX
inserts no second reduction; its backward sums the partial input gradients once) or off
(the pipeline stages). `gendist.parallel.manual` builds the model's explicit per-device
form from them. The vocabulary-parallel cross-entropy used by the train step lives here
too: it never gathers the [B, T, V] logits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from gendist.parallel.compat import shard_map, to_varying
from gendist.sharding import DEFAULT_RULES, Rules, logical_to_spec

# --- the conjugate operators (inside shard_map, check on) -------------------------------


def _conjugate(name: str, doc: str, forward, backward):
    """op(x, axis): `forward(x, axis)` in the forward pass, `backward(ct, axis)` on the
    cotangent in the backward pass (a `jax.custom_vjp`, the axis name static)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def op(x, axis):
        return forward(x, axis)

    op.defvjp(lambda x, axis: (forward(x, axis), None),
              lambda axis, _, ct: (backward(ct, axis),))
    op.__name__ = op.__qualname__ = name
    op.__doc__ = doc
    return op


def _all_gather_seq(x, axis):
    return jax.lax.all_gather(x, axis, axis=1, tiled=True)


def _reduce_scatter_seq(x, axis):
    return jax.lax.psum_scatter(x, axis, scatter_dimension=1, tiled=True)


f_op = _conjugate("f_op", "Megatron's f: identity forward (the value becomes varying), "
                  "all-reduce backward.", to_varying, jax.lax.psum)
g_op = _conjugate("g_op", "Megatron's g: all-reduce forward, identity backward.",
                  jax.lax.psum, to_varying)
gather_seq = _conjugate("gather_seq", "Sequence parallel f: all-gather the sequence shards "
                        "forward, reduce-scatter backward.", _all_gather_seq, _reduce_scatter_seq)
scatter_seq = _conjugate("scatter_seq", "Sequence parallel g: reduce-scatter partial sums onto "
                         "sequence shards, all-gather back.", _reduce_scatter_seq, _all_gather_seq)


# --- vocabulary-parallel cross-entropy ------------------------------------------------------


def local_vocab_nll(logits_BTV, targets_BT, axis, psum=jax.lax.psum):
    """Per-token loss from this device's vocabulary slice: three [B, T] reductions.

    `psum` is the sum over `axis`: `lax.psum` inside a shard_map with the varying-axes
    check (JAX transposes it correctly), Megatron's `g_op` (identity backward) where the
    check is off, as in the pipeline stages.
    """
    v_loc = logits_BTV.shape[-1]
    start = jax.lax.axis_index(axis) * v_loc
    m_BT = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits_BTV, axis=-1)), axis)
    sum_BT = psum(jnp.sum(jnp.exp(logits_BTV - m_BT[..., None]), axis=-1), axis)
    local_BT = targets_BT - start
    mine_BT = (local_BT >= 0) & (local_BT < v_loc)
    picked_BT = jnp.take_along_axis(logits_BTV, jnp.clip(local_BT, 0, v_loc - 1)[..., None],
                                    axis=-1)[..., 0]
    target_BT = psum(jnp.where(mine_BT, picked_BT, 0.0), axis)
    return m_BT + jnp.log(sum_BT) - target_BT


def vocab_parallel_nll(logits_BTV, targets_BT, mesh: Mesh, rules: Rules = DEFAULT_RULES):
    """Per-token next-token cross-entropy [B, T] (fp32, nats) of logits split over vocab on
    `tensor`.

    Each device keeps its [B, T, V/tp] slice: a max (pmax), a sum of exponentials (psum)
    and the target's logit, picked on the shard that owns it (psum) are all that cross the
    axis. The gradient softmax - onehot is local to each slice (JAX transposes psum into
    the identity on varying values).
    """
    spec = logical_to_spec(("batch", "seq", "vocab"), rules, mesh)
    axis = spec[2]
    if axis is None:  # vocab not split on this mesh
        logp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0]
    fn = shard_map(functools.partial(local_vocab_nll, axis=axis), mesh=mesh,
                   in_specs=(spec, PartitionSpec(*spec[:2])),
                   out_specs=PartitionSpec(*spec[:2]))
    return fn(logits_BTV.astype(jnp.float32), targets_BT)
