"""Pipeline-parallel loss and gradients: any static schedule run inside one `shard_map`.

Each device on the `pipeline` mesh axis is a stage holding a contiguous slice of the
stacked layers (stage 0 also runs the embedding, the last stage the head and loss). A
`lax.scan` walks the schedule table one step at a time; every stage looks up its own
action with `lax.axis_index('pipeline')` and runs it under `lax.switch`, then activations
move to stage s+1 and cotangents to stage s-1 with one `ppermute` each. A backward
recomputes its stage's forward from the stored input under `jax.vjp`, so a stage stores one
activation per in-flight microbatch: p for 1F1B, m for GPipe. That is how 1F1B
(PipeDream-Flush, Narayanan et al. 2019; Megatron-LM, Narayanan et al. 2021) keeps memory
flat in m while GPipe (Huang et al. 2019) grows. The gradient is accumulated by hand, not by
differentiating the scan, so no per-step residuals are kept. Borrowed from praxis/MaxText:
layers stacked on a leading axis and sharded over stages, a circular shift between stages
as the only communication, and NaN-polluted bubbles as a test for leaks.

Other mesh axes: the batch is split over `batch_axes` (default `data`) and gradients are
summed over them at the end. Only `pipeline` and the batch axes are manual inside the
`shard_map`; every other axis (`tensor`, `expert`) stays under the compiler, so params
sharded over `tensor` stay sharded and XLA partitions `layer_fn` over it (Megatron-style
tensor parallelism from annotations). Sharding constraints inside the user functions may
therefore name only those other axes. The mesh must use Auto axis types.
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

from gendist.parallel import schedule as sched_lib

try:  # jax >= 0.6 has jax.shard_map (check_vma); older ones only the experimental one.
    _shard_map = jax.shard_map
    _NO_CHECK = {"check_vma": False}
except AttributeError:  # pragma: no cover - old jax
    from jax.experimental.shard_map import shard_map as _shard_map

    _NO_CHECK = {"check_rep": False}

PIPELINE = "pipeline"
PARAM_KEYS = ("embed", "layers", "head")
_ROLES = ("first", "mid", "last", "only")


def stage_layer_split(num_layers: int, num_stages: int, stage_layer_counts=None) -> tuple[int, ...]:
    """Layers per stage: `stage_layer_counts`, or an even split when it is None."""
    if num_layers < num_stages:
        raise ValueError(
            f"layers: the model has {num_layers} layers but the pipeline has {num_stages} "
            "stages; use a pipeline mesh axis of at most the number of layers"
        )
    if stage_layer_counts is None:
        if num_layers % num_stages:
            raise ValueError(
                f"layers: {num_layers} layers do not split evenly over {num_stages} stages; "
                "pass stage_layer_counts (e.g. from gendist.parallel.partition)"
            )
        return (num_layers // num_stages,) * num_stages
    counts = tuple(int(c) for c in stage_layer_counts)
    if len(counts) != num_stages or min(counts) < 1 or sum(counts) != num_layers:
        raise ValueError(
            f"stage_layer_counts={counts} must give each of the {num_stages} stages at least "
            f"one layer and sum to the {num_layers} layers"
        )
    return counts


def _resolve_schedule(schedule, num_stages: int, num_microbatches) -> sched_lib.Schedule:
    if isinstance(schedule, str):
        if num_microbatches is None:
            raise ValueError("num_microbatches is required when schedule is given by name")
        return sched_lib.make(schedule, num_stages, num_microbatches)
    if num_microbatches is not None and num_microbatches != schedule.num_microbatches:
        raise ValueError(
            f"num_microbatches={num_microbatches} disagrees with the schedule's "
            f"{schedule.num_microbatches}; pass one or the other"
        )
    if schedule.num_stages != num_stages:
        raise ValueError(
            f"schedule has {schedule.num_stages} stages but the mesh axis '{PIPELINE}' has "
            f"{num_stages}; build the schedule with num_stages={num_stages}"
        )
    return schedule


def _branch_table(s: sched_lib.Schedule) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """Static [steps, stages] index into the (kind, role) branches this schedule uses."""
    p = s.num_stages
    roles = np.array(["only"] if p == 1 else ["first"] + ["mid"] * (p - 2) + ["last"])
    role_TS = np.broadcast_to(roles, s.kind.shape)
    pairs = sorted({(int(k), str(r)) for k, r in zip(s.kind.ravel(), role_TS.ravel(), strict=True)},
                   key=lambda kr: (kr[0], _ROLES.index(kr[1])))
    index = {kr: i for i, kr in enumerate(pairs)}
    table = np.vectorize(lambda k, r: index[(int(k), str(r))], otypes=[np.int32])(s.kind, role_TS)
    return table, pairs


def _stage_layout(counts: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Uneven splits as a [p * max_count] layout: `gather` picks each stage's layers (padding
    with layer 0, which a mask skips) and `inverse` brings gradients back to [L]."""
    maxc = max(counts)
    starts = np.cumsum((0,) + counts[:-1])
    valid = np.arange(maxc)[None, :] < np.asarray(counts)[:, None]
    gather = np.where(valid, starts[:, None] + np.arange(maxc)[None, :], 0).ravel()
    return gather, np.flatnonzero(valid.ravel())


