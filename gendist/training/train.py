"""Train state and the one train-step builder.

`build(cfg, mesh)` makes every training step in gendist: one `jax.jit` with explicit
in/out shardings and a donated state. What computes the loss and gradients is an engine
(`gendist.training.gradients`: plain, manual, pipeline, TeraPipe, PipeDream), chosen by the config.
The optimizer (optax AdamW), the ZeRO placement of the state and gradients, gradient
accumulation, the non-finite guard, the metrics, evaluation and checkpoints are shared by
all of them, here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gendist.config import Config
from gendist.models import transformer
from gendist.parallel import zero
from gendist.parallel.mesh_ops import MeshOps
from gendist.sharding import make_mesh, named_sharding, rules_for, use_mesh
from gendist.training import dpo, fp8_scaling, lora, optim
from gendist.training.checks import ASYNC_SCHEDULES, validate_config
from gendist.training.gradients import (
    compute_params,
    cross_entropy,
    engine_for,
    loss_and_metrics,
    loss_fn,
    pipedream_update,
)

# The training loss, re-exported: `train.loss_fn` is every parallel form's one-device oracle.
__all__ = ["NonFiniteLoss", "Setup", "build", "cross_entropy", "host_metrics", "loss_and_metrics",
           "loss_fn", "make_train_step", "throughput"]


class NonFiniteLoss(FloatingPointError):
    """Raised (train.nonfinite='stop') when a step's loss or gradients are NaN/inf."""


def optax_global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def accumulated(engine: Callable, accum: int, place: Callable, fp8_margin: int = 0
                ) -> Callable:
    """engine over `accum` microbatches of the batch, averaged (gradient accumulation);
    `place` puts each microbatch's gradients where they live (ZeRO-2/3: split on data).
    FP8 histories (params = (params, histories)) go in and come out per the batch's mean
    loss (`fp8_scaling.to_engine`: a microbatch's mean loss is `accum` x its share)."""
    def grads_of(params, batch):
        if accum == 1:
            loss, metrics, g = engine(params, batch)
            return loss, metrics, place(g)
        if isinstance(params, tuple):
            params = (params[0], fp8_scaling.to_engine(params[1], accum, fp8_margin))
        micro = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), batch)

        def body(carry, mb):
            loss, metrics, g = engine(params, mb)
            c_loss, c_metrics, c_g = carry
            metrics = {k: fp8_scaling.combine(c_metrics[k], v, k) for k, v in metrics.items()}
            return (c_loss + loss, metrics, jax.tree.map(jnp.add, c_g, place(g))), None

        shapes = jax.eval_shape(engine, params, jax.tree.map(lambda x: x[0], micro))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        (loss, metrics, g), _ = jax.lax.scan(body, zeros, micro)
        metrics = {k: fp8_scaling.from_engine(v, accum) if k == fp8_scaling.OBSERVED
                   else v / accum for k, v in metrics.items()}
        return loss / accum, metrics, jax.tree.map(lambda x: x / accum, g)

    return grads_of


