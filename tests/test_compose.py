"""Parallel forms composed, each against one device (fp32, the project's fixed tolerances).

Pipeline stages run manual over every mesh axis (Megatron f/g, ZeRO-3 gathers, the MoE
all-to-all written out), so these are the cases that the separate tests of each form do not
reach: pipeline x tensor x data with ZeRO-3 and sequence parallelism; pipeline x expert
with a top-2 MoE model; pipeline with gradient accumulation; TeraPipe x tensor; and the
three PipeDream modes driven through `train.build`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, mesh_of, run_steps_with_grads, small_config, stash_update

from gendist.data.batches import TextData, shard_batch
from gendist.models import transformer
from gendist.models.moe import moe_ffn
from gendist.models.ops import Ops
from gendist.presets import replace
from gendist.training import optim, train

RTOL, ATOL = 1e-5, 1e-7  # fp32, as tests/test_zero.py
PARAM_ATOL = 1e-6  # params after optimizer steps, as tests/test_zero.py


@pytest.fixture(scope="module")
def data():
    return TextData.from_config(small_config().data)


def assert_runs_match(got, want):
    losses, grads, params, _, _ = got
    w_losses, w_grads, w_params, _, _ = want
    np.testing.assert_allclose(losses, w_losses, rtol=RTOL)
    for g, wg in zip(grads, w_grads, strict=True):
        assert_trees_close(g, wg, rtol=RTOL, atol=ATOL)
    assert_trees_close(params, w_params, rtol=RTOL, atol=PARAM_ATOL)


def test_pipeline_tensor_data_zero3_sequence_parallel(data):
    cfg = replace(small_config(), **{"train.zero_stage": 3, "mesh.sequence_parallel": True,
                                     "train.pipeline_microbatches": 2})
    got = run_steps_with_grads(cfg, mesh_of(8, data=2, pipeline=2, tensor=2), data, 2)
    want = run_steps_with_grads(small_config(), mesh_of(1), data, 2)
    assert_runs_match(got, want)
    params = got[4].state_sharding["params"]["blocks"]["wq"].spec
    assert params[0] == "pipeline" and "tensor" in params and "data" in str(params)


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b-split"])
def test_split_backward_schedules_match_one_device(data, schedule):
    """B and W as separate steps (ZB-H1 defers W into the bubbles), data 2 x pipeline 2 x
    tensor 2, on the model's engine."""
    cfg = replace(small_config(), **{"train.pipeline_schedule": schedule,
                                     "train.pipeline_microbatches": 4})
    got = run_steps_with_grads(cfg, mesh_of(8, data=2, pipeline=2, tensor=2), data, 1)
    want = run_steps_with_grads(small_config(), mesh_of(1), data, 1)
    assert_runs_match(got, want)


def test_pipeline_with_gradient_accumulation(data):
    cfg = replace(small_config(), **{"train.grad_accum": 2, "train.pipeline_microbatches": 2,
                                     "train.pipeline_schedule": "gpipe"})
    got = run_steps_with_grads(cfg, mesh_of(4, data=2, pipeline=2), data, 2)
    want = run_steps_with_grads(small_config(), mesh_of(1), data, 2)
    assert_runs_match(got, want)


def test_uneven_split_through_train(data):
    """Stages of 2 and 1 layers: each stage's branches run exactly its own layers."""
    three = replace(small_config(), **{"model.num_layers": 3})
    cfg = replace(three, **{"train.pipeline_stage_layers": (2, 1),
                            "train.pipeline_microbatches": 2})
    got = run_steps_with_grads(cfg, mesh_of(4, data=2, pipeline=2), data, 1)
    want = run_steps_with_grads(three, mesh_of(1), data, 1)
    assert_runs_match(got, want)


# --- pipeline x expert, top-2 MoE ---------------------------------------------------------

MOE = {"model.num_layers": 4, "model.moe_experts": 4, "model.moe_top_k": 2,
       "model.moe_every": 2, "model.moe_capacity_factor": 4.0}  # capacity: nothing dropped


class GroupedOps(Ops):
    """One device, tokens routed in `groups` contiguous batch groups: how a mesh with that
    many batch shards routes them (`moe_ffn(num_groups=...)` is the sharded layer's oracle)."""

    groups = 4

    def moe(self, p_moe, h_BTD, cfg):
        y, aux = moe_ffn(p_moe, h_BTD, cfg, num_groups=self.groups)
        return y, aux


