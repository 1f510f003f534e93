"""The pipeline executor equals the plain model: loss, gradients, optimizer steps, memory.

Every equality run fills bubbles with NaN (praxis `polluting_bubbles_with_nan`): whatever a
stage holds or sends while it has nothing to do is NaN, so any leak poisons the result.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close as trees_close
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gendist.parallel import pipeline as pl
from gendist.parallel.pipeline import schedules as S

D, F, V, T = 16, 32, 32, 8
MB = 2  # sequences per microbatch per data shard
RTOL, ATOL = 1e-5, 1e-7  # fp32, fixed
NAN = float("nan")


def init_params(key, num_layers):
    k = jax.random.split(key, 5)
    return {
        "embed": {"tok": jax.random.normal(k[0], (V, D))},
        "layers": {
            "w1": jax.random.normal(k[1], (num_layers, D, F)) / 4,
            "w2": jax.random.normal(k[2], (num_layers, F, D)) / 6,
            "scale": 1 + 0.1 * jax.random.normal(k[3], (num_layers, D)),
        },
        "head": {"scale": jnp.ones((D,)), "w": jax.random.normal(k[4], (D, V)) / 4},
    }


def rms_norm(x_BTD, scale_D):
    return x_BTD * jax.lax.rsqrt(jnp.mean(x_BTD * x_BTD, -1, keepdims=True) + 1e-6) * scale_D[None, None]


def embed_fn(embed, tokens_BT):
    return embed["tok"][tokens_BT]


def layer_fn(layer, x_BTD):
    h_BTF = jax.nn.gelu(rms_norm(x_BTD, layer["scale"]) @ layer["w1"])
    return x_BTD + h_BTF @ layer["w2"]


def head_loss_fn(head, x_BTD, targets_BT):
    logp_BTV = jax.nn.log_softmax(rms_norm(x_BTD, head["scale"]) @ head["w"])
    nll_BT = -jnp.take_along_axis(logp_BTV, targets_BT[..., None], -1)[..., 0]
    return nll_BT.sum(), targets_BT.size


MODEL = dict(embed_fn=embed_fn, layer_fn=layer_fn, head_loss_fn=head_loss_fn)
reference = jax.jit(jax.value_and_grad(functools.partial(pl.sequential_loss, **MODEL)))


def make_mesh(data, pipeline, tensor=1):
    devices = np.array(jax.devices()[: data * pipeline * tensor])
    return Mesh(devices.reshape(data, pipeline, 1, tensor), ("data", "pipeline", "expert", "tensor"))


def batch(data, m, seed=1):
    kt, ky = jax.random.split(jax.random.key(seed))
    shape = (data * m * MB, T)
    return jax.random.randint(kt, shape, 0, V), jax.random.randint(ky, shape, 0, V)


assert_trees_close = functools.partial(trees_close, rtol=RTOL, atol=ATOL)


# (data, pipeline, tensor, schedule, microbatches): m in {1, p, 2p, 3p+1} over both p.
CASES = [
    (8, 1, 1, "1f1b", 3),
    (4, 2, 1, "1f1b", 1),
    (4, 2, 1, "gpipe", 2),
    (2, 2, 2, "1f1b", 4),
    (4, 2, 1, "gpipe", 7),
    (2, 4, 1, "1f1b", 4),
    (2, 4, 1, "gpipe", 8),
    (2, 4, 1, "1f1b", 13),
    (4, 2, 1, "1f1b-split", 4),  # backwards split into B and W: kept residuals
    (2, 4, 1, "zb-h1", 8),
    (2, 2, 2, "zb-h1", 5),
]


@pytest.mark.parametrize("data, pipe, tensor, name, m", CASES)
def test_matches_sequential_model_with_nan_bubbles(data, pipe, tensor, name, m):
    mesh = make_mesh(data, pipe, tensor)
    params = init_params(jax.random.key(0), 4)
    if tensor > 1:  # Megatron split of the MLP; the pipeline must keep it sharded.
        specs = {"w1": P(None, None, "tensor"), "w2": P(None, "tensor", None), "scale": P()}
        params["layers"] = {k: jax.device_put(v, NamedSharding(mesh, specs[k]))
                            for k, v in params["layers"].items()}
    tokens, targets = batch(data, m)
    run = jax.jit(functools.partial(pl.pipeline_loss_and_grads, mesh=mesh, schedule=name,
                                    num_microbatches=m, bubble_value=NAN, **MODEL))
    loss, grads = run(params, tokens, targets)
    want_loss, want_grads = reference(params, tokens, targets)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    assert_trees_close(grads, want_grads)
    if tensor > 1:
        assert "tensor" in tuple(grads["layers"]["w1"].sharding.spec)


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "1f1b-phased"])
def test_kept_residuals_match_sequential_model_with_nan_bubbles(name):
    """No recomputed forward: each stage keeps its forward's vjp residuals for the backward."""
    mesh = make_mesh(2, 4)
    params = init_params(jax.random.key(5), 4)
    tokens, targets = batch(2, 6)
    run = jax.jit(functools.partial(pl.pipeline_loss_and_grads, mesh=mesh, schedule=name,
                                    num_microbatches=6, bubble_value=NAN, recompute=False,
                                    **MODEL))
    loss, grads = run(params, tokens, targets)
    want_loss, want_grads = reference(params, tokens, targets)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    assert_trees_close(grads, want_grads)


