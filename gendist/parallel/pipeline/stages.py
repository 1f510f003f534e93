"""A model as a pipeline runs it, and what one stage does in a forward or a backward step.

The executor (`core.run_table`) is generic; a model enters it as `StageFns` over stage
weights w = (embed, layers, head): the embedding (stage 0), a contiguous slice of the
layer stack (every stage), the head and loss (the last stage). `computations` turns them
into one function per (kind, role) that an engine wraps into its branches:

    compute(w, x, g, tokens, targets) -> Out(grads, loss, count, metrics, act, cot)

A backward step recomputes the stage's forward from its stored input under `jax.vjp`, so
a stage stores one activation per in-flight microbatch (p for 1F1B, m for GPipe); the last
stage keeps its input and does all its work in the backward step. Layers may return a
differentiable auxiliary loss (MoE router losses, already scaled to the microbatch's
tokens) that joins the objective, and metrics that are summed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gendist.parallel import schedule as sched_lib
from gendist.parallel.pipeline import core


@dataclasses.dataclass(frozen=True)
class StageFns:
    """embed(embed_w, tokens_bT) -> x; layers(layers_w, x, stage) -> (y, aux_loss, metrics);
    head_loss(head_w, x, targets_bT) -> (loss_sum, count). `metrics` is a pytree of zeros
    shaped like what `layers` reports (() when nothing).

    `stage` is static: None when every stage runs all of its layers (an even split), else
    the stage whose branch is being built, which runs only its own first `counts[stage]`
    units of the padded stack (no masked padding layers, so an uneven split pays nothing
    for the padding in either pass)."""

    embed: Callable
    layers: Callable
    head_loss: Callable
    metrics: Any = ()


def own_units(tree, counts: tuple[int, ...], stage: int | None, unit_sizes=None):
    """A stage's real units of its padded slice (static): everything when `stage` is None."""
    if stage is None:
        return tree
    n = counts[stage]
    sizes = jax.tree.map(lambda _: 1, tree) if unit_sizes is None else unit_sizes
    return jax.tree.map(lambda a, k: a[:n * k], tree, sizes)


def from_layer_fn(embed_fn, layer_fn, head_loss_fn, counts: tuple[int, ...]) -> StageFns:
    """StageFns for a model given per layer: `layer_fn(layer_w, x) -> x`, scanned over the
    stage's own layers."""
    def layers(lp, x, stage):
        lp = own_units(lp, counts, stage)
        return jax.lax.scan(lambda x, l: (layer_fn(l, x), None), x, lp)[0], jnp.float32(0), ()

    return StageFns(embed_fn, layers, head_loss_fn)


class Out(NamedTuple):
    """What one action yields; None where it yields nothing (an engine adds the rest)."""

    grads: tuple | None = None  # (d_embed, d_layers, d_head), entries None if untouched
    loss: Any = None  # summed objective (+ auxiliary losses) of this microbatch's tokens
    count: Any = None  # tokens it covered (the last stage)
    metrics: Any = None
    act: Any = None  # activation for stage s + 1
    cot: Any = None  # cotangent for stage s - 1


def computations(fns: StageFns, stage: int | None = None) -> dict[tuple[int, str], Callable]:
    """{(kind, role): compute(w, x, g, tok, tgt) -> Out} for every kind and role, running
    the layers of `stage` (None: the stage's whole slice; see StageFns)."""
    one = jnp.float32(1)
    layers_fn = fns.layers
    fns = dataclasses.replace(fns, layers=lambda lp, x: layers_fn(lp, x, stage))

    def idle(w, x, g, tok, tgt):
        return Out()

    def fwd_first(w, x, g, tok, tgt):
        return Out(act=fns.layers(w[1], fns.embed(w[0], tok))[0])

    def fwd_mid(w, x, g, tok, tgt):
        return Out(act=fns.layers(w[1], x)[0])

    def bwd_first(w, x, g, tok, tgt):
        def f(e, lp):
            y, aux, metrics = fns.layers(lp, fns.embed(e, tok))
            return (y, aux), metrics
        (_, aux), vjp, metrics = jax.vjp(f, w[0], w[1], has_aux=True)
        d_e, d_l = vjp((g, one))
        return Out(grads=(d_e, d_l, None), loss=aux, metrics=metrics)

    def bwd_mid(w, x, g, tok, tgt):
        def f(lp, x):
            y, aux, metrics = fns.layers(lp, x)
            return (y, aux), metrics
        (_, aux), vjp, metrics = jax.vjp(f, w[1], x, has_aux=True)
        d_l, d_x = vjp((g, one))
        return Out(grads=(None, d_l, None), loss=aux, metrics=metrics, cot=d_x)

    def bwd_last(w, x, g, tok, tgt):
        def f(lp, hp, x):
            y, aux, metrics = fns.layers(lp, x)
            loss, count = fns.head_loss(hp, y, tgt)
            return loss + aux, (count, metrics)
        loss, vjp, (count, metrics) = jax.vjp(f, w[1], w[2], x, has_aux=True)
        d_l, d_h, d_x = vjp(jnp.ones_like(loss))
        return Out((None, d_l, d_h), loss, count, metrics, cot=d_x)

    def bwd_only(w, x, g, tok, tgt):
        def f(e, lp, hp):
            y, aux, metrics = fns.layers(lp, fns.embed(e, tok))
            loss, count = fns.head_loss(hp, y, tgt)
            return loss + aux, (count, metrics)
        loss, vjp, (count, metrics) = jax.vjp(f, *w, has_aux=True)
        return Out(vjp(jnp.ones_like(loss)), loss, count, metrics)

    F, B = sched_lib.FORWARD, sched_lib.BACKWARD
    return ({(sched_lib.IDLE, r): idle for r in core.ROLES}
            | {(F, "first"): fwd_first, (F, "mid"): fwd_mid, (F, "last"): idle,
               (F, "only"): idle, (B, "first"): bwd_first, (B, "mid"): bwd_mid,
               (B, "last"): bwd_last, (B, "only"): bwd_only})


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
        grads = tuple(a if d is None else jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, d)
                      for a, d in zip(grads, new, strict=True))
    if out.loss is not None:
        loss = loss + out.loss
    if out.count is not None:
        count = count + out.count
    if out.metrics is not None:
        metrics = jax.tree.map(lambda a, b: a + b, metrics, out.metrics)
    return grads, loss, count, metrics


