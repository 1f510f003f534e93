"""Safe (3-pass) and online (2-pass) Pallas row softmax against the jnp reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.softmax import (
    BlockSizes,
    online_softmax,
    row_reads,
    safe_softmax,
    softmax_reference,
)

ON_GPU = jax.default_backend() == "gpu"
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
KERNELS = {"safe": safe_softmax, "online": online_softmax}


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


class TestSoftmax:
    INTERPRET = not ON_GPU
    # Several column slices per row so every pass is a real loop.
    BLOCKS = BlockSizes(block_rows=2, block_cols=32)

    @pytest.mark.parametrize("kind", ["safe", "online"])
    @pytest.mark.parametrize(
        "shape,dtype",
        [((4, 128), jnp.float32), ((3, 5, 200), jnp.float32), ((7, 1), jnp.float32),
         ((6, 300), jnp.bfloat16)],
    )
    def test_matches_reference(self, kind, shape, dtype):
        x = (jax.random.normal(jax.random.key(sum(shape)), shape) * 4).astype(dtype)
        out = KERNELS[kind](x, block_sizes=self.BLOCKS, interpret=self.INTERPRET)
        assert out.shape == x.shape and out.dtype == dtype
        ref = softmax_reference(x.astype(jnp.float32))
        assert rel_err(out, ref) < TOL[dtype]

    @pytest.mark.parametrize("kind", ["safe", "online"])
    def test_rising_max_and_large_logits(self, kind):
        # The max rises in every slice (the online rescaling runs each step) and the logits
        # are large enough that exp without the max subtraction would overflow fp32.
        x = jnp.stack([jnp.linspace(0.0, 500.0, 160), jnp.linspace(400.0, -400.0, 160)])
        out = KERNELS[kind](x, block_sizes=self.BLOCKS, interpret=self.INTERPRET)
        assert np.all(np.isfinite(np.asarray(out)))
        assert rel_err(out, softmax_reference(x)) < TOL[jnp.float32]

    def test_online_reads_each_row_twice_safe_three_times(self):
        assert row_reads("safe") == 3
        assert row_reads("online") == 2

    def test_bad_input_names_the_field(self):
        with pytest.raises(ValueError, match="dtype"):
            safe_softmax(jnp.ones((2, 4), jnp.int32), interpret=True)
        with pytest.raises(ValueError, match="block_cols"):
            BlockSizes(block_cols=48)
        with pytest.raises(ValueError, match="kind"):
            row_reads("fast")
