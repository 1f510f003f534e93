"""Small configs and oracles shared by tests."""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from gendist.config import Config, DataConfig, MeshConfig, ModelConfig, TrainConfig


def experiment(name: str):
    """experiments/<name>.py as a module (experiments/ is not a package), loaded once."""
    return _experiment(name)


@functools.cache
def _experiment(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # as an import would: dataclasses resolve their annotations there
    spec.loader.exec_module(mod)
    return mod


def small_config(out_dir: str = "/tmp/gendist-test", **train_kw) -> Config:
    """A 2-layer width-32 model: compiles in seconds on CPU."""
    model = ModelConfig(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                        d_ff=64, max_seq_len=64)
    train = dict(batch_size=8, seq_len=16, steps=3, warmup_steps=1, lr=1e-2, eval_every=1000,
                 eval_batches=1, log_every=1, checkpoint_every=0, out_dir=out_dir,
                 tensorboard=False, progress=False)
    train.update(train_kw)
    return Config(model=model, mesh=MeshConfig(), data=DataConfig(), train=TrainConfig(**train))


def mesh_of(n: int, **sizes):
    from gendist.sharding import make_mesh
    return make_mesh(MeshConfig(**sizes), devices=jax.devices()[:n])


def run_steps_with_grads(cfg, mesh, data, steps: int):
    """Train `steps` steps on fixed batches; (losses, grads per step, final params,
    compiled step, setup). Asserts the step compiled once."""
    from gendist.data.batches import shard_batch
    from gendist.training import train
    setup = train.build(cfg, mesh, with_grads=True)
    state = setup.init_state()
    batches = [shard_batch(data.global_batch(i, 8, 16), mesh) for i in range(steps)]
    compiled = setup.step_fn.lower(state, batches[0]).compile()
    losses, grads = [], []
    for b in batches:
        state, m = setup.step_fn(state, b)
        losses.append(float(m["loss"]))
        grads.append(jax.device_get(m["grads"]))
    assert setup.traces["step"] == 1, "the train step recompiled"
    return losses, grads, jax.device_get(state["params"]), compiled, setup


def assert_trees_close(got, want, *, rtol: float, atol: float = 0.0, leaf_atol: float = 0.0):
    """Leaf by leaf, naming the failing leaf. The absolute tolerance is `atol` plus
    `leaf_atol` times the leaf's largest |want| (near-zero entries of a large leaf)."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                            strict=True):
        a, b = np.asarray(a), np.asarray(b)
        tol = atol + (leaf_atol * np.abs(b).max() if b.size else 0.0)
        np.testing.assert_allclose(a, b, rtol=rtol, atol=tol, err_msg=jax.tree_util.keystr(path))


@functools.cache
def _jitted_forward(model_cfg):
    from gendist.models import transformer
    return jax.jit(lambda params, tokens_BT: transformer.forward(model_cfg, params, tokens_BT))


def full_forward_greedy(model_cfg, params, prompt, n: int) -> list[int]:
    """The decoding oracle: n greedy tokens, each from the full forward over the whole
    sequence so far (no cache). Jitted: one compile per sequence length, where the eager
    forward compiled every op for every length."""
    forward = _jitted_forward(model_cfg)
    seq = [int(t) for t in prompt]
    for _ in range(n):
        seq.append(int(jnp.argmax(forward(params, jnp.asarray([seq]))[0, -1])))
    return seq[len(prompt):]


def lowered_for_sm90(f, *shapes) -> str:
    """f's program lowered for a CUDA GPU as text: Mosaic GPU's own checks run (tile-aligned
    shared-memory slices, TMA strides, layouts) with no GPU. Its Mosaic GPU kernels are the
    text's `stablehlo.custom_call @mosaic_gpu` calls."""
    return jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def stash_update(acc, grads, versions, states, opt, i: int, window: int):
    """PipeDream's sequential reference, one microbatch: stage s adds microbatch i's gradients
    grads[s] to acc[s]; after every `window` microbatches it applies their mean to its newest
    weights and appends the new version to versions[s] (acc, versions, states updated in place)."""
    import optax

    for s, g_s in enumerate(grads):
        acc[s] = g_s if acc[s] is None else jax.tree.map(jnp.add, acc[s], g_s)
        if (i + 1) % window == 0:
            g = jax.tree.map(lambda a: a / window, acc[s])
            upd, states[s] = opt.update(g, states[s], versions[s][-1])
            versions[s].append(optax.apply_updates(versions[s][-1], upd))
            acc[s] = None
