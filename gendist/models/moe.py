"""Mixture-of-experts FFN: top-k router, fixed-capacity expert buffers, aux losses.

A token picks its top-k experts (Shazeer et al. 2017); k=1 is the Switch Transformer
(Fedus et al. 2021), k=2 with gates renormalised over the two choices is GShard (Lepikhin
et al. 2020). Every expert has a buffer of `capacity` slots per group of tokens, so all
shapes are static: slots are filled first-come first-served in token order, every token's
first choice before any token's second choice (GShard), and a token-choice that finds its
expert's buffer full is dropped. A dropped choice contributes zero, so a token whose every
choice was dropped gets a zero layer output and rides the residual path unchanged.

The layer is configured by `ModelConfig`'s `moe_*` fields (one place, named as flags); the
activation is the model's `mlp` (SwiGLU: w_gate, w_up, w_down; GELU: w_up, w_down).
This module is the single-device math; `gendist.parallel.expert` runs the same group
routing inside `shard_map` with all-to-alls over the `expert` mesh axis.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gendist.config import ModelConfig
from gendist.models import fp8 as fp8_lib
from gendist.models.params import block_specs

ROUTER_DTYPE = jnp.float32  # router logits and softmax in fp32 for stable routing


def check_expert_axis(num_experts: int, axis_size: int, axis_name: str = "expert") -> None:
    """Experts are split evenly over the expert mesh axis; say how to fix it if not."""
    if num_experts % axis_size:
        raise ValueError(
            f"model.moe_experts={num_experts} is not divisible by the size {axis_size} of "
            f"mesh axis {axis_name!r}: choose moe_experts as a multiple of {axis_size} or "
            f"set the {axis_name!r} axis size to a divisor of {num_experts}.")


class MoEAux(NamedTuple):
    """Per-layer router losses and metrics (averaged over token groups)."""

    load_balance_loss: jax.Array  # [] Switch loss E * sum_e f_e P_e (1.0 when balanced)
    z_loss: jax.Array  # [] mean over tokens of logsumexp(router logits)^2
    drop_fraction: jax.Array  # [] dropped token-choices / all token-choices
    expert_load_E: jax.Array  # [E] token-choices routed to each expert, before capacity
    kept_BTK: jax.Array  # [B, T, k] bool: this token's k-th choice got a buffer slot
    expert_BTK: jax.Array  # [B, T, k] int32: expert of the k-th choice

    def weighted_loss(self, cfg: ModelConfig) -> jax.Array:
        """The term to add to the training loss."""
        return (cfg.moe_load_balance_weight * self.load_balance_loss
                + cfg.moe_z_loss_weight * self.z_loss)


def moe_logical_axes(cfg: ModelConfig) -> dict[str, tuple[str | None, ...]]:
    """Logical axes of one MoE layer's weights (router, experts), named as this module
    uses them: the model's table (`params.block_specs`) without its `moe_` prefix."""
    return {k[4:]: s.axes for k, s in block_specs(cfg, moe=True).items()
            if k.startswith("moe_")}


def layer_weights(p_block: dict) -> dict[str, jax.Array]:
    """The MoE weights of one block's params (`moe_router` -> `router`, ...)."""
    return {k[4:]: v for k, v in p_block.items() if k.startswith("moe_")}


def init_moe_params(key: jax.Array, cfg: ModelConfig, dtype=jnp.float32) -> dict[str, jax.Array]:
    """One MoE layer's router [D, E] (fp32) and experts [E, ...], std fan_in ** -0.5."""
    specs = {k[4:]: s for k, s in block_specs(cfg, moe=True).items() if k.startswith("moe_")}
    keys = jax.random.split(key, len(specs))
    out = {}
    for k, (name, s) in zip(keys, sorted(specs.items()), strict=True):
        w = jax.random.normal(k, s.shape, jnp.float32) * s.fan_in ** -0.5
        out[name] = w if name == "router" else w.astype(dtype)
    return out


