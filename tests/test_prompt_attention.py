"""The prompt's attention kernel (`pallas_kernels.prompt_attention`: RoPE, causal attention
over the cached rows and the prompt's own, the prompt's rotated k and v handed back) against
its unfused math, and a prompt through it (and the RMSNorm kernel) on the megakernel path
against the same prompt in XLA. On a CPU the kernels run in Pallas interpret mode."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gendist.config import ModelConfig
from gendist.inference import decoder
from gendist.inference import megakernel as mk
from gendist.models import transformer
from gendist.models.layers import rope_angles
from pallas_kernels.prompt_attention import prompt_attention, prompt_attention_reference, tiling


def _case(T, N, K, H, S, start, dtype, L=3, seed=0):
    ks = jax.random.split(jax.random.key(seed), 2)
    qkv = jax.random.normal(ks[0], (T, N + 2 * K, H), jnp.float32).astype(dtype)
    kv = jax.random.normal(ks[1], (L, 2, K, S, H), jnp.float32).astype(dtype)
    kv = kv.at[:, :, :, start:].set(jnp.nan)  # rows at and past start: never read
    cos, sin = rope_angles((start + jnp.arange(T))[None], H, 10000.0, None)
    return qkv, kv, jnp.array([start], jnp.int32), cos[0], sin[0]


@pytest.mark.parametrize("T,N,K,H,start,dtype", [
    (32, 4, 4, 64, 0, jnp.bfloat16),    # a first prompt: nothing cached, one tile
    (40, 8, 2, 64, 37, jnp.bfloat16),   # grouped (4 a kv head): 3 tiles of 16 tokens, rows cached
    (5, 3, 1, 32, 40, jnp.float32),     # a group of 3 (rows padded), one short tile
    (9, 2, 1, 128, 64, jnp.float32),    # head_dim 128, the cache's rows in whole blocks
])
def test_prompt_attention_matches_unfused_math(T, N, K, H, start, dtype):
    """Output and the rotated k / v rows against `prompt_attention_reference`, with the
    cache's rows from `start` on NaN: the kernel reads only the rows before the prompt."""
    S, layer = 96, 1
    qkv, kv, st, cos, sin = _case(T, N, K, H, S, start, dtype)
    o, rows = prompt_attention(qkv, kv, st, cos, sin, layer=layer, num_heads=N, interpret=True)
    clean = jnp.nan_to_num(kv)  # the reference writes the prompt's rows over them first
    o_ref, rows_ref = prompt_attention_reference(qkv, clean, st, cos, sin, layer=layer, num_heads=N)
    assert o.shape == (T, N, H) and rows.shape == (2, K, T, H)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(rows, np.float32), np.asarray(rows_ref, np.float32), atol=tol, rtol=tol)


def test_prompt_attention_takes_its_layer_at_run_time():
    """One kernel for every layer of a scan: the layer a traced index into the cache, each
    layer's output that of the reference at that layer (the layers' rows differ)."""
    qkv, kv, st, cos, sin = _case(5, 2, 1, 32, 64, 9, jnp.float32, L=3)
    clean = jnp.nan_to_num(kv)

    def one(_, layer):
        return None, prompt_attention(qkv, kv, st, cos, sin, layer=layer, num_heads=2, interpret=True)

    _, (o_L, rows_L) = jax.lax.scan(one, None, jnp.arange(3, dtype=jnp.int32))
    for layer in range(3):
        o_ref, rows_ref = prompt_attention_reference(qkv, clean, st, cos, sin, layer=layer, num_heads=2)
        np.testing.assert_allclose(np.asarray(o_L[layer]), np.asarray(o_ref), atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(rows_L[layer]), np.asarray(rows_ref), atol=1e-5, rtol=1e-5)
    assert not np.allclose(np.asarray(o_L[0]), np.asarray(o_L[2]), atol=1e-3)


def test_prompt_attention_tiles_and_errors():
    """A tile holds as many tokens as fit 64 rows with the group's heads (rows a power of two
    of at least 16); bad shapes name the argument."""
    assert tiling(32, 1) == (32, 32) and tiling(40, 4) == (16, 64) and tiling(5, 3) == (8, 32)
    qkv, kv, st, cos, sin = _case(4, 2, 1, 64, 32, 0, jnp.float32)
    with pytest.raises(ValueError, match="num_heads \\+ 2 \\* kv_heads"):
        prompt_attention(qkv, kv, st, cos, sin, layer=0, num_heads=4, interpret=True)
    with pytest.raises(ValueError, match="layer=3"):
        prompt_attention(qkv, kv, st, cos, sin, layer=3, num_heads=2, interpret=True)


CFG = ModelConfig(d_model=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, d_ff=192,
                  max_seq_len=256, dtype="bfloat16")


def test_a_prompt_through_its_kernels_is_the_prompt_in_xla():
    """On the megakernel path a prompt's norms and attention run through their Pallas kernels
    where the cache asks for them (`ChainCache(prompt_kernels=True)`, a GPU's): two prompts
    one after the other (the second attends to the first's rows) give the logits and cache
    rows of the XLA prompt (`prompt_kernels=False`) within bf16 rounding, and nothing is
    written past them."""
    params = transformer.init_params(CFG, 3)
    plan = decoder.plan(CFG, params, 1, 128, "megakernel", mk.chain_reference, head="xla", kernel_state=False)
    first = jax.random.randint(jax.random.key(1), (1, 24), 0, CFG.vocab_size)
    second = jax.random.randint(jax.random.key(2), (1, 40), 0, CFG.vocab_size)
    out = {}
    for kernels in (False, True):
        cache = dataclasses.replace(plan.make_cache(), prompt_kernels=kernels)
        assert cache.decode_kernels(1, 40) == ((kernels, kernels))
        _, cache = plan.prefill(first, jnp.array([24], jnp.int32), cache)
        logits, cache = plan.prefill(second, jnp.array([40], jnp.int32), cache)
        out[kernels] = (np.asarray(logits), np.asarray(cache.kv, np.float32), int(cache.lengths[0]))
    (l0, kv0, n0), (l1, kv1, n1) = out[False], out[True]
    assert n0 == n1 == 64
    np.testing.assert_allclose(l1, l0, atol=0.03 * np.abs(l0).max())
    np.testing.assert_allclose(kv1, kv0, atol=0.02 * np.abs(kv0).max())
    assert (np.abs(kv1[:, :, :, :64]).max(axis=(0, 1, 2, 4)) > 0).all() and not kv1[:, :, :, 64:].any()
