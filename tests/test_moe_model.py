"""MoE blocks inside the transformer: expert-parallel forward equals one device, decoding works."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import full_forward_greedy, mesh_of

from gendist.config import ModelConfig
from gendist.data.batches import shard_batch
from gendist.inference import generate as G
from gendist.inference.sampling import SamplingParams
from gendist.models import transformer
from gendist.parallel.mesh_ops import MeshOps
from gendist.sharding import named_sharding, use_mesh

CFG = ModelConfig(d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, d_ff=64,
                  max_seq_len=64, moe_experts=4, moe_every=2, moe_top_k=2,
                  moe_capacity_factor=4.0)  # capacity = all tokens: nothing is dropped


def logits_on(mesh, params, tokens):
    shardings = jax.tree.map(lambda a: named_sharding(mesh, a), transformer.logical_axes(CFG),
                             is_leaf=lambda a: isinstance(a, tuple))
    p = jax.device_put(params, shardings)
    toks = shard_batch({"t": tokens}, mesh)["t"]

    def f(p, t):  # the train step's ops: expert-parallel MoE when the batch is split
        with use_mesh(mesh):
            return transformer.forward_with_aux(CFG, p, t, MeshOps(mesh))

    def ce(p, t):
        logits, _ = f(p, t)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[..., 0])

    (logits, aux), grads = jax.jit(f)(p, toks), jax.jit(jax.grad(ce))(p, toks)
    return jax.device_get((logits, aux, grads))


def test_expert_parallel_model_equals_single_device():
    params = transformer.init_params(CFG, 0)
    tokens = np.random.default_rng(0).integers(0, 256, (8, 16)).astype(np.int32)
    l1, a1, g1 = logits_on(mesh_of(1), params, tokens)
    l8, a8, g8 = logits_on(mesh_of(8, data=2, expert=4), params, tokens)
    assert float(a8["moe_drop_fraction"]) == 0.0
    np.testing.assert_allclose(l8, l1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a8["moe_expert_load_GE"], a1["moe_expert_load_GE"])
    for x, y in zip(jax.tree.leaves(g8), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_moe_model_decodes_like_full_forward():
    params = transformer.init_params(CFG, 1)
    params = jax.tree.map(lambda x: x * 3 if x.ndim > 1 else x, params)
    pb, lb = G.pad_prompts([np.array([3, 4, 5]), np.array([9, 8])])
    out, _ = G.generate_tokens(CFG, params, jnp.asarray(pb), jnp.asarray(lb), jax.random.key(0),
                               max_new_tokens=5, sp=SamplingParams(temperature=0.0))
    for i, pr in enumerate([[3, 4, 5], [9, 8]]):
        assert full_forward_greedy(CFG, params, pr, 5) == list(np.asarray(out[i]))


def test_moe_training_reports_router_metrics(tmp_path):
    from helpers import small_config

    from gendist.presets import replace
    from gendist.training import loop
    cfg = replace(small_config(str(tmp_path), steps=3, grad_accum=2, batch_size=16),
                  **{"model.moe_experts": 4, "model.moe_top_k": 1, "model.moe_every": 2,
                     "model.moe_capacity_factor": 1.0, "mesh.expert": 2})
    r = loop.run(cfg, mesh=mesh_of(8, data=4, expert=2), log=lambda *a: None)
    h = r.history[-1]
    assert 0.0 <= h["moe_drop_fraction"] < 1.0 and h["moe_aux_loss"] > 0
    assert len(h["moe_expert_load"]) == 4
    # Token-choices per microbatch (8 x 16 tokens, top-1, one MoE layer), averaged over 2.
    assert abs(sum(h["moe_expert_load"]) - 8 * 16) < 1e-3
    assert abs(h["loss"] - h["ce_loss"] - h["moe_aux_loss"]) < 1e-5
    assert r.val_loss is not None
