"""Train state, the jitted train step, and the training loop.

One `jax.jit` with explicit in/out shardings and a donated state; the loop dispatches step
N before pulling step N-1's metrics, so the device never waits for Python.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gendist import optim
from gendist.config import Config
from gendist.models import transformer
from gendist.parallel import zero
from gendist.parallel.tensor import vocab_parallel_cross_entropy
from gendist.sharding import (
    DEFAULT_RULES,
    Rules,
    check_divisible,
    current_mesh,
    current_rules,
    make_mesh,
    named_sharding,
    rules_for,
    use_mesh,
)


class NonFiniteLoss(FloatingPointError):
    """Raised (train.nonfinite='stop') when a step's loss or gradients are NaN/inf."""


def cross_entropy(logits_BTV, targets_BT):
    """Mean next-token cross-entropy in fp32 (nats)."""
    logp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets_BT[..., None], axis=-1))


def loss_and_metrics(cfg: Config, params, batch):
    """(training loss, metrics). The loss is the mean next-token cross-entropy (under a mesh
    the logits stay split over vocab, Megatron) plus, for MoE models, the weighted router
    losses; the metrics report the MoE drop fraction and per-expert load."""
    logits, aux = transformer.forward_with_aux(cfg.model, params, batch["inputs"])
    mesh = current_mesh()
    if mesh is None:
        ce = cross_entropy(logits, batch["targets"])
    else:
        ce = vocab_parallel_cross_entropy(logits, batch["targets"], mesh, current_rules())
    if not aux:
        return ce, {}
    load_E = jnp.sum(aux["moe_expert_load_GE"], axis=0)
    return ce + aux["moe_loss"], {
        "ce_loss": ce, "moe_aux_loss": aux["moe_loss"],
        "moe_drop_fraction": aux["moe_drop_fraction"], "moe_expert_load": load_E,
        "moe_load_max_over_mean": jnp.max(load_E) / jnp.maximum(jnp.mean(load_E), 1e-9)}


def loss_fn(cfg: Config, params, batch):
    """The training loss alone (see `loss_and_metrics`)."""
    return loss_and_metrics(cfg, params, batch)[0]


def zero_loss_fn(cfg: Config, axes: dict):
    """loss(master_params, batch) with ZeRO's compute copy: what the step differentiates.

    Stages 1-2 gather one compute copy (matrices in model.dtype) per step. Stage 3 gathers
    the embedding and final norm once, leaves the blocks' weights sharded for the layer
    scan to gather just in time, and recomputes rather than saves them for the backward.
    """
    stage = cfg.train.zero_stage
    dtype = transformer.DTYPES[cfg.model.dtype]
    cfg = dataclasses.replace(cfg, model=zero.model_for_stage(cfg.model, stage))

    def loss(params, batch):
        if stage in (1, 2):
            params = zero.compute_copy(params, axes, dtype)
        elif stage == 3:
            rest = {k: v for k, v in params.items() if k != "blocks"}
            rest = zero.compute_copy(rest, {k: axes[k] for k in rest}, dtype)
            params = {**params, **rest}
        return loss_and_metrics(cfg, params, batch)

    return loss


def validate_config(cfg: Config, mesh) -> None:
    """Clear errors for shapes the mesh or the model cannot take."""
    m, t = cfg.model, cfg.train
    check_divisible(mesh, model__num_heads=(m.num_heads, "heads"),
                    model__num_kv_heads=(m.num_kv_heads, "kv_heads"),
                    model__d_ff=(m.d_ff, "mlp"), model__vocab_size=(m.vocab_size, "vocab"))
    if t.batch_size % t.grad_accum:
        raise ValueError(f"train.batch_size={t.batch_size} is not divisible by "
                         f"train.grad_accum={t.grad_accum}; make batch_size a multiple of it.")
    shards = mesh.shape["data"] * mesh.shape["expert"]
    if (t.batch_size // t.grad_accum) % shards:
        raise ValueError(
            f"train.batch_size={t.batch_size} (per microbatch {t.batch_size // t.grad_accum}) "
            f"is not divisible by the {shards} batch shards (mesh.data x mesh.expert); use a "
            f"batch size that is a multiple of {shards * t.grad_accum}.")
    zero.check_stage(t.zero_stage)
    tp = mesh.shape["tensor"]
    if cfg.mesh.sequence_parallel and t.seq_len % tp:
        raise ValueError(
            f"train.seq_len={t.seq_len} is not divisible by mesh.tensor={tp}, which "
            "mesh.sequence_parallel splits the sequence over; choose a multiple of it or "
            "turn sequence parallelism off.")
    if t.seq_len > m.max_seq_len:
        raise ValueError(f"train.seq_len={t.seq_len} is longer than model.max_seq_len="
                         f"{m.max_seq_len}; raise model.max_seq_len or shorten train.seq_len.")


def make_train_step(cfg: Config, optimizer, grad_sharding: dict | None = None,
                    with_grads: bool = False):
    """step(state, batch) -> (state, metrics); grads accumulated over train.grad_accum.

    `grad_sharding` places the gradients (ZeRO-2/3: reduce-scattered over `data`);
    `with_grads` adds them to the metrics (tests compare them across meshes).
    """
    accum = cfg.train.grad_accum
    value_and_grad = jax.value_and_grad(zero_loss_fn(cfg, transformer.logical_axes(cfg.model)),
                                        has_aux=True)
    place = (lambda g: g) if grad_sharding is None else (
        lambda g: zero.constrain_tree(g, grad_sharding))

    def grads_of(params, batch):
        if accum == 1:
            (loss, aux), g = value_and_grad(params, batch)
            return loss, aux, place(g)
        micro = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), batch)

        def body(carry, mb):
            (loss, aux), g = value_and_grad(params, mb)
            return jax.tree.map(jnp.add, carry, (loss, aux, place(g))), None

        aux_shape = jax.eval_shape(value_and_grad, params,
                                   jax.tree.map(lambda x: x[0], micro))[0][1]
        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, aux_shape),
                jax.tree.map(jnp.zeros_like, params))
        (loss, aux, g), _ = jax.lax.scan(body, zero, micro)
        return jax.tree.map(lambda x: x / accum, (loss, aux, g))

    def step(state, batch):
        loss, aux, grads = grads_of(state["params"], batch)
        if cfg.train.debug_nan_step >= 0:  # fault injection for tests of the NaN guard
            loss = jnp.where(state["step"] == cfg.train.debug_nan_step, jnp.nan, loss)
        gnorm = optax_global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = jax.tree.map(lambda p, u: p + u, state["params"], updates)
        # A non-finite step changes nothing: the state (and so every checkpoint) stays good.
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_state = {"step": state["step"] + 1,
                     "params": keep(params, state["params"]),
                     "opt_state": keep(opt_state, state["opt_state"])}
        lr = optim.lr_schedule(cfg.train)(state["step"])
        metrics = {"loss": loss, "grad_norm": gnorm, "lr": lr, "finite": finite, **aux}
        if with_grads:
            metrics["grads"] = grads
        return new_state, metrics

    return step


