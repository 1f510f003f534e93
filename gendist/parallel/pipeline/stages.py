"""A model as a pipeline runs it, and what one stage does in a forward or backward step.

The executor (`core.run_table`) is generic; a model enters it as `StageFns` over stage
weights w = (embed, layers, head): the embedding (stage 0), a contiguous slice of the layer
stack (every stage), the head and loss (the last stage). The layers are given as a stack of
units (a layer, or an MoE group) and one unit's function, so that a stage can run its
units and differentiate them one at a time.

Two ways to run a backward step, each a table of functions per (kind, role):

* `saved_computations` (the synchronous engines): a forward step runs each unit under
  `jax.vjp` and keeps its residuals (the stage weights excluded: they do not change during
  a synchronous step) in the slot of the microbatch; the backward step applies the saved
  vjps, so no forward is recomputed - unless `model.remat` asks for it, in which case a
  unit's residual is its input. A schedule with weight steps (kind W, e.g. ZB-H1) splits
  the backward: B propagates the input gradient and keeps each unit's output cotangent, W
  later turns them into the weight gradients (Qi et al. 2024). The last stage keeps its
  output and runs the head in its backward step.
* `computations` (PipeDream, whose weights change between a microbatch's forward and
  backward): a backward step recomputes the stage's forward from its stored input, with
  the weight version the engine passes.

Units may return a differentiable auxiliary loss (MoE router losses, already scaled to the
microbatch's tokens) that joins the objective, and metrics that are summed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gendist.models import fp8 as fp8_lib
from gendist.parallel.pipeline import core
from gendist.parallel.pipeline import schedules as sched_lib


@dataclasses.dataclass(frozen=True)
class StageFns:
    """A model's stage functions.

    embed(embed_w, tokens_bT) -> x; unit(unit_w, x) -> (y, aux_loss, metrics);
    units(layers_w) -> unit weights stacked on one leading axis, from_units its inverse
    (for gradients); head_loss(head_w, x, targets_bT) -> (loss_sum, count). `metrics` is a
    pytree of zeros shaped like what `unit` reports (() when nothing); `counts` the units
    per stage (an uneven split pads every stage's slice to the longest: a stage's branches
    run only its own first `counts[stage]` units, so padding costs nothing); `unroll` the
    unroll of the scans over units.
    """

    embed: Callable
    unit: Callable
    head_loss: Callable
    counts: tuple[int, ...]
    units: Callable = staticmethod(lambda lp: lp)
    from_units: Callable = staticmethod(lambda g: g)
    metrics: Any = ()
    unroll: int = 1

    def own(self, lp, stage: int | None):
        """This stage's real units of its (padded) slice; all of them when `stage` is None."""
        u = self.units(lp)
        if stage is None or len(set(self.counts)) == 1:
            return u
        return jax.tree.map(lambda a: a[:self.counts[stage]], u)

    def layers(self, lp, x, stage: int | None):
        """(y, aux loss, metrics) of the stage's units, scanned."""
        def step(carry, pu):
            x, aux, metrics = carry
            y, a, m = self.unit(pu, x)
            return (y, aux + a, jax.tree.map(jnp.add, metrics, m)), None
        init = (x, jnp.float32(0), core.wide_zeros(self.metrics))
        units = self.own(lp, stage)
        n = jax.tree.leaves(units)[0].shape[0]
        return jax.lax.scan(step, init, units, unroll=max(1, min(self.unroll, n)))[0]

    def pad_grads(self, g_units, lp, stage: int | None):
        """Gradients of this stage's own units, zero-padded to its slice, in lp's layout."""
        full = self.units(lp)
        if stage is not None and len(set(self.counts)) > 1:
            g_units = jax.tree.map(
                lambda g, a: jnp.zeros(a.shape, g.dtype).at[:g.shape[0]].set(g), g_units, full)
        return self.from_units(g_units)


def from_layer_fn(embed_fn, layer_fn, head_loss_fn, counts: tuple[int, ...]) -> StageFns:
    """StageFns for a model given per layer: `layer_fn(layer_w, x) -> x` (a unit is a layer
    and the stacked layers are the units)."""
    return StageFns(embed_fn, lambda pu, x: (layer_fn(pu, x), jnp.float32(0), ()),
                    head_loss_fn, tuple(counts))


class Out(NamedTuple):
    """What one action yields; None where it yields nothing (an engine adds the rest)."""

    grads: tuple | None = None  # (d_embed, d_layers, d_head), entries None if untouched
    loss: Any = None  # summed objective (+ auxiliary losses) of this microbatch's tokens
    count: Any = None  # tokens it covered (the last stage)
    metrics: Any = None
    act: Any = None  # activation for stage s + 1
    cot: Any = None  # cotangent for stage s - 1


def _roles(role: str) -> tuple[bool, bool]:
    return role in ("first", "only"), role in ("last", "only")


# --- recomputing the forward in the backward (PipeDream) --------------------------------


