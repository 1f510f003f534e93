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
stage-local ring of versions it goes. The executor (`pipedream_train`) reuses the stage
branches of `pipeline.py` with the weight version the plan names, and applies a per-stage
optax update (element-wise transforms only: a global-norm clip would need all stages).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from gendist.parallel import pipeline as pl
from gendist.parallel import schedule as sched_lib

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


def pipedream_train(params, tokens_BT, targets_BT, *, mesh, optimizer: optax.GradientTransformation,
                    num_microbatches: int, embed_fn, layer_fn, head_loss_fn,
                    mode: Mode = "stash", window: int = 1, schedule="1f1b",
                    batch_axes=("data",), probe_fn=None, bubble_value: float = 0.0):
    """Trains on `num_microbatches` microbatches as one asynchronous pipeline stream.

    Same model functions and params as `pipeline.pipeline_loss_and_grads`; each stage owns
    its layers, stage 0 the embedding and the last stage the head, and updates them with
    `optimizer` after each backward (after each window for '2bw'), from the mean loss of
    that microbatch over all batch shards. Returns (params, info) with info['loss'] [m]
    (per-microbatch mean loss) and, when `probe_fn(weights) -> scalar` is given,
    info['fwd_probe'] / info['bwd_probe'] [stages, m]: the probe of the weights each
    forward and backward computed with. Jit it from the outside.
    """
    sched, counts, batch_axes = pl._check_inputs(
        params, tokens_BT, targets_BT, mesh, schedule, num_microbatches, None, batch_axes)
    vplan = version_plan(sched, mode, window)
    tokens_per_mb = tokens_BT.size // sched.num_microbatches  # global, all shards
    body = functools.partial(
        _body, sched=sched, vplan=vplan, counts=counts, embed_fn=embed_fn, layer_fn=layer_fn,
        head_loss_fn=head_loss_fn, optimizer=optimizer, window=window, batch_axes=batch_axes,
        tokens_per_mb=tokens_per_mb, probe_fn=probe_fn, bubble_value=bubble_value)
    batch_spec = P(batch_axes if batch_axes else None)
    stacked = P(pl.PIPELINE)
    fn = pl._shard_map(
        body, mesh=mesh, in_specs=(P(), stacked, P(), batch_spec, batch_spec),
        out_specs=((stacked, stacked, stacked), P(), stacked, stacked),
        axis_names=frozenset({pl.PIPELINE, *batch_axes}), **pl._NO_CHECK)
    (embed, layers, head), loss, f_probe, b_probe = fn(
        params["embed"], params["layers"], params["head"], tokens_BT, targets_BT)
    last = mesh.shape[pl.PIPELINE] - 1
    new = {"embed": jax.tree.map(lambda a: a[0], embed), "layers": layers,
           "head": jax.tree.map(lambda a: a[last], head)}
    info = {"loss": loss}
    if probe_fn is not None:
        info |= {"fwd_probe": f_probe, "bwd_probe": b_probe}
    return new, info


