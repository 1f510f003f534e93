"""Tiled Pallas matmul against the jnp reference (interpret mode on CPU, compiled on a GPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import BlockSizes, matmul, matmul_reference

ON_GPU = jax.default_backend() == "gpu"
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


class TestMatmul:
    INTERPRET = not ON_GPU
    # Small tiles on CPU so the K loop and the grid both run several steps.
    BLOCKS = BlockSizes(block_m=32, block_n=32, block_k=16, group_m=2) if not ON_GPU else None

    @pytest.mark.parametrize(
        "m,n,k,dtype",
        [
            (64, 64, 64, jnp.float32),  # exact multiples of the tiles
            (100, 37, 70, jnp.float32),  # nothing divides: padded
            (1, 17, 33, jnp.float32),  # a single row
            (96, 128, 48, jnp.bfloat16),
            (77, 45, 129, jnp.bfloat16),
        ],
    )
    def test_matches_reference(self, m, n, k, dtype):
        ka, kb = jax.random.split(jax.random.key(m * 1000 + n + k))
        a = jax.random.normal(ka, (m, k), dtype)
        b = jax.random.normal(kb, (k, n), dtype)
        out = matmul(a, b, block_sizes=self.BLOCKS, interpret=self.INTERPRET)
        assert out.shape == (m, n) and out.dtype == dtype
        # The oracle works in fp32 on the same (already rounded) inputs.
        ref = matmul_reference(a.astype(jnp.float32), b.astype(jnp.float32))
        assert rel_err(out, ref) < TOL[dtype]

    def test_accumulates_in_fp32(self):
        # The first K tile sums to 256 and each of the 8 later tiles adds 1. An fp32 running
        # sum ends at 264 (exact in bf16); a bf16 one stalls at 256 since 257 rounds to even.
        bk = 16
        a = jnp.ones((16, 9 * bk), jnp.bfloat16)
        col = jnp.concatenate([jnp.full((bk,), 256 / bk), jnp.full((8 * bk,), 1 / bk)])
        b = jnp.broadcast_to(col[:, None], (9 * bk, 16)).astype(jnp.bfloat16)
        blocks = BlockSizes(block_m=16, block_n=16, block_k=bk, num_warps=4)
        out = matmul(a, b, block_sizes=blocks, interpret=self.INTERPRET)
        np.testing.assert_array_equal(np.asarray(out, np.float32), 264.0)

    def test_bad_input_names_the_field(self):
        a = jnp.ones((8, 4), jnp.float32)
        with pytest.raises(ValueError, match="shared K axis"):
            matmul(a, jnp.ones((5, 8), jnp.float32), interpret=True)
        with pytest.raises(ValueError, match="dtype"):
            matmul(a, jnp.ones((4, 8), jnp.bfloat16), interpret=True)
        with pytest.raises(ValueError, match="block_k"):
            BlockSizes(block_k=24)
