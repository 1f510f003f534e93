"""The fused matrix-vector kernel (`pallas_kernels.matvec`) against its jnp reference, in
Pallas interpret mode: plain, with an RMSNorm in front, with SwiGLU in front, with a residual
added, and with K not a power of two (streamed in power-of-two steps)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matvec import BlockSizes, fused_matvec, matvec_reference

CASES = [  # (N, K, gain, swiglu, residual)
    (64, 96, False, False, False),
    (32, 64, True, False, True),
    (16, 48, False, True, True),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_matvec_matches_reference(dtype):
    rng = np.random.default_rng(0)
    blocks = BlockSizes(block_n=8, block_k=32)  # several programs and several K steps
    for n, k, gain, swiglu, residual in CASES:
        w = jnp.asarray(rng.normal(size=(n, k)) / np.sqrt(k), dtype)
        x = jnp.asarray(rng.normal(size=(2 * k if swiglu else k,)), dtype)
        kw = {}
        if gain:
            kw["gain"] = jnp.asarray(rng.uniform(0.5, 2.0, size=(k,)), jnp.float32)
        if residual:
            kw["residual"] = jnp.asarray(rng.normal(size=(n,)), dtype)
        got = fused_matvec(x, w, swiglu=swiglu, block_sizes=blocks, **kw)  # GPU: Triton
        want = matvec_reference(x, w, swiglu=swiglu, **kw)
        assert got.shape == (n,) and got.dtype == dtype
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol)


def test_fused_matvec_rejects_mismatched_shapes():
    w = jnp.zeros((16, 32), jnp.float32)
    with pytest.raises(ValueError, match=r"x must be \[64\]"):
        fused_matvec(jnp.zeros((32,)), w, swiglu=True, interpret=True)
    with pytest.raises(ValueError, match="residual"):
        fused_matvec(jnp.zeros((32,)), w, residual=jnp.zeros((8,)), interpret=True)