def _body(embed, layers, head, tokens, targets, *, sched, vplan, counts, embed_fn, layer_fn,
          head_loss_fn, optimizer, window, batch_axes, tokens_per_mb, probe_fn, bubble_value):
    """Per device: the executor's step loop plus a ring of weight versions and updates."""
    p, m = sched.num_stages, sched.num_microbatches
    stage = jax.lax.axis_index(pl.PIPELINE)
    tokens_M = tokens.reshape(m, tokens.shape[0] // m, *tokens.shape[1:])
    targets_M = targets.reshape(m, targets.shape[0] // m, *targets.shape[1:])
    x_spec = jax.eval_shape(embed_fn, embed, tokens_M[0])
    fill = lambda: jnp.full(x_spec.shape, bubble_value, x_spec.dtype)
    branches = pl.stage_branches(embed_fn, pl.layer_runner(layer_fn, counts, True, stage),
                                 head_loss_fn, fill)
    table, pairs = pl._branch_table(sched)
    branch_fns = [branches[kr] for kr in pairs]
    plan = sched_lib.buffer_plan(sched)
    fwd_perm = [(s, s + 1) for s in range(p - 1)]
    bwd_perm = [(s + 1, s) for s in range(p - 1)]
    w0 = (embed, layers, head)
    ring0 = jax.tree.map(lambda a: jnp.broadcast_to(a, (vplan.num_slots, *a.shape)) + 0, w0)
    at = lambda tree, i: jax.tree.map(lambda a: a[i], tree)
    probe = (lambda w: jnp.float32(0)) if probe_fn is None else (
        lambda w: jnp.asarray(probe_fn(w), jnp.float32))

    def apply_update(ring, opt_state, acc, base_slot, write_slot):
        base = at(ring, base_slot)
        grads = jax.tree.map(lambda g: g / window, acc)
        updates, opt_state = optimizer.update(grads, opt_state, base)
        new = optax.apply_updates(base, updates)
        ring = jax.tree.map(lambda r, a: r.at[write_slot].set(a.astype(r.dtype)), ring, new)
        return ring, opt_state, jax.tree.map(jnp.zeros_like, acc)

    def step(carry, row):
        ring, opt_state, acc, act_buf, cot_buf, recv_act, recv_cot, losses, pf, pb = carry
        branch, kind, mb, slot, act_slot, cot_slot, rslot, upd, bslot, wslot = (
            r[stage] for r in row)
        act_buf = jax.lax.dynamic_update_index_in_dim(act_buf, recv_act, act_slot, 0)
        cot_buf = jax.lax.dynamic_update_index_in_dim(cot_buf, recv_cot, cot_slot, 0)
        mb = jnp.maximum(mb, 0)
        w = at(ring, rslot)
        d_e, d_l, d_h, loss, _, send_act, send_cot = jax.lax.switch(
            branch, branch_fns, w, act_buf[slot], cot_buf[slot], tokens_M[mb], targets_M[mb])
        grads = (d_e, d_l, d_h)
        if batch_axes:  # data parallel: every replica of a stage applies the same update
            grads = jax.lax.psum(grads, batch_axes)
        acc = jax.tree.map(lambda a, g: a + g / tokens_per_mb, acc, grads)
        ring, opt_state, acc = jax.lax.cond(
            upd, apply_update, lambda r, o, a, *_: (r, o, a), ring, opt_state, acc, bslot, wslot)
        losses = losses.at[mb].add(loss)
        value = probe(w)
        pf = jnp.where(kind == sched_lib.FORWARD, pf.at[mb].set(value), pf)
        pb = jnp.where(kind == sched_lib.BACKWARD, pb.at[mb].set(value), pb)
        if p > 1:
            send_act = jax.lax.ppermute(send_act, pl.PIPELINE, fwd_perm)
            send_cot = jax.lax.ppermute(send_cot, pl.PIPELINE, bwd_perm)
        return (ring, opt_state, acc, act_buf, cot_buf, send_act, send_cot, losses, pf, pb), None

    buf = jnp.full((plan.num_slots + 1, *x_spec.shape), bubble_value, x_spec.dtype)
    acc0 = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32)), w0)
    rows = tuple(jnp.asarray(a) for a in (
        table, sched.kind, sched.microbatch, plan.slot, plan.recv_act_slot, plan.recv_cot_slot,
        vplan.read_slot, vplan.update, vplan.base_slot, vplan.write_slot))
    zeros_m = jnp.zeros((m,), jnp.float32)
    carry = (ring0, optimizer.init(w0), acc0, buf, buf, fill(), fill(), zeros_m, zeros_m, zeros_m)
    (ring, _, _, _, _, _, _, losses, pf, pb), _ = jax.lax.scan(step, carry, rows)
    final = at(ring, vplan.num_updates % vplan.num_slots)
    losses = jax.lax.psum(losses, (pl.PIPELINE, *batch_axes)) / tokens_per_mb
    stack = lambda tree: jax.tree.map(lambda a: a[None], tree)
    embed, layers, head = final
    return (stack(embed), layers, stack(head)), losses, pf[None], pb[None]
