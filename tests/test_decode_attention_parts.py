"""The fused decode attention kernel given the q|k|v projection as S fp32 partial sums
[S, B, N+2K, H] (a split matrix-vector product's pieces): it sums them in the kernel, in
fp32, and rounds to the cache dtype, so that it equals the kernel (and the unfused math) on
`parts.sum(0).astype(dtype)`; every program that reads q|k|v sums (split 0 writes the new
rows, every split rotates q and k). Pallas interpret mode on a CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gendist.models import layers
from pallas_kernels.decode_attention import (
    decode_attention,
    decode_attention_reference,
    parse_tiling,
)

B, H, SLOTS = 3, 32, 40
DT = jnp.bfloat16


def _case(N, K, S, seed=0):
    """Partials, caches (NaN in the slots at and past each position: never read) and RoPE
    angles at positions 0 (nothing cached), mid-block and the last slot."""
    ks = jax.random.split(jax.random.key(seed), 3)
    parts = jax.random.normal(ks[0], (S, B, N + 2 * K, H), jnp.float32)
    k_cache = jax.random.normal(ks[1], (K, B, SLOTS, H), jnp.float32)
    v_cache = jax.random.normal(ks[2], (K, B, SLOTS, H), jnp.float32)
    pos = jnp.array([0, 17, SLOTS - 1], jnp.int32)
    stale = jnp.arange(SLOTS)[None, None, :, None] >= pos[None, :, None, None]
    k_cache = jnp.where(stale, jnp.nan, k_cache).astype(DT)
    v_cache = jnp.where(stale, jnp.nan, v_cache).astype(DT)
    cos, sin = layers.rope_angles(pos[:, None], H, 10000.0)
    return parts, (k_cache, v_cache, pos, cos[:, 0], sin[:, 0])


def _f32(x):
    return np.asarray(x, np.float32)


@pytest.mark.parametrize("tiling", ["bk16_sp1", "bk16_sp3"], ids=["one-split", "3-splits"])
@pytest.mark.parametrize("N,K,S", [(4, 2, 3), (4, 4, 3), (4, 2, 1), (4, 4, 1)],
                         ids=["gqa-S3", "mha-S3", "gqa-S1", "mha-S1"])
def test_partials_equal_their_sum(N, K, S, tiling):
    parts, rest = _case(N, K, S)
    kw = dict(num_heads=N, **parse_tiling(tiling))
    # parts.sum(0) in the kernel's order (0 … S-1; XLA's sum on a CPU adds in this order
    # too), rounded once to bf16: the same q|k|v, hence bitwise the same outputs and rows.
    summed = functools.reduce(jnp.add, parts).astype(DT)
    o, k_new, v_new = decode_attention(parts, *rest, **kw)
    o_sum, k_sum, v_sum = decode_attention(summed, *rest, **kw)
    np.testing.assert_array_equal(_f32(o), _f32(o_sum))
    np.testing.assert_array_equal(_f32(k_new), _f32(k_sum))
    np.testing.assert_array_equal(_f32(v_new), _f32(v_sum))
    o_ref, k_ref, v_ref = decode_attention_reference(summed, *rest, num_heads=N)
    assert not np.isnan(_f32(o)).any()
    np.testing.assert_allclose(_f32(o), _f32(o_ref), rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(_f32(k_new), _f32(k_ref))
    np.testing.assert_array_equal(_f32(v_new), _f32(v_ref))


def _pallas_operands(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            return [v.aval for v in eqn.invars]
        for sub in eqn.params.values():  # the jit around the kernel
            sub = getattr(sub, "jaxpr", sub)
            if hasattr(sub, "eqns") and (found := _pallas_operands(sub)):
                return found
    return None


def test_partials_go_into_the_kernel_unsummed():
    """No XLA op sums the pieces before the kernel: its first operand is the partials."""
    parts, rest = _case(4, 2, 3)
    jaxpr = jax.make_jaxpr(lambda p: decode_attention(p, *rest, num_heads=4))(parts)
    first = _pallas_operands(jaxpr.jaxpr)[0]
    assert first.shape == parts.shape and first.dtype == jnp.float32


def test_rejects_other_ranks():
    parts, rest = _case(4, 2, 3)
    with pytest.raises(ValueError, match="partial sums"):
        decode_attention(parts[None], *rest, num_heads=4)
