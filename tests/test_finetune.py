"""Using loaded models: `train --init-from` a Hugging Face directory on a ZeRO-3 mesh starts
from its weights (step 0's loss is the NumPy HF model's), logs to W&B offline, saves a config
YAML that `--config` reads back, exports back to the HF layout; `generate --model-dir` with a
draft prints the target's greedy continuation."""

import glob
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import mesh_of, small_config
from hf_fixtures import hf_llama_logits, llama_config, random_weights, write_llama

from gendist import config_yaml, hf
from gendist.cli.args import parse_config
from gendist.cli.export import cmd_export
from gendist.cli.generate import sample
from gendist.cli.train import resolve_train
from gendist.config import Config
from gendist.data.batches import TextData, load_corpus
from gendist.data.tokenizer import load_tokenizer
from gendist.presets import replace
from gendist.training import loop

TEXT = bytes(load_corpus()[:60_000]).decode("utf-8", errors="ignore")


def char_bpe(path, vocab=96):
    """A BPE over the text's characters (no byte alphabet), so it fits a 96-token model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False))
    tok.save(str(path))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    target_cfg = llama_config(tied=False)
    weights = random_weights(target_cfg)
    draft_cfg = llama_config(layers=1, hidden=32, heads=4, kv_heads=2, ffn=48)
    write_llama(root / "target", target_cfg, weights, shards=2)
    write_llama(root / "draft", draft_cfg, random_weights(draft_cfg, seed=3))
    for d in ("target", "draft"):
        char_bpe(root / d / "tokenizer.json")
    return root, target_cfg, weights


def test_init_from_hf_on_zero3_mesh(models, tmp_path, monkeypatch):
    root, hf_cfg, weights = models
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    cfg = small_config(str(out), steps=2, lr=1e-3, wandb="offline")
    cfg = replace(cfg, **{"train.zero_stage": 3})
    cfg, init, tok = resolve_train(cfg, str(root / "target"))
    assert cfg.data.tokenizer == str(root / "target")  # the model's own tokenizer
    assert (cfg.model.vocab_size, cfg.model.num_kv_heads, cfg.model.tie_embeddings) == \
        (96, 4, False)
    r = loop.run(cfg, mesh=mesh_of(8, data=2, tensor=4), init_params=init, log=lambda *a: None)
    assert r.state["params"]["blocks"]["wq"].sharding.spec[1:3] == ("data", "tensor")

    # Step 0 trained the loaded weights: its loss is the NumPy HF model's cross-entropy.
    batch = TextData.from_config(cfg.data).global_batch(0, 8, 16)
    logits = hf_llama_logits(hf_cfg, weights, batch["inputs"])
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, batch["targets"][..., None], -1).mean()
    np.testing.assert_allclose(r.history[0]["loss"], ce, rtol=1e-5)
    assert r.history[1]["loss"] != r.history[0]["loss"]

    # W&B offline: the run's files, holding the logged metrics.
    runs = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1 and b"loss" in open(runs[0], "rb").read()

    # The saved YAML is the run's config and reads back equal.
    assert config_yaml.load(out / "config.yaml") == cfg

    # Export the fine-tuned params: the HF directory loads back bit for bit.
    assert cmd_export(["--checkpoint", str(out), "--out", str(tmp_path / "export")]) == 0
    cfg2, params2 = hf.load(tmp_path / "export")
    assert cfg2 == cfg.model
    for a, b in zip(jax.tree.leaves(jax.device_get(r.state["params"])),
                    jax.tree.leaves(params2), strict=True):
        assert np.array_equal(a, b)
    assert (tmp_path / "export" / "tokenizer.json").is_file()


def test_loaded_model_refuses_a_larger_tokenizer(models, tmp_path):
    root, _, _ = models
    from tokenizers import Tokenizer, trainers
    from tokenizers import models as tm
    tok = Tokenizer(tm.BPE())
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=200, show_progress=False))
    tok.save(str(tmp_path / "big.json"))
    cfg = replace(small_config(str(tmp_path)), **{"data.tokenizer": str(tmp_path / "big.json")})
    with pytest.raises(ValueError, match=r"has 200 tokens but the model .* embeds only 96"):
        resolve_train(cfg, str(root / "target"))


def test_config_yaml_round_trip_and_cli_overrides(tmp_path):
    cfg = replace(Config(), **{"model.d_model": 64, "model.rope_scaling": "llama3",
                               "data.corpus": ("a.txt", "b/"), "train.zero_stage": 2,
                               "train.lr": 1e-4, "mesh.sequence_parallel": True})
    path = config_yaml.save(cfg, tmp_path / "run.yaml")
    assert config_yaml.load(path) == cfg
    got = parse_config(["--config", str(path), "--train.steps", "7", "--data.tokenizer", "x"])
    assert got == replace(cfg, **{"train.steps": 7, "data.tokenizer": "x"})
    with pytest.raises(ValueError, match="not both"):
        parse_config(["--config", str(path), "--preset", "tiny"])
    (tmp_path / "bad.yaml").write_text("train:\n  stepz: 3\n")
    with pytest.raises(ValueError, match=r"unknown config field train.stepz"):
        config_yaml.load(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("model:\n  attention: flash\n")
    with pytest.raises(ValueError, match=r"model.attention='flash'.*choose one of"):
        config_yaml.load(tmp_path / "bad.yaml")
    # YAML 1.1 reads 1e-3 (no dot) as text: a float field takes it as the number.
    (tmp_path / "lr.yaml").write_text("train:\n  lr: 1e-3\n  pipeline_stage_layers: [2, 2]\n")
    got = config_yaml.load(tmp_path / "lr.yaml").train
    assert got.lr == 1e-3 and got.pipeline_stage_layers == (2, 2)
    for text, want in (("train:\n  lr: fast\n", r"train.lr='fast' in the config file must "
                                                  r"be a number"),
                       ("train:\n  steps: 2.5\n", r"train.steps=2.5 .* must be an integer"),
                       ("train:\n  pipeline_stage_layers: [1, x]\n",
                        r"train.pipeline_stage_layers='x' .* must be an integer"),
                       ("model: 3\n", r"config section 'model' holds 3, not fields"),
                       ("model:\n  d_model: [1\n", r"is not valid YAML: .* at line 3, column 1"),
                       ("train:\n  lr: -1\n", r"train.lr=-1.0 must be a finite number > 0")):
        (tmp_path / "bad.yaml").write_text(text)
        with pytest.raises(ValueError, match=want):
            parse_config(["--config", str(tmp_path / "bad.yaml")])


def test_generate_cli_with_model_dir_and_draft(models):
    """Greedy speculative decoding from the command line prints the target's own greedy text."""
    root, _, _ = models
    r = subprocess.run([sys.executable, "-m", "gendist", "generate", "--model-dir",
                        str(root / "target"), "--draft-dir", str(root / "draft"), "--prompt",
                        "ROMEO:", "--temperature", "0", "--max-new-tokens", "12"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "draft tokens accepted" in r.stderr
    tcfg, tparams = hf.load(root / "target")
    tok = load_tokenizer(str(root / "target"))
    g = parse_config(["--generate.temperature", "0", "--generate.max-new-tokens", "12"]).generate
    want = "ROMEO:" + sample(tcfg, tparams, tok, g, ["ROMEO:"])[0]
    assert r.stdout.rstrip("\n") == want
