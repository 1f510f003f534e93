"""Small configs and oracles shared by tests."""

from __future__ import annotations

import jax

from gendist.config import Config, DataConfig, MeshConfig, ModelConfig, TrainConfig


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