def test_pipeline_expert_moe_matches_one_device(data):
    """data 2 x pipeline 2 x expert 2, m = 2: each batch shard routes each of its microbatches
    as one group. The oracle runs microbatch i of every shard together on one device, routed
    in one group per shard, and averages over the two microbatches."""
    cfg = replace(small_config(), **MOE, **{"train.pipeline_microbatches": 2})
    mesh = mesh_of(8, data=2, pipeline=2, expert=2)
    setup = train.build(cfg, mesh, with_grads=True)
    state = setup.init_state()
    params = jax.device_get(state["params"])
    batch = data.global_batch(0, 8, 16)
    _, metrics = setup.step_fn(state, shard_batch(batch, mesh))
    metrics = jax.device_get(metrics)

    def micro(arr, i, shards=4, m=2):  # rows of microbatch i as the executor splits them
        return arr.reshape(shards, m, -1, *arr.shape[1:])[:, i].reshape(-1, *arr.shape[1:])

    one = jax.jit(jax.value_and_grad(
        lambda p, b: train.loss_and_metrics(cfg, p, b, GroupedOps()), has_aux=True))
    runs = [one(params, {k: micro(v, i) for k, v in batch.items()}) for i in range(2)]
    (loss, want), grads = jax.tree.map(lambda a, b: (a + b) / 2, *runs)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=RTOL)
    for k in ("ce_loss", "moe_aux_loss", "moe_drop_fraction", "moe_expert_load"):
        np.testing.assert_allclose(metrics[k], want[k], rtol=RTOL, atol=ATOL, err_msg=k)
    assert metrics["moe_aux_loss"] > 0 and metrics["moe_drop_fraction"] == 0
    assert_trees_close(metrics["grads"], grads, rtol=RTOL, atol=ATOL)


# --- TeraPipe x tensor ---------------------------------------------------------------------

def test_terapipe_tensor_through_train(data):
    cfg = replace(small_config(), **{"train.terapipe_slices": 4})
    got = run_steps_with_grads(cfg, mesh_of(8, data=2, pipeline=2, tensor=2), data, 1)
    want = run_steps_with_grads(small_config(), mesh_of(1), data, 1)
    assert_runs_match(got, want)


# --- PipeDream modes through train ------------------------------------------------------------

P_STAGES, M, DATA = 2, 4, 2


def pipedream_config(schedule):
    return replace(small_config(), **{
        "model.tie_embeddings": False, "train.pipeline_schedule": schedule,
        "train.pipeline_microbatches": M, "train.pipedream_window": 2,
        "train.batch_size": DATA * M * 2, "train.warmup_steps": 2})


def stage_params(params, s):
    """Stage s of a 2-stage split: its layer slice, plus embed (s = 0) or the head."""
    n = params["blocks"]["wq"].shape[0] // P_STAGES
    out = {"blocks": jax.tree.map(lambda a: a[s * n:(s + 1) * n], params["blocks"])}
    extra = ("embed",) if s == 0 else ("final_norm", "head")
    return out | {k: params[k] for k in extra}


def replay(cfg, params, batch, fwd_version, bwd_version, window):
    """One device: microbatch i forwards stage s with version fwd_version(s, i) and
    backwards with bwd_version(s, i); each stage updates itself after `window` backwards
    with the run's optimizer (its clip over the stage's own weights)."""
    m_cfg = cfg.model
    opt = optim.make_optimizer(cfg.train)
    pos = lambda x: jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    stage0 = lambda w, tok: transformer.run_layers(
        {"blocks": w["blocks"]}, transformer.embed(w, tok, m_cfg), pos(tok), m_cfg)[0]

    def stage1(w, x, tgt):
        y = transformer.run_layers({"blocks": w["blocks"]}, x, pos(x), m_cfg)[0]
        loss, count = transformer.head_loss(w, y, tgt, m_cfg)
        return loss / count

    # Each piece jitted once (the same math as eager; eager re-traced every microbatch).
    fwd0 = jax.jit(stage0)
    grad1 = jax.jit(jax.value_and_grad(stage1, argnums=(0, 1)))
    grad0 = jax.jit(lambda w, tok, cot: jax.vjp(lambda w: stage0(w, tok), w)[1](cot)[0])
    versions = [[stage_params(params, s)] for s in range(P_STAGES)]
    states = [opt.init(v[0]) for v in versions]
    acc = [None, None]
    losses = []
    for i in range(M):
        rows = lambda a, i=i: a.reshape(DATA, M, -1, a.shape[-1])[:, i].reshape(-1, a.shape[-1])
        tok, tgt = rows(batch["inputs"]), rows(batch["targets"])
        x = fwd0(versions[0][fwd_version(0, i)], tok)
        loss, (g1, cot) = grad1(versions[1][bwd_version(1, i)], x, tgt)
        grads = [grad0(versions[0][bwd_version(0, i)], tok, cot), g1]
        losses.append(float(loss))
        stash_update(acc, grads, versions, states, opt, i, window)
    final = [v[-1] for v in versions]
    blocks = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), final[0]["blocks"],
                          final[1]["blocks"])
    return {"embed": final[0]["embed"], "blocks": blocks, "final_norm": final[1]["final_norm"],
            "head": final[1]["head"]}, float(np.mean(losses))


