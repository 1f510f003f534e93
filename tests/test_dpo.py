"""DPO (Rafailov et al. 2023) on the one train-step builder: the loss and its gradient equal
a NumPy reference on fixed log-probs; the batch masks prompt tokens; training on a
constructed preference set (full parameters on data 2 x ZeRO-1, and LoRA) raises the
chosen-over-rejected margin while the reference stays bit-identical (LoRA's: the base, stored
in bf16); a bad preference file
is one line naming its line and field."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh_of, small_config

from gendist.data.batches import shard_batch
from gendist.data.preferences import PreferenceData, read_pairs, window
from gendist.models import transformer
from gendist.presets import replace
from gendist.training import dpo, train

BETA = 0.5


def numpy_dpo(logp, ref, beta):
    """Loss and d loss / d logp of the mean -log sigmoid(beta (dc - dr)) over pairs."""
    logp, ref = np.asarray(logp, np.float64), np.asarray(ref, np.float64)
    d = (logp - ref).reshape(-1, 2)
    z = beta * (d[:, 0] - d[:, 1])
    loss = np.mean(np.log1p(np.exp(-z)))
    s = 1 / (1 + np.exp(z))  # sigmoid(-z)
    g = np.stack([-beta * s, beta * s], axis=1) / len(z)
    return loss, g.reshape(-1), z


def test_loss_and_gradient_match_numpy():
    rng = np.random.default_rng(0)
    logp = jnp.asarray(rng.normal(-20, 5, 12), jnp.float32)
    ref = jnp.asarray(rng.normal(-20, 5, 12), jnp.float32)
    (loss, m), g = jax.value_and_grad(dpo.loss_from_logps, has_aux=True)(logp, ref, BETA)
    want, want_g, z = numpy_dpo(logp, ref, BETA)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(m["reward_margin"], z.mean(), rtol=1e-5)
    np.testing.assert_allclose(m["reward_accuracy"], (z > 0).mean())
    d = (np.asarray(logp, np.float64) - np.asarray(ref, np.float64)).reshape(-1, 2)
    np.testing.assert_allclose(m["reward_chosen"], BETA * d[:, 0].mean(), rtol=1e-5)
    np.testing.assert_allclose(m["reward_rejected"], BETA * d[:, 1].mean(), rtol=1e-5)


def test_window_masks_the_prompt():
    x, y, m = window(np.array([1, 2, 3]), np.array([7, 8]), seq_len=6)
    np.testing.assert_array_equal(x, [1, 2, 3, 7, 8, 0])
    np.testing.assert_array_equal(y, [2, 3, 7, 8, 0, 0])
    np.testing.assert_array_equal(m, [0, 0, 1, 1, 0, 0])  # targets 7 and 8 only
    x, y, m = window(np.array([1, 2, 3, 4, 5]), np.array([7, 8, 9]), seq_len=4)
    np.testing.assert_array_equal(x, [4, 5, 7, 8])  # the prompt's end kept
    np.testing.assert_array_equal(m, [0, 1, 1, 1])


def preference_file(path, n=16):
    """Pairs whose chosen answer repeats the prompt's letter and whose rejected one does not."""
    rows = []
    for i in range(n):
        c = "abcdefgh"[i % 8]
        rows.append({"prompt": f"{c}{c}{c}:", "chosen": c * 6, "rejected": "xyzw"[i % 4] * 6})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("kind", ["full-data2-zero1", "lora"])
def test_margin_grows_and_reference_is_unchanged(tmp_path, kind):
    cfg = replace(small_config(), **{
        "train.objective": "dpo", "train.dpo_beta": 0.5, "train.lr": 3e-3,
        "train.warmup_steps": 0, "train.batch_size": 4, "train.seq_len": 12,
        "data.preferences": str(preference_file(tmp_path / "prefs.jsonl"))})
    if kind == "lora":
        cfg = replace(cfg, **{"train.lora_rank": 4, "train.lora_alpha": 16.0,
                              "train.lora_targets": "q,v,o,up,down", "train.lr": 1e-2,
                              "train.lora_base_dtype": "bfloat16"})
        mesh = mesh_of(1)
    else:
        cfg = replace(cfg, **{"train.zero_stage": 1})
        mesh = mesh_of(2, data=2)
    data = PreferenceData.from_config(cfg.data)
    setup = train.build(cfg, mesh)
    state = setup.init_state()
    ref0 = jax.device_get(dpo.reference_params(state))
    if kind == "lora":  # the base (LoRA's reference) stored in bf16: matrices, not vectors
        assert ref0["blocks"]["wq"].dtype == jnp.bfloat16
        assert ref0["final_norm"].dtype == jnp.float32
    margins, losses = [], []
    for i in range(12):
        batch = shard_batch(data.global_batch(i, 4, 12), mesh)
        state, m = setup.step_fn(state, batch)
        margins.append(float(m["reward_margin"]))
        losses.append(float(m["loss"]))
    # step 0: the policy is the reference, so every reward is 0 and the loss log 2
    assert abs(margins[0]) < 1e-6 and abs(losses[0] - np.log(2)) < 1e-5
    assert np.mean(margins[-3:]) > 0.5 and losses[-1] < losses[0] - 0.2, (margins, losses)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(dpo.reference_params(state)),
                 ref0)
    if kind != "lora":  # the reference is the initial params, and the policy moved
        init = transformer.init_params(cfg.model, cfg.train.seed)
        jax.tree.map(np.testing.assert_array_equal, ref0, init)
        assert not np.array_equal(jax.device_get(state["params"]["embed"]), init["embed"])
    val = setup.eval_fn(setup.eval_params(state),
                        shard_batch(data.global_batch(0, 4, 12, "val"), mesh))
    assert np.isfinite(float(val))


@pytest.mark.parametrize("line,needle", [
    ('{"prompt": "a", "chosen": "b"}', "line 2: no field 'rejected'"),
    ('{"prompt": "a", "chosen": 3, "rejected": "c"}', "field 'chosen' is a int"),
    ('["a"]', "holds a JSON list"),
    ('{"prompt": "a", ', "is not a JSON record"),
])
def test_bad_preference_file_is_one_line(tmp_path, line, needle):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n' + line + "\n")
    with pytest.raises(ValueError) as e:
        read_pairs(p)
    msg = str(e.value)
    assert "\n" not in msg and f"{p}:2" in msg and needle.split(": ", 1)[-1] in msg, msg