def optax_global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


@dataclasses.dataclass
class Setup:
    """Everything a training run compiles against: mesh, shardings, jitted functions."""

    cfg: Config
    mesh: jax.sharding.Mesh
    optimizer: object
    state_sharding: dict
    batch_sharding: NamedSharding
    step_fn: object
    eval_fn: object
    traces: dict  # how many times each jitted function was traced (recompile guard)
    rules: Rules = DEFAULT_RULES  # the logical-axis rules the step was compiled with
    grad_sharding: dict | None = None  # where the gradients live (ZeRO-2/3: split on data)

    def init_state(self, seed: int | None = None) -> dict:
        seed = self.cfg.train.seed if seed is None else seed

        def init():
            params = transformer.init_params(self.cfg.model, seed)
            return {"step": jnp.zeros((), jnp.int32), "params": params,
                    "opt_state": self.optimizer.init(params)}

        with use_mesh(self.mesh):
            return jax.jit(init, out_shardings=self.state_sharding)()

    def abstract_state(self):
        shapes = jax.eval_shape(self.init_state)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_sharding)


def build(cfg: Config, mesh=None, *, with_grads: bool = False) -> Setup:
    """Mesh, shardings and the jitted train/eval steps for a config.

    Tensor and sequence parallelism come from the logical-axis rules (`rules_for`); ZeRO
    from where `optim.state_shardings` puts the state and the gradients.
    `with_grads=True` also returns each step's gradients in the metrics (for tests).
    """
    mesh = make_mesh(cfg.mesh) if mesh is None else mesh
    if mesh.shape["pipeline"] > 1:  # layers split into stages: the pipelined step
        from gendist.parallel.pipeline_model import build_pipeline
        return build_pipeline(cfg, mesh, cfg.train.pipeline_schedule,
                              pipeline_microbatches(cfg, mesh))
    validate_config(cfg, mesh)
    rules = rules_for(cfg.mesh)
    stage = cfg.train.zero_stage
    optimizer = optim.make_optimizer(cfg.train)
    axes = transformer.logical_axes(cfg.model)
    params_shape = jax.eval_shape(lambda: transformer.init_params(cfg.model, 0))
    p_sh, o_sh = optim.state_shardings(mesh, axes, optimizer, params_shape, stage)
    g_sh = zero.grad_shardings(mesh, axes, params_shape, stage)
    replicated = NamedSharding(mesh, PartitionSpec())
    state_sh = {"step": replicated, "params": p_sh, "opt_state": o_sh}
    batch_sh = named_sharding(mesh, ("batch", "seq"))
    raw_step = make_train_step(cfg, optimizer, g_sh, with_grads)
    traces = {"step": 0, "eval": 0}

    def step(state, batch):
        traces["step"] += 1
        with use_mesh(mesh, rules):
            return raw_step(state, batch)

    def evaluate(params, batch):
        traces["eval"] += 1
        with use_mesh(mesh, rules):
            loss, metrics = loss_and_metrics(cfg, params, batch)
            return metrics.get("ce_loss", loss)  # validation: cross-entropy only

    metrics_sh = {k: replicated for k in ("loss", "grad_norm", "lr", "finite")}
    if cfg.model.moe is not None:
        metrics_sh.update({k: replicated for k in ("ce_loss", "moe_aux_loss", "moe_drop_fraction",
                                                   "moe_expert_load", "moe_load_max_over_mean")})
    if with_grads:
        metrics_sh["grads"] = g_sh
    step_fn = jax.jit(step, in_shardings=(state_sh, batch_sh),
                      out_shardings=(state_sh, metrics_sh), donate_argnums=(0,))
    eval_fn = jax.jit(evaluate, in_shardings=(p_sh, batch_sh), out_shardings=replicated)
    return Setup(cfg, mesh, optimizer, state_sh, batch_sh, step_fn, eval_fn, traces, rules,
                 g_sh)


def pipeline_microbatches(cfg: Config, mesh) -> int:
    """train.pipeline_microbatches, or twice the number of stages when it is 0."""
    return cfg.train.pipeline_microbatches or 2 * mesh.shape["pipeline"]


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


def timed(fn, *args):
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t
