"""Collective matmuls (`train.tp_comm='collective'`) equal the single-device math, and the
compiled program moves the sequence-parallel activations by collective-permutes only.

Block: one tensor-4 block (data 2) in value and gradients against one device, fp32 rtol 1e-5,
and its compiled HLO: 12 activation-sized collective-permutes forward (4 rings of 3 steps:
q/k/v and MLP-in gathers, wo and MLP-down reduce-scatters) and 12 backward, no all-gather,
reduce-scatter or all-reduce of an activation over `tensor`. Train step: data 2 x tensor 2
with ZeRO-3, the loss and gradients of a step against one device's autodiff; no activation all-gather or
reduce-scatter over `tensor` runs inside the layer loop. Config errors name the field.
"""

import functools

import jax
import numpy as np
import pytest
from helpers import assert_trees_close, mesh_of
from test_tensor_parallel import _block_case, _value_and_grads, tp_config

from gendist.collectives import parse_collectives
from gendist.data.batches import TextData, shard_batch
from gendist.models import transformer
from gendist.parallel import manual
from gendist.presets import replace
from gendist.training import checks as train_checks
from gendist.training import train

RTOL, ATOL = 1e-5, 1e-7  # fp32, as tests/test_tensor_parallel.py


def test_collective_block_equals_one_device_with_permutes_only():
    cfg, mesh, _, args, shardings = _block_case(True)
    want = _value_and_grads(lambda p, x, pos: transformer.block(p, x, pos, cfg)[0])(*args)
    fn = _value_and_grads(lambda p, x, pos: manual.tp_block_forward(
        p, x, pos, cfg, mesh, sequence_parallel=True, collective=True), shardings)
    got = fn(*args)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    assert_trees_close(got[1], want[1], rtol=RTOL, leaf_atol=1e-6)
    colls = parse_collectives(fn.lower(*args).compile().as_text(), mesh)
    act = 8 // 2 * 16 // 4 * 32 * 4  # [b, T/tp, D] fp32: one ring step
    on_tensor = [c for c in colls if c.axes == "tensor" and c.payload >= act]
    for backward in (False, True):
        kinds = sorted(c.kind for c in on_tensor if c.backward == backward)
        assert kinds == ["collective-permute"] * 12, (backward, kinds)


@pytest.fixture(scope="module")
def data():
    return TextData.from_config(tp_config().data)


def test_collective_step_equals_one_device(data):
    cfg = replace(tp_config(stage=3, sp=True), **{"train.tp_comm": "collective"})
    mesh = mesh_of(4, data=2, tensor=2)
    setup = train.build(cfg, mesh, with_grads=True)
    state = setup.init_state()
    params = jax.device_get(state["params"])
    batch = data.global_batch(0, 8, 16)
    compiled = setup.step_fn.lower(state, shard_batch(batch, mesh)).compile()
    _, metrics = compiled(state, shard_batch(batch, mesh))
    one = jax.jit(jax.value_and_grad(functools.partial(train.loss_fn, tp_config())))
    want_loss, want_grads = one(params, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(want_loss), rtol=RTOL)
    assert_trees_close(jax.device_get(metrics["grads"]), want_grads, rtol=RTOL, atol=ATOL,
                       leaf_atol=1e-6)
    colls = parse_collectives(compiled.as_text(), mesh)
    in_loop = [c for c in colls if c.axes == "tensor" and c.count > 1]
    permutes = [c for c in in_loop if c.kind == "collective-permute"]
    assert len(permutes) >= 8, in_loop  # 4 one-step rings forward, 4 backward, per layer
    assert not [c for c in in_loop if c.kind in ("all-gather", "reduce-scatter")], in_loop


@pytest.mark.parametrize("override, match", [
    ({"mesh.tensor": 1, "mesh.data": 8}, r"train.tp_comm=collective with mesh.tensor=1"),
    ({"mesh.sequence_parallel": False}, r"with mesh.sequence_parallel=False.*--mesh.seq"),
])
def test_collective_config_errors(override, match):
    cfg = replace(tp_config(sp=True), **{"train.tp_comm": "collective", "mesh.data": 2,
                                         "mesh.tensor": 4, **override})
    with pytest.raises(ValueError, match=match):
        train_checks.validate_config(cfg, mesh_of(8, data=cfg.mesh.data, tensor=cfg.mesh.tensor))


def test_tp_comm_value_checked():
    with pytest.raises(ValueError, match=r"train.tp_comm='ring': choose 'xla'"):
        replace(tp_config(), **{"train.tp_comm": "ring"})
