"""The FP8 products' scaling state in training (`train.matmul_precision='fp8'`).

The state is one amax history per product tensor, `state["fp8"]` [L, P, 3, H] (layers,
the block's products in `models.fp8.products` order, rows x / w / g, H steps), beside the
params and outside the optimizer: master weights and the Adam moments stay fp32 and never
see it. Each step the engine differentiates the loss with respect to the params and the
histories together; the histories' cotangent is the amaxes the step observed (column 0),
which `update` rolls in. Over gradient accumulation the observations combine by max, not
mean (`combine`). It is checkpointed with the rest of the state, so a resumed run scales
its first step as the uninterrupted one would. Its layers axis is the params' `layers`
logical axis (the one table in `gendist.sharding`); the rest is replicated.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from gendist.config import Config
from gendist.models import fp8 as fp8_lib

AXES = ("layers", None, None, None)
OBSERVED = "fp8_amax"  # the metrics key that carries the observed amaxes out of an engine


def enabled(cfg: Config) -> bool:
    return cfg.train.matmul_precision == "fp8"


def init(cfg: Config) -> jax.Array:
    return fp8_lib.init_history(cfg.model, cfg.model.num_layers - cfg.model.num_moe_layers,
                                cfg.train.fp8_history)


def attach(cfg: Config, params: dict, hist) -> dict:
    """`params` with the dense blocks' histories where `transformer.block` finds them."""
    if hist is None:
        return params
    state = fp8_lib.Fp8Products(hist, cfg.train.fp8_recipe, cfg.train.fp8_margin)
    return {**params, "blocks": {**params["blocks"], "fp8": state}}


def split(params_and_hist):
    """(params, hist) from an engine's input: a pair when FP8 is on, else params alone."""
    if isinstance(params_and_hist, tuple):
        return params_and_hist
    return params_and_hist, None


def observed(grads, metrics: dict, hist_grad) -> tuple:
    """(grads, metrics with the observed amaxes) from the cotangent of the histories."""
    if hist_grad is None:
        return grads, metrics
    return grads, {**metrics, OBSERVED: hist_grad}


def combine(a, b, key: str):
    """How two microbatches' metric `key` add up: max for the observed amaxes, else sum."""
    return jnp.maximum(a, b) if key == OBSERVED else a + b


def update(hist, obs):
    """The next histories, and whether every observed amax is finite (an overflow in a
    product skips the step like a non-finite loss)."""
    return fp8_lib.roll(hist, obs), jnp.all(jnp.isfinite(obs[..., 0]))
