"""Data parallelism equals the single-device math; the step compiles once."""

import jax
import numpy as np
import pytest
from helpers import mesh_of, small_config

from gendist.data.batches import TextData, shard_batch
from gendist.models import transformer
from gendist.training import train

RTOL = 1e-5  # fp32


@pytest.fixture(scope="module")
def data():
    return TextData.from_config(small_config().data)


def loss_and_grads(cfg, mesh, batch):
    setup = train.build(cfg, mesh)
    state = setup.init_state()
    b = shard_batch(batch, mesh)
    fn = jax.jit(jax.value_and_grad(lambda p, b: train.loss_fn(cfg, p, b)))
    return jax.device_get(fn(state["params"], b))


def run_steps(cfg, mesh, data, n):
    setup = train.build(cfg, mesh)
    state = setup.init_state()
    losses = []
    for i in range(n):
        batch = shard_batch(data.global_batch(i, cfg.train.batch_size, cfg.train.seq_len), mesh)
        state, m = setup.step_fn(state, batch)
        losses.append(float(m["loss"]))
    return setup, jax.device_get(state["params"]), losses


def assert_tree_close(a, b, rtol=RTOL, atol=1e-7):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("n_data", [8])  # data 2 and 4: the ZeRO and tensor meshes
def test_loss_grads_and_three_steps_match_single_device(data, n_data):
    cfg = small_config()
    batch = data.global_batch(0, cfg.train.batch_size, cfg.train.seq_len)
    loss1, g1 = loss_and_grads(cfg, mesh_of(1), batch)
    lossn, gn = loss_and_grads(cfg, mesh_of(n_data, data=n_data), batch)
    np.testing.assert_allclose(lossn, loss1, rtol=RTOL)
    assert_tree_close(gn, g1)

    _, p1, l1 = run_steps(cfg, mesh_of(1), data, 3)
    setup, pn, ln = run_steps(cfg, mesh_of(n_data, data=n_data), data, 3)
    np.testing.assert_allclose(ln, l1, rtol=RTOL)
    assert_tree_close(pn, p1, rtol=1e-5, atol=1e-6)
    assert setup.traces["step"] == 1, "the train step recompiled across steps"


def test_batch_sharded_over_data(data):
    mesh = mesh_of(8, data=8)
    b = shard_batch(data.global_batch(0, 8, 16), mesh)
    assert b["inputs"].sharding.shard_shape(b["inputs"].shape) == (1, 16)


def test_grad_accumulation_matches_one_big_batch(data):
    cfg1 = small_config()
    cfg4 = small_config(grad_accum=4)
    mesh = mesh_of(2, data=2)
    _, p1, l1 = run_steps(cfg1, mesh, data, 2)
    _, p4, l4 = run_steps(cfg4, mesh, data, 2)
    np.testing.assert_allclose(l4, l1, rtol=1e-5)
    assert_tree_close(p4, p1, rtol=1e-4, atol=1e-6)


def test_params_follow_logical_axes():
    cfg = small_config()
    axes = transformer.logical_axes(cfg.model)
    assert axes["blocks"]["wq"] == ("layers", "embed", "heads", "head_dim")
    assert axes["embed"] == ("vocab", "embed")
