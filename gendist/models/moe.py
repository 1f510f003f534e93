"""Mixture-of-experts FFN: top-k router, fixed-capacity expert buffers, aux losses.

A token picks its top-k experts (Shazeer et al. 2017); k=1 is the Switch Transformer
(Fedus et al. 2021), k=2 with gates renormalised over the two choices is GShard (Lepikhin
et al. 2020). Every expert has a buffer of `capacity` slots per group of tokens, so all
shapes are static: slots are filled first-come first-served in token order, every token's
first choice before any token's second choice (GShard), and a token-choice that finds its
expert's buffer full is dropped. A dropped choice contributes zero, so a token whose every
choice was dropped gets a zero layer output and rides the residual path unchanged.

This module is the single-device math; `gendist.parallel.expert` runs the same group
routing inside `shard_map` with all-to-alls over the `expert` mesh axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

ACTIVATIONS = ("swiglu", "gelu")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 8  # E: experts per MoE layer
    top_k: int = 2  # experts per token: 1 = Switch, 2 = GShard (renormalised gates)
    capacity_factor: float = 1.25  # slots per expert = ceil(tokens * k / E * this)
    d_ff: int = 512  # F: hidden width of each expert
    activation: str = "swiglu"  # 'swiglu' (w_gate, w_up, w_down) or 'gelu' (w_up, w_down)
    load_balance_weight: float = 0.01  # Switch load-balancing loss coefficient
    z_loss_weight: float = 1e-3  # ST-MoE router z-loss coefficient (Zoph et al. 2022)
    every_n_layers: int = 2  # an MoE FFN replaces the dense MLP in every N-th block
    router_dtype: Any = jnp.float32  # router logits/softmax dtype (fp32 for stable routing)

    def __post_init__(self):
        if self.num_experts < 1:
            raise ValueError(f"MoEConfig.num_experts={self.num_experts}: need at least 1 expert.")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} must be in [1, num_experts={self.num_experts}]: "
                "a token cannot pick more experts than exist; lower top_k or add experts.")
        if not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig.capacity_factor={self.capacity_factor} must be > 0 "
                             "(1.0 gives each expert exactly its even share of tokens).")
        if self.d_ff < 1:
            raise ValueError(f"MoEConfig.d_ff={self.d_ff}: the expert hidden width must be >= 1.")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation={self.activation!r}: use one of {ACTIVATIONS}.")
        if self.load_balance_weight < 0 or self.z_loss_weight < 0:
            raise ValueError("MoEConfig.load_balance_weight and z_loss_weight must be >= 0, got "
                             f"{self.load_balance_weight} and {self.z_loss_weight}.")
        if self.every_n_layers < 1:
            raise ValueError(f"MoEConfig.every_n_layers={self.every_n_layers} must be >= 1 "
                             "(1 = every block is MoE).")

    def capacity(self, group_tokens: int) -> int:
        """Buffer slots per expert for a group of `group_tokens` tokens (GShard/Switch)."""
        return math.ceil(group_tokens * self.top_k * self.capacity_factor / self.num_experts)


def check_expert_axis(num_experts: int, axis_size: int, axis_name: str = "expert") -> None:
    """Experts are split evenly over the expert mesh axis; say how to fix it if not."""
    if num_experts % axis_size:
        raise ValueError(
            f"MoEConfig.num_experts={num_experts} is not divisible by the size {axis_size} of "
            f"mesh axis {axis_name!r}: choose num_experts as a multiple of {axis_size} or "
            f"set the {axis_name!r} axis size to a divisor of {num_experts}.")


class MoEAux(NamedTuple):
    """Per-layer router losses and metrics (averaged over token groups)."""

    load_balance_loss: jax.Array  # [] Switch loss E * sum_e f_e P_e (1.0 when balanced)
    z_loss: jax.Array  # [] mean over tokens of logsumexp(router logits)^2
    drop_fraction: jax.Array  # [] dropped token-choices / all token-choices
    expert_load_E: jax.Array  # [E] token-choices routed to each expert, before capacity
    kept_BTK: jax.Array  # [B, T, k] bool: this token's k-th choice got a buffer slot
    expert_BTK: jax.Array  # [B, T, k] int32: expert of the k-th choice

    def weighted_loss(self, cfg: MoEConfig) -> jax.Array:
        """The term to add to the training loss."""
        return cfg.load_balance_weight * self.load_balance_loss + cfg.z_loss_weight * self.z_loss


def init_moe_params(key: jax.Array, d_model: int, cfg: MoEConfig,
                    dtype=jnp.float32) -> dict[str, jax.Array]:
    """Router [D, E] (fp32) and expert weights stacked on a leading experts axis."""
    E, D, F = cfg.num_experts, d_model, cfg.d_ff
    k_router, k_gate, k_up, k_down = jax.random.split(key, 4)
    params = {
        "router": jax.random.normal(k_router, (D, E), cfg.router_dtype) * D**-0.5,
        "w_up": (jax.random.normal(k_up, (E, D, F)) * D**-0.5).astype(dtype),
        "w_down": (jax.random.normal(k_down, (E, F, D)) * F**-0.5).astype(dtype),
    }
    if cfg.activation == "swiglu":
        params["w_gate"] = (jax.random.normal(k_gate, (E, D, F)) * D**-0.5).astype(dtype)
    return params


def moe_logical_axes(cfg: MoEConfig) -> dict[str, tuple[str | None, ...]]:
    """Logical axis names of `init_moe_params`; the router's E axis stays whole because
    every token group needs all E logits. Prepend 'layers' for layer-stacked params."""
    axes = {
        "router": ("embed", None),
        "w_up": ("experts", "embed", "mlp"),
        "w_down": ("experts", "mlp", "embed"),
    }
    if cfg.activation == "swiglu":
        axes["w_gate"] = ("experts", "embed", "mlp")
    return axes


class Routing(NamedTuple):
    """Where each token-choice of one group goes; choice-major ([k, G]) like GShard."""

    expert_KG: jax.Array  # int32 expert of each choice
    slot_KG: jax.Array  # int32 row in the flattened [E * C] buffer; E * C when dropped
    gate_KG: jax.Array  # fp32 combine weight; 0 when dropped
    kept_KG: jax.Array  # bool
    load_balance_loss: jax.Array
    z_loss: jax.Array


def route_group(router_DE: jax.Array, x_GD: jax.Array, cfg: MoEConfig, capacity: int) -> Routing:
    """Top-k routing of one group of G tokens into E buffers of `capacity` slots."""
    E, k = cfg.num_experts, cfg.top_k
    logits_GE = jnp.dot(x_GD.astype(cfg.router_dtype), router_DE.astype(cfg.router_dtype))
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


def expert_ffn(params: dict[str, jax.Array], x_ECD: jax.Array, activation: str) -> jax.Array:
    """Each expert's FFN on its own buffer; leading E of params matches x's E. Weights
    are cast to the activation dtype (mixed precision, like `layers.mlp`)."""
    dt = x_ECD.dtype
    up_ECF = jnp.einsum("ECD,EDF->ECF", x_ECD, params["w_up"].astype(dt))
    if activation == "swiglu":
        gate_ECF = jnp.einsum("ECD,EDF->ECF", x_ECD, params["w_gate"].astype(dt))
        h_ECF = jax.nn.silu(gate_ECF) * up_ECF
    else:
        h_ECF = jax.nn.gelu(up_ECF)
    return jnp.einsum("ECF,EFD->ECD", h_ECF, params["w_down"].astype(dt))


def split_groups(x_BTD: jax.Array, num_groups: int) -> jax.Array:
    """[B, T, D] -> [groups, B/groups * T, D]: contiguous batch slices, like a data shard."""
    B, T, D = x_BTD.shape
    if num_groups < 1 or B % num_groups:
        raise ValueError(f"moe num_groups={num_groups} must divide the batch size {B}; "
                         "use one group per data shard (a divisor of the batch).")
    return x_BTD.reshape(num_groups, (B // num_groups) * T, D)


def moe_group(params, x_GD: jax.Array, cfg: MoEConfig, capacity: int):
    """Route, run all experts and combine for one group on one device."""
    r = route_group(params["router"], x_GD, cfg, capacity)
    buf_ECD = dispatch(x_GD, r, cfg.num_experts, capacity)
    y_GD = combine(expert_ffn(params, buf_ECD, cfg.activation), r)
    return y_GD, r


def moe_ffn(params: dict[str, jax.Array], x_BTD: jax.Array, cfg: MoEConfig, *,
            num_groups: int = 1) -> tuple[jax.Array, MoEAux]:
    """Single-device MoE FFN. Tokens are routed in `num_groups` contiguous batch groups,
    each with its own capacity, exactly as `moe_ffn_sharded` routes one group per device
    of the batch axes; pass that shard count here to reproduce it."""
    B, T, D = x_BTD.shape
    x_NGD = split_groups(x_BTD, num_groups)
    capacity = cfg.capacity(x_NGD.shape[1])
    y_NGD, r = jax.vmap(lambda x: moe_group(params, x, cfg, capacity))(x_NGD)
    aux = group_aux(r, cfg, B, T)
    aux = aux._replace(load_balance_loss=jnp.mean(aux.load_balance_loss),
                       z_loss=jnp.mean(aux.z_loss), drop_fraction=jnp.mean(aux.drop_fraction),
                       expert_load_E=jnp.sum(aux.expert_load_E, axis=0))
    return y_NGD.reshape(B, T, D), aux


def group_aux(r: Routing, cfg: MoEConfig, B: int, T: int) -> MoEAux:
    """Per-group metrics from routing with leading group axes; the caller reduces them."""
    k = cfg.top_k
    kept = jnp.moveaxis(r.kept_KG, -2, -1)  # [..., G, k]
    expert = jnp.moveaxis(r.expert_KG, -2, -1)
    load = jnp.sum(jax.nn.one_hot(r.expert_KG, cfg.num_experts, dtype=jnp.float32),
                   axis=(-3, -2))
    return MoEAux(
        load_balance_loss=r.load_balance_loss,
        z_loss=r.z_loss,
        drop_fraction=1.0 - jnp.mean(r.kept_KG.astype(jnp.float32), axis=(-2, -1)),
        expert_load_E=load,
        kept_BTK=kept.reshape(B, T, k),
        expert_BTK=expert.reshape(B, T, k),
    )