def computations(fns: StageFns, stage: int | None = None) -> dict[tuple[int, str], Callable]:
    """{(kind, role): compute(w, x, g, tok, tgt) -> Out}: a backward step recomputes the
    stage's forward from its input under `jax.vjp`; the last stage does all its work in
    its backward step."""
    one = jnp.float32(1)

    def run(e, lp, x, tok, first):
        return fns.layers(lp, fns.embed(e, tok) if first else x, stage)

    def forward(w, x, g, tok, tgt, first):
        return Out(act=run(w[0], w[1], x, tok, first)[0])

    def backward(w, x, g, tok, tgt, first, last):
        if last:
            def f(e, lp, hp, x):
                y, aux, metrics = run(e, lp, x, tok, first)
                loss, count = fns.head_loss(hp, y, tgt)
                return loss + aux, (count, metrics)
            loss, vjp, (count, metrics) = jax.vjp(f, *w, x, has_aux=True)
            d_e, d_l, d_h, d_x = vjp(jnp.ones_like(loss))
            return Out((d_e if first else None, d_l, d_h), loss, count, metrics,
                       cot=None if first else d_x)

        def f(e, lp, x):
            y, aux, metrics = run(e, lp, x, tok, first)
            return (y, aux), metrics
        (_, aux), vjp, metrics = jax.vjp(f, w[0], w[1], x, has_aux=True)
        d_e, d_l, d_x = vjp((g, one))
        return Out((d_e if first else None, d_l, None), loss=aux, metrics=metrics,
                   cot=None if first else d_x)

    return _table(forward, backward, None, forward_last_idle=True,
                  idle=lambda *a, **k: Out())


def _table(forward, backward, weight, forward_last_idle: bool, idle):
    """{(kind, role): compute} from the per-kind functions (first/last flags bound)."""
    out = {(sched_lib.IDLE, r): idle for r in core.ROLES}
    for role in core.ROLES:
        first, last = _roles(role)
        if last and forward_last_idle:
            out[(sched_lib.FORWARD, role)] = idle
        else:
            out[(sched_lib.FORWARD, role)] = _bind(forward, first=first)
        out[(sched_lib.BACKWARD, role)] = _bind(backward, first=first, last=last)
        if weight is not None:
            out[(sched_lib.WEIGHT, role)] = weight
    return out


def _bind(fn, **kw):
    return lambda *args, **more: fn(*args, **kw, **more)


# --- keeping the forward's residuals (synchronous engines) -------------------------------


class UnitPlan(NamedTuple):
    """How one unit's vjp is kept between the forward and the backward.

    `treedef` rebuilds the vjp function from its leaves; `weight_index[i]` says which leaf
    of the unit's weights leaf i is (-1: an activation residual, kept in the buffers with
    shape `shapes`). Weights are never copied into the buffers.
    """

    treedef: Any
    weight_index: tuple[int, ...]
    shapes: list

    def keep(self, vjp) -> list:
        """The activation residuals of a unit's vjp function (its weights left out)."""
        return [leaf for leaf, i in zip(jax.tree.leaves(vjp), self.weight_index, strict=True)
                if i < 0]

    def rebuild(self, pu, res):
        """The unit's vjp function from its weights `pu` and kept residuals `res`."""
        weights, stored = jax.tree.leaves(pu), iter(res)
        leaves = [weights[i] if i >= 0 else next(stored) for i in self.weight_index]
        return jax.tree.unflatten(self.treedef, leaves)


def unit_vjp_fn(fns: StageFns):
    """A unit as the function `jax.vjp` takes: (weights, x) -> ((y, aux loss), metrics)."""
    def f(pu, x):
        y, aux, metrics = fns.unit(pu, x)
        return (y, aux), metrics
    return f


def unit_plan(fns: StageFns, lp, x) -> UnitPlan:
    """Traces one unit (no computation) to learn its residuals."""
    box = {}
    pu0 = jax.tree.map(lambda a: a[0], fns.units(lp))

    def probe(pu, x):
        _, vjp, _ = jax.vjp(unit_vjp_fn(fns), pu, x, has_aux=True)
        leaves, box["treedef"] = jax.tree.flatten(vjp)
        weights = jax.tree.leaves(pu)
        box["index"] = tuple(next((i for i, w in enumerate(weights) if w is leaf), -1)
                             for leaf in leaves)
        return [leaf for leaf, i in zip(leaves, box["index"], strict=True) if i < 0]

    shapes = jax.eval_shape(probe, pu0, x)
    return UnitPlan(box["treedef"], box["index"], shapes)


def slot_buffers(fns: StageFns, plan: UnitPlan, lp, x_spec, slots: int, split: bool) -> dict:
    """Zero buffers for `slots` microbatches: every unit's residuals, the stage output (the
    last stage's head input), and with split backwards every unit's output cotangent."""
    units = max(fns.counts)
    bufs = {"units": [jnp.zeros((slots, units, *s.shape), s.dtype) for s in plan.shapes],
            "y": jnp.zeros((slots, *x_spec.shape), x_spec.dtype)}
    if split:
        bufs["g"] = jnp.zeros((slots, units, *x_spec.shape), x_spec.dtype)
    return bufs