def _check_inputs(params, tokens_BT, targets_BT, mesh, schedule, num_microbatches,
                  stage_layer_counts, batch_axes):
    """Validates the call; returns (schedule, layers per stage, batch axes in the mesh)."""
    if PIPELINE not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} lack '{PIPELINE}'; add a pipeline axis")
    if any(str(t).endswith("Explicit") for t in getattr(mesh, "axis_types", ())):
        raise ValueError(f"mesh axis_types {mesh.axis_types}: the pipeline needs Auto axes; "
                         "build the mesh with jax.sharding.Mesh(devices, names) or "
                         "gendist.sharding.make_mesh")
    if set(params) != set(PARAM_KEYS):
        raise ValueError(f"params has keys {sorted(params)}; pass exactly {list(PARAM_KEYS)}")
    p = mesh.shape[PIPELINE]
    sched = _resolve_schedule(schedule, p, num_microbatches)
    m = sched.num_microbatches
    leaves = jax.tree.leaves(params["layers"])
    if not leaves or len({a.shape[0] for a in leaves}) != 1:
        raise ValueError("params['layers'] must be a pytree of arrays stacked on one leading "
                         "layers axis [L, ...]")
    counts = stage_layer_split(leaves[0].shape[0], p, stage_layer_counts)
    batch_axes = tuple(a for a in batch_axes if a in mesh.axis_names)
    shards = int(np.prod([mesh.shape[a] for a in batch_axes]))
    batch = tokens_BT.shape[0]
    if tokens_BT.shape != targets_BT.shape:
        raise ValueError(f"targets_BT {targets_BT.shape} must match tokens_BT {tokens_BT.shape}")
    if batch % (shards * m):
        raise ValueError(
            f"num_microbatches={m}: the batch of {batch} split over {batch_axes} (size "
            f"{shards}) must divide into {m} equal microbatches; use a batch that is a "
            f"multiple of {shards * m} or another num_microbatches")
    return sched, counts, batch_axes


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
    batch_axes: Sequence[str] = ("data",),
    bubble_value: float = 0.0,
):
    """Mean loss and its gradients for `params = {'embed', 'layers', 'head'}` by pipelining.

    `embed_fn(embed, tokens_BT) -> x_BTD`, `layer_fn(layer, x_BTD) -> x_BTD` for one slice
    of `params['layers']` (a pytree of arrays [L, ...]), and
    `head_loss_fn(head, x_BTD, targets_BT) -> (sum_loss, count)`. The loss is the total sum
    over all microbatches divided by the total count. `schedule` is a Schedule for the
    mesh's pipeline size, or 'gpipe'/'1f1b' with `num_microbatches`. `stage_layer_counts`
    gives an uneven split (e.g. from `partition.partition_layers`). `bubble_value` fills
    everything a stage holds or sends while it has nothing to do (tests pass NaN).
    Returns (loss, grads) with grads shaped like params. Jit it from the outside.
    """
    sched, counts, batch_axes = _check_inputs(
        params, tokens_BT, targets_BT, mesh, schedule, num_microbatches, stage_layer_counts,
        batch_axes)
    even = len(set(counts)) == 1
    gather, inverse = _stage_layout(counts)
    layers = params["layers"] if even else jax.tree.map(lambda a: a[gather], params["layers"])

    body = functools.partial(
        _pipeline_body, sched=sched, counts=counts, even=even, embed_fn=embed_fn,
        layer_fn=layer_fn, head_loss_fn=head_loss_fn, batch_axes=batch_axes,
        bubble_value=bubble_value)
    batch_spec = P(batch_axes if batch_axes else None)
    fn = _shard_map(
        body, mesh=mesh,
        in_specs=(P(), P(PIPELINE), P(), batch_spec, batch_spec),
        out_specs=(P(), (P(), P(PIPELINE), P())),
        axis_names=frozenset({PIPELINE, *batch_axes}),
        **_NO_CHECK)
    loss, (g_embed, g_layers, g_head) = fn(params["embed"], layers, params["head"], tokens_BT, targets_BT)
    if not even:
        g_layers = jax.tree.map(lambda g: g[inverse], g_layers)
    return loss, {"embed": g_embed, "layers": g_layers, "head": g_head}


