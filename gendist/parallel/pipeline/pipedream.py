"""Asynchronous pipelines: PipeDream (weight stashing) and PipeDream-2BW, in one shard_map.

PipeDream (Narayanan et al. 2019) runs 1F1B without a flush and lets each stage update
its weights right after each microbatch's backward. A microbatch's forward and backward on
stage s are then separated by p-1-s updates of that stage, so:

* with weight stashing the stage keeps the version each in-flight microbatch saw in its
  forward and differentiates with it (up to p-s versions on stage s);
* without stashing the backward uses the current weights, p-1-s versions newer than the
  forward's (min(i, p-1-s) for microbatch i) - a gradient of no single set of weights;
* PipeDream-2BW (Narayanan et al. 2021, "Memory-efficient pipeline-parallel DNN
  training") accumulates gradients over a window of W microbatches and updates once per
  window; every microbatch of window k runs with version k-1 in forward and backward, so
  W(k+1) = W(k) - lr * grad f(W(k-1)) on every stage with only two versions stored.

Like the schedule, the weight versions are static data: `version_plan` decides for every
(step, stage) which version is read, whether an update runs and into which slot of a
stage-local ring of versions it goes. The engine is the one executor (`core.run_table`)
with the synchronous engine's stage computations, run on the weight version the plan
names; the ring, the optimizer state and the per-microbatch losses are its extra carry,
and the optimizer update is its per-step hook. The optimizer acts per stage (a global-norm
clip sees the stage's own weights only).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from gendist.parallel.pipeline import core
from gendist.parallel.pipeline import schedules as sched_lib
from gendist.parallel.pipeline.stages import computations, from_layer_fn
from gendist.parallel.pipeline.sync import check_inputs, num_units_of
from gendist.sharding import BATCH_AXES

Mode = Literal["stash", "nostash", "2bw"]
MODES = ("stash", "nostash", "2bw")


@dataclasses.dataclass(frozen=True, eq=False)
class VersionPlan:
    """Which weight version each action uses, as static [steps, stages] tables.

    Version v of stage s is the result of its v-th update (0 = initial weights) and lives
    in ring slot v % num_slots.
    """

    num_slots: int
    read_slot: np.ndarray  # [steps, stages] slot of the version the action computes with
    update: np.ndarray  # [steps, stages] bool: an optimizer update follows this action
    base_slot: np.ndarray  # [steps, stages] slot of the version the update starts from
    write_slot: np.ndarray  # [steps, stages] slot the new version goes to
    fwd_version: np.ndarray  # [stages, microbatches] version used by each forward
    bwd_version: np.ndarray  # [stages, microbatches] version used by each backward
    num_updates: int  # updates per stage over the whole stream


def version_plan(schedule: sched_lib.Schedule, mode: Mode, window: int = 1) -> VersionPlan:
    """Weight versions for `schedule` under `mode` ('stash', 'nostash' or '2bw')."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; use one of {MODES}")
    m, p, n = schedule.num_microbatches, schedule.num_stages, schedule.num_steps
    window = int(window)
    if window < 1 or (mode != "2bw" and window != 1):
        raise ValueError(f"window={window}: use window=1 for {mode!r}; 2bw takes a window >= 1")
    if m % window:
        raise ValueError(f"window={window} must divide num_microbatches={m} (2BW updates once "
                         "per full window)")
    fwd_v = np.zeros((p, m), np.int64)
    bwd_v = np.zeros((p, m), np.int64)
    read = np.zeros((n, p), np.int64)
    base = np.zeros((n, p), np.int64)
    write = np.zeros((n, p), np.int64)
    update = np.zeros((n, p), bool)
    created, last_use = [], []  # per stage: step each version is made / last read
    for s in range(p):
        latest, done_b, made, used = 0, 0, [-1], {}
        for t in range(n):
            k, i = int(schedule.kind[t, s]), int(schedule.microbatch[t, s])
            read[t, s] = latest
            if k == sched_lib.FORWARD:
                v = latest if mode != "2bw" else max(0, i // window - 1)
                if v > latest:
                    raise ValueError(
                        f"window={window}: stage {s} starts window {i // window} before window "
                        f"{i // window - 2} has updated its weights; use a window >= "
                        f"{p - 1} (num_stages - 1)")
                fwd_v[s, i] = read[t, s] = v
                used[v] = t
            elif k == sched_lib.BACKWARD:
                if done_b != i:
                    raise ValueError(f"schedule {schedule.name!r}: stage {s} runs backward {i} "
                                     f"out of order; asynchronous updates need backwards in "
                                     "microbatch order")
                v = latest if mode == "nostash" else int(fwd_v[s, i])
                bwd_v[s, i] = read[t, s] = v
                used[v] = t
                done_b += 1
                if done_b % window == 0:  # the update reads `latest` and makes latest + 1
                    update[t, s], base[t, s], used[latest] = True, latest, t
                    latest += 1
                    made.append(t)
        used[latest] = n  # the final version is the output
        created.append(made)
        last_use.append([used.get(v, -1) for v in range(latest + 1)])
    num_updates = len(created[0]) - 1
    slots = 1
    # Version v may share a slot with v + slots once v is never read after v + slots is made.
    while any(last_use[s][v] > created[s][v + slots]
              for s in range(p) for v in range(num_updates + 1 - slots)):
        slots += 1
    write = np.where(update, (base + 1) % slots, 0)
    return VersionPlan(slots, (read % slots).astype(np.int32), update,
                       (base % slots).astype(np.int32), write.astype(np.int32), fwd_v, bwd_v,
                       num_updates)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a params pytree meets the stages: `split(params) -> (embed, layers, head)` stage
    weights, `merge(grads triple) -> params-shaped`, and per leaf the stage whose copy of a
    leaf that is not split over stages is the result (`owner`: tree of ints, -1 = split)."""

    split: Callable
    merge: Callable
    owner: object


def run(params, opt_state, tokens_BT, targets_BT, *, mesh, sched, vplan, fns, layout: Layout,
        specs, manual_axes, batch_axes, optimizer: optax.GradientTransformation, window: int,
        probe_fn=None, bubble_value: float = 0.0):
    """One asynchronous pipeline stream over `sched.num_microbatches` microbatches.

    params / opt_state: trees with PartitionSpecs `specs` / their optimizer-state specs
    (layer-stacked leaves on `pipeline`). Returns (params, opt_state, losses [m],
    fwd_probe [stages, m], bwd_probe [stages, m]).
    """
    opt_specs = optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(
        optimizer.init, params), specs, transform_non_params=lambda _: P())
    out_param_specs = jax.tree.map(lambda s, o: s if o < 0 else P(core.PIPELINE, *s), specs,
                                   layout.owner)
    out_opt_specs = optax.tree_map_params(
        optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, params), out_param_specs,
        transform_non_params=lambda _: P(core.PIPELINE))
    batch_spec = P(tuple(batch_axes) if batch_axes else None)
    tokens_per_mb = tokens_BT.size // sched.num_microbatches  # global, all shards
    body = functools.partial(
        _body, sched=sched, vplan=vplan, fns=fns, layout=layout, specs=specs,
        optimizer=optimizer, window=window, batch_axes=tuple(batch_axes),
        tokens_per_mb=tokens_per_mb, probe_fn=probe_fn, bubble_value=bubble_value)
    stage_spec = P(core.PIPELINE)
    fn = core.manual(body, mesh, in_specs=(specs, opt_specs, batch_spec, batch_spec),
                     out_specs=(out_param_specs, out_opt_specs, P(), stage_spec, stage_spec),
                     axes=manual_axes)
    params, opt_state, losses, f_probe, b_probe = fn(params, opt_state, tokens_BT, targets_BT)
    pick = lambda a, o: a if o < 0 else a[o]
    params = jax.tree.map(pick, params, layout.owner)
    opt_state = optax.tree_map_params(optimizer, pick, opt_state, layout.owner,
                                      transform_non_params=lambda a: a[0])
    return params, opt_state, losses, f_probe, b_probe


def _body(params, opt_state, tokens, targets, *, sched, vplan, fns, layout, specs, optimizer,
          window, batch_axes, tokens_per_mb, probe_fn, bubble_value):
    """Per device: the executor with a ring of weight versions and per-stage updates."""
    m = sched.num_microbatches
    tokens_M, targets_M = core.microbatches(tokens, m), core.microbatches(targets, m)
    x_spec = jax.eval_shape(fns.embed, layout.split(params)[0], tokens_M[0])
    fill = jnp.full(x_spec.shape, bubble_value, x_spec.dtype)
    comps = computations(fns)
    table, keys = core.branch_table(sched, lambda kind, role, mb, s: (kind, role))
    at = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
    probe = (lambda w: jnp.float32(0)) if probe_fn is None else (
        lambda w: jnp.asarray(probe_fn(w), jnp.float32))
    # Data parallel: every replica of a stage applies the same update, from the gradient
    # summed over the batch axes a leaf is not split over.
    reduce = lambda g, spec: jax.lax.psum(
        g, tuple(a for a in batch_axes if a not in core.spec_axes(spec)))

    def branch(compute):
        def run_action(extra, x, g, row):
            ring, opt, acc, losses, pf, pb = extra
            prm = at(ring, row["rslot"])
            w = layout.split(prm)
            out = compute(w, x, g, tokens_M[row["mb"]], targets_M[row["mb"]])
            if out.grads is not None:
                parts = tuple(jax.tree.map(jnp.zeros_like, wi) if d is None else d
                              for wi, d in zip(w, out.grads, strict=True))
                grads = jax.tree.map(reduce, layout.merge(parts), specs)
                acc = jax.tree.map(lambda a, d: a + d / tokens_per_mb, acc, grads)
            if out.loss is not None:
                losses = losses.at[row["mb"]].add(out.loss)
            value = probe(w)
            pf = jnp.where(row["kind"] == sched_lib.FORWARD, pf.at[row["mb"]].set(value), pf)
            pb = jnp.where(row["kind"] == sched_lib.BACKWARD, pb.at[row["mb"]].set(value), pb)
            act = fill if out.act is None else out.act
            cot = fill if out.cot is None else out.cot
            return (ring, opt, acc, losses, pf, pb), act, cot
        return run_action

    def apply_update(ring, opt, acc, base_slot, write_slot):
        base = at(ring, base_slot)
        grads = jax.tree.map(lambda g: g / window, acc)
        updates, opt = optimizer.update(grads, opt, base)
        new = optax.apply_updates(base, updates)
        ring = jax.tree.map(lambda r, a: r.at[write_slot].set(a.astype(r.dtype)), ring, new)
        return ring, opt, jax.tree.map(jnp.zeros_like, acc)

    def hook(extra, row):
        ring, opt, acc, *rest = extra
        ring, opt, acc = jax.lax.cond(row["update"], apply_update,
                                      lambda r, o, a, *_: (r, o, a), ring, opt, acc,
                                      row["base"], row["write"])
        return (ring, opt, acc, *rest)

    ring0 = jax.tree.map(lambda a: jnp.broadcast_to(a, (vplan.num_slots, *a.shape)) + 0, params)
    zeros_m = jnp.zeros((m,), jnp.float32)
    extra = (ring0, opt_state, core.wide_zeros(params), zeros_m, zeros_m, zeros_m)
    columns = {"kind": sched.kind, "rslot": vplan.read_slot, "update": vplan.update,
               "base": vplan.base_slot, "write": vplan.write_slot}
    ring, opt, _, losses, pf, pb = core.run_table(
        sched, table, [branch(comps[k]) for k in keys], extra, act_shape=x_spec.shape,
        act_dtype=x_spec.dtype, fill_value=bubble_value, columns=columns, hook=hook)
    final = at(ring, vplan.num_updates % vplan.num_slots)
    losses = jax.lax.psum(losses, (core.PIPELINE, *batch_axes)) / tokens_per_mb
    stack = lambda tree: jax.tree.map(lambda a, o: a if o < 0 else a[None], tree, layout.owner)
    opt = optax.tree_map_params(optimizer, lambda a, o: a if o < 0 else a[None], opt,
                                layout.owner, transform_non_params=lambda a: a[None])
    return stack(final), opt, losses, pf[None], pb[None]


def pipedream_train(params, tokens_BT, targets_BT, *, mesh, optimizer: optax.GradientTransformation,
                    num_microbatches: int, embed_fn, layer_fn, head_loss_fn,
                    mode: Mode = "stash", window: int = 1, schedule="1f1b",
                    batch_axes=BATCH_AXES, probe_fn=None, bubble_value: float = 0.0):
    """Trains on `num_microbatches` microbatches as one asynchronous pipeline stream.

    Same model functions and params as `pipeline_loss_and_grads`; each stage owns its
    layers, stage 0 the embedding and the last stage the head, and updates them with
    `optimizer` after each backward (after each window for '2bw'), from the mean loss of
    that microbatch over all batch shards. Returns (params, info) with info['loss'] [m]
    (per-microbatch mean loss) and, when `probe_fn(weights) -> scalar` is given,
    info['fwd_probe'] / info['bwd_probe'] [stages, m]: the probe of the weights each
    forward and backward computed with. Jit it from the outside.
    """
    sched, counts, batch_axes = check_inputs(
        params, tokens_BT, targets_BT, mesh, schedule, num_microbatches,
        num_units_of(params["layers"]), None, batch_axes)
    last = mesh.shape[core.PIPELINE] - 1
    layout = Layout(split=lambda prm: (prm["embed"], prm["layers"], prm["head"]),
                    merge=lambda g: {"embed": g[0], "layers": g[1], "head": g[2]},
                    owner={"embed": jax.tree.map(lambda _: 0, params["embed"]),
                           "layers": jax.tree.map(lambda _: -1, params["layers"]),
                           "head": jax.tree.map(lambda _: last, params["head"])})
    specs = jax.tree.map(lambda o: P() if o >= 0 else P(core.PIPELINE), layout.owner)
    new, _, losses, f_probe, b_probe = run(
        params, optimizer.init(params), tokens_BT, targets_BT, mesh=mesh, sched=sched,
        vplan=version_plan(sched, mode, window),
        fns=from_layer_fn(embed_fn, layer_fn, head_loss_fn, counts), layout=layout,
        specs=specs, manual_axes=(core.PIPELINE, *batch_axes), batch_axes=batch_axes,
        optimizer=optimizer, window=window, probe_fn=probe_fn, bubble_value=bubble_value)
    info = {"loss": losses}
    if probe_fn is not None:
        info |= {"fwd_probe": f_probe, "bwd_probe": b_probe}
    return new, info
