"""The device mesh and THE ONE table from logical axis names to mesh axes.

Model code names what an axis is (`embed`, `heads`, ...); this module alone decides which
mesh axis it lands on. Every `PartitionSpec` in gendist comes from `logical_to_spec`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gendist.config import MeshConfig

MESH_AXES = ("data", "pipeline", "expert", "tensor")

# Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
# `batch` is split over `data` and `expert`: the expert axis is data parallel for every
# layer that is not an MoE layer (GShard). `layers` stays whole here; pipeline stages
# take contiguous slices of it inside shard_map.
LOGICAL_AXIS_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "expert"),
    "seq": None,
    "embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
    "experts": "expert",
    "layers": None,
    # Activation-only names: the sequence axis in norm/residual regions (Megatron sequence
    # parallelism maps it to `tensor`; off by default) and the hidden `mlp` activations.
    "act_seq": None,
    # ZeRO (Rajbhandari et al. 2020): the mesh axis that optimizer state, gradients (stage 2)
    # and parameters (stage 3) are split over, on one dimension chosen per array.
    "zero": "data",
}

# Megatron-3 (Korthikanti et al. 2022): norms and residual adds run on sequence shards.
SEQUENCE_PARALLEL = {"act_seq": "tensor"}
# Pipeline stages (mesh.pipeline > 1): each stage stores its contiguous slice of the layers.
PIPELINE_STAGES = {"layers": "pipeline"}


def mesh_axes_of(logical: str, rules=None) -> tuple[str, ...]:
    """The mesh axes (a tuple, possibly empty) a logical axis is split over."""
    target = (LOGICAL_AXIS_RULES if rules is None else rules)[logical]
    return () if target is None else (target,) if isinstance(target, str) else tuple(target)


# The mesh axes a batch is split over (data parallel): every batch placement reads this.
BATCH_AXES = mesh_axes_of("batch")


@dataclass(frozen=True)
class Rules:
    """A view of the table with optional overrides (e.g. FSDP shards `embed` over `data`)."""

    overrides: tuple[tuple[str, str | tuple[str, ...] | None], ...] = ()

    def __getitem__(self, name: str):
        for k, v in reversed(self.overrides):  # a later override wins
            if k == name:
                return v
        if name not in LOGICAL_AXIS_RULES:
            raise KeyError(f"logical axis {name!r} is not in sharding.LOGICAL_AXIS_RULES; "
                           f"known: {sorted(LOGICAL_AXIS_RULES)}")
        return LOGICAL_AXIS_RULES[name]

    def with_overrides(self, **kw) -> Rules:
        return Rules(self.overrides + tuple(kw.items()))


DEFAULT_RULES = Rules()


def rules_for(mesh_cfg: MeshConfig) -> Rules:
    """The rules a run uses: the table, plus sequence parallelism when asked, plus the
    layers split over pipeline stages when there are several."""
    over = {}
    if mesh_cfg.sequence_parallel:
        over.update(SEQUENCE_PARALLEL)
    if mesh_cfg.pipeline > 1:
        over.update(PIPELINE_STAGES)
    return DEFAULT_RULES.with_overrides(**over) if over else DEFAULT_RULES


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes (data, pipeline, expert, tensor); one size may be -1 (the rest)."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    sizes = cfg.sizes()
    free = [a for a, s in sizes.items() if s == -1]
    for a, s in sizes.items():
        if s == 0 or s < -1:
            raise ValueError(f"mesh.{a}={s}: a mesh axis size must be positive or -1 "
                             "(-1 takes the remaining devices).")
    if len(free) > 1:
        raise ValueError(f"mesh sizes {sizes}: only one axis may be -1, got {free}; "
                         "give explicit sizes to all but one.")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if n % fixed:
            raise ValueError(
                f"mesh sizes {sizes}: the fixed axes multiply to {fixed}, which does not "
                f"divide the {n} devices; choose sizes whose product divides {n}.")
        sizes[free[0]] = n // fixed
    total = math.prod(sizes.values())
    if total != n:
        raise ValueError(
            f"mesh sizes {sizes} multiply to {total} but there are {n} devices; set the "
            f"sizes so their product is {n}, or set one of them (e.g. --mesh.data) to -1.")
    shape = tuple(sizes[a] for a in MESH_AXES)
    try:
        from jax.experimental import mesh_utils
        arr = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # noqa: BLE001 - irregular device sets (CPU, multi-process)
        arr = np.asarray(devices).reshape(shape)
    return Mesh(arr, MESH_AXES)


def logical_to_spec(names: Sequence[str | None] | None, rules: Rules = DEFAULT_RULES,
                    mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec for an array whose axes have these logical names.

    With a mesh, mesh axes of size 1 are dropped (cleaner HLO), and a mesh axis is never
    used twice in one spec (the first logical axis that asks for it gets it).
    """
    if names is None:
        return PartitionSpec()
    used: set[str] = set()
    out = []
    for name in names:
        target = None if name is None else rules[name]
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        keep = tuple(a for a in axes
                     if a not in used and (mesh is None or mesh.shape[a] > 1))
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return PartitionSpec(*out)


