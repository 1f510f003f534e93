"""TeraPipe (Li et al. 2021): pipelining the tokens of each sequence through the stages.

A causal transformer's token t depends only on tokens <= t, so a sequence can be cut into
slices that flow through the stages one after another, like microbatches: slice j at
stage s runs once slice j-1 is done there and attends to the K/V that the earlier slices
left in that stage's cache. All forwards run first, then all backwards in reverse slice
order, because the backward of slice j also yields gradients for the cached K/V of the
slices before it; each stage adds them to a K/V-gradient buffer that the backward of those
slices reads. The slice sizes come from TeraPipe's dynamic programme over measured costs
(a slice costs more the longer its context), against equal slices as the baseline.

The engine is the one executor (`core.run_table`): a branch per (kind, role, slice), so
every slice runs at its exact shape and context length (activations travel padded to the
longest slice), and the stage's K/V cache and K/V gradient are its extra carry. The layers
are the transformer's `run_layers` with a cache (`SliceCache`) whose `attend` lets a slice
attend to its stage's cached K/V with positions; stage bodies are manual over every mesh
axis (`ManualOps`), so tensor parallelism splits the heads of the cache too.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gendist.models import transformer
from gendist.models.attention import xla_attention
from gendist.parallel.pipeline import core
from gendist.parallel.pipeline import model as stage_model
from gendist.parallel.pipeline import schedules as sched_lib
from gendist.parallel.pipeline.partition import profile_fwd_bwd
from gendist.parallel.pipeline.stages import Out, accumulate, accumulators
from gendist.sharding import rules_for


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SliceCache:
    """The cache a slice's layers attend through: this stage's K/V of the earlier slices.

    `kv` is (k, v), each [layers, B, c, K, H] for positions [0, c); the slice's own keys
    follow them, so key index = absolute position and the causal mask by positions is
    exact. After `run_layers`, `kv` holds the slice's own K/V.
    """

    kv: tuple

    def layer_state(self):
        return self.kv

    def with_layer_state(self, kv):
        return SliceCache(kv)

    def attend(self, layer_state, q_BTNH, k_BTKH, v_BTKH, q_pos_BT, sm_scale):
        k_ctx, v_ctx = layer_state
        k_BSKH = jnp.concatenate([k_ctx.astype(k_BTKH.dtype), k_BTKH], axis=1)
        v_BSKH = jnp.concatenate([v_ctx.astype(v_BTKH.dtype), v_BTKH], axis=1)
        kv_len_B = jnp.full((q_BTNH.shape[0],), k_BSKH.shape[1], jnp.int32)
        out = xla_attention(q_BTNH, k_BSKH, v_BSKH, q_pos_BT, kv_len_B, sm_scale)
        return out, (k_BTKH, v_BTKH)


def slice_forward(cfg, lp, x_BLD, kv_ctx, c: int, ops=None):
    """A stage's layers on one slice at positions [c, c + L), attending to kv_ctx's [0, c).

    `lp` is the stage's {'blocks': ...}; kv_ctx [2, layers, B, c, K, H]; returns (y_BLD, the slice's K/V [2, layers, B, L, K, H]).
    """
    B, L = x_BLD.shape[:2]
    pos_BL = jnp.broadcast_to(c + jnp.arange(L, dtype=jnp.int32), (B, L))
    ops = transformer.DEFAULT_OPS if ops is None else ops
    y_BLD, cache, _ = transformer.run_layers(lp, x_BLD, pos_BL, cfg, ops,
                                             cache=SliceCache((kv_ctx[0], kv_ctx[1])))
    return y_BLD, jnp.stack(cache.kv)


def terapipe_loss_and_grads(cfg, params: dict, batch: dict, *, mesh, slices,
                            bubble_value: float = 0.0, zero3: bool = False, rules=None):
    """Mean next-token loss and model-shaped grads of gendist's transformer, TeraPipe-style.

    `cfg` is a gendist Config; `slices` are token counts summing to the sequence length.
    Equals plain autodiff of the model's loss for any slicing. Jit from outside.
    Returns (loss, grads).
    """
    model = cfg.model
    tokens, targets = batch["inputs"], batch["targets"]
    if tokens.shape != targets.shape or tokens.ndim != 2:
        raise ValueError(f"batch: inputs {tokens.shape} and targets {targets.shape} must both "
                         "be [batch, seq]")
    slices = check_slices(slices, tokens.shape[1])
    st = stage_model.stage_setup(model, mesh, rules_for(cfg.mesh) if rules is None else rules,
                                 zero3=zero3)
    if len(set(st.counts)) > 1:
        raise ValueError(f"TeraPipe needs an even split of the layers: {st.counts}")
    if st.ops.sequence_parallel:
        raise ValueError("mesh.sequence_parallel with train.terapipe_slices: TeraPipe cuts the "
                         "sequence into slices itself; turn sequence parallelism off")
    if model.num_moe_layers:
        raise ValueError("model.moe_experts with train.terapipe_slices: TeraPipe runs dense "
                         "models; set model.moe_experts=0 or train.terapipe_slices=0")
    sched = terapipe_schedule(mesh.shape[core.PIPELINE], len(slices))
    shards = int(np.prod([mesh.shape[a] for a in st.batch_axes]))
    if tokens.shape[0] % shards:
        raise ValueError(f"batch: {tokens.shape[0]} sequences do not split over the {shards} "
                         f"shards of {st.batch_axes}; use a multiple of {shards}")
    w = stage_model.stage_weights(model, params)
    body = functools.partial(_body, cfg=model, ops=st.ops, sched=sched, slices=slices,
                             specs=st.specs, reduce_axes=(core.PIPELINE, *st.batch_axes),
                             bubble_value=bubble_value)
    spec = P(st.batch_axes if st.batch_axes else None)
    fn = core.manual(body, mesh, in_specs=(st.specs, spec, spec),
                     out_specs=(P(), st.specs), axes=st.manual_axes)
    loss, grads = fn(w, tokens, targets)
    return loss, stage_model.model_grads(model, grads)


def _branches(cfg, ops, slices, fill, w, tokens, targets):
    """(make(kind, role, j), idle): branches f(extra, x, g, row) at each slice's shape.

    extra = (kv, gkv, acc): this stage's K/V cache [2, layers, B, T, K, H], the gradient
    arriving for it from later slices, and the (grads, loss, count, metrics) accumulators.
    """
    starts = np.cumsum((0,) + slices[:-1])
    width = fill.shape[1]
    pad = lambda x: jnp.pad(x, ((0, 0), (0, width - x.shape[1]), (0, 0)))
    kv_cols = lambda kv, a, b: jax.lax.slice_in_dim(kv, a, b, axis=3)
    embed = lambda e, tok: transformer.embed(e, tok, cfg, ops)
    layers = lambda lp, x, kv_ctx, c: slice_forward(cfg, lp, x, kv_ctx, c, ops)
    head_loss = lambda hp, y, tgt: transformer.head_loss(hp, y, tgt, cfg, ops)

    def make(kind, role, j):
        c, n = int(starts[j]), slices[j]
        first, last = role in ("first", "only"), role in ("last", "only")
        tok, tgt = tokens[:, c:c + n], targets[:, c:c + n]

        def apply(e, lp, hp, x, kv_ctx):
            x = embed(e, tok) if first else x[:, :n]
            y, kv_new = layers(lp, x, kv_ctx, c)
            if last:
                loss, count = head_loss(hp, y, tgt)
                return (loss, kv_new), count
            return (y, kv_new), 0

        def forward(extra, x, g, row):
            kv, gkv, acc = extra
            (y, kv_new), _ = apply(*w, x, kv_cols(kv, 0, c))
            kv = jax.lax.dynamic_update_slice_in_dim(kv, kv_new.astype(kv.dtype), c, axis=3)
            return (kv, gkv, acc), (fill if last else pad(y)), fill

        def backward(extra, x, g, row):
            kv, gkv, acc = extra
            (out, _), vjp, count = jax.vjp(apply, *w, x, kv_cols(kv, 0, c), has_aux=True)
            seed = jnp.ones_like(out) if last else g[:, :n]
            d_e, d_l, d_h, d_x, d_kv = vjp((seed, kv_cols(gkv, c, c + n).astype(kv.dtype)))
            gkv = gkv.at[:, :, :, :c].add(d_kv.astype(gkv.dtype))
            acc = accumulate(acc, Out(grads=(d_e, d_l, d_h), loss=out if last else None,
                                      count=count if last else None))
            return (kv, gkv, acc), fill, (fill if first else d_x)

        return forward if kind == sched_lib.FORWARD else backward

    def idle(extra, x, g, row):
        return extra, fill, fill

    return make, idle


def _body(w, tokens, targets, *, cfg, ops, sched, slices, specs, reduce_axes, bubble_value):
    """Per device: the executor's table; the K/V cache and its gradient stay on the stage."""
    dt = transformer.compute_dtype(cfg)
    B, T = tokens.shape
    wk = w[1]["blocks"]["wk"]  # [stage layers, D, local kv heads, H]
    kv_shape = (2, wk.shape[0], B, T, wk.shape[2], cfg.head_dim)
    fill = jnp.full((B, max(slices), cfg.d_model), bubble_value, dt)
    make, idle = _branches(cfg, ops, slices, fill, w, tokens, targets)
    table, keys = core.branch_table(sched, lambda kind, role, mb, s: (kind, role, mb))
    branch_fns = [idle if kd == sched_lib.IDLE else make(kd, r, j) for kd, r, j in keys]
    kv0 = jnp.zeros(kv_shape, dt)
    extra = (kv0, jnp.zeros(kv0.shape, jnp.float32), accumulators(w, ()))
    _, _, acc = core.run_table(sched, table, branch_fns, extra, act_shape=fill.shape,
                               act_dtype=dt, fill_value=bubble_value)
    loss, grads, _, _ = core.finish(acc, w, specs, reduce_axes)
    return loss, grads


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
    if seq_len % granularity:
        raise ValueError(f"granularity={granularity} must divide seq_len={seq_len}")
    n = seq_len // granularity
    dt = transformer.compute_dtype(cfg)
    nl = jax.tree.leaves(layers)[0].shape[0]
    cost, fwd = np.full((n + 1, n + 1), np.inf), np.full((n + 1, n + 1), np.inf)
    for l, c in itertools.product(range(1, n + 1), range(n)):
        if l + c > n:
            continue
        x = jnp.ones((batch, l * granularity, cfg.d_model), dt)
        kv = jnp.ones((2, nl, batch, c * granularity, cfg.num_kv_heads, cfg.head_dim), dt)
        fn = lambda lp, x, kv, c=c: slice_forward(cfg, {"blocks": lp}, x, kv, c * granularity)
        measured = profile_fwd_bwd(fn, layers, x, kv, repeats=repeats)
        cost[l, c], fwd[l, c] = measured.time_s, measured.fwd_time_s
    return cost, fwd
