"""ZeRO over `data` (Rajbhandari et al. 2020) equals the single-device math and shards what
it says it shards, read from the compiled step.

Grid here: stage 3 on (data, tensor) = (1,8), (2,4), (4,2), (8,1), each with sequence
parallelism off and on (on skipped for tensor=1), and stages 1 and 2 on (4,2) with
sequence parallelism off and on: losses of 3 steps, every step's gradients and the params
after 3 steps match one device at fp32 rtol 1e-5. Stage 0 is covered by
test_tensor_parallel.py on the same four meshes.
"""

import jax
import numpy as np
import pytest
from helpers import mesh_of, run_steps_with_grads, small_config

from gendist.collectives import parse_collectives
from gendist.data.batches import TextData
from gendist.models import transformer
from gendist.parallel import zero
from gendist.presets import replace
from gendist.sharding import make_mesh
from gendist.training import optim

RTOL, ATOL = 1e-5, 1e-7  # fp32
STEPS = 3


def zero_config(stage, sp=False):
    return replace(small_config(), **{
        "model.num_heads": 8, "model.num_kv_heads": 8, "model.head_dim": 4,
        "train.zero_stage": stage, "mesh.sequence_parallel": sp})


@pytest.fixture(scope="module")
def data():
    return TextData.from_config(small_config().data)


_RUNS: dict = {}


def run(key, data):
    """(losses, grads per step, params after STEPS, compiled, setup) per (d, t, stage, sp)."""
    if key not in _RUNS:
        d, t, stage, sp = key
        _RUNS[key] = run_steps_with_grads(zero_config(stage, sp),
                                          mesh_of(d * t, data=d, tensor=t), data, STEPS)
    return _RUNS[key]


def assert_tree_close(a, b, rtol, atol):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b),
                            strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


def assert_matches_single_device(key, data):
    losses, grads, params, _, _ = run(key, data)
    r_losses, r_grads, r_params, _, _ = run((1, 1, 0, False), data)
    np.testing.assert_allclose(losses, r_losses, rtol=RTOL)
    for g, rg in zip(grads, r_grads, strict=True):
        assert_tree_close(g, rg, RTOL, ATOL)
    assert_tree_close(params, r_params, RTOL, 1e-6)


# Each mesh shape and sequence parallelism at least once per stage (every combination ran
# ~7 min of the suite for little more coverage).
@pytest.mark.parametrize("d,t,sp", [(8, 1, False), (2, 4, True), (4, 2, False)])
def test_zero3_matches_single_device(data, d, t, sp):
    assert_matches_single_device((d, t, 3, sp), data)


@pytest.mark.parametrize("stage,d,t,sp", [(1, 4, 2, False), (1, 1, 8, True), (2, 8, 1, False),
                                          (2, 2, 4, True)])
def test_zero1_and_2_match_single_device(data, stage, d, t, sp):
    assert_matches_single_device((d, t, stage, sp), data)


# --- what lives where: read from the compiled step ---------------------------------------------

def _local_bytes(structs, shardings):
    return sum(s.dtype.itemsize * int(np.prod(sh.shard_shape(s.shape)))
               for s, sh in zip(jax.tree.leaves(structs), jax.tree.leaves(shardings), strict=True))


def _stage0_bytes(setup, key):
    """Per-device bytes of `key` with no ZeRO (only the table's tensor split) on this mesh."""
    axes = transformer.logical_axes(setup.cfg.model)
    shapes = setup.abstract_state()["params"]
    p_sh, o_sh = optim.state_shardings(setup.mesh, axes, setup.optimizer, shapes, 0)
    struct = setup.abstract_state()[key]
    return _local_bytes(struct, p_sh if key == "params" else o_sh)


@pytest.mark.parametrize("key", [(4, 2, 1, False), (4, 2, 2, False), (2, 4, 3, False),
                                 (8, 1, 3, False)])
