"""Jitted KV-cache decoding equals recomputing the full sequence; sampling filters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_forward_greedy

from gendist.config import ModelConfig
from gendist.inference import generate as G
from gendist.inference.cache import ContiguousKVCache
from gendist.inference.sampling import SamplingParams, probs, processed_logits
from gendist.models import transformer

CFG = ModelConfig(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, d_ff=64,
                  max_seq_len=64)


@pytest.fixture(scope="module")
def params():
    p = transformer.init_params(CFG, 1)
    return jax.tree.map(lambda x: x * 4 if x.ndim > 1 else x, p)  # peaky logits


def test_greedy_cached_equals_full_forward(params):
    prompts = [np.array([1, 2, 3, 4, 5]), np.array([7, 8]), np.array([9, 10, 11, 12, 13, 14])]
    pb, lb = G.pad_prompts(prompts)
    n = 7
    out, count = G.generate_tokens(CFG, params, jnp.asarray(pb), jnp.asarray(lb),
                                   jax.random.key(0), max_new_tokens=n,
                                   sp=SamplingParams(temperature=0.0))
    assert list(np.asarray(count)) == [n] * 3
    for i, pr in enumerate(prompts):
        assert full_forward_greedy(CFG, params, pr, n) == list(np.asarray(out[i]))


def test_prefill_logits_equal_full_forward(params):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
    full = transformer.forward(CFG, params, tokens)
    cache = ContiguousKVCache.create(CFG.num_layers, 2, 16, CFG.num_kv_heads, CFG.head_dim)
    # Feed the sequence in two chunks of 7 and 5 tokens through the cache.
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    a, cache = transformer.forward(CFG, params, tokens[:, :7], pos, cache)
    cache = cache.advance(jnp.full((2,), 7))
    b, cache = transformer.forward(CFG, params, tokens[:, 7:], pos[:, :5] + 7, cache)
    np.testing.assert_allclose(jnp.concatenate([a, b], 1), full, rtol=1e-5, atol=1e-5)


def test_eos_stops_sequence(params):
    pb, lb = G.pad_prompts([np.array([1, 2, 3])])
    out, count = G.generate_tokens(CFG, params, jnp.asarray(pb), jnp.asarray(lb),
                                   jax.random.key(0), max_new_tokens=6,
                                   sp=SamplingParams(temperature=0.0), eos_id=-1)
    first = int(out[0, 1])
    out2, count2 = G.generate_tokens(CFG, params, jnp.asarray(pb), jnp.asarray(lb),
                                     jax.random.key(0), max_new_tokens=6,
                                     sp=SamplingParams(temperature=0.0), eos_id=first)
    assert int(count2[0]) == 2 and list(np.asarray(out2[0, :2])) == list(np.asarray(out[0, :2]))


def test_top_k_and_top_p_filters():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    p = probs(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [[0.5 / 0.7, 0.2 / 0.7, 0, 0, 0]], rtol=1e-6)
    p = probs(logits, SamplingParams(temperature=1.0, top_p=0.8))  # 0.5+0.2 < 0.8 -> keep 3
    np.testing.assert_allclose(p, [[0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0]], rtol=1e-6)
    x = processed_logits(logits, SamplingParams(temperature=0.5))
    np.testing.assert_allclose(x, logits * 2, rtol=1e-6)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
