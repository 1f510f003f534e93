"""The persistent decode MLP kernel (`pallas_kernels.mlp_mgpu`) against the decode path's math
in XLA: one block in Mosaic GPU's interpreter on CPU; on an sm90 GPU compiled, with many
blocks, the grid-wide barrier and the down product's K ranges summed by TMA reduce-add.
Also its sm90 lowering at the presets' shapes, its shared-memory synchronisation under the
interpreter's race detector, and its input checks."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import experiment, lowered_for_sm90

from pallas_kernels._mgpu import detecting_races, on_sm90
from pallas_kernels.mlp_mgpu import (
    MlpBlockSizes,
    default_rows,
    default_splits,
    mlp_mgpu,
    reference,
    supports,
)

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU
pytestmark = pytest.mark.skipif(ON_GPU and not on_sm90(), reason="Mosaic GPU needs an sm90 GPU (or the CPU interpreter)")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="many blocks need the GPU (the interpreter runs one)")


def inputs(B, D, F, dtype=jnp.bfloat16, seed=0):
    kh, kg, kd = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(kh, (B, D), jnp.float32).astype(dtype)
    w_gu = (jax.random.normal(kg, (2 * F, D), jnp.float32) / D ** 0.5).astype(dtype)
    w_d = (jax.random.normal(kd, (D, F), jnp.float32) / F ** 0.5).astype(dtype)
    return h, w_gu, w_d


def ref(h, w_gu, w_d):
    with jax.default_matmul_precision("highest"):
        return reference(h, w_gu, w_d)


def assert_close(y, r):
    """The hidden activations are rounded to bf16 (fp16) as XLA rounds them; a product summed
    in another order may round one of them to the neighbouring value, which moves y by about
    2^-8 of one term: far below a wrong tile, row or K range (errors of the order of y)."""
    y, r = np.asarray(y, np.float32), np.asarray(r, np.float32)
    assert y.shape == r.shape and np.isfinite(y).all()
    np.testing.assert_allclose(y, r, rtol=2e-2, atol=2e-2 * np.abs(r).max())


# (B, D, F, dtype, sizes) in the interpreter (one block, one K range): rings that wrap, a batch
# past 8 rows, fp16, 128-wide steps.
INTERP_CASES = [
    (1, 128, 128, jnp.bfloat16, MlpBlockSizes(kc=64, stages=2)),
    (3, 256, 192, jnp.float16, MlpBlockSizes(kc=64, stages=3)),
    (16, 128, 256, jnp.bfloat16, MlpBlockSizes(kc=128, stages=2)),
    (5, 128, 128, jnp.bfloat16, MlpBlockSizes(kc=64, stages=3, rows=32)),
    (1, 256, 256, jnp.bfloat16, MlpBlockSizes(kc=128, stages=3, rows=8)),
    (2, 128, 512, jnp.bfloat16, MlpBlockSizes(kc=128, stages=4, rows=16)),
    (1, 128, 256, jnp.bfloat16, MlpBlockSizes(kc=64, stages=3, prefetch=False)),
]


@pytest.mark.parametrize("B,D,F,dtype,sizes", INTERP_CASES)
def test_matches_xla_math(B, D, F, dtype, sizes):
    h, w_gu, w_d = inputs(B, D, F, dtype)
    y = mlp_mgpu(h, w_gu, w_d, block_sizes=sizes, interpret=INTERPRET)
    assert y.dtype == jnp.float32
    assert_close(y, ref(h, w_gu, w_d))


# GPU: many blocks and K ranges. (B, D, F, sizes): the defaults at the presets' shapes (132
# blocks), few blocks with several units each and K ranges, a batch of 16, blocks without work.
GPU_CASES = [
    (1, 2048, 5632, MlpBlockSizes()),
    (1, 1024, 2816, MlpBlockSizes()),
    (3, 512, 1024, MlpBlockSizes(blocks=7, splits=4)),
    (16, 256, 512, MlpBlockSizes(blocks=5, splits=2, kc=128, stages=3)),
    (8, 256, 256, MlpBlockSizes(blocks=32, splits=1)),
    (2, 1024, 2816, MlpBlockSizes(rows=32, kc=64, stages=20)),
    (1, 2048, 5632, MlpBlockSizes(rows=64, kc=128, stages=5)),
    (8, 2048, 5632, MlpBlockSizes(rows=8, kc=256)),
    (3, 512, 768, MlpBlockSizes(rows=16, kc=256, blocks=9, splits=3)),
    (1, 2048, 5632, MlpBlockSizes(rows=64, kc=64, stages=10, prefetch=False)),
]


@gpu_only
@pytest.mark.parametrize("B,D,F,sizes", GPU_CASES)
def test_many_blocks_match_xla_math(B, D, F, sizes):
    h, w_gu, w_d = inputs(B, D, F)
    r = ref(h, w_gu, w_d)
    for _ in range(3):  # the semaphore starts at zero on every call
        assert_close(mlp_mgpu(h, w_gu, w_d, block_sizes=sizes), r)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's race detector")
@pytest.mark.parametrize("F", [128, 256])
def test_shared_memory_synchronisation_has_no_races(F):
    """Gate|up units (2, 4) and a down unit (2, 4 steps) through a 2-slot ring, each slot
    refilled across the phase change, the down weights copied into it before the barrier (all
    of them, or the first 2 of 4), both epilogues' staging reused: no race."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call  # noqa: PLC0415

    h, w_gu, w_d = inputs(2, 128, F)
    with detecting_races():
        y = jax.block_until_ready(mlp_mgpu(h, w_gu, w_d, block_sizes=MlpBlockSizes(kc=64, stages=2),
                                           interpret=True))
    assert not interpret_pallas_call.get_races().races_found
    assert_close(y, ref(h, w_gu, w_d))