class Routing(NamedTuple):
    """Where each token-choice of one group goes; choice-major ([k, G]) like GShard."""

    expert_KG: jax.Array  # int32 expert of each choice
    slot_KG: jax.Array  # int32 row in the flattened [E * C] buffer; E * C when dropped
    gate_KG: jax.Array  # fp32 combine weight; 0 when dropped
    kept_KG: jax.Array  # bool
    load_balance_loss: jax.Array
    z_loss: jax.Array


def route_group(router_DE: jax.Array, x_GD: jax.Array, cfg: ModelConfig,
                capacity: int) -> Routing:
    """Top-k routing of one group of G tokens into E buffers of `capacity` slots."""
    E, k = cfg.moe_experts, cfg.moe_top_k
    logits_GE = jnp.dot(x_GD.astype(ROUTER_DTYPE), router_DE.astype(ROUTER_DTYPE))
    probs_GE = jax.nn.softmax(logits_GE, axis=-1)
    top_p_GK, expert_GK = jax.lax.top_k(probs_GE, k)
    # Switch keeps the raw top-1 probability (its gradient trains the router); k >= 2
    # renormalises over the chosen experts (GShard).
    gate_GK = top_p_GK if k == 1 else top_p_GK / jnp.sum(top_p_GK, axis=-1, keepdims=True)
    expert_KG = expert_GK.T.astype(jnp.int32)
    # Slot = how many earlier choices (all first choices, then all second choices, each in
    # token order) picked the same expert.
    onehot_ME = jax.nn.one_hot(expert_KG.reshape(-1), E, dtype=jnp.int32)
    position_M = jnp.sum((jnp.cumsum(onehot_ME, axis=0) - 1) * onehot_ME, axis=-1)
    position_KG = position_M.reshape(k, -1)
    kept_KG = position_KG < capacity
    slot_KG = jnp.where(kept_KG, expert_KG * capacity + position_KG, E * capacity)
    gate_KG = jnp.where(kept_KG, gate_GK.T, 0.0)
    # Switch load balance: f_e from top-1 choices, P_e the mean router probability.
    f_E = jnp.mean(jax.nn.one_hot(expert_KG[0], E, dtype=probs_GE.dtype), axis=0)
    p_E = jnp.mean(probs_GE, axis=0)
    load_balance = E * jnp.sum(f_E * p_E)
    z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits_GE, axis=-1)))
    return Routing(expert_KG, slot_KG, gate_KG, kept_KG, load_balance, z_loss)


def dispatch(x_GD: jax.Array, r: Routing, num_experts: int, capacity: int) -> jax.Array:
    """Scatter token-choices into the [E, C, D] buffers; dropped ones fall off the end."""
    k, D = r.slot_KG.shape[0], x_GD.shape[-1]
    x_MD = jnp.broadcast_to(x_GD[None], (k, *x_GD.shape)).reshape(-1, D)
    buf = jnp.zeros((num_experts * capacity, D), x_GD.dtype)
    buf = buf.at[r.slot_KG.reshape(-1)].add(x_MD, mode="drop")
    return buf.reshape(num_experts, capacity, D)


def combine(y_ECD: jax.Array, r: Routing) -> jax.Array:
    """Gather each token-choice's expert output and mix with its gate; dropped -> 0."""
    E, C, D = y_ECD.shape
    k, G = r.slot_KG.shape
    y_MD = y_ECD.reshape(E * C, D).at[r.slot_KG.reshape(-1)].get(mode="fill", fill_value=0)
    y_KGD = y_MD.reshape(k, G, D).astype(jnp.float32)
    return jnp.einsum("KG,KGD->GD", r.gate_KG, y_KGD).astype(y_ECD.dtype)


