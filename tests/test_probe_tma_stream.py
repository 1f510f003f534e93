"""experiments/probe_tma_stream.py: the weight stream through a TMA ring and the handovers
between its phases (the prices the chain megakernel's cost model is fitted to). On CPU: the
probe in Mosaic GPU's interpreter, each handover form's inline PTX lowered for sm90, and its
input checks."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers import experiment, lowered_for_sm90

from pallas_kernels._mgpu import on_sm90

ON_GPU = jax.default_backend() == "gpu"
pytestmark = pytest.mark.skipif(ON_GPU and not on_sm90(), reason="Mosaic GPU needs an sm90 GPU (or the CPU interpreter)")


def run_interpreted(script: str, out):
    """experiments/<script> --interpret --out <out>, from the repository root."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root)] + sys.path)}
    subprocess.run([sys.executable, str(root / "experiments" / script), "--interpret", "--out",
                    str(out)], check=True, env=env, cwd=root, capture_output=True, timeout=300)


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
