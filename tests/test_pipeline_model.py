"""The gendist transformer pipelined equals the plain model: loss, grads, steps, ZeRO.

Bubbles are filled with NaN so anything a stage holds or sends while idle poisons the result.
"""

import functools

import jax
import numpy as np
import pytest
from helpers import assert_trees_close as trees_close
from helpers import experiment, mesh_of, small_config

from gendist.data.batches import TextData, shard_batch
from gendist.models import transformer
from gendist.parallel.pipeline import model as stage_model
from gendist.parallel.pipeline import schedules as S
from gendist.parallel.pipeline import stats as SS
from gendist.presets import replace
from gendist.sharding import rules_for
from gendist.training import train

RTOL = 1e-5  # fp32, fixed
# Entries that cancel to ~0 are compared against their leaf's largest entry instead.
LEAF_ATOL = 1e-6
NAN = float("nan")


def config(**kw):
    cfg = replace(small_config(), **{"model.num_layers": 4, "model.vocab_size": 64,
                                     "train.seq_len": 8})
    return replace(cfg, **kw)


@pytest.fixture(scope="module")
def corpus():
    return TextData.from_config(small_config().data)


def text_batch(corpus, step, size, seq=8, vocab=64):
    b = corpus.global_batch(step, size, seq)
    return {k: (v % vocab).astype(np.int32) for k, v in b.items()}


assert_trees_close = functools.partial(trees_close, rtol=RTOL,
                                       leaf_atol=LEAF_ATOL)


# (data, pipeline, tensor, schedule, m, tied): m in {1, p, 2p, 3p+1} over p = 2 and 4, both
# schedules on both p, one Megatron tensor-parallel case (heads, MLP and vocab over
# `tensor`) and one untied output layer.
CASES = [
    (4, 2, 1, "1f1b", 1, True),
    (2, 2, 2, "1f1b", 4, True),
    (4, 2, 1, "gpipe", 7, True),
    (2, 4, 1, "gpipe", 4, False),
    (2, 4, 1, "1f1b", 13, True),
    (4, 2, 1, "1f1b-phased", 6, True),  # all stages F or all B per step
    (4, 2, 1, "interleaved-1f1b", 4, True),  # 2 chunks per stage; the tied table on both
]


@pytest.mark.parametrize("data, pipe, tensor, name, m, tied", CASES)
def test_loss_and_grads_match_plain_model(corpus, data, pipe, tensor, name, m, tied):
    cfg = config(**{"model.tie_embeddings": tied})
    mesh = mesh_of(8, data=data, pipeline=pipe, tensor=tensor)
    params = transformer.init_params(cfg.model, 0)
    batch = text_batch(corpus, m, data * m)
    chunks = 2 if name == "interleaved-1f1b" else 1
    st = stage_model.stage_setup(cfg.model, mesh, rules_for(replace(cfg.mesh, pipeline=pipe)),
                                 num_chunks=chunks)
    sched = S.make(name, pipe, m, chunks)
    run = jax.jit(lambda p, b: stage_model.loss_and_grads(st, p, b, sched, bubble_value=NAN))
    loss, _, grads = run(params, shard_batch(batch, mesh))
    want_loss, want_grads = jax.jit(jax.value_and_grad(
        lambda p, b: train.loss_fn(cfg, p, b)))(params, batch)
    assert set(grads) == set(want_grads) == ({"embed", "blocks", "final_norm"}
                                             | (set() if tied else {"head"}))
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    assert_trees_close(grads, want_grads)
    if tensor > 1:  # the stage's weights stayed split over `tensor`
        assert "tensor" in tuple(grads["blocks"]["wq"].sharding.spec)


def pipelined(cfg, schedule, m):
    return replace(cfg, **{"train.pipeline_schedule": schedule,
                           "train.pipeline_microbatches": m})


def run_steps(setup, corpus, n, size):
    state = setup.init_state()
    losses = []
    for i in range(n):
        state, metrics = setup.step_fn(state, shard_batch(text_batch(corpus, 100 + i, size),
                                                          setup.mesh))
        losses.append(float(metrics["loss"]))
    return state, losses


STEP_ATOL = 1e-6  # params after optimizer steps: test_data_parallel's fixed fp32 tolerance
K_MAX = 10.0  # the most `assert_params_close` widens it for an element with a small √v


@pytest.fixture(scope="module")
def plain_three_steps(corpus):
    """Three AdamW steps of the plain gendist train step on one device: (params, losses,
    Adam's second moments)."""
    cfg = config(**{"train.batch_size": 16})
    state, losses = run_steps(train.build(cfg, mesh_of(1)), corpus, 3, 16)
    nu = state["opt_state"][1][0].nu
    return jax.device_get(state["params"]), losses, jax.device_get(nu)


def assert_params_close(got, want, nu):
    """Params after AdamW steps, element by element. Adam divides each gradient by its
    √v, so a gradient's fp32 rounding (summation order differs between the pipelined and
    the plain step) reaches the parameter amplified by 1/√v: an element whose √v is k times
    below its leaf's median gets k times the fixed tolerance, 1 <= k <= K_MAX so that no
    element goes unchecked. (On an AVX-512 host one w_up element of 8,192, √v 4.6x below the
    median, differed by 1.1e-6 against 1e-6; every other element was within 0.4e-6.)"""
    for (path, a), b, v in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                               jax.tree.leaves(nu), strict=True):
        root = np.sqrt(np.asarray(v, np.float64))
        k = np.clip(np.median(root) / np.maximum(root, 1e-30), 1.0, K_MAX)
        err = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
        bound = STEP_ATOL * k + RTOL * np.abs(np.asarray(b, np.float64))
        bad = err > bound
        assert not bad.any(), (f"{jax.tree_util.keystr(path)}: {int(bad.sum())} of {bad.size} "
                               f"outside the Adam-scaled tolerance; worst excess "
                               f"{float((err - bound).max()):.3g}")