def named_sharding(mesh: Mesh, names: Sequence[str | None] | None,
                   rules: Rules = DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, rules, mesh))


def mesh_axis_size(mesh: Mesh, logical: str, rules: Rules = DEFAULT_RULES) -> int:
    """How many shards a logical axis is split into on this mesh."""
    return math.prod(mesh.shape[a] for a in mesh_axes_of(logical, rules))


def constrain(x: jax.Array, names: Sequence[str | None]):
    """with_sharding_constraint by logical names; a no-op outside a `use_mesh` context."""
    if not _MESH_STACK:
        return x
    mesh, rules = _MESH_STACK[-1]
    return jax.lax.with_sharding_constraint(x, named_sharding(mesh, names, rules))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _layout(x, fwd_names, bwd_names):
    return constrain(x, fwd_names)


def _layout_fwd(x, fwd_names, bwd_names):
    return constrain(x, fwd_names), None


def _layout_bwd(fwd_names, bwd_names, _, ct):
    return (constrain(ct, bwd_names),)


_layout.defvjp(_layout_fwd, _layout_bwd)


def column_input(x_BTD: jax.Array) -> jax.Array:
    """Megatron's f as layouts: the input of column-parallel matmuls (q/k/v, MLP up/gate).

    Forward it is whole over the sequence (an all-gather under sequence parallelism);
    its gradient is summed over `tensor` back onto the residual layout (an all-reduce, or
    a reduce-scatter under sequence parallelism). Constraining the gradient too keeps
    XLA from splitting the backward matmuls over the sequence and gathering weights.
    """
    return _layout(x_BTD, ("batch", "seq", "embed"), ("batch", "act_seq", "embed"))


def row_output(y_BTD: jax.Array) -> jax.Array:
    """Megatron's g as layouts: the partial sums of a row-parallel matmul (wo, MLP down).

    Forward they are summed over `tensor` onto the residual layout (an all-reduce, or a
    reduce-scatter under sequence parallelism); the gradient is whole over the sequence
    (an all-gather under sequence parallelism, nothing otherwise).
    """
    return _layout(y_BTD, ("batch", "act_seq", "embed"), ("batch", "seq", "embed"))


_MESH_STACK: list[tuple[Mesh, Rules]] = []


class use_mesh:
    """Context manager that makes `constrain` act on this mesh (our own, version-stable)."""

    def __init__(self, mesh: Mesh | None, rules: Rules = DEFAULT_RULES):
        self.mesh, self.rules = mesh, rules

    def __enter__(self):
        _MESH_STACK.append((self.mesh, self.rules))
        return self.mesh

    def __exit__(self, *exc):
        _MESH_STACK.pop()


def compute_layout(p: dict, axes: dict, dtype) -> dict:
    """Weights as the matmuls use them: matrices in the compute dtype, laid out by the table.

    Stored weights may be split further (ZeRO-3 shards them over `data`); constraining one
    layer's weights to the compute layout inside the layer scan is then FSDP's just-in-time
    all-gather, in the compute dtype (bf16 halves its bytes), and the scan's recomputation
    gathers them again in the backward (see `zero.model_for_stage`). Vectors (norm scales)
    stay fp32, as the model uses them; keys without axes pass through.
    """
    out = {}
    for k, w in p.items():
        if w.ndim >= 2:
            w = w.astype(dtype)
        out[k] = constrain(w, axes[k]) if k in axes else w
    return out


def check_divisible(mesh: Mesh, **dims: int) -> None:
    """Raise a clear error when a model dimension does not divide its mesh axes.

    `dims` maps a config field (e.g. `model.num_heads`) to (size, logical axis) pairs
    via the keyword `field=(size, logical)`.
    """
    for fieldname, (size, logical) in dims.items():
        shards = mesh_axis_size(mesh, logical)
        if size % shards:
            target = LOGICAL_AXIS_RULES[logical]
            raise ValueError(
                f"{fieldname.replace('__', '.')}={size} is not divisible by the {shards} "
                f"shards of mesh axis {target!r} it is split over (logical axis "
                f"{logical!r}); choose {fieldname.replace('__', '.')} divisible by {shards} "
                f"or a smaller mesh.{target if isinstance(target, str) else 'data'}.")
