"""THE table of the transformer's parameters: names, shapes, logical axes and init.

The model is a pure function of one nested dict of arrays (see `transformer.py` for why),
and this module is the only place that names its leaves:

    embed        [V, D]                     token table (also the output layer when tied)
    blocks       {name: [L_dense, ...]}     dense blocks, stacked on a leading `layers` axis
    moe_blocks   {name: [G, ...]}           MoE blocks (every `moe_every`-th), when E > 0
    final_norm   [D]
    head         [D, V]                     output layer, when embeddings are untied

Every other view (init, logical axes for `gendist.sharding`, shapes without allocation,
the decode-time dtype casts, Hugging Face name maps) is derived from `param_specs`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from gendist.config import ModelConfig

ATTN_NAMES = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm")
MLP_NAMES = ("w_gate", "w_up", "w_down")
MOE_NAMES = ("moe_router", "moe_w_gate", "moe_w_up", "moe_w_down")
# `ModelConfig.dtype` (the compute dtype) by name.
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: shape, logical axis names (one per dim) and how it is initialised.

    init: 'ones'; 'normal' (std = model.init_std); 'residual' (init_std / sqrt(2 L), GPT-2's
    scaling of the projections that write into the residual stream); 'fan_in' (std =
    fan_in ** -0.5, the MoE router and experts).
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str
    fan_in: int = 0


def block_specs(cfg: ModelConfig, moe: bool = False) -> dict[str, ParamSpec]:
    """One block's weights (no `layers` axis): attention, norms, and a dense MLP or experts."""
    D, N, K, H, F = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_ff
    out = {
        "attn_norm": ParamSpec((D,), ("embed",), "ones"),
        "wq": ParamSpec((D, N, H), ("embed", "heads", "head_dim"), "normal"),
        "wk": ParamSpec((D, K, H), ("embed", "kv_heads", "head_dim"), "normal"),
        "wv": ParamSpec((D, K, H), ("embed", "kv_heads", "head_dim"), "normal"),
        "wo": ParamSpec((N, H, D), ("heads", "head_dim", "embed"), "residual"),
        "mlp_norm": ParamSpec((D,), ("embed",), "ones"),
    }
    swiglu = cfg.mlp == "swiglu"
    if not moe:
        if swiglu:
            out["w_gate"] = ParamSpec((D, F), ("embed", "mlp"), "normal")
        out["w_up"] = ParamSpec((D, F), ("embed", "mlp"), "normal")
        out["w_down"] = ParamSpec((F, D), ("mlp", "embed"), "residual")
        return out
    E, Fe = cfg.moe_experts, cfg.moe_expert_d_ff
    # The router's E axis stays whole: every token group needs all E logits.
    out["moe_router"] = ParamSpec((D, E), ("embed", None), "fan_in", D)
    if swiglu:
        out["moe_w_gate"] = ParamSpec((E, D, Fe), ("experts", "embed", "mlp"), "fan_in", D)
    out["moe_w_up"] = ParamSpec((E, D, Fe), ("experts", "embed", "mlp"), "fan_in", D)
    out["moe_w_down"] = ParamSpec((E, Fe, D), ("experts", "mlp", "embed"), "fan_in", Fe)
    return out


def _stacked(specs: dict[str, ParamSpec], n: int) -> dict[str, ParamSpec]:
    return {k: dataclasses.replace(s, shape=(n, *s.shape), axes=("layers", *s.axes))
            for k, s in specs.items()}


def param_specs(cfg: ModelConfig) -> dict:
    """The whole model's ParamSpecs as the nested dict the params use."""
    D, V = cfg.d_model, cfg.vocab_size
    out = {"embed": ParamSpec((V, D), ("vocab", "embed"), "normal"),
           "blocks": _stacked(block_specs(cfg), cfg.num_layers - cfg.num_moe_layers)}
    if cfg.num_moe_layers:
        out["moe_blocks"] = _stacked(block_specs(cfg, moe=True), cfg.num_moe_layers)
    out["final_norm"] = ParamSpec((D,), ("embed",), "ones")
    if not cfg.tie_embeddings:
        out["head"] = ParamSpec((D, V), ("embed", "vocab"), "normal")
    return out


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def _init_one(key, spec: ParamSpec, cfg: ModelConfig) -> jax.Array:
    if spec.init == "ones":
        return jnp.ones(spec.shape, jnp.float32)
    if spec.init == "fan_in":
        std = spec.fan_in ** -0.5
    elif spec.init == "residual":
        std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    else:
        std = cfg.init_std
    return std * jax.random.normal(key, spec.shape, jnp.float32)


def init_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """fp32 parameters; each leaf from its own key, split in table order."""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [_init_one(k, s, cfg) for k, s in zip(keys, leaves,
                                                                             strict=True)])


@functools.lru_cache(maxsize=64)
def logical_axes(cfg: ModelConfig) -> dict:
    """Logical axis names of every parameter (a nested dict of tuples, like the params)."""
    return jax.tree.map(lambda s: s.axes, param_specs(cfg), is_leaf=_is_spec)


def param_shapes(cfg: ModelConfig) -> dict:
    """jax.ShapeDtypeStruct of every parameter, without allocating anything."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), param_specs(cfg),
                        is_leaf=_is_spec)


def count(cfg: ModelConfig) -> int:
    """Total number of parameters (the tied table counted once)."""
    return sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(cfg), is_leaf=_is_spec))