def saved_computations(fns: StageFns, plan: UnitPlan, stage: int | None, split: bool
                       ) -> dict[tuple[int, str], Callable]:
    """{(kind, role): compute(w, x, g, tok, tgt, res) -> (Out, kept or None)}.

    `res` reads this microbatch's slot of the buffers (`slot_buffers`); `kept` is what to
    write there. F runs the units under `jax.vjp` and keeps their residuals (and, on the
    last stage, its output); B applies them from the top unit down (on the last stage after
    the head's own vjp), keeping each unit's output cotangent when a W step follows (split)
    or producing the weight gradients at once (fused); W turns kept cotangents into the
    weight gradients. Losses and metrics of the layers count in F, the head's in B.
    """
    unit_vjp = unit_vjp_fn(fns)
    one = jnp.float32(1)
    keep, rebuild = plan.keep, plan.rebuild

    def own_res(res_units):
        if stage is None or len(set(fns.counts)) == 1:
            return res_units
        return [r[:fns.counts[stage]] for r in res_units]

    def forward(w, x, g, tok, tgt, res, first):
        x = fns.embed(w[0], tok) if first else x
        units = fns.own(w[1], stage)

        def step(carry, pu):
            x, aux, metrics = carry
            (y, a), vjp, m = jax.vjp(unit_vjp, pu, x, has_aux=True)
            return (y, aux + a, jax.tree.map(jnp.add, metrics, m)), keep(vjp)

        init = (x, jnp.float32(0), core.wide_zeros(fns.metrics))
        (y, aux, metrics), kept = jax.lax.scan(step, init, units)
        out = {"units": _pad_units(kept, max(fns.counts)), "y": y}
        return Out(loss=aux, metrics=metrics, act=y), out

    def backward(w, x, g, tok, tgt, res, first, last, split):
        units = fns.own(w[1], stage)
        loss = count = d_h = None
        if last:  # the head's forward and backward on the kept output
            f = lambda hp, y: fns.head_loss(hp, y, tgt)
            loss, vjp, count = jax.vjp(f, w[2], res["y"], has_aux=True)
            d_h, g = vjp(jnp.ones_like(loss))

        def step(g, pu_res):
            pu, r = pu_res
            d_p, d_x = rebuild(pu, r)((g, one))
            return d_x, (g if split else d_p)

        d_x, per_unit = jax.lax.scan(step, g, (units, own_res(res["units"])), reverse=True)
        d_l = None if split else fns.pad_grads(per_unit, w[1], stage)
        d_e = jax.vjp(lambda e: fns.embed(e, tok), w[0])[1](d_x)[0] if first else None
        out = Out((d_e, d_l, d_h), loss, count, cot=None if first else d_x)
        return out, ({"g": _pad_units(per_unit, max(fns.counts))} if split else None)

    def weight(w, x, g, tok, tgt, res):
        units = fns.own(w[1], stage)
        n = jax.tree.leaves(units)[0].shape[0]

        def step(_, pu_res_g):
            pu, r, gu = pu_res_g
            return None, rebuild(pu, r)((gu, one))[0]

        _, d_p = jax.lax.scan(step, None, (units, own_res(res["units"]), res["g"][:n]))
        return Out((None, fns.pad_grads(d_p, w[1], stage), None)), None

    return _table(forward, _bind(backward, split=split), weight if split else None,
                  forward_last_idle=False, idle=lambda *a, **k: (Out(), None))


def _pad_units(tree, units: int):
    """Per-unit values [n, ...] padded to the buffers' [max units, ...]."""
    def pad(a):
        if a.shape[0] == units:
            return a
        return jnp.zeros((units, *a.shape[1:]), a.dtype).at[:a.shape[0]].set(a)
    return jax.tree.map(pad, tree)


def accumulators(w, metrics):
    """Zero (grads, loss, count, metrics) accumulators for stage weights `w`."""
    zero = jnp.float32(0)
    return (core.wide_zeros(w), zero, zero, core.wide_zeros(metrics))


def accumulate(acc, out: Out, scale=None):
    """acc + what `out` carries (only its non-None parts, so idle steps add nothing).
    `scale(tree)` is applied to the gradients first (e.g. a psum for PipeDream)."""
    grads, loss, count, metrics = acc
    if out.grads is not None:
        new = tuple(None if d is None else d if scale is None else scale(d) for d in out.grads)
        grads = tuple(a if d is None else fp8_lib.accumulate(a, d)
                      for a, d in zip(grads, new, strict=True))
    if out.loss is not None:
        loss = loss + out.loss
    if out.count is not None:
        count = count + out.count
    if out.metrics is not None:
        metrics = jax.tree.map(lambda a, b: a + b, metrics, out.metrics)
    return grads, loss, count, metrics
