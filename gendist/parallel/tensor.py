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

Here they are `jax.custom_vjp` functions used under `shard_map` with JAX's varying-axes
check on: f marks its output as varying over `tensor` (so the forward moves nothing and JAX
inserts no second reduction), and its backward sums the partial input gradients once.
`tp_block_forward` is the annotation-driven `block_forward` written by hand with them; the
tests check the two agree in value and gradient. The vocabulary-parallel cross-entropy
used by `train.loss_fn` lives here too: it never gathers the [B, T, V] logits.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from gendist.config import ModelConfig
from gendist.models.attention import attention
from gendist.models.layers import apply_rope, mlp, rms_norm, rope_angles
from gendist.parallel.compat import shard_map, to_varying
from gendist.sharding import DEFAULT_RULES, SEQUENCE_PARALLEL, Rules, logical_to_spec

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


# --- the explicit tensor-parallel block ---------------------------------------------------


def _local_block(p, x_BTD, pos_BT, cfg: ModelConfig, axis: str, sequence_parallel: bool):
    """One block on this device's heads and MLP columns; x is full or a sequence shard."""
    enter = gather_seq if sequence_parallel else f_op
    leave = scatter_seq if sequence_parallel else g_op
    dt = x_BTD.dtype
    h_BTD = enter(rms_norm(x_BTD, p["attn_norm"], cfg.norm_eps), axis)
    q_BTNH = jnp.einsum("BTD,DNH->BTNH", h_BTD, p["wq"].astype(dt))  # column parallel
    k_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, p["wk"].astype(dt))
    v_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, p["wv"].astype(dt))
    cos, sin = rope_angles(pos_BT, cfg.head_dim, cfg.rope_theta)
    q_BTNH, k_BTKH = apply_rope(q_BTNH, cos, sin), apply_rope(k_BTKH, cos, sin)
    o_BTNH = attention(q_BTNH, k_BTKH, v_BTKH, backend=cfg.attention,
                       sm_scale=1.0 / math.sqrt(cfg.head_dim))
    partial_BTD = jnp.einsum("BTNH,NHD->BTD", o_BTNH, p["wo"].astype(dt))  # row parallel
    x_BTD = x_BTD + leave(partial_BTD, axis)
    h_BTD = enter(rms_norm(x_BTD, p["mlp_norm"], cfg.norm_eps), axis)
    return x_BTD + leave(mlp(h_BTD, p, cfg.mlp), axis)  # up/gate by columns, down by rows


def block_specs(cfg: ModelConfig, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> dict:
    """PartitionSpecs of one block's weights, from the logical-axis table."""
    from gendist.models.transformer import block_param_shapes
    return {k: logical_to_spec(a, rules, mesh) for k, (_, a) in block_param_shapes(cfg).items()}


def tp_block_forward(p: dict, x_BTD, pos_BT, cfg: ModelConfig, mesh: Mesh, *,
                     sequence_parallel: bool = False, rules: Rules = DEFAULT_RULES):
    """`transformer.block_forward` (no cache) as one shard_map with explicit f and g.

    Weights are split as the table says (heads, kv_heads, mlp -> `tensor`); x is split over
    the batch axes, and with sequence parallelism also over the sequence on `tensor`.
    """
    if sequence_parallel:
        rules = rules.with_overrides(**SEQUENCE_PARALLEL)
    axis = rules["heads"]
    tp = mesh.shape[axis]
    for name, size in (("model.num_heads", cfg.num_heads),
                       ("model.num_kv_heads", cfg.num_kv_heads), ("model.d_ff", cfg.d_ff)):
        if size % tp:
            raise ValueError(f"{name}={size} is not divisible by mesh.tensor={tp}; choose "
                             f"{name} divisible by {tp} or a smaller mesh.tensor.")
    if sequence_parallel and x_BTD.shape[1] % tp:
        raise ValueError(f"sequence length {x_BTD.shape[1]} is not divisible by mesh.tensor="
                         f"{tp}; sequence parallelism needs train.seq_len divisible by it.")
    x_spec = logical_to_spec(("batch", "act_seq", "embed"), rules, mesh)
    pos_spec = logical_to_spec(("batch", "seq"), rules, mesh)
    body = functools.partial(_local_block, cfg=cfg, axis=axis,
                             sequence_parallel=sequence_parallel)
    fn = shard_map(body, mesh=mesh, in_specs=(block_specs(cfg, mesh, rules), x_spec, pos_spec),
                   out_specs=x_spec)
    return fn({k: p[k] for k in block_specs(cfg, mesh, rules)}, x_BTD, pos_BT)


# --- vocabulary-parallel cross-entropy ------------------------------------------------------


def _local_ce(logits_BTV, targets_BT, axis):
    """Per-token loss from this device's vocabulary slice: three [B, T] reductions."""
    v_loc = logits_BTV.shape[-1]
    start = jax.lax.axis_index(axis) * v_loc
    m_BT = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits_BTV, axis=-1)), axis)
    sum_BT = jax.lax.psum(jnp.sum(jnp.exp(logits_BTV - m_BT[..., None]), axis=-1), axis)
    local_BT = targets_BT - start
    mine_BT = (local_BT >= 0) & (local_BT < v_loc)
    picked_BT = jnp.take_along_axis(logits_BTV, jnp.clip(local_BT, 0, v_loc - 1)[..., None],
                                    axis=-1)[..., 0]
    target_BT = jax.lax.psum(jnp.where(mine_BT, picked_BT, 0.0), axis)
    return m_BT + jnp.log(sum_BT) - target_BT


def vocab_parallel_cross_entropy(logits_BTV, targets_BT, mesh: Mesh,
                                 rules: Rules = DEFAULT_RULES):
    """Mean next-token cross-entropy (fp32, nats) of logits split over vocab on `tensor`.

    Each device keeps its [B, T, V/tp] slice: a max (pmax), a sum of exponentials (psum)
    and the target's logit, picked on the shard that owns it (psum) are all that cross the
    axis. The gradient softmax - onehot is local to each slice (JAX transposes psum into
    the identity on varying values).
    """
    spec = logical_to_spec(("batch", "seq", "vocab"), rules, mesh)
    axis = spec[2]
    if axis is None:  # vocab not split on this mesh
        logp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets_BT[..., None], axis=-1))
    fn = shard_map(functools.partial(_local_ce, axis=axis), mesh=mesh,
                   in_specs=(spec, PartitionSpec(*spec[:2])),
                   out_specs=PartitionSpec(*spec[:2]))
    return jnp.mean(fn(logits_BTV.astype(jnp.float32), targets_BT))