LATEST = lambda s, i: i  # noqa: E731 - the newest version: i updates done before it
STASHED = lambda s, i: max(0, i - (P_STAGES - 1 - s))  # noqa: E731 - 1F1B's forward


@pytest.mark.parametrize("schedule, fwd, bwd, window", [
    ("pipedream", STASHED, STASHED, 1),
    ("pipedream-nostash", STASHED, LATEST, 1),
    ("2bw", *(2 * (lambda s, i: max(0, i // 2 - 1),)), 2),
])
def test_pipedream_modes_through_train(data, schedule, fwd, bwd, window):
    cfg = pipedream_config(schedule)
    mesh = mesh_of(4, data=DATA, pipeline=P_STAGES)
    setup = train.build(cfg, mesh)
    state = setup.init_state()
    params = jax.device_get(state["params"])
    batch = data.global_batch(0, cfg.train.batch_size, 16)
    new_state, metrics = setup.step_fn(state, shard_batch(batch, mesh))
    want, want_loss = replay(cfg, params, batch, fwd, bwd, window)
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=RTOL)
    assert_trees_close(jax.device_get(new_state["params"]), want, rtol=RTOL, atol=PARAM_ATOL)
    assert setup.traces["step"] == 1


@pytest.mark.parametrize("kw, fields", [
    ({"train.pipeline_schedule": "pipedream"}, ("pipedream", "model.tie_embeddings")),
    ({"train.pipeline_schedule": "2bw", "model.tie_embeddings": False,
      "train.zero_stage": 1}, ("2bw", "train.zero_stage")),
    ({"train.terapipe_slices": 4, "mesh.sequence_parallel": True},
     ("train.terapipe_slices", "mesh.sequence_parallel")),
    ({"model.num_layers": 3}, ("mesh.pipeline=2", "model.num_layers=3")),
])
def test_combinations_refused_name_both_fields(kw, fields):
    cfg = replace(small_config(), **kw)
    with pytest.raises(ValueError) as e:
        train.build(cfg, mesh_of(8, data=2, pipeline=2, tensor=2))
    for f in fields:
        assert f in str(e.value), (f, str(e.value))



def test_stage_bodies_are_manual_over_every_axis(monkeypatch):
    """cuDNN attention is custom-partitioned: a stage body that left an axis (`tensor`) to
    the compiler ran its partitioner inside the pipeline's shard_map and failed to compile
    on GPUs. Attention inside every stage must see a mesh whose axes are all
    manual, so that no partitioner runs there."""
    from gendist.models import attention as attention_lib
    seen = []
    real = attention_lib.attention

    def recording(q, k, v, **kw):
        seen.append(bool(jax.sharding.get_abstract_mesh().are_all_axes_manual))
        return real(q, k, v, **kw)

    monkeypatch.setattr(transformer, "attention", recording)
    cfg = replace(small_config(), **{"train.pipeline_microbatches": 2})
    mesh = mesh_of(8, data=2, pipeline=2, tensor=2)
    setup = train.build(cfg, mesh)
    batch = {k: jax.ShapeDtypeStruct((8, 16), jnp.int32, sharding=setup.batch_sharding)
             for k in ("inputs", "targets")}
    setup.step_fn.lower(setup.abstract_state(), batch)  # traces every stage branch
    assert seen and all(seen), seen
