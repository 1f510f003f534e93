"""Exact resume across processes, restore onto another mesh, corrupt checkpoints, NaN guard."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import mesh_of, small_config

from gendist.data.batches import TextData
from gendist.training import loop, train
from gendist.training.checkpoint import Checkpointer, CheckpointError


@pytest.fixture(scope="module")
def data():
    return TextData.from_config(small_config().data)


def read_losses(out_dir):
    rows = [json.loads(line) for line in open(Path(out_dir) / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


SECOND_HALF = textwrap.dedent("""
    import sys  # XLA_FLAGS inherited from this process (tests/conftest.py): the same codegen
    sys.path.insert(0, {tests!r})
    from helpers import small_config
    from gendist.training import loop
    loop.run(small_config({out!r}, steps=20, checkpoint_every=5), log=lambda *a: None)
""")


def test_exact_resume_in_a_new_process(tmp_path, data):
    straight, split = tmp_path / "straight", tmp_path / "split"
    r1 = loop.run(small_config(str(straight), steps=20, checkpoint_every=5), data=data,
                  log=lambda *a: None)
    loop.run(small_config(str(split), steps=20, checkpoint_every=5), data=data, stop_after=10,
             log=lambda *a: None)
    code = SECOND_HALF.format(tests=str(Path(__file__).parent), out=str(split))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=600)
    a, b = read_losses(straight), read_losses(split)
    assert sorted(a) == list(range(1, 21)) and sorted(b) == list(range(1, 21))
    assert [a[s] for s in sorted(a)] == [b[s] for s in sorted(b)]  # bitwise equal losses
    setup = r1.setup
    resumed, _, step = Checkpointer(split / "checkpoints").restore(setup.abstract_state())
    assert step == 20
    for x, y in zip(jax.tree.leaves(r1.state), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_checkpoint_restores_onto_another_mesh(tmp_path, data):
    cfg = small_config(str(tmp_path), zero_stage=3)
    src = train.build(cfg, mesh_of(8, data=4, tensor=2))
    state = src.init_state(seed=3)
    ck = Checkpointer(tmp_path / "ck")
    ck.save(0, state, {})
    assert not state["params"]["embed"].sharding.is_fully_replicated
    dst = train.build(small_config(str(tmp_path)), mesh_of(4, data=2, tensor=2))
    restored, _, _ = ck.restore(dst.abstract_state())
    assert restored["params"]["embed"].sharding.mesh.shape["data"] == 2
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("damage", ["truncate", "delete_dir"])
def test_corrupt_checkpoint_gives_clear_error(tmp_path, damage):
    cfg = small_config(str(tmp_path))
    setup = train.build(cfg, mesh_of(1))
    ck = Checkpointer(tmp_path / "ck")
    ck.save(1, setup.init_state(), {})
    step_dir = tmp_path / "ck" / "1"
    if damage == "truncate":
        for f in step_dir.rglob("*"):
            if f.is_file() and f.stat().st_size > 0 and "state" in str(f):
                f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    else:
        shutil.rmtree(step_dir / "state")
    with pytest.raises(CheckpointError, match=r"cannot be read, it looks partial or damaged.*start fresh with another --train.out-dir"):
        Checkpointer(tmp_path / "ck").restore(setup.abstract_state())


def test_nan_stops_and_keeps_good_checkpoint(tmp_path, data):
    cfg = small_config(str(tmp_path), steps=8, checkpoint_every=2, debug_nan_step=4)
    with pytest.raises(train.NonFiniteLoss, match="step 4"):
        loop.run(cfg, data=data, log=lambda *a: None)
    ck = Checkpointer(tmp_path / "checkpoints")
    assert ck.latest_step() == 4  # steps 0..3 done; step 4 was never applied or saved
    state, _, _ = ck.restore(train.build(cfg, mesh_of(1)).abstract_state())
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state["params"]))


def test_nan_skip_mode_skips_the_step(tmp_path, data):
    cfg = small_config(str(tmp_path), steps=6, nonfinite="skip", debug_nan_step=3)
    r = loop.run(cfg, data=data, log=lambda *a: None)
    finite = [h["finite"] for h in r.history]
    assert finite == [True, True, True, False, True, True]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(r.state["params"]))