def stage_branches(embed_fn, run_layers, head_loss_fn, fill):
    """{(kind, role): f(w, x, g, tok, tgt)} for stage weights w = (embed, layers, head).

    Each returns (d_embed, d_layers, d_head, loss_sum, count, send_act, send_cot); a
    backward recomputes the stage's forward from its stored input `x` under `jax.vjp`.
    The last stage keeps its input and does all its work in the backward step. PipeDream
    (pipedream.py) calls the same branches with a different weight version per action.
    """
    def out(w, d_embed=None, d_layers=None, d_head=None, loss=0.0, count=0.0, act=None,
            cot=None):
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
        embed, layers, head = w
        return (d_embed if d_embed is not None else zeros(embed),
                d_layers if d_layers is not None else zeros(layers),
                d_head if d_head is not None else zeros(head),
                jnp.asarray(loss, jnp.float32), jnp.asarray(count, jnp.float32),
                act if act is not None else fill(), cot if cot is not None else fill())

    def idle(w, x, g, tok, tgt):
        return out(w)

    def fwd_first(w, x, g, tok, tgt):
        return out(w, act=run_layers(w[1], embed_fn(w[0], tok)))

    def fwd_mid(w, x, g, tok, tgt):
        return out(w, act=run_layers(w[1], x))

    def bwd_first(w, x, g, tok, tgt):
        _, vjp = jax.vjp(lambda e, lp: run_layers(lp, embed_fn(e, tok)), w[0], w[1])
        d_e, d_l = vjp(g)
        return out(w, d_embed=d_e, d_layers=d_l)

    def bwd_mid(w, x, g, tok, tgt):
        _, vjp = jax.vjp(run_layers, w[1], x)
        d_l, d_x = vjp(g)
        return out(w, d_layers=d_l, cot=d_x)

    def bwd_last(w, x, g, tok, tgt):
        f = lambda lp, hp, x: head_loss_fn(hp, run_layers(lp, x), tgt)
        loss, vjp, count = jax.vjp(f, w[1], w[2], x, has_aux=True)
        d_l, d_h, d_x = vjp(jnp.ones_like(loss))
        return out(w, d_layers=d_l, d_head=d_h, loss=loss, count=count, cot=d_x)

    def bwd_only(w, x, g, tok, tgt):
        f = lambda e, lp, hp: head_loss_fn(hp, run_layers(lp, embed_fn(e, tok)), tgt)
        loss, vjp, count = jax.vjp(f, *w, has_aux=True)
        d_e, d_l, d_h = vjp(jnp.ones_like(loss))
        return out(w, d_embed=d_e, d_layers=d_l, d_head=d_h, loss=loss, count=count)

    F, B = sched_lib.FORWARD, sched_lib.BACKWARD
    return ({(sched_lib.IDLE, r): idle for r in _ROLES}
            | {(F, "first"): fwd_first, (F, "mid"): fwd_mid, (F, "last"): idle,
               (F, "only"): idle, (B, "first"): bwd_first, (B, "mid"): bwd_mid,
               (B, "last"): bwd_last, (B, "only"): bwd_only})


def layer_runner(layer_fn, counts, even, stage):
    """run_layers(stage_layers, x): a scan over the stage's layers (padding masked off)."""
    active_L = jnp.arange(max(counts)) < jnp.asarray(counts, jnp.int32)[stage]

    def run_layers(lp, x):
        def one(x, lp_on):
            lp_l, on = lp_on
            if even:
                return layer_fn(lp_l, x), None
            return jax.lax.cond(on, layer_fn, lambda _, y: y, lp_l, x), None
        return jax.lax.scan(one, x, (lp, active_L))[0]

    return run_layers


