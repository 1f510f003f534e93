"""Run issue 3's core checks on another jax (the GPU image's 0.11.2), on 8 simulated CPUs."""
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from helpers import mesh_of, small_config  # noqa: E402

from gendist import accounting, train  # noqa: E402
from gendist.config import ModelConfig  # noqa: E402
from gendist.data import TextData, shard_batch  # noqa: E402
from gendist.models import transformer  # noqa: E402
from gendist.parallel import manual, tensor  # noqa: E402
from gendist.presets import replace  # noqa: E402

print("jax", jax.__version__, jax.device_count(), "devices")
data = TextData.from_config(small_config().data)


def cfg_of(stage, sp):
    return replace(small_config(), **{"model.num_heads": 8, "model.num_kv_heads": 8,
                                      "model.head_dim": 4, "train.zero_stage": stage,
                                      "mesh.sequence_parallel": sp})


def run(cfg, mesh):
    s = train.build(cfg, mesh, with_grads=True)
    st = s.init_state()
    out = []
    for i in range(3):
        st, m = s.step_fn(st, shard_batch(data.global_batch(i, 8, 16), mesh))
        out.append((float(m["loss"]), jax.device_get(m["grads"])))
    return out, jax.device_get(st["params"])


ref, ref_p = run(cfg_of(0, False), mesh_of(1))
for d, t, stage, sp in [(2, 4, 0, True), (2, 4, 3, True), (4, 2, 2, False), (1, 8, 1, True)]:
    got, p = run(cfg_of(stage, sp), mesh_of(8, data=d, tensor=t))
    for (l1, g1), (l2, g2) in zip(got, ref, strict=True):
        np.testing.assert_allclose(l1, l2, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    print("equivalence ok", (d, t, stage, sp))
    setup = train.build(cfg_of(stage, sp), mesh_of(8, data=d, tensor=t))
    pred, comp = accounting.predict(setup), accounting.compiled_figures(setup)
    assert set(pred["comm"]) == set(comp["comm"]), (pred["comm"], comp["comm"])
    for k, v in comp["comm"].items():
        assert abs(pred["comm"][k] - v) <= 0.1 * v, (k, pred["comm"][k], v)
    print("plan within 10% ok", comp["comm"])

cfg = ModelConfig(d_model=32, num_layers=1, num_heads=8, num_kv_heads=4, head_dim=4, d_ff=64)
mesh = mesh_of(8, data=2, tensor=4)
p = jax.tree.map(lambda a: a[0], transformer.init_params(cfg, 0)["blocks"])
x = jax.random.normal(jax.random.key(1), (8, 16, 32))
pos = jnp.broadcast_to(jnp.arange(16), (8, 16))
for sp in (False, True):
    f = lambda p, x, sp=sp: jnp.sum(jnp.sin(manual.tp_block_forward(p, x, pos, cfg, mesh,
                                                                   sequence_parallel=sp)))
    g = lambda p, x: jnp.sum(jnp.sin(transformer.block(p, x, pos, cfg)[0]))
    a, b = jax.jit(jax.value_and_grad(f, (0, 1)))(p, x), jax.value_and_grad(g, (0, 1))(p, x)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6)
    print("explicit block ok, sp =", sp)
logits = jax.random.normal(jax.random.key(0), (4, 8, 256))
tg = jax.random.randint(jax.random.key(1), (4, 8), 0, 256)
a = jax.jit(jax.value_and_grad(lambda l: jnp.mean(tensor.vocab_parallel_nll(l, tg, mesh))))(logits)
b = jax.value_and_grad(lambda l: train.cross_entropy(l, tg))(logits)
np.testing.assert_allclose(a[0], b[0], rtol=1e-6)
np.testing.assert_allclose(a[1], b[1], rtol=1e-5, atol=1e-9)
print("vocab-parallel cross-entropy ok")
print("ALL OK")
