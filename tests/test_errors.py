"""Bad input gets an error that names the field and the fix."""

import pytest
from helpers import mesh_of, small_config

from gendist.config import DataConfig, MeshConfig, ModelConfig
from gendist.data.batches import load_corpus
from gendist.inference.generate import check_lengths
from gendist.presets import replace
from gendist.sharding import make_mesh
from gendist.training import train


def test_mesh_sizes_must_divide_devices():
    with pytest.raises(ValueError, match=r"multiply to 6 but there are 8 devices.*mesh.data"):
        make_mesh(MeshConfig(data=3, tensor=2))
    with pytest.raises(ValueError, match=r"fixed axes multiply to 3, which does not divide"):
        make_mesh(MeshConfig(data=-1, tensor=3))
    with pytest.raises(ValueError, match=r"only one axis may be -1"):
        make_mesh(MeshConfig(data=-1, tensor=-1))


def test_heads_must_divide():
    with pytest.raises(ValueError, match=r"model.num_heads=6 is not a multiple of model.num_kv_heads=4"):
        ModelConfig(num_heads=6, num_kv_heads=4)
    cfg = replace(small_config(), **{"model.num_heads": 4, "model.num_kv_heads": 2})
    with pytest.raises(ValueError, match=r"model.num_kv_heads=2 is not divisible by the 4 shards"):
        train.build(cfg, mesh_of(8, data=2, tensor=4))


def test_batch_must_divide_data_axis():
    cfg = small_config(batch_size=6)
    with pytest.raises(ValueError, match=r"train.batch_size=6 .* not divisible by the 4 batch shards"):
        train.build(cfg, mesh_of(4, data=4))


def test_sequence_longer_than_model():
    cfg = small_config(seq_len=128)
    with pytest.raises(ValueError, match=r"train.seq_len=128 is longer than model.max_seq_len=64"):
        train.build(cfg, mesh_of(1))
    with pytest.raises(ValueError, match=r"exceeds model.max_seq_len=64"):
        check_lengths(cfg.model, 60, 10)


def test_missing_corpus_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.corpus: .*nope.txt.* bundled"):
        load_corpus((str(tmp_path / "nope.txt"),))
    assert len(load_corpus(DataConfig().corpus)) == 5_057_282  # the bundled corpus


def test_unknown_attention_backend():
    import jax.numpy as jnp

    from gendist.models.attention import attention
    q = jnp.zeros((1, 2, 2, 4))
    with pytest.raises(ValueError, match=r"model.attention='flash'"):
        attention(q, q, q, backend="flash")


def test_fresh_run_refuses_to_overwrite_checkpoints(tmp_path):
    from gendist.training import loop
    cfg = small_config(str(tmp_path), steps=1, resume=False)
    loop.run(cfg, mesh=mesh_of(1), log=lambda *a: None)
    with pytest.raises(ValueError, match=r"train.resume=False but .* already holds a run .*"
                                         r"--train.out-dir .*-2"):
        loop.run(cfg, mesh=mesh_of(1), log=lambda *a: None)
