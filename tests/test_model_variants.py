"""Speed options of the model change its schedule, not its math."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gendist.config import ModelConfig
from gendist.inference import decode_layout
from gendist.models import transformer

BASE = ModelConfig(vocab_size=64, d_model=64, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=16, d_ff=96, max_seq_len=32)


@functools.partial(jax.jit, static_argnums=0)  # one compile per config, not one per op
def _loss_and_grads(cfg, params, tok_BT):
    def loss(p):
        logits = transformer.forward(cfg, p, tok_BT[:, :-1])
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
    return jax.value_and_grad(loss)(params)


@pytest.fixture(scope="module")
def reference():
    """BASE's params, tokens, loss and gradients: shared by the options."""
    params = transformer.init_params(BASE, seed=1)
    tok = jax.random.randint(jax.random.key(0), (2, 17), 0, BASE.vocab_size)
    return params, tok, _loss_and_grads(BASE, params, tok)


@pytest.mark.parametrize("option", [{"fused_projections": True}, {"scan_unroll": 2},
                                    {"scan_unroll": 3, "fused_projections": True}])
def test_speed_options_give_the_same_loss_and_gradients(reference, option):
    import dataclasses
    params, tok, (ref_loss, ref_g) = reference
    loss, g = _loss_and_grads(dataclasses.replace(BASE, **option), params, tok)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g, ref_g)


def test_scan_unroll_must_be_positive():
    import dataclasses
    with pytest.raises(ValueError, match="scan_unroll"):
        dataclasses.replace(BASE, scan_unroll=0)


@pytest.mark.parametrize("moe", [0, 4])
def test_inference_params_give_bitwise_the_same_logits(moe):
    import dataclasses
    cfg = dataclasses.replace(BASE, dtype="bfloat16", moe_experts=moe, num_layers=4)
    params = transformer.init_params(cfg, seed=2)
    cast = decode_layout.inference_params(cfg, params)
    dtypes = {jax.tree_util.keystr(k): v.dtype for k, v in jax.tree_util.tree_leaves_with_path(cast)}
    matrices = [d for k, d in dtypes.items() if "['wq']" in k or "['embed']" in k]
    vectors = [d for k, d in dtypes.items() if "norm" in k or "router" in k]
    assert matrices and vectors  # the key filters match something
    assert all(d == jnp.bfloat16 for d in matrices)
    assert all(d == jnp.float32 for d in vectors)
    tok = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)
    np.testing.assert_array_equal(transformer.forward(cfg, cast, tok),
                                  transformer.forward(cfg, params, tok))
