"""gendist's transformer on the pipeline engines: stage weights, specs, per-device ops.

The model's params `{'embed', 'blocks', 'moe_blocks'?, 'final_norm', 'head'?}` split into
the executor's stage weights w = (embed, layers, head) without copies: stage 0 reads
`embed`, every stage its slice of `blocks` / `moe_blocks` (whole MoE groups), the last stage
`final_norm` and the output matrix. With tied embeddings the token table is both the
embedding (stage 0) and the output layer (last stage): the same array enters both roles and
its two gradients are added, as Megatron-LM does with an all-reduce between the first and
last stage (Narayanan et al. 2021, section 2.2).

The stage bodies are manual over every mesh axis (`ManualOps`): tensor and sequence
parallelism as Megatron's explicit f/g, ZeRO-3 as a per-layer all-gather of the stage's
weight shards, expert parallelism as the all-to-all of the MoE layer, the vocabulary-parallel
loss - and no partitioner runs inside, so every attention backend (cuDNN's custom
partitioning included) works in a stage. Specs come from the one logical-axis table.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from gendist.config import ModelConfig
from gendist.models import fp8 as fp8_lib
from gendist.models import transformer
from gendist.parallel import zero
from gendist.parallel.manual import ManualOps
from gendist.parallel.pipeline import core, pipedream
from gendist.parallel.pipeline.stages import StageFns
from gendist.parallel.pipeline.sync import pad_layers, run_sync, unpad_layers
from gendist.sharding import BATCH_AXES, PIPELINE_STAGES, Rules, logical_to_spec


def stage_weights(cfg: ModelConfig, params: dict) -> tuple[dict, dict, dict]:
    """Model params -> (embed, layers, head) stage weights (no copies)."""
    return ({"embed": params["embed"]}, transformer.layers_of(params),
            transformer.head_params(params, cfg))


def model_grads(cfg: ModelConfig, grads: tuple[dict, dict, dict]) -> dict:
    """Stage-weight grads -> grads shaped like the model params (tied table: roles add)."""
    g_embed, g_layers, g_head = grads
    out = {"embed": g_embed["embed"], **g_layers, "final_norm": g_head["final_norm"]}
    if cfg.tie_embeddings:
        out["embed"] = out["embed"] + g_head["embed"]
    else:
        out["head"] = g_head["head"]
    return out


def stage_specs(cfg: ModelConfig, mesh: Mesh, rules: Rules, zero3: bool,
                fp8: tuple[str, int, str] | None = None):
    """PartitionSpecs of the stage weights in a body manual over every axis: the table's
    (layers on `pipeline`), and ZeRO-3's extra split of the layers over `data`. `fp8 =
    (recipe, margin, transpose)`: the layer stacks carry their FP8 products' state
    (`fp8_lib.STATE_KEY`, as `fp8_scaling.attach` puts it), its histories split with the
    layers."""
    axes = stage_weights(cfg, transformer.logical_axes(cfg))
    shapes = stage_weights(cfg, transformer.param_shapes(cfg))
    is_axes = lambda a: isinstance(a, tuple)
    plain = lambda names, s: logical_to_spec(names, rules, mesh)
    layer = (lambda names, s: zero.zero_spec(names, s.shape, mesh, rules)) if zero3 else plain
    layers = jax.tree.map(layer, axes[1], shapes[1], is_leaf=is_axes)
    if fp8 is not None:  # each layer stack's products' state
        spec = logical_to_spec(fp8_lib.HISTORY_AXES, rules, mesh)
        for stack in layers.values():
            stack[fp8_lib.STATE_KEY] = fp8_lib.Fp8Products(spec, *fp8)
    return (jax.tree.map(plain, axes[0], shapes[0], is_leaf=is_axes), layers,
            jax.tree.map(plain, axes[2], shapes[2], is_leaf=is_axes))


def manual_ops(cfg: ModelConfig, mesh: Mesh, rules: Rules, zero3: bool) -> ManualOps:
    """The per-device ops of a stage body on this mesh."""
    tensor = "tensor" if mesh.shape["tensor"] > 1 else None
    dims = ()
    if zero3 and mesh.shape["data"] > 1:
        found = {}
        for group in stage_specs(cfg, mesh, rules, True)[1].values():
            for name, spec in group.items():
                for d, entry in enumerate(spec):
                    if "data" in core.spec_axes(jax.sharding.PartitionSpec(entry)):
                        found[name] = d - 1  # per layer: without the leading layers axis
        dims = tuple(sorted(found.items()))
    return ManualOps(tensor=tensor, sequence_parallel=rules["act_seq"] is not None,
                     zero_axis="data" if dims else None, zero_dims=dims,
                     batch_axes=tuple(a for a in BATCH_AXES if mesh.shape[a] > 1))


def unit_sizes(cfg: ModelConfig, layers: dict) -> dict:
    """Leading entries per layer unit in each layer stack: a MoE group holds moe_every - 1
    dense blocks and one MoE block; a dense model's unit is one block."""
    dense = cfg.moe_every - 1 if cfg.num_moe_layers else 1
    per_key = {k: dense if k == "blocks" else 1 for k in layers}
    return {k: jax.tree.map(lambda _, n=per_key[k]: n, v) for k, v in layers.items()}


def moe_zeros(cfg: ModelConfig):
    """Zero MoE metric sums: (router loss x tokens, drop fraction x tokens, load [E])."""
    if not cfg.num_moe_layers:
        return ()
    return (jnp.float32(0), jnp.float32(0), jnp.zeros((cfg.moe_experts,), jnp.float32))


def stage_fns(cfg: ModelConfig, ops: ManualOps, seq_len: int, counts: tuple[int, ...]
              ) -> StageFns:
    """The model's embed / unit / head-loss for a stage body (a unit is a layer, or an MoE
    group: `transformer.unit_params`).

    A stage's MoE router losses join the objective scaled by its microbatch's tokens (the
    executor divides everything by the token count, so they come out averaged over routing
    groups and microbatches, as a plain step averages them); the metrics are such sums too.
    """
    def unit(pu, x_BTD):
        b = x_BTD.shape[0]
        pos_BT = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (b, seq_len))
        y_BTD, stats = transformer.apply_unit(pu, x_BTD, pos_BT, cfg, ops)
        if stats is None:
            return y_BTD, jnp.float32(0), ()
        tokens = jnp.float32(b * seq_len)
        loss, drop, load = stats
        return y_BTD, loss * tokens, (loss * tokens, drop * tokens, load.astype(jnp.float32))

    def from_units(g):
        if not cfg.num_moe_layers:
            return {"blocks": g}
        dense, moe = g
        return {"blocks": jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), dense),
                "moe_blocks": moe}

    return StageFns(
        embed=lambda e, tok: transformer.embed(e, tok, cfg, ops),
        unit=unit,
        head_loss=lambda hp, x, tgt: transformer.head_loss(hp, x, tgt, cfg, ops),
        counts=tuple(counts),
        units=lambda lp: transformer.unit_params(lp, cfg),
        from_units=from_units,
        metrics=moe_zeros(cfg),
        unroll=cfg.scan_unroll)


def moe_metrics(cfg: ModelConfig, sums, num_microbatches: int) -> dict:
    """Router metrics from the pipeline's sums, as a plain step (averaged over microbatches)
    reports them; sums are already divided by the token count except the load."""
    if not sums:
        return {}
    loss, drop, load = sums
    load = load / num_microbatches
    return {"moe_aux_loss": loss, "moe_drop_fraction": drop / cfg.num_moe_layers,
            "moe_expert_load": load,
            "moe_load_max_over_mean": jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9)}


@dataclasses.dataclass(frozen=True)
class StageSetup:
    """Everything an engine needs to run the model's stages on a mesh."""

    cfg: ModelConfig
    mesh: Mesh
    counts: tuple[int, ...]  # layer units per (virtual) stage: p x v entries when interleaved
    specs: tuple  # stage-weight PartitionSpecs (manual over every axis)
    ops: ManualOps
    batch_axes: tuple[str, ...]  # the batch axes of this mesh (size > 1)
    fp8: tuple[str, int, str] | None = None  # FP8 (recipe, margin, transpose); None: plain

    @property
    def manual_axes(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)

    @property
    def num_chunks(self) -> int:
        """Chunks of layers per device (v of an interleaved schedule; 1 otherwise)."""
        return len(self.counts) // self.mesh.shape[core.PIPELINE]


def stage_setup(cfg: ModelConfig, mesh: Mesh, rules: Rules, *, zero3: bool = False,
                stage_layer_counts=None, num_chunks: int = 1,
                fp8: tuple[str, int, str] | None = None) -> StageSetup:
    """Stage specs and ops of `cfg` on `mesh` under `rules` (the run's table; the layers go
    onto the pipeline stages whatever it says). `num_chunks` > 1: each stage holds that
    many chunks of layers, for an interleaved schedule. `fp8 = (recipe, margin,
    transpose)`: the blocks' projections are FP8 products whose state comes in each layer
    stack's `fp8_lib.STATE_KEY` entry; its gradient there is the observed amaxes."""
    rules = rules.with_overrides(**PIPELINE_STAGES)
    counts = core.chunk_layer_split(transformer.layer_units(cfg), mesh.shape[core.PIPELINE],
                                    num_chunks, stage_layer_counts)
    if len(set(counts)) > 1 and zero3:
        raise ValueError(f"stage_layer_counts={counts} with train.zero_stage=3: an uneven "
                         "split pads the layer stack, which ZeRO-3's per-layer shards cannot "
                         "follow; use an even split or zero_stage <= 2")
    return StageSetup(cfg, mesh, counts, stage_specs(cfg, mesh, rules, zero3, fp8),
                      manual_ops(cfg, mesh, rules, zero3),
                      tuple(a for a in BATCH_AXES if mesh.shape[a] > 1), fp8)


def loss_and_grads(st: StageSetup, params: dict, batch: dict, sched, *,
                   bubble_value: float = 0.0, recompute: bool = False):
    """(mean loss, metrics, model-shaped grads) of one pipelined pass over `batch` (m =
    sched.num_microbatches microbatches per batch shard). Equals plain autodiff of the
    model's loss accumulated over the same microbatches, for any schedule and split.

    A stage keeps its forward's residuals for the backward (no recomputed forward; what a
    residual is follows `model.remat`: with remat only each layer's input), except on an
    uneven split or with `recompute=True`, where the backward recomputes the forward."""
    cfg = st.cfg
    if sched.num_chunks != st.num_chunks:
        raise ValueError(f"schedule {sched.name!r} runs {sched.num_chunks} chunks per stage but "
                         f"the stage setup holds {st.num_chunks} (train.pipeline_chunks); build "
                         "both with the same number")
    tokens, targets = batch["inputs"], batch["targets"]
    w = stage_weights(cfg, params)
    sizes = unit_sizes(cfg, w[1])
    p = st.mesh.shape[core.PIPELINE]
    w = (w[0], pad_layers(w[1], st.counts, sizes, p), w[2])
    fns = stage_fns(cfg, st.ops, tokens.shape[1], st.counts)
    loss, (g_e, g_l, g_h), sums, count = run_sync(
        w, tokens, targets, mesh=st.mesh, sched=sched, fns=fns, specs=st.specs,
        manual_axes=st.manual_axes, batch_axes=st.batch_axes, bubble_value=bubble_value,
        uneven=len(set(st.counts)) > 1, recompute=recompute)
    sums = jax.tree.map(lambda a: a / count, sums[:2]) + sums[2:] if sums else ()
    metrics = moe_metrics(cfg, sums, sched.num_microbatches)
    grads = model_grads(cfg, (g_e, unpad_layers(g_l, st.counts, sizes, p), g_h))
    return loss, metrics, grads


def manual_loss_and_grads(st: StageSetup, params: dict, batch: dict):
    """(mean loss, metrics, model-shaped grads) of the whole model as ONE per-device program
    (no pipeline stages, one microbatch): `st.ops` writes every collective out, e.g. the
    collective matmuls of `train.tp_comm='collective'`. The layer scan and the gradient
    reduction are the pipeline's (`StageFns`, `core.finish`); the mesh's pipeline axis must
    be 1. Equals plain autodiff of the model's loss."""
    if st.mesh.shape[core.PIPELINE] != 1:
        raise ValueError("manual_loss_and_grads runs one stage; use loss_and_grads for "
                         f"mesh.pipeline={st.mesh.shape[core.PIPELINE]}")
    cfg = st.cfg
    fns = stage_fns(cfg, st.ops, batch["inputs"].shape[1], st.counts)

    def body(w, tokens, targets):
        def objective(w):
            def step(x, pu):
                y, obj, metrics = fns.unit(pu, x)
                return y, (obj, metrics)

            x = fns.embed(w[0], tokens)
            x, (objs, metrics) = jax.lax.scan(step, x, fns.units(w[1]), unroll=fns.unroll)
            loss, count = fns.head_loss(w[2], x, targets)
            loss = loss + jnp.sum(objs)  # router losses, already scaled by the tokens
            return loss, (loss, count, jax.tree.map(lambda a: jnp.sum(a, 0), metrics))

        (_, (loss, count, metrics)), grads = jax.value_and_grad(objective, has_aux=True)(w)
        acc = (grads, loss, jnp.float32(count), metrics)
        return core.finish(acc, w, st.specs, (core.PIPELINE, *st.batch_axes))

    batch_spec = jax.sharding.PartitionSpec(st.batch_axes or None)
    P0 = jax.sharding.PartitionSpec()
    fn = core.manual(body, st.mesh, in_specs=(st.specs, batch_spec, batch_spec),
                     out_specs=(P0, st.specs, P0, P0), axes=st.manual_axes)
    loss, grads, sums, count = fn(stage_weights(cfg, params), batch["inputs"], batch["targets"])
    sums = jax.tree.map(lambda a: a / count, sums[:2]) + sums[2:] if sums else ()
    return loss, moe_metrics(cfg, sums, 1), model_grads(cfg, grads)


def pipedream_engine(cfg: ModelConfig, mesh: Mesh, rules: Rules, optimizer, sched, mode: str,
                     window: int = 1):
    """update(params, opt_state, batch) -> (params, opt_state, per-microbatch losses [m]):
    one asynchronous PipeDream stream (`mode` 'stash', 'nostash' or '2bw') over the batch's
    microbatches with `sched` (1F1B, or 'sequential' for one microbatch in flight). Needs
    untied embeddings: stage 0 owns the table, the last stage the output layer."""
    st = stage_setup(cfg, mesh, rules)
    vplan = pipedream.version_plan(sched, mode, window)
    embed_s, layer_s, head_s = st.specs
    specs = {"embed": embed_s["embed"], **layer_s, **head_s}
    last = mesh.shape[core.PIPELINE] - 1
    owner = {k: (jax.tree.map(lambda _: -1, v) if k in layer_s else 0 if k == "embed" else last)
             for k, v in specs.items()}
    layout = pipedream.Layout(split=lambda prm: stage_weights(cfg, prm),
                              merge=lambda g: model_grads(cfg, g), owner=owner)

    def update(params, opt_state, batch):
        fns = stage_fns(cfg, st.ops, batch["inputs"].shape[1], st.counts)
        params, opt_state, losses, _, _ = pipedream.run(
            params, opt_state, batch["inputs"], batch["targets"], mesh=mesh, sched=sched,
            vplan=vplan, fns=fns, layout=layout, specs=specs, manual_axes=st.manual_axes,
            batch_axes=st.batch_axes, optimizer=optimizer, window=window)
        return params, opt_state, losses

    return update
