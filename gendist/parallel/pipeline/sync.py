"""Synchronous pipeline schedules (GPipe, 1F1B, any validated table): loss and gradients.

GPipe (Huang et al. 2019) runs all forwards, then all backwards; 1F1B with a flush
(PipeDream-Flush, Narayanan et al. 2019; Megatron-LM's default, Narayanan et al. 2021)
interleaves them so a stage holds at most p microbatches. Both compute exactly the
gradient of the mean loss over all microbatches: each stage accumulates its weights'
gradients over the schedule (by hand, not by differentiating the scan, so no per-step
residuals are kept) and `core.finish` reduces them. Borrowed from praxis/MaxText: layers
stacked on a leading axis and sharded over stages, a shift between neighbouring stages as
the only communication, and NaN-polluted bubbles as a test for leaks.

`pipeline_loss_and_grads` takes any model given as embed / layer / head-loss functions
over `{'embed', 'layers', 'head'}`; `gendist.parallel.pipeline.model` runs gendist's
transformer through the same `run_sync`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from gendist.parallel.pipeline import core, uniform
from gendist.parallel.pipeline import plan as schedule_plan
from gendist.parallel.pipeline import schedules as sched_lib
from gendist.parallel.pipeline.stages import (
    Out,
    StageFns,
    accumulate,
    accumulators,
    computations,
    from_layer_fn,
    saved_computations,
    slot_buffers,
    unit_plan,
)
from gendist.sharding import BATCH_AXES

PARAM_KEYS = ("embed", "layers", "head")


def resolve_schedule(schedule, num_stages: int, num_microbatches, num_chunks: int = 1
                     ) -> sched_lib.Schedule:
    """A Schedule for `num_stages` devices from a Schedule or a name plus microbatches (and
    chunks per device, for an interleaved one)."""
    if isinstance(schedule, str):
        if num_microbatches is None:
            raise ValueError("num_microbatches is required when schedule is given by name")
        return sched_lib.make(schedule, num_stages, num_microbatches, num_chunks)
    if num_microbatches is not None and num_microbatches != schedule.num_microbatches:
        raise ValueError(
            f"num_microbatches={num_microbatches} disagrees with the schedule's "
            f"{schedule.num_microbatches}; pass one or the other")
    if schedule.num_devices != num_stages:
        raise ValueError(
            f"schedule has {schedule.num_devices} stages but the mesh axis '{core.PIPELINE}' has "
            f"{num_stages}; build the schedule with num_stages={num_stages}")
    return schedule


def check_inputs(params, tokens_BT, targets_BT, mesh, schedule, num_microbatches,
                 num_units: int, stage_layer_counts, batch_axes, num_chunks: int = 1):
    """Validates a call; returns (schedule, units per (virtual) stage, batch axes in the
    mesh)."""
    if core.PIPELINE not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} lack '{core.PIPELINE}'; add a pipeline "
                         "axis")
    if any(str(t).endswith("Explicit") for t in getattr(mesh, "axis_types", ())):
        raise ValueError(f"mesh axis_types {mesh.axis_types}: the pipeline needs Auto axes; "
                         "build the mesh with jax.sharding.Mesh(devices, names) or "
                         "gendist.sharding.make_mesh")
    if set(params) != set(PARAM_KEYS):
        raise ValueError(f"params has keys {sorted(params)}; pass exactly {list(PARAM_KEYS)}")
    p = mesh.shape[core.PIPELINE]
    sched = resolve_schedule(schedule, p, num_microbatches, num_chunks)
    counts = core.chunk_layer_split(num_units, p, sched.num_chunks, stage_layer_counts)
    batch_axes = tuple(a for a in batch_axes if a in mesh.axis_names)
    shards = int(np.prod([mesh.shape[a] for a in batch_axes]))
    if tokens_BT.shape != targets_BT.shape:
        raise ValueError(f"targets_BT {targets_BT.shape} must match tokens_BT {tokens_BT.shape}")
    m = sched.num_microbatches
    if tokens_BT.shape[0] % (shards * m):
        raise ValueError(
            f"num_microbatches={m}: the batch of {tokens_BT.shape[0]} split over {batch_axes} "
            f"(size {shards}) must divide into {m} equal microbatches; use a batch that is a "
            f"multiple of {shards * m} or another num_microbatches")
    return sched, counts, batch_axes


def num_units_of(layers) -> int:
    leaves = jax.tree.leaves(layers)
    if not leaves or len({a.shape[0] for a in leaves}) != 1:
        raise ValueError("params['layers'] must be a pytree of arrays stacked on one leading "
                         "layers axis [L, ...]")
    return leaves[0].shape[0]


def _by_unit(tree, index, unit_sizes):
    """a[units] along the leading axis, where a unit is `unit_sizes` consecutive entries."""
    def one(a, k):
        if k == 0:  # an empty stack (e.g. no dense blocks between MoE blocks)
            return a
        u = a.reshape(-1, k, *a.shape[1:])[index]
        return u.reshape(-1, *a.shape[1:])
    sizes = jax.tree.map(lambda _: 1, tree) if unit_sizes is None else unit_sizes
    return jax.tree.map(one, tree, sizes)


def pad_layers(layers, counts, unit_sizes=None, num_devices=None):
    """The layers in the executor's layout of units (`core.stage_layout`; a no-op for an
    even split with one chunk per device). `unit_sizes` (a tree like `layers`, default 1):
    leading entries per unit."""
    if len(set(counts)) == 1 and len(counts) == (num_devices or len(counts)):
        return layers
    return _by_unit(layers, core.stage_layout(counts, num_devices)[0], unit_sizes)


def unpad_layers(g_layers, counts, unit_sizes=None, num_devices=None):
    """Gradients in the executor's layout back to the layers' own."""
    if len(set(counts)) == 1 and len(counts) == (num_devices or len(counts)):
        return g_layers
    return _by_unit(g_layers, core.stage_layout(counts, num_devices)[1], unit_sizes)


def run_sync(w, tokens_BT, targets_BT, *, mesh: Mesh, sched: sched_lib.Schedule,
             fns: StageFns, specs, manual_axes: Sequence[str], batch_axes: Sequence[str],
             bubble_value: float = 0.0, uneven: bool = False, recompute: bool = True):
    """(mean loss, grads of w, summed metrics, token count) of a synchronous schedule.

    `w = (embed, layers, head)` with layers already in the executor's layout; `specs` are
    their PartitionSpecs over `manual_axes` (the layers' leading axis on `pipeline`).
    `uneven`: stages hold different numbers of layers, so each gets its own branches.
    `recompute=False` keeps each forward's residuals until its backward (or its weight
    step, in a split schedule) instead of recomputing the forward there.
    """
    batch_spec = P(tuple(batch_axes) if batch_axes else None)
    body = functools.partial(_sync_body, sched=sched, fns=fns, specs=specs,
                             reduce_axes=(core.PIPELINE, *batch_axes),
                             amax_axes=tuple(manual_axes), bubble_value=bubble_value,
                             uneven=uneven, recompute=recompute and not sched.split)
    fn = core.manual(body, mesh, in_specs=(specs, batch_spec, batch_spec),
                     out_specs=(P(), specs, P(), P()), axes=manual_axes)
    return fn(tuple(w), tokens_BT, targets_BT)


def _sync_body(w, tokens, targets, *, sched, fns: StageFns, specs, reduce_axes, amax_axes,
               bubble_value, uneven, recompute):
    """The per-device program: accumulate gradients over the schedule, then reduce.

    The accumulators and the slot buffers stay out of the executor's branches (a branch
    would copy them whole at every step): a branch returns this step's gradient and what it
    keeps for its microbatch, which are added and written in place after it.
    """
    m = sched.num_microbatches
    tokens_M, targets_M = core.microbatches(tokens, m), core.microbatches(targets, m)
    x_spec = jax.eval_shape(fns.embed, w[0], tokens_M[0])
    fill = jnp.full(x_spec.shape, bubble_value, x_spec.dtype)
    table, keys = core.branch_table(
        sched, lambda kind, role, mb, s: (kind, role, s if uneven else None))
    plan = schedule_plan.device_plan(sched)
    spare = plan.num_slots
    chunks = sched.num_chunks  # chunks of layers per device; a step runs one (`row['chunk']`)
    if recompute:
        comps = {k: _no_slots(computations(fns, k[2])[k[:2]]) for k in keys}
        bufs = {}
    else:  # a slot per microbatch a stage holds (+ the spare) for the forward's residuals
        uplan = unit_plan(fns, w[1], x_spec)
        bufs = slot_buffers(fns, uplan, w[1], x_spec, plan.num_slots + 1, sched.split)
        if not uneven and chunks == 1 and uniform.segments(sched) is not None:  # no branches
            acc = uniform.run_uniform(w, tokens_M, targets_M, sched=sched, fns=fns, plan=uplan,
                                      bufs=bufs, act_shape=x_spec.shape,
                                      act_dtype=x_spec.dtype, fill_value=bubble_value)
            return core.finish(acc, w, specs, reduce_axes, amax_axes)
        tables = {st: saved_computations(fns, uplan, st, sched.split)
                  for st in {k[2] for k in keys}}
        comps = {k: tables[k[2]][k[:2]] for k in keys}
    # Where each step writes each buffer: its slot if it fills that buffer, else the spare.
    fills = {"units": sched_lib.FORWARD, "y": sched_lib.FORWARD, "g": sched_lib.BACKWARD}
    columns = {f"write_{name}": np.where(plan.kind == kind, plan.slot, spare).astype(np.int32)
               for name, kind in fills.items() if name in bufs}
    zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
    chunk_w = lambda c: (w[0], core.chunk_of(w[1], c, chunks), w[2])  # the weights a step uses
    grad_shapes = jax.eval_shape(chunk_w, 0)
    slot_shapes = jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.shape[1:], b.dtype), bufs)

    def branch(compute):
        def run(res, x, g, row):
            out, kept = compute(chunk_w(row["chunk"]), x, g, tokens_M[row["mb"]],
                                targets_M[row["mb"]], res)
            grads = out.grads or (None, None, None)
            grads = tuple(zeros(s) if d is None else d for s, d in zip(grad_shapes, grads,
                                                                        strict=True))
            kept = {k: (kept or {}).get(k, zeros(v)) for k, v in slot_shapes.items()}
            result = (grads, _or0(out.loss), _or0(out.count),
                      zeros(fns.metrics) if out.metrics is None else out.metrics, kept)
            return (result, fill if out.act is None else out.act,
                    fill if out.cot is None else out.cot)
        return run

    def read(extra, row):
        return jax.tree.map(lambda b: b[row["slot"]], extra[1])

    def write(extra, result, row):
        acc, bufs = extra
        grads, loss, count, metrics, kept = result
        (g_e, g_l, g_h), *rest = acc  # add this step's chunk gradient into its chunk
        view = ((g_e, core.chunk_of(g_l, row["chunk"], chunks), g_h), *rest)
        (g_e, g_c, g_h), *rest = accumulate(view, Out(grads, loss, count, metrics))
        acc = ((g_e, core.with_chunk(g_l, g_c, row["chunk"], chunks), g_h), *rest)
        bufs = {k: jax.tree.map(lambda b, v, at=row[f"write_{k}"]:
                                jax.lax.dynamic_update_index_in_dim(b, v.astype(b.dtype), at, 0),
                                bufs[k], kept[k]) for k in bufs}
        return acc, bufs

    acc, _ = core.run_table(sched, table, [branch(comps[k]) for k in keys],
                            (accumulators(w, fns.metrics), bufs), act_shape=x_spec.shape,
                            act_dtype=x_spec.dtype, fill_value=bubble_value, columns=columns,
                            read=read, write=write)
    return core.finish(acc, w, specs, reduce_axes, amax_axes)


def _or0(value):
    return jnp.float32(0) if value is None else jnp.asarray(value, jnp.float32)


def _no_slots(compute):
    return lambda w, x, g, tok, tgt, res: (compute(w, x, g, tok, tgt), None)


def pipeline_loss_and_grads(
    params: Mapping[str, Any],
    tokens_BT: jax.Array,
    targets_BT: jax.Array,
    *,
    mesh: Mesh,
    schedule: sched_lib.Schedule | str,
    embed_fn: Callable,
    layer_fn: Callable,
    head_loss_fn: Callable,
    num_microbatches: int | None = None,
    stage_layer_counts: Sequence[int] | None = None,
    batch_axes: Sequence[str] = BATCH_AXES,
    bubble_value: float = 0.0,
    recompute: bool = True,
    num_chunks: int = 1,
):
    """Mean loss and its gradients for `params = {'embed', 'layers', 'head'}` by pipelining.

    `embed_fn(embed, tokens_BT) -> x_BTD`, `layer_fn(layer, x_BTD) -> x_BTD` for one slice
    of `params['layers']` (a pytree of arrays [L, ...]), and
    `head_loss_fn(head, x_BTD, targets_BT) -> (sum_loss, count)`. The loss is the total sum
    over all microbatches divided by the total count. `schedule` is a Schedule for the
    mesh's pipeline size, or 'gpipe'/'1f1b' with `num_microbatches`. `stage_layer_counts`
    gives an uneven split (e.g. from `partition.partition_layers`). `bubble_value` fills
    everything a stage holds or sends while it has nothing to do (tests pass NaN).
    `recompute=False` keeps each forward's vjp residuals for its backward (see run_sync).
    `num_chunks`: chunks of layers per device of an interleaved schedule given by name.
    Only `pipeline` and the batch axes are manual: other axes (`tensor`) stay with XLA, so
    weights sharded over them stay sharded. Returns (loss, grads). Jit it from outside.
    """
    sched, counts, batch_axes = check_inputs(
        params, tokens_BT, targets_BT, mesh, schedule, num_microbatches,
        num_units_of(params["layers"]), stage_layer_counts, batch_axes, num_chunks)
    fns = from_layer_fn(embed_fn, layer_fn, head_loss_fn, counts)
    p = sched.num_devices
    w = (params["embed"], pad_layers(params["layers"], counts, num_devices=p), params["head"])
    specs = (jax.tree.map(lambda _: P(), w[0]), jax.tree.map(lambda _: P(core.PIPELINE), w[1]),
             jax.tree.map(lambda _: P(), w[2]))
    loss, (g_e, g_l, g_h), _, _ = run_sync(
        w, tokens_BT, targets_BT, mesh=mesh, sched=sched, fns=fns, specs=specs,
        manual_axes=(core.PIPELINE, *batch_axes), batch_axes=batch_axes,
        bubble_value=bubble_value, uneven=len(set(counts)) > 1, recompute=recompute)
    return loss, {"embed": g_e, "layers": unpad_layers(g_l, counts, num_devices=p),
                  "head": g_h}


def sequential_loss(params, tokens_BT, targets_BT, *, embed_fn, layer_fn, head_loss_fn):
    """The plain, non-pipelined model: the oracle every pipelined run must equal."""
    x_BTD = embed_fn(params["embed"], tokens_BT)
    x_BTD = jax.lax.scan(lambda x, lp: (layer_fn(lp, x), None), x_BTD, params["layers"])[0]
    loss, count = head_loss_fn(params["head"], x_BTD, targets_BT)
    return loss / count