def _pipeline_body(embed, layers, head, tokens, targets, *, sched, counts, even, embed_fn,
                   layer_fn, head_loss_fn, batch_axes, bubble_value):
    """The per-device program: scan over schedule steps, one switch and two ppermutes each."""
    p, m = sched.num_stages, sched.num_microbatches
    stage = jax.lax.axis_index(PIPELINE)
    tokens_M = tokens.reshape(m, tokens.shape[0] // m, *tokens.shape[1:])
    targets_M = targets.reshape(m, targets.shape[0] // m, *targets.shape[1:])
    x_spec = jax.eval_shape(embed_fn, embed, tokens_M[0])
    fill = lambda: jnp.full(x_spec.shape, bubble_value, x_spec.dtype)
    run_layers = layer_runner(layer_fn, counts, even, stage)
    branches = stage_branches(embed_fn, run_layers, head_loss_fn, fill)
    table, pairs = _branch_table(sched)
    branch_fns = [branches[kr] for kr in pairs]
    plan = sched_lib.buffer_plan(sched)
    fwd_perm = [(s, s + 1) for s in range(p - 1)]
    bwd_perm = [(s + 1, s) for s in range(p - 1)]
    w = (embed, layers, head)

    def step(carry, row):
        act_buf, cot_buf, recv_act, recv_cot, acc = carry
        branch, mb, slot, act_slot, cot_slot = (r[stage] for r in row)
        act_buf = jax.lax.dynamic_update_index_in_dim(act_buf, recv_act, act_slot, 0)
        cot_buf = jax.lax.dynamic_update_index_in_dim(cot_buf, recv_cot, cot_slot, 0)
        x, g = act_buf[slot], cot_buf[slot]
        mb = jnp.maximum(mb, 0)
        *deltas, send_act, send_cot = jax.lax.switch(branch, branch_fns, w, x, g, tokens_M[mb],
                                                     targets_M[mb])
        acc = jax.tree.map(lambda a, d: a + d.astype(a.dtype), acc, tuple(deltas))
        if p > 1:
            send_act = jax.lax.ppermute(send_act, PIPELINE, fwd_perm)
            send_cot = jax.lax.ppermute(send_cot, PIPELINE, bwd_perm)
        return (act_buf, cot_buf, send_act, send_cot, acc), None

    buf = jnp.full((plan.num_slots + 1, *x_spec.shape), bubble_value, x_spec.dtype)
    # Accumulate in at least fp32 so bf16 params do not lose small microbatch contributions.
    wide = lambda tree: jax.tree.map(
        lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32)), tree)
    acc0 = (wide(embed), wide(layers), wide(head), jnp.float32(0), jnp.float32(0))
    rows = tuple(jnp.asarray(a) for a in (table, sched.microbatch, plan.slot,
                                           plan.recv_act_slot, plan.recv_cot_slot))
    carry = (buf, buf, fill(), fill(), acc0)
    (_, _, _, _, acc), _ = jax.lax.scan(step, carry, rows)
    return mean_loss_and_grads(acc, (embed, layers, head), batch_axes)


def mean_loss_and_grads(acc, params, batch_axes):
    """(mean loss, grads) from a stage's accumulated (d_embed, d_layers, d_head, loss sum,
    token count): sums over the pipeline (embedding and head live on one stage each; every
    stage holds its own layers) and the batch axes, then divides by the token count."""
    embed, layers, head = params
    d_embed, d_layers, d_head, loss, count = acc
    everywhere = (PIPELINE, *batch_axes)
    loss, count = jax.lax.psum((loss, count), everywhere)
    d_embed, d_head = jax.lax.psum((d_embed, d_head), everywhere)
    if batch_axes:
        d_layers = jax.lax.psum(d_layers, batch_axes)
    scale = lambda g, like: jax.tree.map(lambda a, b: (a / count).astype(b.dtype), g, like)
    return loss / count, (scale(d_embed, embed), scale(d_layers, layers), scale(d_head, head))


def sequential_loss(params, tokens_BT, targets_BT, *, embed_fn, layer_fn, head_loss_fn):
    """The plain, non-pipelined model: the oracle every pipelined run must equal."""
    x_BTD = embed_fn(params["embed"], tokens_BT)
    x_BTD = jax.lax.scan(lambda x, lp: (layer_fn(lp, x), None), x_BTD, params["layers"])[0]
    loss, count = head_loss_fn(params["head"], x_BTD, targets_BT)
    return loss / count
