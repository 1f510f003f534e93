"""The FP8 products' scaling state in training (`train.matmul_precision='fp8'`).

The state is one amax history per product tensor, `state["fp8"]` = {"blocks": [L, P, 3, H]}
(the dense blocks: layers, the block's products in `models.fp8.products` order, rows
x / w / g, H steps; an MoE model also "moe_blocks", its MoE blocks' attention and experts'
products), keyed like the layer stacks they belong to, beside the params and outside the
optimizer: master weights and the Adam moments stay fp32 and never
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

OBSERVED = "fp8_amax"  # the metrics key that carries the observed amaxes out of an engine
STACKS = ("blocks", "moe_blocks")  # the layer stacks, as in the params


def enabled(cfg: Config) -> bool:
    return cfg.train.matmul_precision == "fp8"


def transposes(cfg: Config, mesh) -> str:
    """How the FP8 GEMMs' float8 operands are transposed (`train.fp8_transpose`) in a step on
    `mesh`: "auto" is the Pallas kernel on a one-device GPU mesh (3.4-5.3% of the step faster
    than XLA's transposes of one-byte elements: `benchmarks/training.md`) and XLA's elsewhere. The
    kernel is a custom call that jit's partitioner cannot split, so sharded steps keep
    XLA's."""
    how = cfg.train.fp8_transpose
    if how != "auto":
        return how
    return "pallas" if jax.default_backend() == "gpu" and mesh.size == 1 else "xla"


def stacks(cfg: Config) -> dict[str, int]:
    """The model's layer stacks and their layers: the dense blocks, and the MoE blocks of
    an MoE model."""
    m = cfg.model
    out = {"blocks": m.num_layers - m.num_moe_layers}
    return {**out, "moe_blocks": m.num_moe_layers} if m.num_moe_layers else out


def init(cfg: Config) -> dict:
    """Empty histories, one array per layer stack of the model."""
    return {k: fp8_lib.init_history(cfg.model, n, cfg.train.fp8_history, moe=k == "moe_blocks")
            for k, n in stacks(cfg).items()}


def axes(cfg: Config) -> dict:
    """The histories' logical axes (their layers axis is the params' `layers`)."""
    return {k: fp8_lib.HISTORY_AXES for k in stacks(cfg)}


def attach(cfg: Config, params: dict, hist, transpose: str = "xla") -> dict:
    """`params` with each layer stack's histories where `transformer.block` finds them, their
    products' float8 operands transposed as `transpose` says (`transposes`)."""
    if hist is None:
        return params
    out = dict(params)
    for k, h in hist.items():
        state = fp8_lib.Fp8Products(h, cfg.train.fp8_recipe, cfg.train.fp8_margin, transpose)
        out[k] = {**params[k], fp8_lib.STATE_KEY: state}
    return out


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


def to_engine(hist, factor: int, margin: int):
    """The histories as an engine that differentiates `factor` x the batch-mean loss sees
    them: the gradients' row times `factor` (an empty row: the amax whose scale is
    `factor`, what scale 1 is to the mean loss). A pipeline differentiates the loss summed
    over its tokens; gradient accumulation each microbatch's own mean, `accum` x its share
    of the batch's. With `from_engine` on the way back, one history means the same whatever
    the engine, the split into microbatches or the mesh, so a checkpoint moves between them."""
    if hist is None or factor == 1:
        return hist
    n = jnp.float32(factor)
    unit = n * fp8_lib.fp8_max(fp8_lib.E5M2) / 2.0 ** margin

    def one(h):
        g = h[..., 2, :]
        return h.at[..., 2, :].set(jnp.where(jnp.max(g, axis=-1, keepdims=True) > 0, g * n,
                                             unit))
    return jax.tree.map(one, hist)


def from_engine(obs, factor: int):
    """Observed amaxes of an engine that differentiates `factor` x the mean loss, per the
    mean loss (the inverse of `to_engine`)."""
    if factor == 1:
        return obs
    return jax.tree.map(lambda o: o.at[..., 2, :].divide(jnp.float32(factor)), obs)


def pop_observed(grads: dict, metrics: dict) -> tuple:
    """(grads without the products' state, metrics with the observed amaxes) from a
    pipeline engine's gradients, which carry the state where `attach` put it."""
    obs, out = {}, dict(grads)
    for k in STACKS:
        if fp8_lib.STATE_KEY in grads.get(k, {}):
            out[k] = dict(grads[k])
            obs[k] = out[k].pop(fp8_lib.STATE_KEY).hist
    return (out, {**metrics, OBSERVED: obs}) if obs else (grads, metrics)


def combine(a, b, key: str):
    """How two microbatches' metric `key` add up: max for the observed amaxes, else sum."""
    return jax.tree.map(jnp.maximum, a, b) if key == OBSERVED else a + b


def update(hist, obs):
    """The next histories, and whether every observed amax is finite (an overflow in a
    product skips the step like a non-finite loss)."""
    new = jax.tree.map(fp8_lib.roll, hist, obs)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(o[..., 0])) for o in jax.tree.leaves(obs)]))
    return new, finite