@pytest.mark.parametrize("B,D,F", [(1, 2048, 5632), (8, 1024, 2816)])
def test_lowers_for_sm90(B, D, F):
    h = jax.ShapeDtypeStruct((B, D), jnp.bfloat16)
    w_gu = jax.ShapeDtypeStruct((2 * F, D), jnp.bfloat16)
    w_d = jax.ShapeDtypeStruct((D, F), jnp.bfloat16)
    text = lowered_for_sm90(lambda a, b, c: mlp_mgpu(a, b, c, block_sizes=MlpBlockSizes(blocks=132)),
                            h, w_gu, w_d)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert "decode_mlp" in text


def test_default_splits_spread_the_down_product():
    # 1b: 88 gate|up units on 132 blocks, then 16 row tiles of down over 88 steps of 64: 8 K
    # ranges (128 units of 11 steps) leave no block more than one.
    assert default_splits(2048, 5632, 64, 132) == 8
    # a gate|up unit for at least every other block, as large as that allows: 1b 88 units of
    # 64 rows, 350m 88 of 32; a narrow F on many blocks takes the fewest rows
    assert default_rows(5632, 132) == 64 and default_rows(2816, 132) == 32
    assert default_rows(256, 1) == 64 and default_rows(192, 132) == 8
    assert default_splits(128, 128, 64, 1) == 1  # one block: nothing to spread


def test_bad_inputs_name_the_field():
    h, w_gu, w_d = inputs(1, 128, 128)
    with pytest.raises(ValueError, match="want \\[B, D\\], \\[2F, D\\], \\[D, F\\]"):
        mlp_mgpu(h, w_gu[:64], w_d, interpret=True)
    with pytest.raises(ValueError, match="batch B=9"):
        mlp_mgpu(jnp.zeros((9, 128), jnp.bfloat16), w_gu, w_d, interpret=True)
    with pytest.raises(ValueError, match="MlpBlockSizes.kc=96"):
        MlpBlockSizes(kc=96)
    with pytest.raises(ValueError, match="interpreter runs one block"):
        mlp_mgpu(h, w_gu, w_d, block_sizes=MlpBlockSizes(blocks=2), interpret=True)
    assert supports((1, 2048), 2048, 5632, jnp.bfloat16)
    assert not supports((1, 2048), 2048, 5632, jnp.float32)


def run_interpreted(script: str, out):
    """experiments/<script> --interpret --out <out>, from the repository root."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root)] + sys.path)}
    subprocess.run([sys.executable, str(root / "experiments" / script), "--interpret", "--out",
                    str(out)], check=True, env=env, cwd=root, capture_output=True, timeout=300)


@pytest.mark.skipif(ON_GPU, reason="the benchmark's CPU path (the GPU runs experiments/gpu_call_mlp.sh)")
def test_benchmark_runs_in_the_interpreter(tmp_path):
    """experiments/bench_mlp_mgpu.py --interpret: its chain, the kernel against XLA's MLP."""
    run_interpreted("bench_mlp_mgpu.py", tmp_path)
    cases = json.loads((tmp_path / "mlp_mgpu.json").read_text())["cases"]
    assert {c["impl"] for c in cases} == {"xla", "ours"}
    assert all(c["rel_err_vs_xla"] < 2e-2 for c in cases)