def expert_ffn(params: dict[str, jax.Array], x_ECD: jax.Array, activation: str,
               fp8: tuple | None = None) -> jax.Array:
    """Each expert's FFN on its own buffer; leading E of params matches x's E. Weights
    are cast to the activation dtype (mixed precision, like the dense MLP). `fp8`: the
    products' `fp8.Fp8Meta`s in `fp8.products(cfg, moe=True)` order after the attention's
    ([gate,] up, down): FP8 products batched over the experts, one scale per tensor."""
    dt = x_ECD.dtype
    names = ("w_gate", "w_up", "w_down") if activation == "swiglu" else ("w_up", "w_down")
    metas = dict(zip(names, fp8, strict=True)) if fp8 is not None else {}

    def mm(x_ECK, name):  # [E, C, K] . [E, K, N]
        if fp8 is None:
            return jnp.einsum("ECK,EKN->ECN", x_ECK, params[name].astype(dt))
        return fp8_lib.dot(x_ECK, params[name], metas[name], dims=1, batch=1)

    up_ECF = mm(x_ECD, "w_up")
    if activation == "swiglu":
        h_ECF = jax.nn.silu(mm(x_ECD, "w_gate")) * up_ECF
    else:
        h_ECF = jax.nn.gelu(up_ECF)
    return mm(h_ECF, "w_down")


def split_groups(x_BTD: jax.Array, num_groups: int) -> jax.Array:
    """[B, T, D] -> [groups, B/groups * T, D]: contiguous batch slices, like a data shard."""
    B, T, D = x_BTD.shape
    if num_groups < 1 or B % num_groups:
        raise ValueError(f"moe num_groups={num_groups} must divide the batch size {B}; "
                         "use one group per data shard (a divisor of the batch).")
    return x_BTD.reshape(num_groups, (B // num_groups) * T, D)


def moe_ffn(params: dict[str, jax.Array], x_BTD: jax.Array, cfg: ModelConfig, *,
            num_groups: int = 1, fp8: tuple | None = None) -> tuple[jax.Array, MoEAux]:
    """Single-device MoE FFN. Tokens are routed in `num_groups` contiguous batch groups,
    each with its own capacity, exactly as `moe_ffn_sharded` routes one group per device
    of the batch axes; pass that shard count here to reproduce it. The experts run once
    on every group's slots ([E, groups x C, D]), as the sharded form runs its local
    experts on the slots of every source device. `fp8`: see `expert_ffn`."""
    B, T, D = x_BTD.shape
    x_NGD = split_groups(x_BTD, num_groups)
    N, E = x_NGD.shape[0], cfg.moe_experts
    capacity = cfg.moe_capacity(x_NGD.shape[1])
    r = jax.vmap(lambda x: route_group(params["router"], x, cfg, capacity))(x_NGD)
    buf_NECD = jax.vmap(lambda x, r: dispatch(x, r, E, capacity))(x_NGD, r)
    x_EMD = buf_NECD.transpose(1, 0, 2, 3).reshape(E, N * capacity, D)
    y_EMD = expert_ffn(params, x_EMD, cfg.mlp, fp8)
    y_NECD = y_EMD.reshape(E, N, capacity, D).transpose(1, 0, 2, 3)
    y_NGD = jax.vmap(combine)(y_NECD, r)
    aux = group_aux(r, cfg, B, T)
    aux = aux._replace(load_balance_loss=jnp.mean(aux.load_balance_loss),
                       z_loss=jnp.mean(aux.z_loss), drop_fraction=jnp.mean(aux.drop_fraction),
                       expert_load_E=jnp.sum(aux.expert_load_E, axis=0))
    return y_NGD.reshape(B, T, D), aux


def group_aux(r: Routing, cfg: ModelConfig, B: int, T: int) -> MoEAux:
    """Per-group metrics from routing with leading group axes; the caller reduces them."""
    k = cfg.moe_top_k
    kept = jnp.moveaxis(r.kept_KG, -2, -1)  # [..., G, k]
    expert = jnp.moveaxis(r.expert_KG, -2, -1)
    load = jnp.sum(jax.nn.one_hot(r.expert_KG, cfg.moe_experts, dtype=jnp.float32),
                   axis=(-3, -2))
    return MoEAux(
        load_balance_loss=r.load_balance_loss,
        z_loss=r.z_loss,
        drop_fraction=1.0 - jnp.mean(r.kept_KG.astype(jnp.float32), axis=(-2, -1)),
        expert_load_E=load,
        kept_BTK=kept.reshape(B, T, k),
        expert_BTK=expert.reshape(B, T, k),
    )