@pytest.mark.parametrize("data, pipe, chunks, m, recompute", [
    (2, 2, 2, 4, False),  # kept residuals, buffers per chunk
    (2, 4, 2, 4, True),  # the ring's wrap from device 3 to device 0
])
def test_interleaved_matches_sequential_model_with_nan_bubbles(data, pipe, chunks, m,
                                                               recompute):
    """Interleaved 1F1B: device d runs layer chunks d, d + p, ...; a wrong chunk assignment
    changes the layer order (grads differ) and a missing ring wrap starves chunk 1 of its
    input (the loss differs)."""
    mesh = make_mesh(data, pipe)
    params = init_params(jax.random.key(6), pipe * chunks)
    tokens, targets = batch(data, m)
    run = jax.jit(functools.partial(pl.pipeline_loss_and_grads, mesh=mesh,
                                    schedule="interleaved-1f1b", num_microbatches=m,
                                    num_chunks=chunks, bubble_value=NAN, recompute=recompute,
                                    **MODEL))
    loss, grads = run(params, tokens, targets)
    want_loss, want_grads = reference(params, tokens, targets)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    assert_trees_close(grads, want_grads)


def test_uneven_stage_split_with_nan_bubbles():
    mesh = make_mesh(2, 4)
    params = init_params(jax.random.key(3), 7)
    tokens, targets = batch(2, 5)
    run = jax.jit(functools.partial(pl.pipeline_loss_and_grads, mesh=mesh, schedule="1f1b",
                                    num_microbatches=5, stage_layer_counts=(1, 3, 2, 1),
                                    bubble_value=NAN, **MODEL))
    loss, grads = run(params, tokens, targets)
    want_loss, want_grads = reference(params, tokens, targets)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    assert_trees_close(grads, want_grads)


def test_three_sgd_momentum_steps_match():
    """Params after three optax steps agree. SGD with momentum, not Adam: Adam's update
    g / sqrt(v) amplifies fp32 reassociation error of small gradient entries by lr / |g|,
    which says nothing about the pipeline."""
    mesh = make_mesh(2, 4)
    opt = optax.sgd(0.5, momentum=0.9)
    pipe_grad = functools.partial(pl.pipeline_loss_and_grads, mesh=mesh,
                                  schedule=S.one_f_one_b(4, 4), bubble_value=NAN, **MODEL)

    def train_step(grad_fn, params, state, tokens, targets):
        loss, grads = grad_fn(params, tokens, targets)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    pipe_step = jax.jit(functools.partial(train_step, pipe_grad))
    ref_step = jax.jit(functools.partial(train_step, reference))
    params = init_params(jax.random.key(4), 4)
    got = want = (params, opt.init(params))
    for i in range(3):
        tokens, targets = batch(2, 4, seed=10 + i)
        *got, got_loss = pipe_step(*got, tokens, targets)
        *want, want_loss = ref_step(*want, tokens, targets)
        np.testing.assert_allclose(got_loss, want_loss, rtol=RTOL)
    assert_trees_close(got[0], want[0])


