"""Train state, the one train-step builder and its gradient engines.

`build(cfg, mesh)` makes every training step in gendist: one `jax.jit` with explicit
in/out shardings and a donated state. What computes the loss and gradients is an engine,
chosen by the config:

    plain      autodiff of the model under the mesh's sharding annotations (data, tensor,
               sequence, ZeRO, expert parallelism)
    pipeline   a synchronous schedule table (GPipe, 1F1B) on the pipeline executor
    terapipe   token slices through the pipeline (train.terapipe_slices)
    pipedream  asynchronous: PipeDream with / without weight stashing, PipeDream-2BW; this
               engine updates the weights itself, microbatch by microbatch

The optimizer (optax AdamW), the ZeRO placement of the state and gradients, gradient
accumulation, the non-finite guard, the metrics, evaluation and checkpoints are shared by
all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gendist import optim
from gendist.config import Config
from gendist.models import transformer
from gendist.models.ops import DEFAULT_OPS, Ops
from gendist.parallel import schedule as sched_lib
from gendist.parallel import zero
from gendist.parallel.mesh_ops import MeshOps
from gendist.parallel.pipeline import model as stage_model
from gendist.parallel.pipeline import terapipe
from gendist.sharding import make_mesh, named_sharding, rules_for, use_mesh
from gendist.train_checks import (
    ASYNC_SCHEDULES,
    pipedream_window,
    pipeline_microbatches,
    validate_config,
)


class NonFiniteLoss(FloatingPointError):
    """Raised (train.nonfinite='stop') when a step's loss or gradients are NaN/inf."""


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
    statistics. `ops` places the computation (`MeshOps` inside a jitted step)."""
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


# --- gradient engines: (params, batch) -> (loss, metrics, grads) -----------------------------


def plain_engine(cfg: Config, mesh, rules) -> Callable:
    """Autodiff of the model under the mesh's annotations. Stage 3 recomputes each layer in
    the backward (`zero.model_for_stage`) so that its weights are gathered again, not kept."""
    axes = transformer.logical_axes(cfg.model)
    run_cfg = dataclasses.replace(
        cfg, model=zero.model_for_stage(cfg.model, cfg.train.zero_stage))
    ops = MeshOps(mesh, rules)

    def loss(params, batch):
        return loss_and_metrics(run_cfg, compute_params(cfg, params, axes), batch, ops)

    value_and_grad = jax.value_and_grad(loss, has_aux=True)

    def engine(params, batch):
        (value, metrics), grads = value_and_grad(params, batch)
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
    return {"ce_loss": loss - metrics["moe_aux_loss"], **metrics} if metrics else metrics


def pipeline_engine(cfg: Config, mesh, rules) -> Callable:
    """A synchronous schedule table on the pipeline executor."""
    st = stage_model.stage_setup(cfg.model, mesh, rules, zero3=cfg.train.zero_stage == 3,
                                 stage_layer_counts=cfg.train.pipeline_stage_layers or None,
                                 num_chunks=cfg.train.pipeline_chunks)
    sched = sched_lib.make(cfg.train.pipeline_schedule, mesh.shape["pipeline"],
                           pipeline_microbatches(cfg, mesh), cfg.train.pipeline_chunks)
    axes = transformer.logical_axes(cfg.model)

    def engine(params, batch):
        compute = _cast_layers(cfg, compute_params(cfg, params, axes))
        loss, metrics, grads = stage_model.loss_and_grads(st, compute, batch, sched)
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


def optax_global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def accumulated(engine: Callable, accum: int, place: Callable) -> Callable:
    """engine over `accum` microbatches of the batch, averaged (gradient accumulation);
    `place` puts each microbatch's gradients where they live (ZeRO-2/3: split on data)."""
    def grads_of(params, batch):
        if accum == 1:
            loss, metrics, g = engine(params, batch)
            return loss, metrics, place(g)
        micro = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), batch)

        def body(carry, mb):
            loss, metrics, g = engine(params, mb)
            return jax.tree.map(jnp.add, carry, (loss, metrics, place(g))), None

        shapes = jax.eval_shape(engine, params, jax.tree.map(lambda x: x[0], micro))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        (loss, metrics, g), _ = jax.lax.scan(body, zeros, micro)
        return jax.tree.map(lambda x: x / accum, (loss, metrics, g))

    return grads_of


