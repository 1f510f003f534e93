"""Expert parallelism: the MoE FFN with experts split over the `expert` mesh axis.

GShard (Lepikhin et al. 2020) form inside `shard_map`. Tokens are sharded over the batch
axes (`data` and `expert`: the expert axis is data parallel for tokens), so each device
routes its own group of tokens into fixed-capacity buffers [E, C, D]. One all-to-all over
`expert` sends every expert's buffer to the device that holds the expert (dispatch), the
device runs its E/ep local experts on ep * C slots each, and a second all-to-all brings the
outputs back (combine). Expert weights shard their hidden F axis over `tensor` (Megatron
column/row split), so each expert's output is a partial sum completed by a psum over
`tensor` before the combine all-to-all. The routing is the single-device
`gendist.models.moe` code run per group, so `moe_ffn(..., num_groups=shards)` is the oracle.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from gendist.config import ModelConfig
from gendist.models.moe import (
    MoEAux,
    check_expert_axis,
    combine,
    dispatch,
    expert_ffn,
    group_aux,
    moe_logical_axes,
    route_group,
)
from gendist.parallel.compat import shard_map, to_varying
from gendist.sharding import BATCH_AXES, DEFAULT_RULES, logical_to_spec


def _param_specs(cfg: ModelConfig, expert_axis: str, tensor_axis: str | None) -> dict[str, P]:
    """PartitionSpecs of the expert weights: the one table, with the experts and their
    hidden width on the axes this call names."""
    rules = DEFAULT_RULES.with_overrides(experts=expert_axis, mlp=tensor_axis)
    return {k: logical_to_spec(names, rules) for k, names in moe_logical_axes(cfg).items()}


def _check(cfg: ModelConfig, mesh: Mesh, x_BTD, expert_axis: str, data_axes: tuple[str, ...],
           tensor_axis: str | None) -> None:
    for name in (expert_axis, *data_axes, *(() if tensor_axis is None else (tensor_axis,))):
        if name not in mesh.shape:
            raise ValueError(f"mesh axis {name!r} is not in the mesh {dict(mesh.shape)}; pass "
                             "expert_axis/data_axes/tensor_axis naming axes of this mesh.")
    if expert_axis not in data_axes:
        raise ValueError(f"data_axes={data_axes} must include expert_axis={expert_axis!r}: "
                         "tokens are data parallel over the expert axis.")
    check_expert_axis(cfg.moe_experts, mesh.shape[expert_axis], expert_axis)
    if tensor_axis is not None and cfg.moe_expert_d_ff % mesh.shape[tensor_axis]:
        raise ValueError(f"expert width d_ff={cfg.moe_expert_d_ff} (model.moe_d_ff, or "
                         "model.d_ff when it is 0) is not divisible by the size "
                         f"{mesh.shape[tensor_axis]} of mesh axis {tensor_axis!r}; pick a "
                         "multiple of it.")
    shards = math.prod(mesh.shape[a] for a in data_axes)
    if x_BTD.ndim != 3 or x_BTD.shape[0] % shards:
        raise ValueError(f"x_BTD shape {x_BTD.shape}: the batch must be divisible by the "
                         f"{shards} shards of mesh axes {data_axes}; change the batch size.")


def moe_local(p: dict, x_bTD: jax.Array, cfg: ModelConfig, *, expert_axis: str,
              data_axes: tuple[str, ...], tensor_axis: str | None, mean_aux: bool = True,
              fp8: tuple | None = None):
    """The per-device body (inside a shard_map where these axes are manual): route this
    device's tokens as one group, all-to-all to the experts' owners, run the local experts,
    all-to-all back, combine. Expert weights are this device's [E/ep, ...] slice.

    `tensor_axis`: the experts' hidden F is split over it and the partial outputs are
    summed here (None: leave them to the caller, e.g. Megatron's g after the block).
    `mean_aux`: average the router losses/metrics over `data_axes` (False: this group's).
    `fp8`: the experts' FP8 products' state (`expert_ffn`); the amaxes they observe are
    this device's shards' (the caller takes their max over the devices).
    """
    b_loc, T, D = x_bTD.shape
    ep = jax.lax.axis_size(expert_axis)
    E = cfg.moe_experts
    E_loc = E // ep
    capacity = cfg.moe_capacity(b_loc * T)
    x_GD = x_bTD.reshape(b_loc * T, D)
    r = route_group(p["router"], x_GD, cfg, capacity)
    buf_ECD = dispatch(x_GD, r, E, capacity)
    # Dispatch: row j of [ep, E_loc, C, D] goes to the device holding experts of shard j;
    # afterwards row j holds the slots that device j of the expert axis filled.
    buf_SLCD = jax.lax.all_to_all(buf_ECD.reshape(ep, E_loc, capacity, D), expert_axis,
                                  split_axis=0, concat_axis=0)
    x_LMD = buf_SLCD.transpose(1, 0, 2, 3).reshape(E_loc, ep * capacity, D)
    y_LMD = expert_ffn(p, x_LMD, cfg.mlp, fp8)
    if tensor_axis is not None:
        y_LMD = jax.lax.psum(y_LMD, tensor_axis)  # F was split over tensor: sum partials
    y_SLCD = y_LMD.reshape(E_loc, ep, capacity, D).transpose(1, 0, 2, 3)
    # Combine: send each source device its slots back, in [E, C, D] order.
    y_ECD = jax.lax.all_to_all(y_SLCD, expert_axis, split_axis=0, concat_axis=0)
    y_GD = combine(y_ECD.reshape(E, capacity, D), r)
    aux = group_aux(r, cfg, b_loc, T)
    if mean_aux:
        aux = aux._replace(
            load_balance_loss=jax.lax.pmean(aux.load_balance_loss, data_axes),
            z_loss=jax.lax.pmean(aux.z_loss, data_axes),
            drop_fraction=jax.lax.pmean(aux.drop_fraction, data_axes),
            expert_load_E=jax.lax.psum(aux.expert_load_E, data_axes))
    return y_GD.reshape(b_loc, T, D), aux


def moe_ffn_sharded(params: dict[str, jax.Array], x_BTD: jax.Array, cfg: ModelConfig,
                    mesh: Mesh, *, expert_axis: str = "expert",
                    data_axes: Sequence[str] = BATCH_AXES,
                    tensor_axis: str | None = "tensor",
                    fp8: tuple | None = None) -> tuple[jax.Array, MoEAux]:
    """Expert-parallel MoE FFN; equals `moe_ffn(params, x, cfg, num_groups=shards)` where
    shards is the product of the `data_axes` sizes (one routing group per batch shard).
    `fp8`: the experts' FP8 products' state (`expert_ffn`); the amaxes observed come out as
    the max over the devices, as one device would see them.

    Mesh axes not named here (e.g. `pipeline`) see replicated tokens and weights.
    """
    data_axes = tuple(data_axes)
    _check(cfg, mesh, x_BTD, expert_axis, data_axes, tensor_axis)
    # The axes the experts' operands vary over: the histories' cotangent is reduced there.
    varying = data_axes + (() if tensor_axis is None else (tensor_axis,))

    hists = () if fp8 is None else tuple(m.hist_3H for m in fp8)

    def local(p, x, hists):
        metas = None
        if fp8 is not None:  # the histories, replicated: their cotangent's max, not sum
            metas = tuple(dataclasses.replace(m, hist_3H=_max_over(to_varying(h, varying),
                                                                    varying))
                          for m, h in zip(fp8, hists, strict=True))
        return moe_local(p, x, cfg, expert_axis=expert_axis, data_axes=data_axes,
                         tensor_axis=tensor_axis, fp8=metas)

    batch = P(data_axes)
    aux_specs = MoEAux(P(), P(), P(), P(), batch, batch)
    fn = shard_map(local, mesh=mesh,
                   in_specs=(_param_specs(cfg, expert_axis, tensor_axis), batch, P()),
                   out_specs=(batch, aux_specs))
    return fn({k: params[k] for k in moe_logical_axes(cfg)}, x_BTD, hists)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _max_over(h, axes: tuple[str, ...]):
    """Identity whose transpose takes the max over `axes` of a varying cotangent, divided by
    the devices there: the psum that follows (the transpose of making a replicated value
    varying) gives back the max. For FP8 histories, whose cotangent is observed amaxes.
    Exact for device counts that are powers of two; otherwise within an ulp."""
    return h


def _max_over_fwd(h, axes):
    return h, None


def _max_over_bwd(axes, _, ct):
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    return (to_varying(jax.lax.pmax(ct, axes) / n, axes),)


_max_over.defvjp(_max_over_fwd, _max_over_bwd)
