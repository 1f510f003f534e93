"""ZeRO (Rajbhandari et al. 2020) over `data`: where the training state lives, per stage.

ZeRO is a placement, not another optimizer: optax's AdamW runs unchanged, and the shardings
below decide which device holds which slice. With bf16 compute the stored parameters are
the fp32 master weights; the matmuls see a compute copy (matrices cast to model.dtype).

    stage  fp32 master   Adam m, v   gradients              compute copy
    0      replicated    replicated  all-reduced            the master itself
    1      / |data|      / |data|    all-reduced (full)     all-gathered once per step
    2      / |data|      / |data|    reduce-scattered       all-gathered once per step
    3      / |data|      / |data|    reduce-scattered       all-gathered per layer, in the
                                                           layer scan, again in the backward

"Replicated" means over `data`; every array is also split over `tensor` by the table.
Each array is split over `data` along one dimension whose (per-`tensor`-shard) length
`data` divides: `embed` first, then the longest other dimension (never `layers`, which the
scan walks). An array with no such dimension (a norm scale with d_model % data != 0, say)
stays replicated: small, and it keeps the step correct.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gendist.sharding import DEFAULT_RULES, Rules, constrain, logical_to_spec

STAGES = (0, 1, 2, 3)


def check_stage(stage: int) -> None:
    if stage not in STAGES:
        raise ValueError(f"train.zero_stage={stage!r}; choose one of {STAGES} "
                         "(0 replicated, 1 optimizer state, 2 + gradients, 3 + parameters).")


def _axes_of(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def zero_spec(names: tuple, shape: tuple[int, ...], mesh: Mesh,
              rules: Rules = DEFAULT_RULES) -> PartitionSpec:
    """The table's spec for an array, with the ZeRO axis added on one divisible dimension."""
    base = list(logical_to_spec(names, rules, mesh))
    base += [None] * (len(shape) - len(base))
    zaxes = tuple(a for a in _axes_of(rules["zero"]) if mesh.shape[a] > 1)
    used = {a for e in base for a in _axes_of(e)}
    if not zaxes or used & set(zaxes):
        return PartitionSpec(*base)
    n = math.prod(mesh.shape[a] for a in zaxes)
    names = tuple(names) + (None,) * (len(shape) - len(names))

    def per_shard(i):
        return shape[i] // math.prod(mesh.shape[a] for a in _axes_of(base[i]))

    order = sorted((i for i in range(len(shape)) if names[i] != "layers"),
                   key=lambda i: (names[i] != "embed", -per_shard(i)))
    for i in order:
        if per_shard(i) % n == 0:
            base[i] = _axes_of(base[i]) + zaxes
            base[i] = base[i][0] if len(base[i]) == 1 else base[i]
            return PartitionSpec(*base)
    return PartitionSpec(*base)  # nothing divisible: replicated over `data`


def _tree_specs(mesh, axes, shapes, zero: bool, rules):
    def one(names, s):
        if zero:
            return NamedSharding(mesh, zero_spec(names, s.shape, mesh, rules))
        return NamedSharding(mesh, logical_to_spec(names, rules, mesh))
    return jax.tree.map(one, axes, shapes, is_leaf=lambda a: isinstance(a, tuple))


def param_shardings(mesh: Mesh, axes: dict, shapes: dict, stage: int,
                    rules: Rules = DEFAULT_RULES) -> dict:
    """Where the stored (fp32 master) parameters live: split over `data` from stage 1."""
    check_stage(stage)
    return _tree_specs(mesh, axes, shapes, stage >= 1, rules)


def moment_shardings(mesh: Mesh, axes: dict, shapes: dict, stage: int,
                     rules: Rules = DEFAULT_RULES) -> dict:
    """Where Adam's moments (one per parameter) live: split over `data` from stage 1."""
    check_stage(stage)
    return _tree_specs(mesh, axes, shapes, stage >= 1, rules)


def grad_shardings(mesh: Mesh, axes: dict, shapes: dict, stage: int,
                   rules: Rules = DEFAULT_RULES) -> dict:
    """Where gradients land: reduce-scattered over `data` from stage 2, else all-reduced."""
    check_stage(stage)
    return _tree_specs(mesh, axes, shapes, stage >= 2, rules)


def compute_copy(params: dict, axes: dict, dtype) -> dict:
    """Stages 1-2: the whole compute copy, cast to `dtype` and gathered once per step.

    Matrices are cast before the gather (a bf16 gather moves half the bytes); vectors stay
    fp32, exactly as the model would use them, so the math is unchanged. Call inside
    `use_mesh`; the gradient of this copy flows back to the fp32 master.
    """
    def one(w, names):
        w = w.astype(dtype) if w.ndim >= 2 else w
        return constrain(w, names)
    return jax.tree.map(one, params, axes)


def constrain_tree(tree: dict, shardings: dict) -> dict:
    """with_sharding_constraint leaf by leaf (e.g. gradients onto their ZeRO shards)."""
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def model_for_stage(model_cfg, stage: int):
    """Stage 3 needs each layer's weights gathered again in the backward, not saved.

    Plain autodiff keeps every layer's gathered weights as scan residuals (the backward
    matmuls need them), which would undo ZeRO-3's saving. Recomputing inside the layer
    scan avoids that: with model.remat='none' stage 3 uses 'save_matmuls' (projection
    outputs saved; weights, norms and the attention core recomputed per layer, so the
    backward scan all-gathers each layer's weights once more: FSDP's backward gather).
    """
    if stage == 3 and model_cfg.remat == "none":
        return dataclasses.replace(model_cfg, remat="save_matmuls")
    return model_cfg