def test_three_adamw_steps_match_plain_train_step(corpus, plain_three_steps):
    """gendist's own optimizer (clip + AdamW + schedule) and state layout, 1F1B over 4 stages."""
    cfg = config(**{"train.batch_size": 16})
    setup = train.build(pipelined(cfg, "1f1b", 4), mesh_of(8, data=2, pipeline=4))
    state, losses = run_steps(setup, corpus, 3, 16)
    want_params, want_losses, want_nu = plain_three_steps
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    assert_params_close(state["params"], want_params, want_nu)
    assert set(state) == {"step", "params", "opt_state"} and int(state["step"]) == 3
    assert setup.traces["step"] == 1, "the pipelined step recompiled across steps"
    # Each stage stores only its own layers.
    assert state["params"]["blocks"]["wq"].sharding.spec[0] == "pipeline"


def test_zero1_moments_sharded_over_data_and_stages(corpus, plain_three_steps):
    """ZeRO-1 composes: moments split over `data` (optim.state_shardings) and over stages."""
    cfg = config(**{"train.batch_size": 16, "train.zero_stage": 1})
    mesh = mesh_of(8, data=4, pipeline=2)
    setup = train.build(pipelined(cfg, "gpipe", 2), mesh)
    state, losses = run_steps(setup, corpus, 3, 16)
    want_params, want_losses, want_nu = plain_three_steps
    np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
    assert_params_close(state["params"], want_params, want_nu)
    # The plain step's ZeRO-1 placement of every moment, with `layers` moved onto stages.
    plain = train.build(cfg, mesh)
    adam = lambda opt_state: opt_state[1][0]
    for name in ("wq", "w_up", "attn_norm"):
        plain_spec = tuple(adam(plain.state_sharding["opt_state"]).mu["blocks"][name].spec)
        mu = adam(state["opt_state"]).mu["blocks"][name]
        got_spec = tuple(mu.sharding.spec)
        assert got_spec[0] == "pipeline" and got_spec[1:] == plain_spec[1:], (name, got_spec)
    mu = adam(state["opt_state"]).mu["blocks"]["wq"]
    assert mu.addressable_shards[0].data.size == mu.size // 8  # 1/(stages x data) per device
    mu_embed = adam(state["opt_state"]).mu["embed"]
    assert tuple(mu_embed.sharding.spec) == tuple(adam(plain.state_sharding["opt_state"]).mu["embed"].spec)
    assert "data" in tuple(mu_embed.sharding.spec)


@pytest.mark.parametrize("kw, field", [
    # 8 rows / 2 accumulation steps / 2 data shards do not split into 4 microbatches
    ({"train.grad_accum": 2, "train.batch_size": 8}, "train.pipeline_microbatches"),
    ({"train.batch_size": 12}, "train.pipeline_microbatches"),  # 12 / 2 shards / 4
])
def test_bad_input_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        train.build(pipelined(config(**kw), "1f1b", 4), mesh_of(8, data=2, pipeline=4))


@pytest.mark.parametrize("kw, field", [
    ({"train.pipeline_chunks": 2}, "train.pipeline_chunks"),  # with 1f1b
    ({"train.pipeline_schedule": "interleaved-1f1b"}, "train.pipeline_chunks"),  # 1 chunk
    ({"train.pipeline_schedule": "interleaved-1f1b", "train.pipeline_chunks": 3},
     "train.pipeline_chunks"),  # 4 stages x 3 chunks do not divide 8 layers
    ({"train.pipeline_schedule": "interleaved-1f1b", "train.pipeline_chunks": 2,
      "train.pipeline_microbatches": 6, "train.batch_size": 12}, "train.pipeline_microbatches"),
])
def test_interleaved_config_errors_name_the_field(kw, field):
    """8 layers on mesh.pipeline=4: 2 chunks fit (the config builds); the rest name the
    field to change."""
    def build(**kw):
        cfg = replace(config(**{"model.num_layers": 8, "train.batch_size": 16}),
                      **{"train.pipeline_microbatches": 4, **kw})
        return train.build(cfg, mesh_of(8, data=2, pipeline=4))
    with pytest.raises(ValueError, match=field):
        build(**kw)
    build(**{"train.pipeline_schedule": "interleaved-1f1b", "train.pipeline_chunks": 2})


def test_plan_lines_count_the_table():
    from gendist.parallel.pipeline import schedules as S
    lines = SS.pipeline_plan_lines(4, 8, "1f1b")
    assert "24/88 idle" in lines[1] and "0.2727" in lines[1] and "0.2727" in lines[2]
    assert "4 3 2 1 (max 4" in lines[3]
    assert "8 8 8 8 (max 8" in SS.pipeline_plan_lines(4, 8, "gpipe")[3]
    with pytest.raises(ValueError, match="num_microbatches"):
        SS.pipeline_plan_lines(4, 8, S.gpipe(4, 6))


def test_partitioner_beats_uniform_on_uneven_layers():
    """experiments/partition_uneven.py's model: layers 4 and 5 run their MLP six times.
    On the measured profile the DP split's bottleneck is below the uniform split's."""

    exp = experiment("partition_uneven")
    params, fns = exp.uneven_model(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 32), 0, 128)
    _, dp, uniform = exp.plan_both(params, fns, tokens, 4, repeats=3)
    assert uniform.counts == (2, 2, 2, 2)
    assert sum(dp.counts) == 8 and dp.bottleneck < uniform.bottleneck
    assert 5 in np.cumsum(dp.counts)  # a stage boundary between the heavy layers 4 and 5