def test_optimizer_state_and_params_divide_by_data(data, key):
    _, _, _, compiled, setup = run(key, data)
    state = setup.abstract_state()
    out = compiled.output_shardings[0]
    dp = setup.mesh.shape["data"]
    for part in ("opt_state", "params"):  # fp32 master weights are sharded from stage 1
        got = _local_bytes(state[part], out[part])
        want = _stage0_bytes(setup, part) / dp
        assert abs(got - want) <= 0.1 * want, (part, got, want)
    # XLA's own count of the step's inputs agrees: state shards plus the batch shard.
    batch = 2 * 4 * 8 * 16 // dp
    args = compiled.memory_analysis().argument_size_in_bytes
    want = _stage0_bytes(setup, "params") / dp + _stage0_bytes(setup, "opt_state") / dp + batch
    assert abs(args - want) <= 0.1 * want, (args, want)


def test_one_gradient_reduction_per_step_over_data(data):
    """Data parallelism reduces every gradient element once per step over `data`.

    XLA combines the per-array all-reduces into tuple all-reduces (one per layer inside the
    backward scan, one for the rest), so 'one' means: the payload of all data-axis
    reductions equals the gradient bytes, plus the tied embedding's second use (XLA:CPU
    reduces the gradients of its lookup and of the output layer separately) and a few
    scalars (loss, norms).
    """
    for key in [(8, 1, 0, False), (4, 2, 2, False)]:
        _, _, _, compiled, setup = run(key, data)
        colls = [c for c in parse_collectives(compiled.as_text(), setup.mesh)
                 if c.axes == "data" and c.kind in ("all-reduce", "reduce-scatter")]
        grads = sum(4 * int(np.prod(sh.shard_shape(s.shape))) for s, sh in zip(
            jax.tree.leaves(setup.abstract_state()["params"]),
            jax.tree.leaves(zero.grad_shardings(setup.mesh, transformer.logical_axes(
                setup.cfg.model), setup.abstract_state()["params"], 0)), strict=True))
        embed = 4 * 256 * 32 // setup.mesh.shape["tensor"]
        total = sum(c.payload * c.count for c in colls)
        scalars = total - grads - embed  # loss and the like ride along in the tuples
        assert 0 <= scalars < 256, (key, total, grads, embed)
        if key[2] >= 2:  # ZeRO-2: each device keeps only its 1/|data| of every gradient
            g_sh = jax.tree.leaves(setup.grad_sharding)
            kept = sum(4 * int(np.prod(sh.shard_shape(s.shape))) for s, sh in zip(
                jax.tree.leaves(setup.abstract_state()["params"]), g_sh, strict=True))
            assert kept == grads // setup.mesh.shape["data"]


def test_zero3_gathers_each_layer_inside_the_scan(data):
    """FSDP: every layer's weights are all-gathered over `data` in the forward scan and
    again in the backward scan (never saved), in the layer's compute layout."""
    _, _, _, compiled, setup = run((2, 4, 3, False), data)
    L = setup.cfg.model.num_layers
    gathers = [c for c in parse_collectives(compiled.as_text(), setup.mesh)
               if c.kind == "all-gather" and c.axes == "data"]
    per_layer = {bwd: sum(c.payload for c in gathers if c.count == L and c.backward == bwd)
                 for bwd in (False, True)}
    blocks = setup.abstract_state()["params"]["blocks"]
    tp = setup.mesh.shape["tensor"]
    heads_or_mlp = {"wq", "wk", "wv", "wo", "w_up", "w_down", "w_gate"}
    layer_bytes = sum(4 * int(np.prod(s.shape[1:])) // (tp if k in heads_or_mlp else 1)
                      for k, s in blocks.items())
    assert per_layer[False] == layer_bytes and per_layer[True] == layer_bytes, per_layer


# --- placement rules ------------------------------------------------------------------------------

def test_zero_spec_picks_a_divisible_dimension():
    mesh = make_mesh(replace(small_config().mesh, data=4, tensor=2))
    # embed (first choice) divisible by 4:
    assert tuple(zero.zero_spec(("embed", "mlp"), (32, 64), mesh)) == ("data", "tensor")
    # embed 6 is not: the longest other dimension takes `data` next to `tensor`:
    assert tuple(zero.zero_spec(("embed", "mlp"), (6, 64), mesh)) == (None, ("tensor", "data"))
    # never the layers axis; nothing divisible: replicated over data.
    assert tuple(zero.zero_spec(("layers", "embed"), (8, 6), mesh)) == (None, None)
    with pytest.raises(ValueError, match=r"train.zero_stage=4"):
        zero.check_stage(4)
