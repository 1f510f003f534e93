"""Gradient engines: (params, batch) -> (loss, metrics, grads), one per way of computing them.

`train.build` jits every training step around one of these; the config picks it
(`engine_for`):

    plain      autodiff of the model under the mesh's sharding annotations (data, tensor,
               sequence, ZeRO, expert parallelism)
    manual     the model as one per-device program with every collective written out
               (`train.tp_comm='collective'`: collective matmuls)
    pipeline   a synchronous schedule table (GPipe, 1F1B, ...) on the pipeline executor
    terapipe   token slices through the pipeline (train.terapipe_slices)
    pipedream  asynchronous: PipeDream with / without weight stashing, PipeDream-2BW; this
               engine updates the weights itself, microbatch by microbatch (`pipedream_update`)

Also here: the training loss itself (`loss_and_metrics`, and `loss_fn` on one device, the
oracle of every parallel form) and ZeRO's compute copy of the weights (`compute_params`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from gendist.config import Config
from gendist.models import transformer
from gendist.models.ops import DEFAULT_OPS, Ops
from gendist.parallel import zero
from gendist.parallel.mesh_ops import MeshOps
from gendist.parallel.pipeline import model as stage_model
from gendist.parallel.pipeline import schedules as sched_lib
from gendist.parallel.pipeline import terapipe
from gendist.training import dpo, fp8_scaling
from gendist.training.checks import ASYNC_SCHEDULES, pipedream_window, pipeline_microbatches


def cross_entropy(logits_BTV, targets_BT):
    """Mean next-token cross-entropy in fp32 (nats)."""
    return jnp.mean(DEFAULT_OPS.nll(logits_BTV, targets_BT))


def moe_metrics(aux: dict) -> dict:
    """Router metrics of a plain forward's aux dict."""
    load_E = jnp.sum(aux["moe_expert_load_GE"], axis=0)
    return {"moe_aux_loss": aux["moe_loss"], "moe_drop_fraction": aux["moe_drop_fraction"],
            "moe_expert_load": load_E,
            "moe_load_max_over_mean": jnp.max(load_E) / jnp.maximum(jnp.mean(load_E), 1e-9)}


def loss_and_metrics(cfg: Config, params, batch, ops: Ops = DEFAULT_OPS):
    """(training loss, metrics): the mean next-token cross-entropy plus, for MoE models,
    the weighted router losses; the metrics report the cross-entropy alone and the router
    statistics. `ops` places the computation (`MeshOps` inside a jitted step).
    train.objective=dpo: the DPO loss and its reward metrics (`gendist.training.dpo`)."""
    if cfg.train.objective == "dpo":
        return dpo.loss_and_metrics(cfg, params, batch, ops)
    logits, aux = transformer.forward_with_aux(cfg.model, params, batch["inputs"], ops)
    ce = jnp.mean(ops.nll(logits, batch["targets"]))
    if not aux:
        return ce, {}
    return ce + aux["moe_loss"], {"ce_loss": ce, **moe_metrics(aux)}


def loss_fn(cfg: Config, params, batch):
    """The training loss alone, on one device (the oracle of every parallel form)."""
    return loss_and_metrics(cfg, params, batch)[0]


def compute_params(cfg: Config, params: dict, axes: dict) -> dict:
    """ZeRO's compute copy of the fp32 master weights (call inside `use_mesh`).

    Stages 1-2 gather one copy (matrices in model.dtype) per step. Stage 3 gathers the
    embedding, final norm and head once and leaves the layers' weights sharded, for the
    layer scan to gather just in time.
    """
    stage = cfg.train.zero_stage
    dtype = transformer.compute_dtype(cfg.model)
    if stage in (1, 2):
        return zero.compute_copy(params, axes, dtype)
    if stage == 3:
        rest = {k: v for k, v in params.items() if k not in ("blocks", "moe_blocks")}
        return {**params, **zero.compute_copy(rest, {k: axes[k] for k in rest}, dtype)}
    return params


# --- the engines ------------------------------------------------------------------------------


def plain_engine(cfg: Config, mesh, rules) -> Callable:
    """Autodiff of the model under the mesh's annotations. Stage 3 recomputes each layer in
    the backward (`zero.model_for_stage`) so that its weights are gathered again, not kept."""
    axes = transformer.logical_axes(cfg.model)
    run_cfg = dataclasses.replace(
        cfg, model=zero.model_for_stage(cfg.model, cfg.train.zero_stage))
    ops = MeshOps(mesh, rules)
    transpose = fp8_scaling.transposes(cfg, mesh)

    def loss(params, hist, batch):
        compute = fp8_scaling.attach(cfg, compute_params(cfg, params, axes), hist, transpose)
        return loss_and_metrics(run_cfg, compute, batch, ops)

    value_and_grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)

    def engine(params, batch):  # params: the params, or (params, FP8 histories)
        params, hist = fp8_scaling.split(params)
        (value, metrics), (grads, hist_grad) = value_and_grad(params, hist, batch)
        grads, metrics = fp8_scaling.observed(grads, metrics, hist_grad)
        return value, metrics, grads

    return engine


