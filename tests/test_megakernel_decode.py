"""Decoding through the chain megakernel (`decoder.plan(..., path="megakernel")`): on a CPU
its step runs with `chain_reference` (the kernel's math in XLA from the kernel's own inputs),
so the wiring around it (stacked, norm-folded weights, the cache layout and its update,
positions, RoPE angles, the output layer) is checked against the model's own decoding token
for token; on an sm90 GPU the kernel itself."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gendist.config import ModelConfig
from gendist.inference import decoder
from gendist.inference import generate as G
from gendist.inference import megakernel as mk
from gendist.inference.sampling import SamplingParams
from gendist.models import transformer
from pallas_kernels._mgpu import on_sm90

CFG = ModelConfig(d_model=128, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=64, d_ff=192,
                  max_seq_len=256, dtype="bfloat16")
GREEDY = SamplingParams(temperature=0.0)
ON_SM90 = jax.default_backend() == "gpu" and on_sm90()
KERNEL = None if ON_SM90 else mk.chain_reference  # None: the plan's own, the Mosaic GPU kernel


@pytest.fixture(scope="module")
def params():
    p = transformer.init_params(CFG, 1)
    leaves, tree = jax.tree_util.tree_flatten_with_path(p)
    keys = jax.random.split(jax.random.key(7), len(leaves))

    def perturb(path, x, k):  # peaky logits; norm gains away from 1, different for every norm
        if "norm" in jax.tree_util.keystr(path):
            return x * (1 + 0.5 * jax.random.normal(k, x.shape))
        return x * 4 if x.ndim > 1 else x

    return jax.tree.unflatten(tree, [perturb(path, x, k) for (path, x), k in zip(leaves, keys, strict=True)])


def _generate(params, prompt, new, **kw):
    pb = jnp.asarray(prompt)[None]
    return G.generate_tokens(CFG, params, pb, jnp.array([prompt.size], jnp.int32), jax.random.key(0),
                             max_new_tokens=new, sp=GREEDY, **kw)


def _plan(params, max_len, kernel=KERNEL):
    return decoder.plan(CFG, params, 1, max_len, "megakernel", kernel)


@pytest.mark.parametrize("prompt_len", [5, 70])
def test_chain_steps_give_the_models_logits(params, prompt_len):
    """Teacher-forced: the prompt, then 10 given tokens one step at a time through the chain;
    each step's logits within twice the model's own bf16 error of the model's fp32 forward
    (same bf16-rounded weights). Both round differently (the chain keeps the residual in
    fp32, the model in bf16; ~1% each here); a wiring fault is far larger (the two norms'
    gains swapped: ~90%)."""
    rng = np.random.default_rng(prompt_len)
    tokens = jnp.asarray(rng.integers(0, 256, (1, prompt_len + 10)), jnp.int32)
    plan = _plan(params, prompt_len + 10)
    logits, cache = plan.prefill(tokens[:, :prompt_len], jnp.array([prompt_len], jnp.int32),
                                 plan.make_cache())
    assert isinstance(cache, mk.ChainCache)
    got = []
    for i in range(prompt_len, prompt_len + 10):
        step_logits, cache = plan.step(tokens[:, i], cache)
        got.append(step_logits[0])
    f32 = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32) if x.ndim > 1 else x  # noqa: E731
    exact = transformer.forward(dataclasses.replace(CFG, dtype="float32"), jax.tree.map(f32, params), tokens)
    model = transformer.forward(CFG, params, tokens)
    as64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    got, exact, model = as64(jnp.stack(got)), as64(exact[0, prompt_len:]), as64(model[0, prompt_len:])
    err = lambda a: np.linalg.norm(a - exact, axis=1) / np.linalg.norm(exact, axis=1)  # noqa: E731
    assert err(got).max() <= 2 * err(model).max(), (err(got), err(model))


def test_chain_decoding_runs_in_generate_tokens(params):
    """generate_tokens on path="megakernel": prefill, then steps through the chain in the loop;
    its first greedy tokens are the model's (later ones may part on a rounding tie)."""
    prompt = np.arange(3, 40, dtype=np.int32)
    want, _ = _generate(params, prompt, 12, path="reference")
    got, count = _generate(params, prompt, 12, path="megakernel", kernel=KERNEL)
    assert int(count[0]) == 12
    np.testing.assert_array_equal(np.asarray(got)[:, :4], np.asarray(want)[:, :4])


def test_chain_cache_holds_what_the_model_wrote(params):
    """After the prompt and a few steps the cache rows equal a contiguous cache's (the
    per-step update writes every layer's new k and v at its position)."""
    prompt = jnp.arange(1, 9, dtype=jnp.int32)[None]
    plan = _plan(params, 16, mk.chain_reference)
    logits, cache = plan.prefill(prompt, jnp.array([8], jnp.int32), plan.make_cache())
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    _, cache = plan.step(tok, cache)
    assert int(cache.lengths[0]) == 9 and cache.kv.shape == (2, 2, 2, 64, 64)
    # the model's own k and v at every position, from the same tokens as one prompt
    _, ref_cache = plan.prefill(jnp.concatenate([prompt, tok[:, None]], 1),
                                jnp.array([9], jnp.int32), plan.make_cache())
    got, want = np.asarray(cache.kv[:, :, :, :9], np.float32), np.asarray(ref_cache.kv[:, :, :, :9], np.float32)
    np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())
    assert not np.asarray(cache.kv[:, :, :, 9:]).any()  # nothing written past the length


def test_unsupported_models_say_why():
    assert mk.supported(CFG, 2) == "batch 1 (this is batch 2)"
    assert "num_kv_heads == num_heads (this has 1 for 2)" in mk.supported(
        dataclasses.replace(CFG, num_kv_heads=1), 1)
    assert "head_dim a multiple of 64 (is 32)" in mk.supported(
        dataclasses.replace(CFG, head_dim=32, num_heads=4), 1)
    assert mk.supported(CFG, 1) is None
    with pytest.raises(ValueError, match="megakernel needs mlp='swiglu'"):
        mk.chain_params(dataclasses.replace(CFG, mlp="gelu"), {})


def test_rolled_back_chain_cache_decodes_as_a_fresh_one(params):
    """Speculative decoding rolls a cache back over rejected drafts: steps after a rollback
    (stale rows past the length) give the logits of a cache that never held them."""
    plan = _plan(params, 32, mk.chain_reference)
    prompt = jnp.arange(1, 9, dtype=jnp.int32)[None]
    _, fresh = plan.prefill(prompt, jnp.array([8], jnp.int32), plan.make_cache())
    _, used = plan.prefill(prompt, jnp.array([8], jnp.int32), plan.make_cache())
    for t in (200, 201, 202):  # three rejected drafts
        _, used = plan.step(jnp.array([t], jnp.int32), used)
    used = used.rollback(jnp.array([8], jnp.int32))
    for t in (5, 6, 7):
        want, fresh = plan.step(jnp.array([t], jnp.int32), fresh)
        got, used = plan.step(jnp.array([t], jnp.int32), used)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
