"""Llama checkpoints in the Hugging Face layout: gendist's logits equal an independent NumPy
transcription of HF's LlamaForCausalLM; export -> load is bitwise; loading onto data 2 x
tensor 4 with ZeRO 3 gives one device's logits; unsupported checkpoints are refused;
speculative decoding with two loaded checkpoints equals plain greedy decoding."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh_of
from hf_fixtures import (
    LLAMA3,
    hf_inv_freq,
    hf_llama_logits,
    llama_config,
    random_weights,
    write_llama,
)

from gendist import hf
from gendist.inference import decoder
from gendist.inference.generate import generate_tokens
from gendist.inference.lm import transformer_lm
from gendist.inference.sampling import SamplingParams
from gendist.inference.speculative import SpecConfig, speculative_generate
from gendist.models import transformer
from gendist.models.layers import rope_angles
from gendist.sharding import use_mesh

RTOL = 1e-5  # fp32 against float64; atol: 1e-6 of the largest |logit|
IDS = np.random.default_rng(1).integers(0, 96, (2, 12))

CASES = {  # GQA (8 query heads over 4 kv heads) and head_dim 8 * 8 heads != hidden 48
    "tied_llama3_theta500k": dict(tied=True, rope_scaling=LLAMA3, theta=500_000.0),
    "untied_sharded_theta10k": dict(tied=False, rope_scaling=None, theta=10_000.0),
}


def checkpoint(tmp_path, name, shards=1, **kw):
    cfg = llama_config(**kw)
    w = random_weights(cfg)
    write_llama(tmp_path / name, cfg, w, shards)
    return tmp_path / name, cfg, w


def assert_logits_close(got, want):
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_equal_numpy_hf_llama(tmp_path, case):
    kw = CASES[case]
    d, hf_cfg, w = checkpoint(tmp_path, case, shards=3 if "sharded" in case else 1, **kw)
    assert (d / "model.safetensors.index.json").is_file() == ("sharded" in case)
    cfg, params = hf.load(d)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.tie_embeddings, cfg.rope_theta) == \
        (4, 8, kw["tied"], kw["theta"])
    assert ("head" in params) == (not kw["tied"])
    ref = hf_llama_logits(hf_cfg, w, IDS)
    assert_logits_close(transformer.forward(cfg, params, IDS), ref)
    if kw["rope_scaling"]:  # the scaling changes these logits: the comparison can see it
        plain = hf_llama_logits({**hf_cfg, "rope_scaling": None}, w, IDS)
        assert np.abs(plain - ref).max() > 1e-3 * np.abs(ref).max()


def test_llama3_frequencies_cover_all_three_bands():
    """With original length 256 and H=8, θ=5e5 the four frequencies fall in the kept, blended
    and stretched bands; gendist's angles equal HF's in each."""
    hf_cfg = llama_config(rope_scaling=LLAMA3)
    cfg = hf.model_config_from_hf(hf_cfg)
    base = hf_inv_freq({**hf_cfg, "rope_scaling": None})
    scaled = hf_inv_freq(hf_cfg)
    ratio = scaled / base
    assert ratio[0] == 1 and 1 / 8 < ratio[1] < 1 and np.allclose(ratio[2:], 1 / 8)
    pos = jnp.arange(40, dtype=jnp.int32)[None]
    cos, sin = rope_angles(pos, cfg.head_dim, cfg.rope_theta, cfg.rope_llama3)
    ang = np.arange(40)[:, None] * scaled[None]
    np.testing.assert_allclose(np.asarray(cos[0]), np.cos(ang), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(sin[0]), np.sin(ang), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_then_load_is_bitwise(tmp_path, case):
    d, hf_cfg, w = checkpoint(tmp_path, "src", **CASES[case])
    cfg, params = hf.load(d)
    names = hf.save(tmp_path / "out", cfg, params, max_shard_bytes=20_000)
    assert len(names) > 1 and (tmp_path / "out" / "model.safetensors.index.json").is_file()
    cfg2, params2 = hf.load(tmp_path / "out")
    assert cfg2 == cfg
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params),
                            jax.tree.leaves(params2), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b), jax.tree_util.keystr(path)
    # The exported tensors are the original ones, bit for bit, under the same HF names.
    reader = hf._Reader(tmp_path / "out")
    assert set(reader.where) == set(w)
    for name, t in w.items():
        assert np.array_equal(reader.get(name), t), name
    # bfloat16 export: half the bytes; loads back as the bf16-rounded fp32 params.
    hf.save(tmp_path / "bf16", cfg, params, dtype="bfloat16")
    _, params3 = hf.load(tmp_path / "bf16")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params3), strict=True):
        assert b.dtype == np.float32
        assert np.array_equal(np.asarray(a).astype(jnp.bfloat16).astype(np.float32), b)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == \
        "bfloat16"
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    for k in ("num_key_value_heads", "head_dim", "rope_theta", "tie_word_embeddings",
              "rms_norm_eps", "rope_scaling"):
        assert exported[k] == hf_cfg[k], k


def test_load_onto_data2_tensor4_zero3_equals_one_device(tmp_path):
    d, hf_cfg, w = checkpoint(tmp_path, "m", **CASES["untied_sharded_theta10k"])
    cfg, params1 = hf.load(d)
    mesh = mesh_of(8, data=2, tensor=4)
    sh = hf.param_shardings(mesh, cfg, zero_stage=3)
    _, params8 = hf.load(d, shardings=sh)
    wq = params8["blocks"]["wq"]  # [L, D, N, H]: heads over tensor, embed over data (ZeRO)
    assert wq.sharding.spec[1:3] == ("data", "tensor"), wq.sharding.spec
    assert wq.addressable_shards[0].data.shape == (2, 24, 2, 8)
    for a, b in zip(jax.tree.leaves(params1), jax.tree.leaves(params8), strict=True):
        assert np.array_equal(a, np.asarray(b))

    @jax.jit
    def fwd(p, ids):
        with use_mesh(mesh):
            return transformer.forward(cfg, p, ids)

    ids = jax.device_put(jnp.asarray(np.tile(IDS, (2, 1))))
    one = transformer.forward(cfg, params1, np.tile(IDS, (2, 1)))
    assert_logits_close(fwd(params8, ids), one)


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}, "biases on the q/k/v"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "sliding-window"),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "learned positions"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
])
def test_unsupported_checkpoints_are_refused(change, match):
    with pytest.raises(hf.UnsupportedCheckpoint, match=match):
        hf.model_config_from_hf({**llama_config(), **change})


def test_speculative_with_two_loaded_checkpoints_equals_greedy(tmp_path):
    """A 2-layer target drafted by a 1-layer model with the same vocabulary, both loaded
    from HF directories: greedy speculative decoding reproduces plain greedy decoding."""
    t_dir, _, _ = checkpoint(tmp_path, "target", layers=2, tied=False)
    hf_cfg = llama_config(layers=1, hidden=32, heads=4, kv_heads=2, ffn=48)
    write_llama(tmp_path / "draft", hf_cfg, random_weights(hf_cfg, seed=5))
    tcfg, tparams = hf.load(t_dir)
    dcfg, dparams = hf.load(tmp_path / "draft")
    prompt = jnp.asarray(IDS[:, :5], jnp.int32)
    lens = jnp.asarray([5, 3], jnp.int32)
    sp = SamplingParams(temperature=0.0)
    want, _ = generate_tokens(tcfg, tparams, prompt, lens, jax.random.key(0),
                              max_new_tokens=12, sp=sp)
    target = decoder.plan(tcfg, tparams, 2, 32, step_tokens=4)
    draft = decoder.plan(dcfg, dparams, 2, 32)
    got, _, stats = speculative_generate(transformer_lm(target), target.params,
                                         transformer_lm(draft), draft.params, prompt, lens,
                                         jax.random.key(0),
                                         max_new_tokens=12, sp=sp, spec=SpecConfig(gamma=3))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(stats["steps"]) > 0
