"""A branch-free executor for schedules whose every step runs one kind of action.

`core.run_table` picks each stage's action with a `lax.switch`, and an XLA conditional
copies whatever large operands and results pass through it: the kept vjp residuals of a
microbatch were sliced out of their buffer before the switch, copied out of it after, and
written back (on two H200s, a 1b pipeline step spent a third of its kernel time in those
copies: `benchmarks/pipeline.md`).

When every step of a schedule runs the same kind of action on all stages that are busy
(GPipe; 1F1B in phases, `schedule.one_f_one_b_phased`), no switch is needed: a step runs
that kind on every stage, idle stages included, on their spare buffer slot, and whatever
an idle stage computes is masked out of the accumulators (`jnp.where`, so even NaN
bubbles cannot leak). In a lock-step program an idle stage's work costs no time: its
neighbours compute for as long in the same step. The forward writes each unit's residuals
straight into the microbatch's slot and the backward reads them from there, one unit at a
time, inside the scan's loop where XLA updates buffers in place. The table's step kinds
must read F...F (F B)...(F B) B...B; `segments` says whether they do.

The stage program runs the model's `StageFns` exactly as `stages.saved_computations`
does; `sync.run_sync` picks this executor when it applies (even split, no B/W split, no
recomputation) and the tests compare it with the plain model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gendist.models import fp8 as fp8_lib
from gendist.parallel.pipeline import core
from gendist.parallel.pipeline import plan as schedule_plan
from gendist.parallel.pipeline import schedules as sched_lib
from gendist.parallel.pipeline.stages import StageFns, UnitPlan, accumulators, unit_vjp_fn

F, B = sched_lib.FORWARD, sched_lib.BACKWARD


def segments(sched: sched_lib.Schedule) -> tuple[int, int, int] | None:
    """(a, k, b) when the step kinds are F^a (F B)^k B^b (every step one kind on all busy
    stages, none idle everywhere); None otherwise (or for a split schedule)."""
    if sched.split:
        return None
    kinds = []
    for row in sched.kind:
        busy = set(row[row != sched_lib.IDLE].tolist())
        if len(busy) != 1:
            return None
        kinds.append(busy.pop())
    n = len(kinds)
    a = 0
    while a < n and kinds[a] == F and not (a + 1 < n and kinds[a + 1] == B):
        a += 1
    k = 0
    while a + 2 * k + 1 < n and kinds[a + 2 * k] == F and kinds[a + 2 * k + 1] == B:
        k += 1
    rest = kinds[a + 2 * k:]
    return (a, k, len(rest)) if all(kd == B for kd in rest) else None


def run_uniform(w, tokens_M, targets_M, *, sched: sched_lib.Schedule, fns: StageFns,
                plan: UnitPlan, bufs: dict, act_shape, act_dtype, fill_value: float):
    """(grads, loss, count, metrics) accumulators of this stage (inside the shard_map)."""
    p = sched.num_stages
    a, k, b = segments(sched)
    stage = jax.lax.axis_index(core.PIPELINE)
    first, last = stage == 0, stage == p - 1
    bplan = schedule_plan.buffer_plan(sched)
    cols = {"mb": np.maximum(sched.microbatch, 0), "slot": bplan.slot,
            "recv_act": bplan.recv_act_slot, "recv_cot": bplan.recv_cot_slot,
            "active": (sched.kind != sched_lib.IDLE).astype(np.int32)}
    fwd_perm = [(s, s + 1) for s in range(p - 1)]
    bwd_perm = [(s + 1, s) for s in range(p - 1)]
    one = jnp.float32(1)
    units_w = fns.units(w[1])
    n = jax.tree.leaves(units_w)[0].shape[0]
    unroll = max(1, min(fns.unroll, n))

    unit_vjp = unit_vjp_fn(fns)
    keep, rebuild = plan.keep, plan.rebuild

    def masked(on, tree):
        return jax.tree.map(lambda v: jnp.where(on, v, jnp.zeros_like(v)), tree)

    add = fp8_lib.accumulate  # sums; the FP8 histories' observed amaxes by max

    def receive(carry, row):
        acc, bufs, act_buf, cot_buf, recv_act, recv_cot = carry
        act_buf = jax.lax.dynamic_update_index_in_dim(act_buf, recv_act, row["recv_act"], 0)
        cot_buf = jax.lax.dynamic_update_index_in_dim(cot_buf, recv_cot, row["recv_cot"], 0)
        return acc, bufs, act_buf, cot_buf

    def f_step(carry, row):
        acc, bufs, act_buf, cot_buf = receive(carry, row)
        slot, on = row["slot"], row["active"] > 0
        tok = tokens_M[row["mb"]]
        x = jnp.where(first, fns.embed(w[0], tok).astype(act_dtype), act_buf[slot])

        def unit(c, pu_u):
            x, aux, metrics, res = c
            pu, u = pu_u
            (y, au), vjp, m = jax.vjp(unit_vjp, pu, x, has_aux=True)
            res = [jax.lax.dynamic_update_slice(
                buf, r[None, None].astype(buf.dtype), (slot, u) + (0,) * r.ndim)
                for buf, r in zip(res, keep(vjp), strict=True)]
            return (y, aux + au, jax.tree.map(jnp.add, metrics, m), res), None

        init = (x, jnp.float32(0), core.wide_zeros(fns.metrics), bufs["units"])
        (y, aux, metrics, res), _ = jax.lax.scan(unit, init, (units_w, jnp.arange(n)),
                                                 unroll=unroll)
        y_buf = jax.lax.dynamic_update_index_in_dim(bufs["y"], y.astype(bufs["y"].dtype),
                                                    slot, 0)
        grads, loss, count, mets = acc
        acc = (grads, loss + jnp.where(on, aux, 0.0), count, add(mets, masked(on, metrics)))
        send = jax.lax.ppermute(y.astype(act_dtype), core.PIPELINE, fwd_perm) if p > 1 else y
        return (acc, {**bufs, "units": res, "y": y_buf}, act_buf, cot_buf, send,
                carry[5]), None

    def b_step(carry, row):
        acc, bufs, act_buf, cot_buf = receive(carry, row)
        slot, on = row["slot"], row["active"] > 0
        tgt = targets_M[row["mb"]]
        y = jax.lax.dynamic_index_in_dim(bufs["y"], slot, 0, keepdims=False)
        loss, head_vjp, count = jax.vjp(lambda hp, y: fns.head_loss(hp, y, tgt), w[2], y,
                                        has_aux=True)
        d_h, g_head = head_vjp(jnp.ones_like(loss))
        g = jnp.where(last, g_head.astype(act_dtype), cot_buf[slot])

        (g_e, g_l, g_h), tot, cnt, mets = acc

        def unit(carry, pu_u):  # each unit's weight gradient added to its accumulator
            g, acc_u = carry
            pu, u = pu_u
            res = [jax.lax.dynamic_index_in_dim(
                jax.lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False), u, 0,
                keepdims=False) for buf in bufs["units"]]
            d_p, d_x = rebuild(pu, res)((g, one))
            at_u = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, u, 0, keepdims=False),
                                acc_u)
            at_u = add(at_u, masked(on, d_p))
            acc_u = jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, u, 0),
                                 acc_u, at_u)
            return (d_x, acc_u), None

        (d_x, acc_units), _ = jax.lax.scan(unit, (g, fns.units(g_l)), (units_w, jnp.arange(n)),
                                           reverse=True, unroll=unroll)
        g_l = fns.from_units(acc_units)
        # The embedding's gradient once after the loop, from every microbatch's d_x (a
        # scatter over the vocabulary per step cost more than the buffer of them).
        dx_buf = jax.lax.dynamic_update_index_in_dim(
            bufs["dx"], d_x.astype(bufs["dx"].dtype), jnp.where(on, row["mb"], m), 0)
        g_h = add(g_h, masked(on & last, d_h))
        tot = tot + jnp.where(on & last, loss, 0.0)
        cnt = cnt + jnp.where(on & last, jnp.asarray(count, jnp.float32), 0.0)
        send = jax.lax.ppermute(d_x, core.PIPELINE, bwd_perm) if p > 1 else d_x
        return (((g_e, g_l, g_h), tot, cnt, mets), {**bufs, "dx": dx_buf}, act_buf, cot_buf,
                carry[4], send)

    def b_scan_step(carry, row):
        return b_step(carry, row), None

    def pair(carry, rows):
        carry, _ = f_step(carry, jax.tree.map(lambda v: v[0], rows))
        return b_step(carry, jax.tree.map(lambda v: v[1], rows)), None

    m = sched.num_microbatches
    fill = jnp.full(act_shape, fill_value, act_dtype)
    buf = jnp.full((bplan.num_slots + 1, *act_shape), fill_value, act_dtype)
    bufs = {**bufs, "dx": jnp.zeros((m + 1, *act_shape), act_dtype)}  # row m: idle steps
    carry = (accumulators(w, fns.metrics), bufs, buf, buf, fill, fill)
    rows = {key: jnp.asarray(v)[:, stage] for key, v in cols.items()}
    take = lambda lo, hi: jax.tree.map(lambda v: v[lo:hi], rows)
    if a:
        carry, _ = jax.lax.scan(f_step, carry, take(0, a))
    if k:
        paired = jax.tree.map(lambda v: v.reshape(k, 2, *v.shape[1:]), take(a, a + 2 * k))
        carry, _ = jax.lax.scan(pair, carry, paired)
    if b:
        carry, _ = jax.lax.scan(b_scan_step, carry, take(a + 2 * k, a + 2 * k + b))
    (g_e, g_l, g_h), tot, cnt, mets = carry[0]
    tokens = tokens_M.reshape(-1, *tokens_M.shape[2:])
    d_x = carry[1]["dx"][:m].reshape(-1, *act_shape[1:])
    d_e = jax.vjp(lambda e: fns.embed(e, tokens), w[0])[1](d_x)[0]
    return (add(g_e, masked(first, d_e)), g_l, g_h), tot, cnt, mets
