"""The model's `pallas` attention backend (FlashAttention kernel) trains like `xla`."""

import jax
import numpy as np
from helpers import mesh_of, small_config

from gendist.data.batches import TextData, shard_batch
from gendist.presets import replace
from gendist.training import train


def losses(backend, dtype, steps=3):
    cfg = replace(small_config(), **{"model.attention": backend, "model.dtype": dtype,
                                     "model.head_dim": 32, "model.num_heads": 2,
                                     "model.num_kv_heads": 1})
    setup = train.build(cfg, mesh_of(1))
    data = TextData.from_config(cfg.data)
    state, out = setup.init_state(), []
    for i in range(steps):
        batch = shard_batch(data.global_batch(i, cfg.train.batch_size, cfg.train.seq_len),
                            setup.mesh)
        state, m = setup.step_fn(state, batch)
        out.append(float(m["loss"]))
    return np.array(out), jax.device_get(state["params"])


def test_pallas_backend_matches_xla_fp32_and_bf16():
    # fp32 as IEEE fp32 on both sides: a GPU would otherwise run the model's fp32 einsums in
    # TF32 (the kernel uses full precision for fp32 tiles), and the run failed on an H200.
    with jax.default_matmul_precision("highest"):
        ref, p_ref = losses("xla", "float32")
        got, p_got = losses("pallas", "float32")
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(p_got), jax.tree.leaves(p_ref), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    bf_ref, _ = losses("xla", "bfloat16")
    bf_got, _ = losses("pallas", "bfloat16")
    np.testing.assert_allclose(bf_got, bf_ref, rtol=1e-2)  # the bf16 tolerance