def make_train_step(cfg: Config, optimizer, engine: Callable, grad_sharding: dict | None = None,
                    with_grads: bool = False, update: Callable | None = None):
    """step(state, batch) -> (state, metrics).

    `engine(params, batch) -> (loss, metrics, grads)` is accumulated over train.grad_accum
    and fed to the optimizer; an asynchronous engine instead passes
    `update(params, opt_state, batch) -> (params, opt_state, per-microbatch losses)`. Either
    way a
    non-finite loss (or gradient) leaves the state as it was. `grad_sharding` places the
    gradients; `with_grads` adds them to the metrics (tests compare them across meshes).
    """
    place = (lambda g: g) if grad_sharding is None else (
        lambda g: zero.constrain_tree(g, grad_sharding))
    grads_of = accumulated(engine, cfg.train.grad_accum, place)

    def step(state, batch):
        if update is None:
            loss, aux, grads = grads_of(state["params"], batch)
            gnorm = optax_global_norm(grads)
            updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
            params = jax.tree.map(lambda p, u: p + u, state["params"], updates)
            aux = {"grad_norm": gnorm, **aux}
        else:
            params, opt_state, losses = update(state["params"], state["opt_state"], batch)
            loss, gnorm, aux = jnp.mean(losses), jnp.float32(0), {}
        if cfg.train.debug_nan_step >= 0:  # fault injection for tests of the NaN guard
            loss = jnp.where(state["step"] == cfg.train.debug_nan_step, jnp.nan, loss)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        # A non-finite step changes nothing: the state (and so every checkpoint) stays good.
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_state = {"step": state["step"] + 1,
                     "params": keep(params, state["params"]),
                     "opt_state": keep(opt_state, state["opt_state"])}
        lr = optim.lr_schedule(cfg.train)(state["step"])
        metrics = {"loss": loss, "lr": lr, "finite": finite, **aux}
        if with_grads:
            metrics["grads"] = grads
        return new_state, metrics

    return step


@dataclasses.dataclass
class Setup:
    """Everything a training run compiles against: mesh, shardings, jitted functions.

    `step_fn(state, batch) -> (state, metrics)` DONATES `state`: its buffers are reused for
    the new state, so keep only the returned one (reading the old state afterwards raises
    "Array has been deleted"). `eval_fn(params, batch)` returns the mean cross-entropy.
    """

    cfg: Config
    mesh: jax.sharding.Mesh
    optimizer: object
    state_sharding: dict
    batch_sharding: NamedSharding
    step_fn: object
    eval_fn: object
    traces: dict  # how many times each jitted function was traced (recompile guard)
    grad_sharding: dict | None = None  # where the gradients live (ZeRO-2/3: split on data)

    def init_state(self, seed: int | None = None, params=None) -> dict:
        """A step-0 state: random params from `seed` (default train.seed), or `params`
        (fine-tuning: a params dict of host or device arrays, or a function of the params'
        shardings returning arrays placed on them), with a fresh optimizer state."""
        p_sh = self.state_sharding["params"]

        def state(p):
            return {"step": jnp.zeros((), jnp.int32), "params": p,
                    "opt_state": self.optimizer.init(p)}

        with use_mesh(self.mesh):
            if params is None:
                seed = self.cfg.train.seed if seed is None else seed
                init = lambda: state(transformer.init_params(self.cfg.model, seed))
                return jax.jit(init, out_shardings=self.state_sharding)()
            given = params(p_sh) if callable(params) else jax.tree.map(_place, params, p_sh)
            return jax.jit(state, in_shardings=(p_sh,), out_shardings=self.state_sharding)(given)

    def abstract_state(self):
        shapes = jax.eval_shape(self.init_state)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_sharding)


def _place(x, sharding):
    """A host array placed on `sharding`, each process writing its own devices' slices."""
    if isinstance(x, jax.Array):
        return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def metric_names(cfg: Config, asynchronous: bool) -> tuple[str, ...]:
    names = ("loss", "lr", "finite") + (() if asynchronous else ("grad_norm",))
    if cfg.model.num_moe_layers and not asynchronous and not cfg.train.terapipe_slices:
        names += ("ce_loss", "moe_aux_loss", "moe_drop_fraction", "moe_expert_load",
                  "moe_load_max_over_mean")
    return names


