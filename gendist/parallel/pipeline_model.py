"""The gendist transformer on the pipeline executor, with gendist.train's state layout.

`pipeline.pipeline_loss_and_grads` is generic over `{'embed', 'layers', 'head'}`; this
module adapts the model's pure params (`{'embed', 'blocks', 'final_norm', 'head'?}`) to it
and back. With tied embeddings the token table is both the embedding (stage 0) and the
output layer (last stage): the same array enters both roles and its two gradients are
added, as Megatron-LM does with an all-reduce between the first and last stage
(Narayanan et al. 2021, section 2.2). The train step keeps `{"step", "params",
"opt_state"}`, so checkpoints and the evaluation of `gendist.train` read its state; only the
placement differs: each stage stores the slice of the `layers` axis it runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gendist import optim, train
from gendist.config import Config, ModelConfig
from gendist.models.layers import rms_norm
from gendist.models.transformer import (
    DTYPES,
    block_forward,
    init_params,
    logical_axes,
    remat_policy,
)
from gendist.parallel import pipeline as pl
from gendist.sharding import DEFAULT_RULES, Rules, constrain, named_sharding, use_mesh

# Stored state: stage s keeps only its own layers (and their optimizer moments).
PIPELINE_RULES = DEFAULT_RULES.with_overrides(layers="pipeline")
# Inside the executor's shard_map `pipeline` and the batch axes are manual, so constraints
# in block_forward may only name the other axes (tensor parallelism stays automatic).
STAGE_RULES = DEFAULT_RULES.with_overrides(batch=None, act_seq=None)
BATCH_AXES = ("data", "expert")  # the mesh axes of the `batch` logical axis


def to_stage_params(cfg: ModelConfig, params: dict) -> dict:
    """Model params -> the executor's {'embed', 'layers', 'head'} (no copies)."""
    w = params["embed"] if cfg.tie_embeddings else params["head"]
    return {"embed": {"tok": params["embed"]}, "layers": params["blocks"],
            "head": {"final_norm": params["final_norm"], "w": w}}


def from_stage_grads(cfg: ModelConfig, grads: dict) -> dict:
    """Executor grads -> grads shaped like the model params (tied table: both roles add)."""
    out = {"embed": grads["embed"]["tok"], "blocks": grads["layers"],
           "final_norm": grads["head"]["final_norm"]}
    if cfg.tie_embeddings:
        out["embed"] = out["embed"] + grads["head"]["w"]
    else:
        out["head"] = grads["head"]["w"]
    return out


def model_fns(cfg: ModelConfig) -> dict:
    """embed_fn / layer_fn / head_loss_fn computing exactly `transformer.forward`'s math."""
    if getattr(cfg, "moe", None) is not None:
        raise ValueError("model.moe: the pipeline runs dense blocks only (one stacked `blocks` "
                         "tree); set model.moe=None or train MoE without mesh.pipeline")
    dt = DTYPES[cfg.dtype]

    def embed_fn(embed, tokens_BT):
        x_BTD = jnp.take(embed["tok"], tokens_BT, axis=0).astype(dt)
        return constrain(x_BTD, ("batch", "act_seq", "embed"))

    def layer_fn(layer, x_BTD):
        B, T = x_BTD.shape[:2]
        pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return block_forward(layer, x_BTD, pos_BT, cfg)[0]

    if cfg.remat != "none":
        layer_fn = jax.checkpoint(layer_fn, policy=remat_policy(cfg.remat), prevent_cse=False)

    def head_loss_fn(head, x_BTD, targets_BT):
        """Summed fp32 cross-entropy and its token count (the executor divides once)."""
        h_BTD = rms_norm(x_BTD, head["final_norm"], cfg.norm_eps)
        w_DV = (head["w"].T if cfg.tie_embeddings else head["w"]).astype(h_BTD.dtype)
        logits_BTV = jnp.einsum("BTD,DV->BTV", h_BTD, w_DV, preferred_element_type=jnp.float32)
        logits_BTV = constrain(logits_BTV, ("batch", "seq", "vocab"))
        logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
        nll_BT = -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
        return jnp.sum(nll_BT), targets_BT.size

    return {"embed_fn": _in_stage(embed_fn), "layer_fn": _in_stage(layer_fn),
            "head_loss_fn": _in_stage(head_loss_fn)}


def _in_stage(fn):
    """Runs `fn` with `constrain` bound to the shard_map's own (partly manual) mesh.

    A constraint inside shard_map must use the context's abstract mesh, whose `pipeline`
    and batch axes are Manual; STAGE_RULES keeps the logical table off those axes.
    """
    def wrapped(*args):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh is None or not mesh.shape:
            return fn(*args)
        with use_mesh(mesh, STAGE_RULES):
            return fn(*args)
    return wrapped


