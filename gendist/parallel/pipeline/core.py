"""The one schedule executor: a static table walked by a `lax.scan` on every stage.

Each device on the `pipeline` mesh axis is a stage. A schedule (`gendist.parallel.pipeline.schedules`)
says, for every step t and stage s, what the stage does (forward, backward or idle) and on
which microbatch; `schedule_plan.buffer_plan` says in which slot of its activation /
cotangent buffers a stage keeps each microbatch it holds. `run_table` turns that into one
per-device program:

    for each step:                                  (lax.scan over the table's rows)
        store the activation and cotangent that arrived last step into their slots
        extra, send_act, send_cot = branch[t, s](extra, x[slot], g[slot], row)   (lax.switch)
        extra = hook(extra, row)                    (optional: e.g. PipeDream's update)
        send_act -> stage s+1, send_cot -> stage s-1                             (ppermute)

An interleaved schedule (`schedule.interleaved_1f1b`) runs v chunks of layers per device:
the table's columns are virtual stages, folded onto the devices by
`schedule_plan.device_plan` (a `chunk` column says which chunk acts, buffer slots are per
chunk), and the messages go round a ring, device p-1 sending to device 0 (chunk c to
chunk c+1).

A branch is picked per (kind, role, ...) key - role = first / mid / last / only stage - and
`extra` is whatever the engine carries: gradient accumulators (GPipe, 1F1B), a ring of
weight versions and optimizer state (PipeDream), a stage's K/V cache and its gradient
(TeraPipe). Extra per-step columns (`columns`) reach the branches and the hook. This is
the only scan over a schedule in gendist; the engines in this package differ only in
their branches, carry and hook.

The program runs inside one `shard_map` (`manual`), manual over the pipeline axis and
whatever other axes the engine takes into its own hands.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gendist.models import fp8 as fp8_lib
from gendist.parallel.compat import shard_map_manual
from gendist.parallel.pipeline import plan as schedule_plan
from gendist.parallel.pipeline import schedules as sched_lib

PIPELINE = "pipeline"
ROLES = ("first", "mid", "last", "only")


def stage_roles(num_stages: int) -> list[str]:
    """'only' for one stage; else 'first', 'mid'..., 'last'."""
    if num_stages == 1:
        return ["only"]
    return ["first"] + ["mid"] * (num_stages - 2) + ["last"]


def branch_table(sched: sched_lib.Schedule, key: Callable[[int, str, int, int], object]
                 ) -> tuple[np.ndarray, list]:
    """Static [steps, devices] index into the sorted distinct `key(kind, role, microbatch,
    stage)`s that the schedule uses (e.g. (kind, role); for TeraPipe (kind, role, slice);
    for an uneven split (kind, role, stage)). The role and stage are the acting (virtual)
    stage's: on an interleaved table the first role is virtual stage 0 and the last
    p x v - 1 (an idle device counts as its first chunk's stage)."""
    roles = stage_roles(sched.num_stages)
    dplan = schedule_plan.device_plan(sched)
    devices = sched.num_devices

    def cell(t, d):
        s = int(dplan.stage[t, d])
        s = d if s < 0 else s
        return key(int(dplan.kind[t, d]), roles[s], int(dplan.microbatch[t, d]), s)

    keys = sorted({cell(t, d) for t in range(sched.num_steps) for d in range(devices)},
                  key=repr)
    index = {k: i for i, k in enumerate(keys)}
    table = np.array([[index[cell(t, d)] for d in range(devices)]
                      for t in range(sched.num_steps)], np.int32).reshape(-1, devices)
    return table, keys


def run_table(sched: sched_lib.Schedule, table: np.ndarray, branches: Sequence[Callable],
              extra, *, act_shape: tuple[int, ...], act_dtype, fill_value: float = 0.0,
              columns: Mapping[str, np.ndarray] | None = None, hook: Callable | None = None,
              read: Callable | None = None, write: Callable | None = None):
    """Runs the schedule on this stage (call inside a shard_map manual over `pipeline`).

    `branches[table[t, s]](operand, x, g, row) -> (result, send_act, send_cot)`, where x / g
    are the activation / cotangent slot of the microbatch it acts on and `row` holds this
    stage's entries of every column at step t ('mb', 'slot', 'chunk' and `columns`, all
    [steps, devices]: `schedule_plan.device_plan`'s view). By default the
    operand is the carry `extra` and the result its new value. A carry too large to pass
    through the branch (a conditional copies what its branches pass through: buffers of
    residuals, gradient accumulators) stays outside: `read(extra, row)` makes the operand
    (e.g. one slot of the buffers) and `write(extra, result, row)` the new carry (e.g. in
    place updates). Messages have shape `act_shape`; everything a stage holds or sends while
    idle is `fill_value` (tests pass NaN to prove no bubble leaks into a result). Returns
    the final `extra`.
    """
    p = sched.num_devices
    stage = jax.lax.axis_index(PIPELINE)
    plan = schedule_plan.device_plan(sched)
    cols = {"branch": table, "mb": np.maximum(plan.microbatch, 0), "slot": plan.slot,
            "chunk": plan.chunk, "recv_act": plan.recv_act_slot,
            "recv_cot": plan.recv_cot_slot, **(columns or {})}
    # Stage s sends to s + 1; with chunks, the last device's chunk c to device 0's c + 1.
    ring = sched.num_chunks > 1
    fwd_perm = [(s, (s + 1) % p) for s in range(p if ring else p - 1)]
    bwd_perm = [((s + 1) % p, s) for s in range(p if ring else p - 1)]

    def step(carry, cols_t):
        extra, act_buf, cot_buf, recv_act, recv_cot = carry
        row = {k: v[stage] for k, v in cols_t.items()}
        act_buf = jax.lax.dynamic_update_index_in_dim(act_buf, recv_act, row["recv_act"], 0)
        cot_buf = jax.lax.dynamic_update_index_in_dim(cot_buf, recv_cot, row["recv_cot"], 0)
        operand = extra if read is None else read(extra, row)
        result, send_act, send_cot = jax.lax.switch(
            row["branch"], list(branches), operand, act_buf[row["slot"]], cot_buf[row["slot"]],
            row)
        extra = result if write is None else write(extra, result, row)
        if hook is not None:
            extra = hook(extra, row)
        if p > 1:
            send_act = jax.lax.ppermute(send_act, PIPELINE, fwd_perm)
            send_cot = jax.lax.ppermute(send_cot, PIPELINE, bwd_perm)
        return (extra, act_buf, cot_buf, send_act, send_cot), None

    fill = jnp.full(act_shape, fill_value, act_dtype)
    buf = jnp.full((plan.num_slots + 1, *act_shape), fill_value, act_dtype)
    carry = (extra, buf, buf, fill, fill)
    (extra, *_), _ = jax.lax.scan(step, carry, {k: jnp.asarray(v) for k, v in cols.items()})
    return extra


def manual(body: Callable, mesh, in_specs, out_specs, axes: Sequence[str]):
    """`body` as a shard_map manual over `axes` (the rest stay with the compiler)."""
    return shard_map_manual(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                            axis_names=frozenset(axes))


def spec_axes(spec: P) -> set[str]:
    """Mesh axes a PartitionSpec names."""
    out = set()
    for entry in spec:
        if entry is None:
            continue
        out.update((entry,) if isinstance(entry, str) else entry)
    return out


def finish(acc, params, specs, reduce_axes: Sequence[str], amax_axes: Sequence[str] = ()):
    """(mean loss, grads, metric sums, token count) from a stage's accumulators.

    `acc = (grads, loss_sum, count, metrics)` with grads shaped like `params`. Each value
    is summed over the `reduce_axes` it is not split over (an embedding lives on one stage;
    a batch shard saw its own tokens; a ZeRO-3 shard or an expert's weights were already
    reduced by the transpose of their all-gather / all-to-all), then divided by the token
    count (in at least fp32). Metrics are summed everywhere; the engine normalises them.
    The FP8 histories' entries (`models.fp8.is_history`) are observed amaxes of this
    device's shards: their max over `reduce_axes` and `amax_axes` (a tensor-parallel
    shard saw part of a weight) that they are not split over, not divided.
    """
    grads, loss, count, metrics = acc
    everywhere = tuple(reduce_axes)
    loss, count, metrics = jax.lax.psum((loss, count, metrics), everywhere)

    def reduce(path, g, like, spec):
        if fp8_lib.is_history(path):
            axes = tuple(dict.fromkeys(a for a in (*everywhere, *amax_axes)
                                       if a not in spec_axes(spec)))
            return jax.lax.pmax(g, axes) if axes else g
        axes = tuple(a for a in everywhere if a not in spec_axes(spec))
        g = jax.lax.psum(g, axes) if axes else g
        return (g / count).astype(jnp.promote_types(like.dtype, jnp.float32))

    grads = jax.tree_util.tree_map_with_path(reduce, grads, params, specs)
    return loss / count, grads, metrics, count


def wide_zeros(tree):
    """Accumulators shaped like `tree`, in at least fp32 (small bf16 deltas are kept)."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32)),
                        tree)


def stage_layer_split(num_units: int, num_stages: int, stage_layer_counts=None
                      ) -> tuple[int, ...]:
    """Layer units per stage: `stage_layer_counts`, or an even split when it is None."""
    if num_units < num_stages:
        raise ValueError(
            f"layers: the model has {num_units} layers but the pipeline has {num_stages} "
            "stages; use a pipeline mesh axis of at most the number of layers")
    if stage_layer_counts is None:
        if num_units % num_stages:
            raise ValueError(
                f"layers: {num_units} layers do not split evenly over {num_stages} stages; "
                "pass stage_layer_counts (e.g. from gendist.parallel.pipeline.partition)")
        return (num_units // num_stages,) * num_stages
    counts = tuple(int(c) for c in stage_layer_counts)
    if len(counts) != num_stages or min(counts) < 1 or sum(counts) != num_units:
        raise ValueError(
            f"stage_layer_counts={counts} must give each of the {num_stages} stages at least "
            f"one layer and sum to the {num_units} layers")
    return counts


def chunk_layer_split(num_units: int, num_stages: int, num_chunks: int = 1,
                      stage_layer_counts=None) -> tuple[int, ...]:
    """Layer units per (virtual) stage: `stage_layer_split` for one chunk per device; an
    even split over `num_stages` x `num_chunks` chunks for an interleaved schedule."""
    if num_chunks == 1:
        return stage_layer_split(num_units, num_stages, stage_layer_counts)
    if stage_layer_counts is not None:
        raise ValueError(f"stage_layer_counts={tuple(stage_layer_counts)} with "
                         f"train.pipeline_chunks={num_chunks}: interleaved chunks take an even "
                         "split; drop the stage layer counts (train.pipeline_stage_layers)")
    chunks = num_stages * num_chunks
    if num_units % chunks:
        raise ValueError(
            f"train.pipeline_chunks={num_chunks}: {num_units} layers do not split into "
            f"{num_stages} stages x {num_chunks} chunks; use a chunk count such that stages "
            "x chunks divides the layers")
    return (num_units // chunks,) * chunks


def stage_layout(counts: tuple[int, ...], num_devices: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The layers in the executor's layout: `gather` picks each device's layers and
    `inverse` brings gradients back to [L].

    Uneven splits: a [p * max_count] layout, each stage's slice padded with layer 0 (which
    a mask skips). Interleaved (`num_devices` < len(counts), counts equal): device d holds
    the chunks of stages d, d + p, ... one after the other (Megatron's assignment), so that
    the layers' leading axis split over `pipeline` gives each device its chunks."""
    devices = num_devices or len(counts)
    if devices < len(counts):
        if len(set(counts)) != 1 or len(counts) % devices:
            raise ValueError(f"stage_layer_counts={counts}: interleaved chunks take an even "
                             f"split over a multiple of the {devices} devices")
        n, v = counts[0], len(counts) // devices
        stages = [c * devices + d for d in range(devices) for c in range(v)]
        gather = (np.asarray(stages)[:, None] * n + np.arange(n)[None, :]).ravel()
        return gather, np.argsort(gather)
    maxc = max(counts)
    starts = np.cumsum((0,) + counts[:-1])
    valid = np.arange(maxc)[None, :] < np.asarray(counts)[:, None]
    gather = np.where(valid, starts[:, None] + np.arange(maxc)[None, :], 0).ravel()
    return gather, np.flatnonzero(valid.ravel())


def chunk_of(tree, chunk, num_chunks: int):
    """A device's layers [v * n, ...] -> those of its `chunk` (traced) [n, ...]."""
    if num_chunks == 1:
        return tree
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(
        a.reshape(num_chunks, -1, *a.shape[1:]), chunk, 0, keepdims=False), tree)


def with_chunk(tree, part, chunk, num_chunks: int):
    """`tree` [v * n, ...] with its `chunk` replaced by `part` [n, ...] (in place)."""
    if num_chunks == 1:
        return part
    return jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(
        a.reshape(num_chunks, -1, *a.shape[1:]), b.astype(a.dtype), chunk, 0).reshape(a.shape),
        tree, part)


def microbatches(x_B, m: int):
    """[B, ...] -> [m, B/m, ...] (this device's rows, cut into m contiguous microbatches)."""
    return x_B.reshape(m, x_B.shape[0] // m, *x_B.shape[1:])