def build(cfg: Config, mesh=None, *, with_grads: bool = False) -> Setup:
    """Mesh, shardings, the engine and the jitted train/eval steps for a config.

    Tensor and sequence parallelism and the pipeline stages' slices come from the
    logical-axis rules (`rules_for`); ZeRO from where `optim.state_shardings` puts the state
    and the gradients; the engine from `mesh.pipeline`, `train.pipeline_schedule` and
    `train.terapipe_slices`. `with_grads=True` also returns each step's gradients in the
    metrics (tests compare them across parallel forms).
    """
    mesh = make_mesh(cfg.mesh) if mesh is None else mesh
    validate_config(cfg, mesh)
    rules = rules_for(dataclasses.replace(cfg.mesh, pipeline=mesh.shape["pipeline"]))
    if len(set(cfg.train.pipeline_stage_layers)) > 1:  # uneven stages: layers stored whole
        rules = rules.with_overrides(layers=None)
    stage = cfg.train.zero_stage
    optimizer = optim.make_optimizer(cfg.train)
    axes = transformer.logical_axes(cfg.model)
    params_shape = transformer.param_shapes(cfg.model)
    p_sh, o_sh = optim.state_shardings(mesh, axes, optimizer, params_shape, stage, rules)
    g_sh = zero.grad_shardings(mesh, axes, params_shape, stage, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    state_sh = {"step": replicated, "params": p_sh, "opt_state": o_sh}
    batch_sh = named_sharding(mesh, ("batch", "seq"))
    asynchronous = mesh.shape["pipeline"] > 1 and cfg.train.pipeline_schedule in ASYNC_SCHEDULES
    if asynchronous:
        raw_step = make_train_step(cfg, optimizer, None, g_sh, with_grads=False,
                                   update=pipedream_update(cfg, mesh, rules, optimizer))
    else:
        raw_step = make_train_step(cfg, optimizer, engine_for(cfg, mesh, rules), g_sh,
                                   with_grads)
    eval_ops = MeshOps(mesh, rules)
    traces = {"step": 0, "eval": 0}

    def step(state, batch):
        traces["step"] += 1
        with use_mesh(mesh, rules):
            return raw_step(state, batch)

    def evaluate(params, batch):
        traces["eval"] += 1
        with use_mesh(mesh, rules):
            loss, metrics = loss_and_metrics(cfg, params, batch, eval_ops)
            return metrics.get("ce_loss", loss)  # validation: cross-entropy only

    metrics_sh = {k: replicated for k in metric_names(cfg, asynchronous)}
    if with_grads:
        metrics_sh["grads"] = g_sh
    step_fn = jax.jit(step, in_shardings=(state_sh, batch_sh),
                      out_shardings=(state_sh, metrics_sh), donate_argnums=(0,))
    eval_fn = jax.jit(evaluate, in_shardings=(p_sh, batch_sh), out_shardings=replicated)
    return Setup(cfg, mesh, optimizer, state_sh, batch_sh, step_fn, eval_fn, traces, g_sh)


def peak_flops_per_device() -> float | None:
    """Dense bf16 datasheet peak of the local accelerator (None where unknown, e.g. CPU)."""
    kind = jax.devices()[0].device_kind.lower()
    for name, peak in (("h200", 989e12), ("h100", 989e12), ("a100", 312e12)):
        if name in kind:
            return peak
    return None


def throughput(cfg: Config, tokens: int, seconds: float) -> dict:
    tps = tokens / max(seconds, 1e-9)
    out = {"tokens_per_s": tps}
    peak = peak_flops_per_device()
    if peak:
        out["mfu"] = cfg.model.flops_per_token(cfg.train.seq_len) * tps / (peak * jax.device_count())
    return out


def host_metrics(metrics) -> dict:
    """Scalars as floats, vectors (e.g. per-expert load) as lists."""
    out = {}
    for k, v in jax.device_get(metrics).items():
        v = np.asarray(v)
        out[k] = float(v) if v.ndim == 0 else v.tolist()
    return out