def make_train_step(cfg: Config, optimizer, engine: Callable, grad_sharding: dict | None = None,
                    with_grads: bool = False, update: Callable | None = None,
                    reference: Callable | None = None):
    """step(state, batch) -> (state, metrics).

    `engine(params, batch) -> (loss, metrics, grads)` is accumulated over train.grad_accum
    and fed to the optimizer; an asynchronous engine instead passes
    `update(params, opt_state, batch) -> (params, opt_state, per-microbatch losses)`. Either
    way a
    non-finite loss (or gradient) leaves the state as it was. `grad_sharding` places the
    gradients; `with_grads` adds them to the metrics (tests compare them across meshes).
    LoRA (a state with `base`): `params` are the adapters and the engine gets
    {"adapters", "base"} (`lora.wrap_engine`); the base passes through unchanged.
    DPO: `reference(ref_params, batch)` gives the frozen reference's sequence log-probs,
    computed once per batch (no gradient) and handed to the loss as batch["ref_logp"].
    """
    place = (lambda g: g) if grad_sharding is None else (
        lambda g: zero.constrain_tree(g, grad_sharding))
    grads_of = accumulated(engine, cfg.train.grad_accum, place, cfg.train.fp8_margin)

    def step(state, batch):
        fp8_ok, fp8 = True, state.get("fp8")
        if reference is not None:
            ref = jax.lax.stop_gradient(reference(dpo.reference_params(state), batch))
            batch = {**batch, "ref_logp": ref}
        if update is None:
            inputs = state["params"] if fp8 is None else (state["params"], fp8)
            if "base" in state:
                inputs = {"adapters": state["params"], "base": state["base"]}
            loss, aux, grads = grads_of(inputs, batch)
            if fp8 is not None:  # the FP8 products' amaxes of this step roll into the history
                fp8, fp8_ok = fp8_scaling.update(fp8, aux.pop(fp8_scaling.OBSERVED))
            gnorm = optax_global_norm(grads)
            updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
            params = jax.tree.map(lambda p, u: p + u, state["params"], updates)
            aux = {"grad_norm": gnorm, **aux}
        else:
            params, opt_state, losses = update(state["params"], state["opt_state"], batch)
            loss, gnorm, aux = jnp.mean(losses), jnp.float32(0), {}
        if cfg.train.debug_nan_step >= 0:  # fault injection for tests of the NaN guard
            loss = jnp.where(state["step"] == cfg.train.debug_nan_step, jnp.nan, loss)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm) & fp8_ok
        # A non-finite step changes nothing: the state (and so every checkpoint) stays good.
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_state = {"step": state["step"] + 1,
                     "params": keep(params, state["params"]),
                     "opt_state": keep(opt_state, state["opt_state"])}
        if fp8 is not None:
            new_state["fp8"] = keep(fp8, state["fp8"])
        for frozen in ("base", "reference"):  # LoRA's base, DPO's reference: never change
            if frozen in state:
                new_state[frozen] = state[frozen]
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
    model_sharding: dict | None = None  # where the model's full params live (LoRA: the base's)
    merge_fn: object = None  # LoRA: jitted (base, adapters) -> merged params

    def model_params(self, state: dict) -> dict:
        """The model's params in a train state: the params, or LoRA's base with its adapters
        merged (W + alpha/r A B, fp32)."""
        if "base" not in state:
            return state["params"]
        return self.merge_fn(state["base"], state["params"])

    def eval_params(self, state: dict):
        """What `eval_fn` takes: the model's params, or (policy, reference) for DPO."""
        if dpo.enabled(self.cfg):
            return self.model_params(state), dpo.reference_params(state)
        return self.model_params(state)

    def init_state(self, seed: int | None = None, params=None) -> dict:
        """A step-0 state: random params from `seed` (default train.seed), or `params`
        (fine-tuning: a params dict of host or device arrays, or a function of the params'
        shardings returning arrays placed on them), with a fresh optimizer state. LoRA: those
        params become the frozen base and fresh adapters (train.seed) the trained params;
        DPO without LoRA: they are also kept, frozen, as the reference."""
        p_sh = self.model_sharding or self.state_sharding["params"]
        cfg = self.cfg

        def state(p):
            if lora.enabled(cfg):
                ad = lora.init(cfg.model, cfg.train, cfg.train.seed)
                s = {"step": jnp.zeros((), jnp.int32), "params": ad,
                     "opt_state": self.optimizer.init(ad), "base": lora.base_params(p, cfg.train)}
            else:
                s = {"step": jnp.zeros((), jnp.int32), "params": p,
                     "opt_state": self.optimizer.init(p)}
                if dpo.enabled(cfg):
                    s["reference"] = jax.tree.map(jnp.copy, p)
            if fp8_scaling.enabled(self.cfg):
                s["fp8"] = fp8_scaling.init(self.cfg)
            return s

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
    if dpo.enabled(cfg):
        return names + dpo.METRICS
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
    model_sh = zero.param_shardings(mesh, axes, params_shape, stage, rules)
    train_axes, train_shape = axes, params_shape  # what the optimizer trains
    if lora.enabled(cfg):  # the adapters, placed by their logical axes like their layers
        train_axes = lora.logical_axes(cfg.model, cfg.train)
        train_shape = lora.shapes(cfg.model, cfg.train)
    p_sh, o_sh = optim.state_shardings(mesh, train_axes, optimizer, train_shape, stage, rules)
    g_sh = zero.grad_shardings(mesh, train_axes, train_shape, stage, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    state_sh = {"step": replicated, "params": p_sh, "opt_state": o_sh}
    merge_fn = None
    if lora.enabled(cfg):
        state_sh["base"] = model_sh
        s = lora.scale(cfg.train)
        merge_fn = jax.jit(lambda b, a: lora.merged(b, a, s), out_shardings=model_sh)
    elif dpo.enabled(cfg):
        state_sh["reference"] = model_sh
    if fp8_scaling.enabled(cfg):
        state_sh["fp8"] = {k: named_sharding(mesh, a, rules)
                           for k, a in fp8_scaling.axes(cfg).items()}
    batch_sh = named_sharding(mesh, ("batch", "seq"))
    asynchronous = mesh.shape["pipeline"] > 1 and cfg.train.pipeline_schedule in ASYNC_SCHEDULES
    if asynchronous:
        raw_step = make_train_step(cfg, optimizer, None, g_sh, with_grads=False,
                                   update=pipedream_update(cfg, mesh, rules, optimizer))
    else:
        engine = engine_for(cfg, mesh, rules)
        if lora.enabled(cfg):
            engine = lora.wrap_engine(cfg, engine, lambda p: zero.constrain_tree(p, model_sh))
        reference = reference_logp(cfg, mesh, rules) if dpo.enabled(cfg) else None
        raw_step = make_train_step(cfg, optimizer, engine, g_sh, with_grads,
                                   reference=reference)
    eval_ops = MeshOps(mesh, rules)
    traces = {"step": 0, "eval": 0}

    def step(state, batch):
        traces["step"] += 1
        with use_mesh(mesh, rules):
            return raw_step(state, batch)

    def evaluate(params, batch):
        traces["eval"] += 1
        with use_mesh(mesh, rules):
            if dpo.enabled(cfg):  # the DPO loss on held-out pairs against the reference
                params, ref = params
                batch = {**batch, "ref_logp": dpo.sequence_logp(cfg, ref, batch, eval_ops)}
            loss, metrics = loss_and_metrics(cfg, params, batch, eval_ops)
            return metrics.get("ce_loss", loss)  # validation: cross-entropy only

    metrics_sh = {k: replicated for k in metric_names(cfg, asynchronous)}
    if with_grads:
        metrics_sh["grads"] = g_sh
    step_fn = jax.jit(step, in_shardings=(state_sh, batch_sh),
                      out_shardings=(state_sh, metrics_sh), donate_argnums=(0,))
    eval_sh = (model_sh, model_sh) if dpo.enabled(cfg) else model_sh
    eval_fn = jax.jit(evaluate, in_shardings=(eval_sh, batch_sh), out_shardings=replicated)
    return Setup(cfg, mesh, optimizer, state_sh, batch_sh, step_fn, eval_fn, traces, g_sh,
                 model_sh if lora.enabled(cfg) else None, merge_fn)


def reference_logp(cfg: Config, mesh, rules) -> Callable:
    """DPO's reference: (frozen params, batch) -> [2B] sequence log-probs, laid out as the
    model's compute copy (ZeRO: gathered) under the mesh's annotations."""
    axes = transformer.logical_axes(cfg.model)
    run_cfg = dataclasses.replace(
        cfg, model=zero.model_for_stage(cfg.model, cfg.train.zero_stage))
    ops = MeshOps(mesh, rules)
    return lambda ref, batch: dpo.sequence_logp(run_cfg, compute_params(cfg, ref, axes), batch,
                                                ops)


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


