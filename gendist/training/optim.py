"""The optimizer (optax AdamW, warm-up + cosine) and where its state lives on the mesh.

ZeRO (Rajbhandari et al. 2020) is a placement, not a different optimizer: stage 1 shards
the fp32 master weights and Adam's moments over `data`, stage 2 also the gradients, stage 3
gathers the parameters per layer (see gendist.parallel.zero). So the optimizer stays plain
optax, and `state_shardings` decides the placement.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gendist.config import TrainConfig
from gendist.parallel import zero
from gendist.sharding import DEFAULT_RULES, Rules


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    decay_steps = max(cfg.steps, cfg.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
        decay_steps=decay_steps, end_value=cfg.lr * cfg.min_lr_ratio)


def decay_mask(params: dict) -> dict:
    """True where weight decay applies: matrices, not norms or biases."""
    def leaf(path, _):
        name = str(getattr(path[-1], "key", path[-1]))
        return not (name.endswith("norm") or name.startswith("b_") or name == "bias")
    return jax.tree_util.tree_map_with_path(leaf, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                    mask=decay_mask),
    )


def state_shardings(mesh: Mesh, axes: dict, optimizer, params_shape, zero_stage: int = 0,
                    rules: Rules = DEFAULT_RULES):
    """Shardings of (params, opt_state): each moment sits where `zero` puts its parameter.

    optax's state is walked with `tree_map_params`, so any optax chain works; its non-param
    leaves (step counts) are replicated.
    """
    p_sh = zero.param_shardings(mesh, axes, params_shape, zero_stage, rules)
    m_sh = zero.moment_shardings(mesh, axes, params_shape, zero_stage, rules)
    opt_shape = jax.eval_shape(optimizer.init, params_shape)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_shape, m_sh,
                                   transform_non_params=lambda _: replicated)
    return p_sh, opt_sh