@pytest.mark.skipif(ON_GPU, reason="the probe's CPU path")
def test_tma_stream_probe_runs_in_the_interpreter(tmp_path):
    """experiments/probe_tma_stream.py --interpret: the ring alone, its wgmma sums checked."""
    run_interpreted("probe_tma_stream.py", tmp_path)
    rows = json.loads((tmp_path / "probe_tma_stream.json").read_text())["rows"]
    assert {r["variant"] for r in rows} >= {"xla_sum", "r64_kc64_st2_wgmma_x1"}


def probe_module():
    """experiments/probe_tma_stream.py as a module."""
    return experiment("probe_tma_stream")


@pytest.mark.parametrize("tag,present,absent", [
    # today's barrier: proxy + acquire-release fences, a release add on one counter, an acquire wait
    ("P16_cons_gpu", ["fence.proxy.async.global", "red.release.sys.global.add.u32",
                      "ld.relaxed.gpu.global.b32", "fence.acquire.gpu"], ["LAB_POLL"]),
    # a flag a block, polled by every thread at once, then an acquire-release fence
    ("P16_cons_gpu_flags_none", ["red.release.gpu.global.add.u32", "LAB_POLL", "fence.acq_rel.gpu"],
     ["fence.proxy.async.global"]),
    # relaxed: no memory-ordering fence anywhere (Mosaic's own barrier-init and shared-memory
    # proxy fences stay), a relaxed add, the flags polled with no fence after
    ("P16_cons_gpu_flags_relaxed", ["red.relaxed.gpu.global.add.u32", "LAB_POLL"],
     ["fence.acq", "fence.proxy.async.global", "red.release"]),
])
def test_tma_stream_probe_sync_modes_lower_for_sm90(tag, present, absent):
    """Each barrier the probe prices emits what its name says (the inline PTX), on sm90."""
    mod = probe_module()
    kw = mod.parse(f"r64_kc64_st10_wgmma_x1_{tag}", 132)
    w = jax.ShapeDtypeStruct((1024, 8192), jnp.bfloat16)
    text = lowered_for_sm90(lambda w: mod.stream(w, **kw), w)
    for s in present:
        assert s in text, s
    for s in absent:
        assert s not in text, s


def test_tma_stream_probe_bad_modes_name_the_field():
    mod = probe_module()
    w = jnp.zeros((64, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="mode="):
        mod.stream(w, rows=64, kc=64, stages=2, blocks=1, consume="none", phases=1, mode="tree")
    with pytest.raises(ValueError, match="fences="):
        mod.stream(w, rows=64, kc=64, stages=2, blocks=1, consume="none", phases=1, fences="full")
    with pytest.raises(ValueError, match="wait="):
        mod.stream(w, rows=64, kc=64, stages=2, blocks=1, consume="none", phases=1, wait="both")


@pytest.mark.parametrize("deps", [0, 3])
def test_tma_stream_probe_ll_mode_lowers_for_sm90(deps):
    """mode="ll": relaxed 64-bit stores of {value, tag} and (deps > 0) the polling loop over
    `deps` sources, and no memory-ordering fence."""
    mod = probe_module()
    kw = mod.parse(f"r64_kc64_st16_wgmma_x1_P16_cons_gpu_ll_d{deps}", 132)
    w = jax.ShapeDtypeStruct((1024, 8192), jnp.bfloat16)
    text = lowered_for_sm90(lambda w: mod.stream(w, **kw), w)
    assert "st.relaxed.gpu.global.b64" in text
    assert text.count("ld.relaxed.gpu.global.b64") == deps
    assert ("LAB_LL" in text) == (deps > 0)
    assert ("trap;" in text) == (deps > 0)  # a poll that never ends traps instead of hanging
    for s in ("fence.acq", "fence.proxy.async.global", "red.release"):
        assert s not in text, s
    with pytest.raises(ValueError, match="mode='ll' wants"):
        mod.stream(jnp.zeros((64, 128), jnp.bfloat16), rows=64, kc=128, stages=2, blocks=1,
                   consume="wgmma", phases=2, mode="ll")
