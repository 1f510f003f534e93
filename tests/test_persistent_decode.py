"""The persistent-decode probe (`pallas_kernels/persistent_decode.py`) against its jnp reference.

On CPU the phased form runs in Pallas interpret mode; on a GPU the same cases also run the
persistent form (one launch, grid barriers), with and without prefetch and with both spins.
The persistent form cannot run interpreted (a spin barrier deadlocks when programs run one
after another), so on CPU it is only lowered to Triton IR for an abstract H200.
"""
import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import persistent_decode as pd

ON_GPU = jax.default_backend() == "gpu"
D, N1, F, L = 64, 96, 80, 2
# Small units so each program streams several of them, with lookahead depths 2..4 and tile
# widths 64/32/16 (plan_phases): the loop bodies, the tails and the masked loads all run.
TINY = dict(unit_bytes=512, inflight_bytes=1024, k_block=64, num_warps=4)
# Max error over max |reference|: one bf16 ulp at the largest value. Kernel and reference
# round the same tensors to bf16; they differ by fp32 summation order (~1e-6) and, rarely,
# an activation rounded the other way at a bf16 boundary (one ulp of one term of a sum).
TOL = 2.0 ** -8


@pytest.fixture(scope="module")
def weights():
    w = pd.init_weights(jax.random.key(0), layers=L, d=D, n1=N1, f=F)
    return w, pd.pack_weights(w)


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def _check(weights, batch, programs, **kw):
    w, packed = weights
    x = jax.random.normal(jax.random.key(batch), (batch, D), jnp.float32)
    ref = pd.reference_chain(x, w)
    out = pd.decode_chain(x, packed, tiling=pd.Tiling(programs=programs, **TINY), **kw)
    assert out.shape == (batch, D) and out.dtype == jnp.float32
    err = _rel_err(out, ref)
    assert err <= TOL, f"max error {err:.2e} (relative to max |ref|) > {TOL:.2e}"


# batch 1 on 4 programs; batch 3 on 5 (uneven unit ranges); batch 2 on 40 (programs with
# no unit, or fewer units than the lookahead depth)
CASES = [(1, 4), (3, 5), (2, 40)]


@pytest.mark.parametrize("batch,programs", CASES)
def test_phased_matches_reference(weights, batch, programs):
    _check(weights, batch, programs, mode="phased")


@pytest.mark.skipif(not ON_GPU, reason="the persistent form needs a GPU (grid barrier)")
@pytest.mark.parametrize("batch,programs", CASES + [(1, None)])
@pytest.mark.parametrize("prefetch,spin", [(True, "volatile"), (False, "volatile"),
                                           (True, "atomic")])
def test_persistent_matches_reference(weights, batch, programs, prefetch, spin):
    _check(weights, batch, programs, mode="persistent", prefetch=prefetch, spin=spin)


def test_reference_scan_equals_unrolled(weights):
    w, _ = weights
    x = jax.random.normal(jax.random.key(7), (2, D), jnp.float32)
    np.testing.assert_allclose(pd.reference_chain(x, w, scan=True), pd.reference_chain(x, w),
                               rtol=1e-6, atol=1e-6)


def test_persistent_refuses_interpret(weights):
    _, packed = weights
    with pytest.raises(ValueError, match="interpret"):
        pd.decode_chain(jnp.ones((1, D)), packed, mode="persistent", interpret=True)


def test_bad_arguments(weights):
    _, packed = weights
    with pytest.raises(ValueError, match="batch"):
        pd.decode_chain(jnp.ones((9, D)), packed)
    with pytest.raises(ValueError, match="k_block"):
        pd.decode_chain(jnp.ones((1, D)), packed, tiling=pd.Tiling(k_block=48))
    with pytest.raises(ValueError, match="mode"):
        pd.decode_chain(jnp.ones((1, D)), packed, mode="fused")


def test_persistent_lowers_to_triton_ir(weights):
    """Deviceless: lower the persistent kernel for an abstract H200 and read its Triton IR:
    one arrival and one acquire RMW per barrier (acq_rel, gpu scope), the spin loops, CTA
    barriers, volatile loads. (Compiling the IR to PTX needs the CUDA plugin.)"""
    if not hasattr(jax.sharding, "AbstractDevice") or ON_GPU:
        pytest.skip("needs jax.sharding.AbstractDevice and a host without a GPU")
    _, packed = weights
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    x = jax.ShapeDtypeStruct((1, D), jnp.float32)
    buf = io.StringIO()
    fn = jax.jit(lambda x, w: pd.decode_chain(
        x, w, mode="persistent", interpret=False, debug=True,
        tiling=pd.Tiling(programs=132, **TINY)))
    with jax.sharding.use_abstract_mesh(mesh), contextlib.redirect_stdout(buf):
        fn.trace(x, packed).lower(lowering_platforms=("cuda",))
    ir = buf.getvalue()
    # 4 barriers in the layer loop's body (the last one under an scf.if)
    assert ir.count("tt.atomic_rmw add, acq_rel, gpu") == 4
    assert ir.count("tt.atomic_rmw max, acq_rel, gpu") == 4
    assert ir.count("scf.while") == 4
    assert ir.count("gpu.barrier") == 8
    assert "isVolatile = true" in ir