def _temp_bytes(mesh, name, m):
    params = init_params(jax.random.key(0), 4)
    tokens = jnp.zeros((2 * m * MB, T), jnp.int32)
    run = jax.jit(functools.partial(pl.pipeline_loss_and_grads, mesh=mesh, schedule=name,
                                    num_microbatches=m, **MODEL))
    return run.lower(params, tokens, tokens).compile().memory_analysis().temp_size_in_bytes


def test_1f1b_activation_memory_is_flat_gpipe_grows():
    """Same microbatch size, m = 4 -> 16: GPipe holds 12 more inputs (and their
    cotangents) per stage; 1F1B holds p = 4 either way."""
    mesh = make_mesh(2, 4)
    slot_bytes = MB * T * D * 4
    one_f = [_temp_bytes(mesh, "1f1b", m) for m in (4, 16)]
    gp = [_temp_bytes(mesh, "gpipe", m) for m in (4, 16)]
    assert one_f[1] == one_f[0], one_f
    assert gp[1] - gp[0] >= 2 * 12 * slot_bytes, gp


@pytest.mark.parametrize(
    "layers, kwargs, field",
    [
        (1, {}, "layers"),  # fewer layers than stages
        (6, {}, "stage_layer_counts"),  # 6 layers do not split evenly over 4 stages
        (6, {"stage_layer_counts": (2, 2, 2, 1)}, "stage_layer_counts"),
        (4, {"num_microbatches": 3}, "num_microbatches"),  # 3 does not divide 8 per shard
        (4, {"schedule": S.gpipe(2, 4), "num_microbatches": None}, "num_stages"),
        (4, {"schedule": S.gpipe(4, 4), "num_microbatches": 2}, "num_microbatches"),
        # 4 layers do not split into 4 stages x 2 chunks
        (4, {"schedule": "interleaved-1f1b", "num_chunks": 2}, "train.pipeline_chunks"),
        (8, {"schedule": "interleaved-1f1b", "num_chunks": 2, "stage_layer_counts": (2,) * 4},
         "pipeline_chunks"),
    ],
)
def test_bad_input_names_the_field(layers, kwargs, field):
    mesh = make_mesh(2, 4)
    params = init_params(jax.random.key(0), layers)
    tokens, targets = batch(2, 4)
    call = dict(mesh=mesh, schedule="1f1b", num_microbatches=4, **MODEL) | kwargs
    with pytest.raises(ValueError, match=field):
        pl.pipeline_loss_and_grads(params, tokens, targets, **call)


def test_uniform_steps_run_without_branches_or_residual_copies():
    """GPipe and 1F1B in phases run one kind of action per step, so the executor needs no
    switch: the compiled loop writes and reads the kept residuals in place (an XLA
    conditional would copy every buffer it passes through, each step)."""
    from gendist.parallel.pipeline import uniform

    assert uniform.segments(S.gpipe(2, 4)) == (4, 1, 4)  # F^4 (F B) B^4
    assert uniform.segments(S.one_f_one_b_phased(2, 4)) == (1, 4, 1)
    assert uniform.segments(S.one_f_one_b_phased(4, 8)) is not None
    assert uniform.segments(S.one_f_one_b(2, 4)) is None
    assert uniform.segments(S.zb_h1(2, 4)) is None
    mesh = make_mesh(1, 2)
    params = init_params(jax.random.key(0), 4)
    tokens, targets = batch(1, 4)
    run = jax.jit(functools.partial(pl.pipeline_loss_and_grads, mesh=mesh,
                                    schedule="1f1b-phased", num_microbatches=4,
                                    recompute=False, **MODEL))
    hlo = run.lower(params, tokens, targets).compile().as_text()
    body = hlo[:hlo.index("ENTRY")]  # every computation but the entry (loops, fusions)
    # The residual buffers are [slots + 1, layers per stage, MB, T, ...] = [4, 2, 2, 8, ...].
    assert "f32[4,2,2,8,32]" in hlo
    copies = [ln for ln in body.splitlines() if " copy(" in ln and "[4,2,2,8," in ln]
    assert not copies, copies[:3]
