"""The Mosaic GPU decode matvec y = x @ w^T (Mosaic GPU's interpreter on CPU, compiled on an
sm90 GPU) against an fp32 einsum at HIGHEST precision; its lowering for sm90 at the 1b
preset's shapes; its shared-memory synchronisation under the interpreter's race detector."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import lowered_for_sm90

from pallas_kernels._mgpu import on_sm90
from pallas_kernels.matvec_mgpu import (
    MatvecBlockSizes,
    default_block_sizes,
    default_splits,
    matvec_mgpu,
    matvec_mgpu_partials,
    supports,
)

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
pytestmark = pytest.mark.skipif(ON_GPU and not on_sm90(), reason="Mosaic GPU needs an sm90 GPU (or the CPU interpreter)")

# The output is the fp32 accumulator rounded once to the dtype: at most half an ulp, 2^-8 of the
# value in bf16, 2^-11 in fp16; atol (relative to the largest output) covers sums that cancel.
TOL = {jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11}
ATOL = 1e-5
# fp32 partials against the fp32 einsum: summation order only (the tensor core's fp32 adds are
# not IEEE on the GPU).
TOL_FP32 = 1e-4 if ON_GPU else 1e-5


def inputs(B, N, K, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (B, K), dtype), jax.random.normal(kw, (N, K), dtype)


def reference(x, w):
    return jnp.einsum("BK,NK->BN", x.astype(jnp.float32), w.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def assert_close(y, ref, rtol):
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, ref, rtol=rtol, atol=ATOL * np.abs(ref).max())


# (dtype, B, N, K, block sizes): rings that wrap (steps > stages), splits, every n_tile, a batch
# that is not a multiple of 8 (x's last rows past its end: TMA zero-fills), B = 64 (every row
# of the wgmma tile), the defaults on a shape of 64-row tiles.
CASES = [
    (jnp.bfloat16, 1, 256, 512, MatvecBlockSizes(128, 128, 2, 1)),  # 4 steps, 2 slots
    (jnp.float16, 5, 256, 512, MatvecBlockSizes(64, 64, 3, 2)),  # 2 splits of 4 steps, 3 slots
    (jnp.bfloat16, 8, 128, 512, MatvecBlockSizes(128, 64, 4, 4)),  # 4 splits of 2 steps
    (jnp.float16, 8, 256, 256, MatvecBlockSizes(128, 64, 2, 1)),  # 4 steps, 2 slots, fp16
    (jnp.bfloat16, 64, 128, 512, MatvecBlockSizes(64, 128, 2, 1)),  # 4 steps, 2 slots
    (jnp.bfloat16, 3, 192, 384, None),  # defaults: n_tile 64, kc 128
]


@pytest.mark.parametrize("dtype,B,N,K,sizes", CASES)
def test_matches_einsum(dtype, B, N, K, sizes):
    x, w = inputs(B, N, K, dtype, seed=B + N)
    ref = reference(x, w)
    y = matvec_mgpu(x, w, block_sizes=sizes, interpret=INTERPRET)
    assert y.shape == (B, N) and y.dtype == dtype
    assert_close(y, ref, TOL[dtype])
    parts = matvec_mgpu_partials(x, w, block_sizes=sizes, interpret=INTERPRET)
    splits = (sizes or default_block_sizes(B, N, K)).splits
    assert parts.shape == (splits, B, N) and parts.dtype == jnp.float32
    assert_close(parts.sum(axis=0), ref, TOL_FP32)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's race detector")
def test_no_shared_memory_race():
    """Two splits of 4 steps through a 2-slot ring per block (each slot refilled twice), 5 rows
    of x: the interpreter sees no race between the TMA copies, the wgmma reads and the output
    staging."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    from pallas_kernels._mgpu import detecting_races

    x, w = inputs(5, 128, 512, jnp.bfloat16, seed=3)
    with detecting_races():
        y = jax.block_until_ready(matvec_mgpu(x, w, block_sizes=MatvecBlockSizes(64, 64, 2, 2), interpret=True))
    assert not interpret_pallas_call.get_races().races_found
    assert_close(y, reference(x, w), TOL[jnp.bfloat16])


