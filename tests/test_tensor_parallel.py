"""Tensor (Megatron) and sequence parallelism equal the single-device math, with the
collectives Megatron-LM and Korthikanti et al. 2022 prescribe read back from the HLO.

Grid here: ZeRO stage 0 on (data, tensor) = (1,8), (2,4), (4,2), (8,1), each with sequence
parallelism off and on (on is skipped for tensor=1, where it is the same program): loss
of 3 steps, every step's gradients and the params after 3 steps match one device at fp32
rtol 1e-5. bf16 (one mesh, sequence parallel): the losses of 3 steps match one bf16 device
at rtol 1e-3, and the first step's gradients are as accurate as one bf16 device's: their
distance to the fp32 gradients is at most twice the single bf16 device's (plus 1e-3 of the
array's scale). Params after 3 steps are not compared in bf16: Adam's normalised update
turns bf16 rounding of near-zero gradients into +-lr steps (one bf16 device already
differs from fp32 by up to 15% of a weight matrix's scale after 3 steps).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh_of, run_steps_with_grads, small_config
from jax.sharding import NamedSharding

from gendist.collectives import parse_collectives
from gendist.config import ModelConfig
from gendist.data.batches import TextData
from gendist.models import transformer
from gendist.parallel import manual, tensor
from gendist.parallel.compat import shard_map
from gendist.presets import replace
from gendist.sharding import DEFAULT_RULES, SEQUENCE_PARALLEL, named_sharding, use_mesh
from gendist.training import train

RTOL, ATOL = 1e-5, 1e-7  # fp32
BF16_LOSS_RTOL, BF16_VS_ONE_DEVICE, BF16_FLOOR = 1e-3, 2.0, 1e-3
STEPS = 3


def tp_config(stage=0, sp=False, dtype="float32"):
    """2 layers, width 32, 8 heads: splits 8 ways over tensor (heads, kv, d_ff, vocab)."""
    return replace(small_config(), **{
        "model.num_heads": 8, "model.num_kv_heads": 8, "model.head_dim": 4,
        "model.dtype": dtype, "train.zero_stage": stage, "mesh.sequence_parallel": sp})


@pytest.fixture(scope="module")
def data():
    return TextData.from_config(small_config().data)


_RUNS: dict = {}


def run(key, data):
    """(losses, grads per step, params after STEPS, compiled, setup), once per key:
    (data, tensor, zero stage, sequence parallel, dtype)."""
    if key not in _RUNS:
        _RUNS[key] = _run(key, data)
    return _RUNS[key]


def _run(key, data):
    d, t, stage, sp, dtype = key
    cfg = tp_config(stage, sp, dtype)
    return run_steps_with_grads(cfg, mesh_of(d * t, data=d, tensor=t), data, STEPS)


def assert_tree_close(a, b, rtol, atol):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b),
                            strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


def assert_matches(key, ref_key, data, rtol=RTOL, atol=ATOL):
    losses, grads, params, _, _ = run(key, data)
    r_losses, r_grads, r_params, _, _ = run(ref_key, data)
    np.testing.assert_allclose(losses, r_losses, rtol=rtol)
    for g, rg in zip(grads, r_grads, strict=True):
        assert_tree_close(g, rg, rtol, atol)
    assert_tree_close(params, r_params, rtol, max(atol, 1e-6))


# tensor 8, 4 and 2, each with and without sequence parallelism once (tensor 1 is data
# parallelism, tested in test_data_parallel)
CASES = [(1, 8, True), (2, 4, False), (4, 2, True)]


@pytest.mark.parametrize("d,t,sp", CASES)
def test_tensor_and_sequence_parallel_match_single_device(data, d, t, sp):
    assert_matches((d, t, 0, sp, "float32"), (1, 1, 0, False, "float32"), data)


def test_bf16_tensor_parallel_matches_single_bf16_device(data):
    losses, grads, _, _, _ = run((2, 4, 0, True, "bfloat16"), data)
    r_losses, r_grads, _, _, _ = run((1, 1, 0, False, "bfloat16"), data)
    _, f32_grads, _, _, _ = run((1, 1, 0, False, "float32"), data)
    np.testing.assert_allclose(losses, r_losses, rtol=BF16_LOSS_RTOL)
    for (path, x), y, z in zip(jax.tree_util.tree_leaves_with_path(grads[0]),
                               jax.tree.leaves(r_grads[0]), jax.tree.leaves(f32_grads[0]),
                               strict=True):
        split_err, one_err = np.max(np.abs(x - z)), np.max(np.abs(y - z))
        bound = BF16_VS_ONE_DEVICE * one_err + BF16_FLOOR * np.max(np.abs(z))
        assert split_err <= bound, (jax.tree_util.keystr(path), split_err, one_err)


def _block_forward_collectives(key, data):
    """Collectives of the forward layer scan's body: one block's forward, run L times."""
    _, _, _, compiled, setup = run(key, data)
    L = setup.cfg.model.num_layers
    colls = parse_collectives(compiled.as_text(), setup.mesh)
    return [c for c in colls if c.count == L and not c.backward and c.axes == "tensor"]


def test_block_forward_has_two_all_reduces_over_tensor(data):
    colls = _block_forward_collectives((2, 4, 0, False, "float32"), data)
    act = (8 // 2) * 16 * 32 * 4  # local batch x seq x d_model, fp32
    assert sorted((c.kind, c.payload) for c in colls) == [("all-reduce", act)] * 2


def test_block_forward_sequence_parallel_gathers_and_reduces(data):
    colls = _block_forward_collectives((2, 4, 0, True, "float32"), data)
    act = (8 // 2) * 16 * 32 * 4
    gathers = [c.payload for c in colls if c.kind == "all-gather"]
    # XLA:CPU keeps each reduce-scatter as all-reduce + slice (no ReduceScatterCreator).
    reductions = [c.payload for c in colls if c.kind in ("reduce-scatter", "all-reduce")]
    assert gathers == [act, act] and reductions == [act, act] and len(colls) == 4


def test_logits_never_gathered_over_vocab(data):
    """Vocab-parallel embedding, output layer and loss: no collective carries a full V axis."""
    for key in [(2, 4, 0, False, "float32"), (1, 8, 0, True, "float32")]:
        _, _, _, compiled, setup = run(key, data)
        V = setup.cfg.model.vocab_size
        for c in parse_collectives(compiled.as_text(), setup.mesh):
            dims = [int(x) for d in re.findall(r"\[([\d,]*)\]", c.shape) for x in d.split(",") if x]
            assert V not in dims, f"{c.kind} over {c.axes} carries the full vocabulary: {c.shape}"


# --- the explicit form: f and g under shard_map ----------------------------------------------

def _block_case(sp):
    cfg = ModelConfig(d_model=32, num_layers=1, num_heads=8, num_kv_heads=4, head_dim=4,
                      d_ff=64, max_seq_len=64)  # grouped-query: 2 query heads per kv head
    mesh = mesh_of(8, data=2, tensor=4)
    p = jax.tree.map(lambda a: a[0], transformer.init_params(cfg, 0)["blocks"])
    x = jax.random.normal(jax.random.key(1), (8, 16, cfg.d_model))
    pos = jnp.broadcast_to(jnp.arange(16), (8, 16))
    rules = DEFAULT_RULES.with_overrides(**SEQUENCE_PARALLEL) if sp else DEFAULT_RULES
    shardings = ({k: NamedSharding(mesh, s) for k, s in manual.block_specs(cfg, mesh).items()},
                 named_sharding(mesh, ("batch", "act_seq", "embed"), rules),
                 named_sharding(mesh, ("batch", "seq"), rules))
    return cfg, mesh, rules, (p, x, pos), shardings


def _value_and_grads(block, shardings=None):
    loss = lambda p, x, pos: jnp.sum(jnp.sin(block(p, x, pos)))
    fn = jax.value_and_grad(loss, argnums=(0, 1))
    return jax.jit(fn) if shardings is None else jax.jit(fn, in_shardings=shardings)


@pytest.mark.parametrize("sp", [False, True])
def test_explicit_block_equals_annotated_block(sp):
    cfg, mesh, rules, args, shardings = _block_case(sp)

    def annotated(p, x, pos):
        with use_mesh(mesh, rules):
            return transformer.block(p, x, pos, cfg)[0]

    explicit = lambda p, x, pos: manual.tp_block_forward(p, x, pos, cfg, mesh,
                                                         sequence_parallel=sp)
    single = _value_and_grads(lambda p, x, pos: transformer.block(p, x, pos, cfg)[0])
    want = single(*args)
    for block in (annotated, explicit):
        got = _value_and_grads(block, shardings)(*args)
        np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
        assert_tree_close(got[1], want[1], RTOL, 1e-6)
    # Megatron's count: two all-reduces forward (g) and two backward (f), each [b, T, D];
    # with sequence parallelism each becomes a reduce-scatter plus an all-gather.
    colls = parse_collectives(_value_and_grads(explicit, shardings).lower(*args).compile()
                              .as_text(), mesh)
    act = 4 * 16 * 32 * 4
    kinds = ["all-gather", "reduce-scatter"] if sp else ["all-reduce"]
    for backward in (False, True):
        got = sorted((c.kind, c.payload) for c in colls
                     if c.axes == "tensor" and c.backward == backward and c.payload >= act)
        assert got == sorted([(k, act) for k in kinds] * 2), (backward, got)


def test_conjugate_operators_on_2x2_blocks():
    """The lecture's check: X A with A = [A1 A2] split by columns, then (X A) B with B split
    by rows; f and g give the dense forward and backward on two devices."""
    mesh = mesh_of(2, tensor=2)
    X, A, B = (jax.random.normal(jax.random.key(i), (2, 2)) for i in range(3))

    def local(x, a_col, b_row):
        y = tensor.f_op(x, "tensor") @ a_col  # column parallel: [X A1 | X A2]
        return tensor.g_op(y @ b_row, "tensor")  # row parallel: X A1 B1 + X A2 B2

    P = jax.sharding.PartitionSpec
    split = shard_map(local, mesh=mesh, in_specs=(P(), P(None, "tensor"), P("tensor", None)),
                      out_specs=P())
    dense = lambda x, a, b: x @ a @ b
    np.testing.assert_allclose(split(X, A, B), dense(X, A, B), rtol=1e-6)
    loss = lambda fn: lambda *a: jnp.sum(jnp.tanh(fn(*a)))
    g_split = jax.grad(loss(split), argnums=(0, 1, 2))(X, A, B)
    g_dense = jax.grad(loss(dense), argnums=(0, 1, 2))(X, A, B)
    for gs, gd in zip(g_split, g_dense, strict=True):
        np.testing.assert_allclose(gs, gd, rtol=1e-5, atol=1e-7)


def test_vocab_parallel_cross_entropy_matches_dense():
    mesh = mesh_of(8, data=2, tensor=4)
    logits = 3 * jax.random.normal(jax.random.key(0), (4, 8, 256))
    targets = jax.random.randint(jax.random.key(1), (4, 8), 0, 256)
    targets = targets.at[0, :4].set(jnp.array([0, 63, 64, 255]))  # shard edges
    dense = jax.value_and_grad(lambda lg: train.cross_entropy(lg, targets))(logits)
    split = jax.jit(jax.value_and_grad(
        lambda lg: jnp.mean(tensor.vocab_parallel_nll(lg, targets, mesh))))(logits)
    np.testing.assert_allclose(split[0], dense[0], rtol=1e-6)
    np.testing.assert_allclose(split[1], dense[1], rtol=1e-5, atol=1e-9)


# --- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value,kv", [("num_heads", 12, 4), ("num_kv_heads", 4, 4),
                                            ("d_ff", 36, 8), ("vocab_size", 260, 8)])
def test_tensor_degree_must_divide(field, value, kv):
    cfg = replace(tp_config(), **{"model.num_kv_heads": kv, f"model.{field}": value})
    with pytest.raises(ValueError, match=rf"model.{field}={value} is not divisible by the 8 "
                                         r"shards of mesh axis 'tensor'"):
        train.build(cfg, mesh_of(8, tensor=8))


def test_sequence_parallel_needs_divisible_sequence():
    cfg = replace(tp_config(sp=True), **{"train.seq_len": 12})
    with pytest.raises(ValueError, match=r"train.seq_len=12 is not divisible by mesh.tensor=8"):
        train.build(cfg, mesh_of(8, tensor=8))


def test_explicit_block_rejects_indivisible_heads():
    cfg, mesh, _, (p, x, pos), _ = _block_case(False)
    bad = replace(cfg, num_heads=6, num_kv_heads=6)
    with pytest.raises(ValueError, match=r"model.num_heads=6 is not divisible by mesh.tensor=4"):
        manual.tp_block_forward(p, x, pos, bad, mesh)
