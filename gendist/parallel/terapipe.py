"""TeraPipe (Li et al. 2021): pipelining the tokens of each sequence through the stages.

A causal transformer's token t depends only on tokens <= t, so a sequence can be cut into
slices that flow through the stages one after another, like microbatches: slice j at
stage s runs once slice j-1 is done there and attends to the K/V that the earlier slices
left in that stage's cache. All forwards run first, then all backwards in reverse slice
order, because the backward of slice j also yields gradients for the cached K/V of the
slices before it; each stage adds them to a K/V-gradient buffer that the backward of those
slices reads. The slice sizes come from TeraPipe's dynamic programme over measured costs
(a slice costs more the longer its context), against equal slices as the baseline.

Like `pipeline.py`, one `shard_map` over `pipeline` walks a static table with one
`lax.switch` and two `ppermute`s per step; here a branch is (kind, role, slice), so every
slice runs at its exact shape and context length (activations travel padded to the
longest slice). The block math is `block_forward` of gendist's transformer, whose
`cache.attend` hook lets a slice attend to its stage's cached K/V with positions.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gendist.models.attention import xla_attention
from gendist.models.transformer import DTYPES, block_forward
from gendist.parallel import pipeline as pl
from gendist.parallel import pipeline_model as pm
from gendist.parallel import schedule as sched_lib


def terapipe_schedule(num_stages: int, num_slices: int) -> sched_lib.Schedule:
    """All forwards in slice order, then all backwards in reverse slice order."""
    F, B = sched_lib.FORWARD, sched_lib.BACKWARD
    order = [(F, j) for j in range(num_slices)] + [(B, j) for j in reversed(range(num_slices))]
    return sched_lib.from_stage_orders([list(order) for _ in range(num_stages)], num_slices,
                                       "terapipe")


def check_slices(slices, seq_len: int) -> tuple[int, ...]:
    """Slice lengths as a tuple; they must be positive and sum to the sequence length."""
    out = tuple(int(s) for s in slices)
    if not out or min(out) < 1 or sum(out) != seq_len:
        raise ValueError(f"slices={out} must be positive token counts summing to the sequence "
                         f"length {seq_len}; e.g. equal_slices({seq_len}, k)")
    return out


def equal_slices(seq_len: int, num_slices: int) -> tuple[int, ...]:
    """The baseline: num_slices slices as equal as integers allow (longer ones first)."""
    if not 1 <= num_slices <= seq_len:
        raise ValueError(f"num_slices={num_slices} must be in [1, seq_len={seq_len}]")
    q, r = divmod(seq_len, num_slices)
    return tuple(q + (j < r) for j in range(num_slices))


@dataclasses.dataclass(frozen=True)
class _SliceContext:
    """The `cache` block_forward attends through: this stage's K/V of the earlier slices.

    `layer_state` is (k, v) of positions [0, c); the slice's own keys follow them, so key
    index = absolute position and xla_attention's causal mask by positions is exact.
    Returns the slice's own K/V as the new layer state.
    """

    def attend(self, layer_state, q_BTNH, k_BTKH, v_BTKH, q_pos_BT, sm_scale):
        k_ctx, v_ctx = layer_state
        k_BSKH = jnp.concatenate([k_ctx.astype(k_BTKH.dtype), k_BTKH], axis=1)
        v_BSKH = jnp.concatenate([v_ctx.astype(v_BTKH.dtype), v_BTKH], axis=1)
        kv_len_B = jnp.full((q_BTNH.shape[0],), k_BSKH.shape[1], jnp.int32)
        out = xla_attention(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, kv_len_B, sm_scale)
        return out, (k_BTKH, v_BTKH)


def terapipe_loss_and_grads(cfg, params: dict, batch: dict, *, mesh, slices,
                            batch_axes=pm.BATCH_AXES, bubble_value: float = 0.0):
    """Mean next-token loss and model-shaped grads of gendist's transformer, TeraPipe-style.

    `cfg` is a gendist Config; `slices` are token counts summing to the sequence length.
    Equals `jax.value_and_grad(gendist.train.loss_fn)` for any slicing. Jit from outside.
    """
    model = cfg.model
    fns = pm.model_fns(model)
    stage_params = pm.to_stage_params(model, params)
    tokens, targets = batch["inputs"], batch["targets"]
    if tokens.shape != targets.shape or tokens.ndim != 2:
        raise ValueError(f"batch: inputs {tokens.shape} and targets {targets.shape} must both "
                         "be [batch, seq]")
    slices = check_slices(slices, tokens.shape[1])
    p = mesh.shape[pl.PIPELINE]
    counts = pl.stage_layer_split(model.num_layers, p)
    sched = terapipe_schedule(p, len(slices))
    batch_axes = tuple(a for a in batch_axes if a in mesh.axis_names)
    shards = int(np.prod([mesh.shape[a] for a in batch_axes]))
    if tokens.shape[0] % shards:
        raise ValueError(f"batch: {tokens.shape[0]} sequences do not split over the {shards} "
                         f"shards of {batch_axes}; use a multiple of {shards}")
    body = functools.partial(_body, cfg=model, sched=sched, slices=slices,
                             layers_per_stage=counts[0], fns=fns, batch_axes=batch_axes,
                             bubble_value=bubble_value)
    spec = P(batch_axes if batch_axes else None)
    fn = pl._shard_map(body, mesh=mesh, in_specs=(P(), P(pl.PIPELINE), P(), spec, spec),
                       out_specs=(P(), (P(), P(pl.PIPELINE), P())),
                       axis_names=frozenset({pl.PIPELINE, *batch_axes}), **pl._NO_CHECK)
    loss, (d_e, d_l, d_h) = fn(stage_params["embed"], stage_params["layers"],
                               stage_params["head"], tokens, targets)
    return loss, pm.from_stage_grads(model, {"embed": d_e, "layers": d_l, "head": d_h})


def slice_forward(cfg, lp, x_BLD, kv_ctx, c: int):
    """A stage's layers on one slice at positions [c, c + L), attending to kv_ctx's [0, c).

    kv_ctx [2, layers, B, c, K, H]; returns (y_BLD, the slice's K/V [2, layers, B, L, K, H]).
    """
    B, L = x_BLD.shape[:2]
    pos_BL = jnp.broadcast_to(c + jnp.arange(L, dtype=jnp.int32), (B, L))

    def one(x, layer):
        lpl, kc, vc = layer
        x, (k, v) = block_forward(lpl, x, pos_BL, cfg, cache=_SliceContext(), layer_state=(kc, vc))
        return x, jnp.stack([k, v])
    y_BLD, kv_new = jax.lax.scan(one, x_BLD, (lp, kv_ctx[0], kv_ctx[1]))
    return y_BLD, jnp.moveaxis(kv_new, 1, 0)


def _stage_branches(cfg, slices, fns, fill):
    """{(kind, role, slice): f(w, kv, gkv, x, g, tok, tgt)}, each at the slice's own shape.

    kv / gkv [2, layers, B, T, K, H]: this stage's K/V cache and the gradient arriving for
    it from later slices. Returns (d_embed, d_layers, d_head, loss, count, kv, gkv, act, cot).
    """
    starts = np.cumsum((0,) + slices[:-1])
    width = fill().shape[1]
    pad = lambda x: jnp.pad(x, ((0, 0), (0, width - x.shape[1]), (0, 0)))
    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
    kv_cols = lambda kv, a, b: jax.lax.slice_in_dim(kv, a, b, axis=3)

    stage_fwd = functools.partial(slice_forward, cfg)

    def make(kind, role, j):
        c, n = int(starts[j]), slices[j]
        first, last = role in ("first", "only"), role in ("last", "only")

        def apply(e, lp, hp, x, kv_ctx, tok, tgt):
            x = fns["embed_fn"](e, tok[:, c:c + n]) if first else x[:, :n]
            y, kv_new = stage_fwd(lp, x, kv_ctx, c)
            if last:
                loss, count = fns["head_loss_fn"](hp, y, tgt[:, c:c + n])
                return (loss, kv_new), count
            return (y, kv_new), 0

        def forward(w, kv, gkv, x, g, tok, tgt):
            e, lp, hp = w
            xs = fns["embed_fn"](e, tok[:, c:c + n]) if first else x[:, :n]
            y, kv_new = stage_fwd(lp, xs, kv_cols(kv, 0, c), c)
            kv = jax.lax.dynamic_update_slice_in_dim(kv, kv_new.astype(kv.dtype), c, axis=3)
            act = fill() if last else pad(y)
            return (*zeros(w), jnp.float32(0), jnp.float32(0), kv, gkv, act, fill())

        def backward(w, kv, gkv, x, g, tok, tgt):
            kv_ctx = kv_cols(kv, 0, c)
            (out, _), vjp, count = jax.vjp(
                lambda e, lp, hp, x, kvc: apply(e, lp, hp, x, kvc, tok, tgt), *w, x, kv_ctx,
                has_aux=True)
            seed = jnp.ones_like(out) if last else g[:, :n]
            d_e, d_l, d_h, d_x, d_kv = vjp((seed, kv_cols(gkv, c, c + n).astype(kv.dtype)))
            gkv = gkv.at[:, :, :, :c].add(d_kv.astype(gkv.dtype))
            loss = out if last else jnp.float32(0)
            return (d_e, d_l, d_h, jnp.asarray(loss, jnp.float32), jnp.asarray(count, jnp.float32),
                    kv, gkv, fill(), fill() if first else d_x)

        return forward if kind == sched_lib.FORWARD else backward

    def idle(w, kv, gkv, x, g, tok, tgt):
        return (*zeros(w), jnp.float32(0), jnp.float32(0), kv, gkv, fill(), fill())

    return make, idle


def _body(embed, layers, head, tokens, targets, *, cfg, sched, slices, layers_per_stage, fns,
          batch_axes, bubble_value):
    """Per device: scan over the table; the K/V cache and its gradient stay on the stage."""
    p = sched.num_stages
    stage = jax.lax.axis_index(pl.PIPELINE)
    dt = DTYPES[cfg.dtype]
    B, T = tokens.shape
    fill = lambda: jnp.full((B, max(slices), cfg.d_model), bubble_value, dt)
    make, idle = _stage_branches(cfg, slices, fns, fill)
    roles = ["only"] if p == 1 else ["first"] + ["mid"] * (p - 2) + ["last"]
    keys = sorted({(int(sched.kind[t, s]), roles[s], int(sched.microbatch[t, s]))
                   for t, s in itertools.product(range(sched.num_steps), range(p))})
    index = {key: i for i, key in enumerate(keys)}
    table = np.array([[index[(int(sched.kind[t, s]), roles[s], int(sched.microbatch[t, s]))]
                       for s in range(p)] for t in range(sched.num_steps)], np.int32)
    branch_fns = [idle if kd == sched_lib.IDLE else make(kd, r, j) for kd, r, j in keys]
    plan = sched_lib.buffer_plan(sched)
    w = (embed, layers, head)

    def step(carry, row):
        kv, gkv, act_buf, cot_buf, recv_act, recv_cot, acc = carry
        branch, slot, act_slot, cot_slot = (r[stage] for r in row)
        act_buf = jax.lax.dynamic_update_index_in_dim(act_buf, recv_act, act_slot, 0)
        cot_buf = jax.lax.dynamic_update_index_in_dim(cot_buf, recv_cot, cot_slot, 0)
        *deltas, kv, gkv, send_act, send_cot = jax.lax.switch(
            branch, branch_fns, w, kv, gkv, act_buf[slot], cot_buf[slot], tokens, targets)
        acc = jax.tree.map(lambda a, d: a + d.astype(a.dtype), acc, tuple(deltas))
        if p > 1:
            send_act = jax.lax.ppermute(send_act, pl.PIPELINE, [(s, s + 1) for s in range(p - 1)])
            send_cot = jax.lax.ppermute(send_cot, pl.PIPELINE, [(s + 1, s) for s in range(p - 1)])
        return (kv, gkv, act_buf, cot_buf, send_act, send_cot, acc), None

    kv0 = jnp.zeros((2, layers_per_stage, B, T, cfg.num_kv_heads, cfg.head_dim), dt)
    buf = jnp.full((plan.num_slots + 1, *fill().shape), bubble_value, dt)
    wide = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)
    acc0 = (wide(embed), wide(layers), wide(head), jnp.float32(0), jnp.float32(0))
    rows = tuple(jnp.asarray(a) for a in (table, plan.slot, plan.recv_act_slot,
                                           plan.recv_cot_slot))
    carry = (kv0, jnp.zeros(kv0.shape, jnp.float32), buf, buf, fill(), fill(), acc0)
    (*_, acc), _ = jax.lax.scan(step, carry, rows)
    return pl.mean_loss_and_grads(acc, (embed, layers, head), batch_axes)


# --- slice sizes: TeraPipe's dynamic programme (Li et al. 2021, section 3.3) -------------

def slicing_latency(slices_units, cost: np.ndarray, num_stages: int) -> float:
    """Pipeline latency of a slicing: sum of slice times + (p-1) x the slowest slice.

    cost[l, c] is the time of a slice of l units after c units of context (the whole
    forward+backward of one stage); the first slice enters, the last one leaves p-1
    slice-times later behind the slowest one.
    """
    starts = np.cumsum((0,) + tuple(slices_units[:-1]))
    times = [cost[l, c] for l, c in zip(slices_units, starts, strict=True)]
    return float(sum(times) + (num_stages - 1) * max(times))


def plan_slices(cost: np.ndarray, num_stages: int) -> tuple[int, ...]:
    """Slice lengths (in cost units) minimising `slicing_latency`.

    For each candidate bound t_max on a slice's time, best[i] = the least total time of
    slicing the first i units with every slice <= t_max (a DP over the last slice); the
    answer is the t_max minimising best[n] + (p-1) t_max (TeraPipe's Algorithm 1).
    """
    cost = np.asarray(cost, np.float64)
    n = cost.shape[0] - 1
    if cost.ndim != 2 or cost.shape[1] < n or n < 1:
        raise ValueError(f"cost has shape {cost.shape}; give cost[l, c] for l in 0..n, c in 0..n-1")
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    cand = np.unique([cost[l, c] for l in range(1, n + 1) for c in range(n - l + 1)])
    best_total, best_slices = np.inf, None
    for t_max in cand:
        best = np.full(n + 1, np.inf)
        best[0] = 0.0
        last = np.zeros(n + 1, np.int64)
        for i in range(1, n + 1):
            ls = np.arange(1, i + 1)
            t = cost[ls, i - ls]
            total = np.where(t <= t_max, best[i - ls] + t, np.inf)
            j = int(np.argmin(total))
            best[i], last[i] = total[j], ls[j]
        if best[n] + (num_stages - 1) * t_max < best_total:
            best_total = best[n] + (num_stages - 1) * t_max
            out, i = [], n
            while i:
                out.append(int(last[i]))
                i -= out[-1]
            best_slices = tuple(out[::-1])
    return best_slices


def fit_slice_costs(cost: np.ndarray) -> np.ndarray:
    """Least-squares fit t(l, c) = a + b*l + d*l*(c + l/2) to measured costs (inf = absent).

    A fixed per-slice cost, per-token work, and attention of each token over its context
    and the earlier tokens of its slice. TeraPipe plans on such a fitted model; it also
    smooths timing noise out of the DP's input.
    """
    cost = np.asarray(cost, np.float64)
    l, c = np.nonzero(np.isfinite(cost))
    keep = l > 0
    l, c = l[keep], c[keep]
    feats = lambda l, c: np.stack([np.ones_like(l, dtype=np.float64), l, l * (c + l / 2)], -1)
    coef, *_ = np.linalg.lstsq(feats(l, c), cost[l, c], rcond=None)
    fitted = np.full_like(cost, np.inf)
    fitted[l, c] = feats(l, c) @ coef
    return fitted


def measure_slice_costs(cfg, layers: dict, batch: int, seq_len: int, granularity: int,
                        repeats: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """(cost[l, c], fwd[l, c]) in seconds: forward+backward, and the forward alone, of one
    stage's `layers` on a slice of l*granularity tokens after c*granularity tokens of cached
    context, timed on the device."""
    from gendist.parallel.partition import profile_fwd_bwd

    if seq_len % granularity:
        raise ValueError(f"granularity={granularity} must divide seq_len={seq_len}")
    n = seq_len // granularity
    dt = DTYPES[cfg.dtype]
    nl = jax.tree.leaves(layers)[0].shape[0]
    cost, fwd = np.full((n + 1, n + 1), np.inf), np.full((n + 1, n + 1), np.inf)
    for l, c in itertools.product(range(1, n + 1), range(n)):
        if l + c > n:
            continue
        x = jnp.ones((batch, l * granularity, cfg.d_model), dt)
        kv = jnp.ones((2, nl, batch, c * granularity, cfg.num_kv_heads, cfg.head_dim), dt)
        fn = lambda lp, x, kv, c=c: slice_forward(cfg, lp, x, kv, c * granularity)
        measured = profile_fwd_bwd(fn, layers, x, kv, repeats=repeats)
        cost[l, c], fwd[l, c] = measured.time_s, measured.fwd_time_s
    return cost, fwd
