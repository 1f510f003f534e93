"""Transformer layers with Mixture-of-Experts blocks every `moe_every` layers.

Layers come in G = L / moe_every groups: moe_every − 1 dense blocks, then one block whose
MLP is the MoE layer of `gendist.models.moe`. Dense and MoE blocks are stacked separately
(dense [L − G, ...], MoE [G, ...], expert weights [G, E, ...]) and a scan over groups runs
each group's dense blocks and its MoE block. Inside a `use_mesh` context with more than one
batch shard the expert-parallel form (all-to-all over `expert`) runs; elsewhere (decoding,
one device) the single-device form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gendist.config import ModelConfig
from gendist.models.moe import MoEAux, init_moe_params, moe_ffn, moe_logical_axes
from gendist.sharding import current_mesh

ATTN_PARAM_NAMES = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm")


class MoEBlocks(nnx.Module):
    """The MoE blocks: attention weights [G, ...] and expert weights [G, E, ...]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        from gendist.models.transformer import _init_block_param, block_param_shapes
        G, mcfg = cfg.num_moe_layers, cfg.moe
        shapes = block_param_shapes(cfg)
        for name in ATTN_PARAM_NAMES:
            shape, axes = shapes[name]
            setattr(self, name, nnx.Param(_init_block_param(rngs.params(), name, shape, cfg, G),
                                          axes=("layers", *axes)))
        keys = jax.random.split(rngs.params(), G)
        moe = jax.vmap(lambda k: init_moe_params(k, cfg.d_model, mcfg))(keys)
        for name, axes in moe_logical_axes(mcfg).items():
            setattr(self, "moe_" + name, nnx.Param(moe[name], axes=("layers", *axes)))

    def stacked(self) -> dict[str, jax.Array]:
        out = {n: getattr(self, n)[...] for n in ATTN_PARAM_NAMES}
        for name in ("router", "w_gate", "w_up", "w_down"):
            if hasattr(self, "moe_" + name):
                out["moe_" + name] = getattr(self, "moe_" + name)[...]
        return out


def moe_apply(p_moe: dict, h_BTD, cfg: ModelConfig) -> tuple[jax.Array, MoEAux]:
    """The MoE FFN, expert-parallel when a mesh with several batch shards is active."""
    mesh = current_mesh()
    mcfg = cfg.moe
    if mesh is not None and mesh.shape["data"] * mesh.shape["expert"] > 1:
        from gendist.parallel.expert import moe_ffn_sharded
        tensor = "tensor" if mesh.shape["tensor"] > 1 else None
        return moe_ffn_sharded(p_moe, h_BTD, mcfg, mesh, tensor_axis=tensor)
    return moe_ffn(p_moe, h_BTD, mcfg)


def _regroup(tree, G, n):
    return jax.tree.map(lambda a: a.reshape(G, n, *a.shape[1:]), tree)


def apply_moe_groups(dense: dict, moe: dict, x_BTD, pos_BT, cfg: ModelConfig, cache=None):
    """Scan over layer groups; returns (x, cache, aux) with aux summed/averaged over layers."""
    from gendist.models.transformer import block_forward, remat_policy
    G, n = cfg.num_moe_layers, cfg.moe_every
    states = None if cache is None else _regroup(cache.layer_state(), G, n)

    def moe_block(p, x, ls):
        box = []

        def ffn(h):
            y, aux = moe_apply({k[4:]: v for k, v in p.items() if k.startswith("moe_")}, h, cfg)
            box.append(aux)
            return y

        x, ls = block_forward(p, x, pos_BT, cfg, cache=cache, layer_state=ls, ffn=ffn)
        aux = box[0]
        return x, ls, (aux.weighted_loss(cfg.moe), aux.drop_fraction, aux.expert_load_E)

    def group(x, inp):
        dp, mp, ls = inp
        dense_ls = None if ls is None else jax.tree.map(lambda a: a[: n - 1], ls)
        moe_ls = None if ls is None else jax.tree.map(lambda a: a[n - 1], ls)

        def dense_body(x, layer):
            q, s = layer
            return block_forward(q, x, pos_BT, cfg, cache=cache, layer_state=s)

        x, dense_ls = jax.lax.scan(dense_body, x, (dp, dense_ls))
        x, moe_ls, aux = moe_block(mp, x, moe_ls)
        new_ls = None if ls is None else jax.tree.map(
            lambda a, b: jnp.concatenate([a, b[None]], 0), dense_ls, moe_ls)
        return x, (new_ls, aux)

    if cfg.remat != "none":
        group = jax.checkpoint(group, policy=remat_policy(cfg.remat), prevent_cse=False)
    x_BTD, (new_states, (loss_G, drop_G, load_GE)) = jax.lax.scan(
        group, x_BTD, (_regroup(dense, G, n - 1), moe, states))
    if cache is not None:
        new_states = jax.tree.map(lambda a: a.reshape(G * n, *a.shape[2:]), new_states)
        cache = cache.with_layer_state(new_states)
    aux = {"moe_loss": jnp.sum(loss_G), "moe_drop_fraction": jnp.mean(drop_G),
           "moe_expert_load_GE": load_GE}
    return x_BTD, cache, aux