def loss_and_grads(cfg: Config, params: dict, batch: dict, *, mesh, schedule,
                   num_microbatches: int | None = None, stage_layer_counts=None,
                   bubble_value: float = 0.0):
    """Mean next-token loss and model-shaped grads, pipelined over the mesh's `pipeline` axis.

    Equals `jax.value_and_grad(gendist.train.loss_fn)` for any schedule and split.
    """
    if cfg.train.grad_accum != 1:
        raise ValueError(f"train.grad_accum={cfg.train.grad_accum}: the pipeline already "
                         "accumulates over num_microbatches; set train.grad_accum=1")
    loss, grads = pl.pipeline_loss_and_grads(
        to_stage_params(cfg.model, params), batch["inputs"], batch["targets"], mesh=mesh,
        schedule=schedule, num_microbatches=num_microbatches,
        stage_layer_counts=stage_layer_counts, batch_axes=BATCH_AXES,
        bubble_value=bubble_value, **model_fns(cfg.model))
    return loss, from_stage_grads(cfg.model, grads)


def state_rules(stage_layer_counts=None) -> Rules:
    """Layers sharded over stages when the split is even (an uneven split keeps them whole)."""
    even = stage_layer_counts is None or len(set(stage_layer_counts)) == 1
    return PIPELINE_RULES if even else DEFAULT_RULES


def _check_batch(cfg: Config, mesh, schedule, num_microbatches) -> None:
    """Errors at build time (not at the first step) for batches the pipeline cannot split."""
    if cfg.train.grad_accum != 1:
        raise ValueError(f"train.grad_accum={cfg.train.grad_accum}: the pipeline already "
                         "accumulates over num_microbatches; set train.grad_accum=1")
    m = num_microbatches if isinstance(schedule, str) else schedule.num_microbatches
    shards = int(np.prod([mesh.shape[a] for a in BATCH_AXES if a in mesh.shape]))
    if m is None or cfg.train.batch_size % (shards * m):
        raise ValueError(
            f"num_microbatches={m}: train.batch_size={cfg.train.batch_size} over {shards} "
            f"batch shards must split into {m} equal microbatches; use a batch_size that is "
            f"a multiple of {shards * (m or 1)} or another num_microbatches")


def build_pipeline(cfg: Config, mesh, schedule, num_microbatches: int | None = None,
                   optimizer=None, stage_layer_counts=None) -> train.Setup:
    """A `gendist.train.Setup` whose step pipelines: same state dict, same metrics.

    `optimizer` defaults to `optim.make_optimizer(cfg.train)`; optimizer state is placed
    by `optim.state_shardings`, so `train.zero_stage` shards the moments over `data` as in
    the plain step (ZeRO-1/2; stage 3 gathers a stage's weights on entry to the pipeline).
    """
    train.validate_config(cfg, mesh)
    _check_batch(cfg, mesh, schedule, num_microbatches)
    optimizer = optim.make_optimizer(cfg.train) if optimizer is None else optimizer
    rules = state_rules(stage_layer_counts)
    axes = logical_axes(cfg.model)
    params_shape = jax.eval_shape(lambda: init_params(cfg.model, 0))
    p_sh, o_sh = optim.state_shardings(mesh, axes, optimizer, params_shape,
                                       cfg.train.zero_stage, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    state_sh = {"step": replicated, "params": p_sh, "opt_state": o_sh}
    batch_sh = named_sharding(mesh, ("batch", "seq"))
    lr_fn = optim.lr_schedule(cfg.train)
    traces = {"step": 0, "eval": 0}

    def step(state, batch):
        traces["step"] += 1
        loss, grads = loss_and_grads(cfg, state["params"], batch, mesh=mesh, schedule=schedule,
                                     num_microbatches=num_microbatches,
                                     stage_layer_counts=stage_layer_counts)
        if cfg.train.debug_nan_step >= 0:  # the same fault injection as gendist.train
            loss = jnp.where(state["step"] == cfg.train.debug_nan_step, jnp.nan, loss)
        with use_mesh(mesh, rules):
            gnorm = train.optax_global_norm(grads)
            finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
            updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
            params = jax.tree.map(lambda p, u: p + u, state["params"], updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_state = {"step": state["step"] + 1, "params": keep(params, state["params"]),
                     "opt_state": keep(opt_state, state["opt_state"])}
        return new_state, {"loss": loss, "grad_norm": gnorm, "lr": lr_fn(state["step"]),
                           "finite": finite}

    def evaluate(params, batch):
        traces["eval"] += 1
        with use_mesh(mesh):
            return train.loss_fn(cfg, params, batch)

    step_fn = jax.jit(step, in_shardings=(state_sh, batch_sh),
                      out_shardings=(state_sh, replicated), donate_argnums=(0,))
    eval_fn = jax.jit(evaluate, in_shardings=(p_sh, batch_sh), out_shardings=replicated)
    return train.Setup(cfg, mesh, optimizer, state_sh, batch_sh, step_fn, eval_fn, traces)


def pipeline_train_step(cfg: Config, mesh, schedule_name, num_microbatches: int,
                        optimizer=None):
    """Jitted step(state, batch) -> (state, metrics), state as in `gendist.train`."""
    return build_pipeline(cfg, mesh, schedule_name, num_microbatches, optimizer).step_fn