# --- no recomputation: a stage keeps its forward's residuals until the backward -----------


class ResidualPlan(NamedTuple):
    """How a stage's `layers` vjp is kept between its forward and backward steps.

    `treedef` rebuilds the vjp function from its leaves; `weight_index[i]` says which leaf
    of the stage weights leaf i is (-1: an activation residual, kept in the buffers, whose
    shapes are `shapes`). Weights are never copied into the buffers: the backward takes them
    from the stage's weights, which a synchronous schedule does not change.
    """

    treedef: Any
    weight_index: tuple[int, ...]
    shapes: list


def _layers_vjp_fn(fns: StageFns):
    """The layers (an even split: every stage runs its whole slice) as a vjp-able function
    with the metrics as its auxiliary output."""
    def f(lp, x):
        y, aux, metrics = fns.layers(lp, x, None)
        return (y, aux), metrics
    return f


def residual_plan(fns: StageFns, lp, x) -> ResidualPlan:
    """Traces the stage's layers once (no computation) to learn its residuals."""
    box = {}

    def probe(lp, x):
        _, vjp, _ = jax.vjp(_layers_vjp_fn(fns), lp, x, has_aux=True)
        leaves, box["treedef"] = jax.tree.flatten(vjp)
        weights = jax.tree.leaves(lp)
        box["index"] = tuple(next((i for i, w in enumerate(weights) if w is leaf), -1)
                             for leaf in leaves)
        return [leaf for leaf, i in zip(leaves, box["index"], strict=True) if i < 0]

    shapes = jax.eval_shape(probe, lp, x)
    return ResidualPlan(box["treedef"], box["index"], shapes)


def saved_computations(fns: StageFns, plan: ResidualPlan) -> dict[tuple[int, str], Callable]:
    """{(kind, role): compute(w, x, g, tok, tgt, res) -> (Out, residuals to keep or None)}.

    Forward steps of the first and middle stages run the layers under `jax.vjp` and hand
    back its activation residuals (their losses and metrics count here); the backward steps
    read them back (`res`) and apply the vjp, so nothing is recomputed. The last stage
    still runs its forward and backward in one step, as in `computations`.
    """
    layers_vjp = _layers_vjp_fn(fns)
    plain = computations(fns, None)
    one = jnp.float32(1)

    def keep(vjp):
        leaves = jax.tree.leaves(vjp)
        return [leaf for leaf, i in zip(leaves, plan.weight_index, strict=True) if i < 0]

    def rebuild(lp, res):
        weights, stored = jax.tree.leaves(lp), iter(res)
        leaves = [weights[i] if i >= 0 else next(stored) for i in plan.weight_index]
        return jax.tree.unflatten(plan.treedef, leaves)

    def forward(first):
        def compute(w, x, g, tok, tgt, res):
            x = fns.embed(w[0], tok) if first else x
            (y, aux), vjp, metrics = jax.vjp(layers_vjp, w[1], x, has_aux=True)
            return Out(loss=aux, metrics=metrics, act=y), keep(vjp)
        return compute

    def backward(first):
        def compute(w, x, g, tok, tgt, res):
            d_l, d_x = rebuild(w[1], res)((g, one))
            if not first:
                return Out(grads=(None, d_l, None), cot=d_x), None
            _, embed_vjp = jax.vjp(lambda e: fns.embed(e, tok), w[0])
            return Out(grads=(embed_vjp(d_x)[0], d_l, None)), None
        return compute

    def unchanged(compute):
        return lambda w, x, g, tok, tgt, res: (compute(w, x, g, tok, tgt), None)

    F, B = sched_lib.FORWARD, sched_lib.BACKWARD
    out = {k: unchanged(c) for k, c in plain.items()}
    out |= {(F, "first"): forward(True), (F, "mid"): forward(False),
            (B, "first"): backward(True), (B, "mid"): backward(False)}
    return out