# The 1b preset's decode products: qkv, o, gate_up, down as [N, K].
SHAPES_1B = [(6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]


@pytest.mark.parametrize("B", [1, 8, 16])
@pytest.mark.parametrize("N,K", SHAPES_1B)
def test_lowers_for_sm90(B, N, K):
    x = jax.ShapeDtypeStruct((B, K), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((N, K), jnp.bfloat16)
    text = lowered_for_sm90(matvec_mgpu, x, w)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    if default_block_sizes(B, N, K).splits == 1:  # the kernel alone: no pad, no sum
        assert "stablehlo.pad" not in text and "stablehlo.reduce" not in text


@pytest.mark.parametrize("sizes", [MatvecBlockSizes(64, 256, 3, 2), MatvecBlockSizes(64, 128, 4, 1),
                                   MatvecBlockSizes(128, 64, 3), MatvecBlockSizes(128, 128, 4, 4)])
def test_benchmark_variants_lower_for_sm90(sizes):
    """The tilings experiments/bench_matvec_mgpu.py times, at B = 5 (x's copy runs past its end)."""
    x = jax.ShapeDtypeStruct((5, 2048), jnp.float16)
    w = jax.ShapeDtypeStruct((1024, 2048), jnp.float16)
    text = lowered_for_sm90(lambda x, w: matvec_mgpu(x, w, block_sizes=sizes), x, w)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


def test_default_block_sizes():
    for N, K in SHAPES_1B + [(3072, 1024), (1024, 1024), (5632, 1024), (1024, 2816)]:
        sizes = default_block_sizes(8, N, K)
        assert N % sizes.n_tile == 0 and (K // sizes.kc) % sizes.splits == 0
    assert default_block_sizes(1, 192, 384) == MatvecBlockSizes(64, 128, 4, default_splits(3, 3))
    # Few tiles: split K so that enough SMs stream; many: no split (no partials, no XLA sum).
    assert default_splits(16, 16, sms=132) > 1 and default_splits(88, 16, sms=132) == 1
    assert default_splits(1, 7, sms=1) == 1


def test_supports():
    assert supports((1, 2048), (6144, 2048), jnp.bfloat16)
    assert supports((64, 1024), (1024, 1024), jnp.float16)
    assert not supports((65, 1024), (1024, 1024), jnp.bfloat16)  # B > 64
    # More than 8 rows must be whole 8-row tiles (x's TMA copy; seen failing to lower at B=10
    # on the H200, a prefill of 2 x 5 tokens): such a step takes XLA's product.
    assert not supports((10, 1024), (1024, 1024), jnp.bfloat16)
    assert supports((16, 1024), (1024, 1024), jnp.bfloat16) and supports((5, 1024), (1024, 1024), jnp.bfloat16)
    assert not supports((1, 1000), (1024, 1000), jnp.bfloat16)  # K % 64
    assert not supports((1, 1024), (1000, 1024), jnp.bfloat16)  # N % 64
    assert not supports((1, 1024), (1024, 1024), jnp.float32)
    assert not supports((1, 1024), (1024, 512), jnp.bfloat16)


def test_bad_inputs_raise_clear_errors():
    for fields, match in [(dict(n_tile=96), "n_tile=96"), (dict(n_tile=256), "n_tile=256"), (dict(kc=96), "kc=96"), (dict(stages=1), "stages=1"),
                          (dict(splits=0), "splits=0"), (dict(stages=8), "stages=8.*shared memory")]:
        with pytest.raises(ValueError, match=match):
            MatvecBlockSizes(**fields)
    x, w = inputs(2, 256, 512, jnp.bfloat16)
    call = lambda x, w, sizes=None: matvec_mgpu(x, w, block_sizes=sizes, interpret=INTERPRET)
    with pytest.raises(ValueError, match="B=65"):
        call(jnp.zeros((65, 512), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="B=10: use B <= 8 or a multiple of 8"):
        call(jnp.zeros((10, 512), jnp.bfloat16), w)
    with pytest.raises(ValueError, match="dtypes"):
        call(x.astype(jnp.float32), w.astype(jnp.float32))
    with pytest.raises(ValueError, match="dtypes"):
        call(x.astype(jnp.float16), w)
    with pytest.raises(ValueError, match=r"want \[B, K\] and \[N, K\]"):
        call(x[:, :256], w)
    with pytest.raises(ValueError, match="multiples of 64"):
        call(x[:, :480], w[:, :480])
    with pytest.raises(ValueError, match="n_tile=128 does not divide N=192"):
        call(x, w[:192], MatvecBlockSizes(n_tile=128, kc=64))
    with pytest.raises(ValueError, match="kc=256 does not divide K=384"):
        call(x[:, :384], w[:, :384], MatvecBlockSizes(kc=256, stages=2))
    with pytest.raises(ValueError, match="splits=3 does not divide K/kc=4"):
        call(x, w, MatvecBlockSizes(splits=3))