def manual_engine(cfg: Config, mesh, rules) -> Callable:
    """The model as one per-device program, every collective written out (`ManualOps`):
    `train.tp_comm='collective'` runs the sequence-parallel gathers and reduce-scatters as
    collective matmuls that overlap their matmuls (`parallel.collective_matmul`)."""
    model = zero.model_for_stage(cfg.model, cfg.train.zero_stage)
    st = stage_model.stage_setup(model, mesh, rules, zero3=cfg.train.zero_stage == 3)
    st = dataclasses.replace(st, ops=dataclasses.replace(
        st.ops, collective=cfg.train.tp_comm == "collective"))
    axes = transformer.logical_axes(cfg.model)

    def engine(params, batch):
        compute = _cast_layers(cfg, compute_params(cfg, params, axes))
        loss, metrics, grads = stage_model.manual_loss_and_grads(st, compute, batch)
        return loss, _with_ce(loss, metrics), grads

    return engine


def _with_ce(loss, metrics):
    if "moe_aux_loss" not in metrics:
        return metrics
    return {"ce_loss": loss - metrics["moe_aux_loss"], **metrics}


def pipeline_engine(cfg: Config, mesh, rules) -> Callable:
    """A synchronous schedule table on the pipeline executor."""
    transpose = fp8_scaling.transposes(cfg, mesh)
    fp8 = ((cfg.train.fp8_recipe, cfg.train.fp8_margin, transpose)
           if fp8_scaling.enabled(cfg) else None)
    st = stage_model.stage_setup(cfg.model, mesh, rules, zero3=cfg.train.zero_stage == 3,
                                 stage_layer_counts=cfg.train.pipeline_stage_layers or None,
                                 num_chunks=cfg.train.pipeline_chunks, fp8=fp8)
    sched = sched_lib.make(cfg.train.pipeline_schedule, mesh.shape["pipeline"],
                           pipeline_microbatches(cfg, mesh), cfg.train.pipeline_chunks)
    axes = transformer.logical_axes(cfg.model)

    def engine(params, batch):  # params: the params, or (params, FP8 histories)
        params, hist = fp8_scaling.split(params)
        compute = _cast_layers(cfg, compute_params(cfg, params, axes))
        tokens = batch["targets"].size  # the pipeline differentiates the summed loss
        hist = fp8_scaling.to_engine(hist, tokens, cfg.train.fp8_margin)
        compute = fp8_scaling.attach(cfg, compute, hist, transpose)
        loss, metrics, grads = stage_model.loss_and_grads(st, compute, batch, sched)
        grads, metrics = fp8_scaling.pop_observed(grads, metrics)
        if hist is not None:
            metrics[fp8_scaling.OBSERVED] = fp8_scaling.from_engine(
                metrics[fp8_scaling.OBSERVED], tokens)
        return loss, _with_ce(loss, metrics), grads

    return engine


def terapipe_engine(cfg: Config, mesh, rules) -> Callable:
    """TeraPipe: equal token slices of every sequence through the pipeline."""
    slices = terapipe.equal_slices(cfg.train.seq_len, cfg.train.terapipe_slices)
    axes = transformer.logical_axes(cfg.model)

    def engine(params, batch):
        compute = _cast_layers(cfg, compute_params(cfg, params, axes))
        loss, grads = terapipe.terapipe_loss_and_grads(
            cfg, compute, batch, mesh=mesh, slices=slices, zero3=cfg.train.zero_stage == 3,
            rules=rules)
        return loss, {}, grads

    return engine


def _cast_layers(cfg: Config, params: dict) -> dict:
    """Layer matrices in the compute dtype before they enter a stage (a ZeRO-3 shard is
    gathered in this dtype inside the stage; earlier stages' copies are cast already)."""
    dt = transformer.compute_dtype(cfg.model)
    cast = lambda w: w.astype(dt) if w.ndim >= 3 else w  # [layers, ...] matrices
    return {k: jax.tree.map(cast, v) if k in ("blocks", "moe_blocks") else v
            for k, v in params.items()}


def pipedream_update(cfg: Config, mesh, rules, optimizer) -> Callable:
    """The asynchronous engine: (params, opt_state, batch) -> (params, opt_state, losses).

    Each stage updates its own weights after every backward (after every window of
    microbatches for 2BW) with `optimizer`, whose global-norm clip sees the stage's
    weights; its learning-rate schedule counts these updates.
    """
    mode = ASYNC_SCHEDULES[cfg.train.pipeline_schedule]
    sched = sched_lib.make("1f1b", mesh.shape["pipeline"], pipeline_microbatches(cfg, mesh))
    window = pipedream_window(cfg, mesh) if mode == "2bw" else 1
    return stage_model.pipedream_engine(cfg.model, mesh, rules, optimizer, sched, mode, window)


def engine_for(cfg: Config, mesh, rules) -> Callable:
    """The configured synchronous engine: plain, pipeline schedule, or TeraPipe."""
    if mesh.shape["pipeline"] == 1:
        if cfg.train.tp_comm == "collective":
            return manual_engine(cfg, mesh, rules)
        return plain_engine(cfg, mesh, rules)
    if cfg.train.terapipe_slices:
        return terapipe_engine(cfg, mesh, rules)
    return pipeline_engine(cfg, mesh, rules)
