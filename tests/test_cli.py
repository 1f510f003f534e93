"""The command line as a user meets it.

Bad input (each mistake a user reported plus those of tests/test_errors.py): exit code 2, one
line on stderr naming the field and the fix, no traceback, nothing on disk created, deleted
or overwritten (every file and folder under the test's root hashed before and after). Every
numeric field of every config section refuses negative, zero-where-meaningless, NaN,
infinite and huge values the same way (a generated table through `main`, and hypothesis
through the sections' `check()`). Mostly `gendist.cli.main.main` in-process; a subprocess
where the process's own shutdown matters (orbax's leftovers after a failed restore). Also:
export never overwrites (`--overwrite` replaces a folder whole), the header and footer of a
run, resuming, `--help` of every command, `--no-sample`, generate's flag names, launch's
output lines.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hf_fixtures import llama_config, random_weights, write_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gendist import config as config_module
from gendist.cli.main import main

MODEL = {"model.num-layers": 2, "model.d-model": 32, "model.num-heads": 2,
         "model.num-kv-heads": 2, "model.head-dim": 16, "model.d-ff": 64}
TRAIN = {"train.steps": 2, "train.batch-size": 8, "train.seq-len": 16, "train.eval-every": 2,
         "train.eval-batches": 1, "train.log-every": 1}


def small(**changes) -> list[str]:
    """Flags of a 2-layer width-32 run, with `changes` (keys like "model.d-model")."""
    flags = {**MODEL, **TRAIN, **{k.replace("__", "."): v for k, v in changes.items()}}
    out = []
    for k, v in flags.items():
        out += [f"--{k}", str(v)]
    return out + ["--train.no-tensorboard", "--no-sample"]


def digest(root: Path) -> dict[str, str]:
    """Every file (its sha256) and folder under root: a folder left behind shows too."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            if p.is_file() else "folder" for p in sorted(root.rglob("*"))}


def bpe(path: Path, vocab: int) -> str:
    """A byte-level BPE of `vocab` tokens (the `tokenizers` library) saved as a json file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return str(path)


CORPUS = "ROMEO: But soft, what light through yonder window breaks?\n" * 300 + "".join(
    f"line {i}: the quick brown fox {i * 7919 % 1000} jumps over the lazy dog\n"
    for i in range(600))


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    """A finished 2-step run in <root>/runs/default, made by the CLI; (root, its stdout).
    Beside it, the materials of the bad-input table: text in UTF-8 and in Latin-1, an empty
    file, malformed YAML, a plain file, a 533-token tokenizer and its token files, a Hugging
    Face model of 512 tokens holding that tokenizer (my-model/: an old export), one of 256
    tokens without a tokenizer (bare/), an empty folder."""
    root = tmp_path_factory.mktemp("cli")
    (root / "utf8.txt").write_text("Ça été très réussi, à côté du château. " * 40)
    (root / "latin.txt").write_bytes("Ça été très réussi, à côté du château.\n".encode("latin-1"))
    (root / "empty.txt").write_text("")
    (root / "text.txt").write_text(CORPUS)
    (root / "afile").write_text("not a folder")
    (root / "short.txt").write_text("a few bytes\n")
    (root / "medium.txt").write_text("twenty bytes of it.\n" * 10)
    (root / "rec.jsonl").write_text('{"body": "text under another name"}\n')
    (root / "bad.yaml").write_text("model:\n  d_model: [1\n  num_layers: 3\n")
    (root / "lr_text.yaml").write_text("train:\n  lr: fast\n")
    (root / "prefs.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
                                      '{"prompt": "a", "chosen": "b"}\n')
    (root / "pairs.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n' * 2)
    (root / "empty").mkdir()
    tok = bpe(root / "tok533.json", 533)
    for name, vocab, tokenizer in (("my-model", 512, tok), ("bare", 256, None)):
        cfg = llama_config(vocab=vocab, hidden=32, heads=2, kv_heads=2, head_dim=16, ffn=64)
        write_llama(root / name, cfg, random_weights(cfg))
        if tokenizer:
            shutil.copyfile(tokenizer, root / name / "tokenizer.json")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        from contextlib import redirect_stdout
        buf = io.StringIO()
        with redirect_stdout(io.StringIO()):
            assert main(["prepare", "--out", "tok533", "--data.corpus", "text.txt",
                         "--data.tokenizer", "tok533.json", "--no-progress"]) == 0
        with redirect_stdout(buf):
            assert main(["train", *small()]) == 0
    finally:
        os.chdir(cwd)
    meta = json.loads((root / "tok533" / "meta.json").read_text())
    assert meta["vocab_size"] == 533 and meta["max_token_id"] == 532
    return root, buf.getvalue()


# (name, argv, what the one line must contain: the field and the fix)
BAD_INPUT = [
    ("negative steps", ["train", "--train.steps", "-5"],
     ["train.steps=-5", "--train.steps"]),
    ("zero steps", ["train", "--train.steps", "0"], ["train.steps=0", "--train.steps"]),
    ("vocabulary smaller than the data's token ids",
     ["train", "--model.vocab-size", "128", "--data.corpus", "utf8.txt"],
     ["model.vocab_size=128", "--model.vocab-size 256"]),
    ("pipeline larger than the layers", ["train", "--mesh.pipeline", "8"],
     ["mesh.pipeline=8", "model.num_layers=4", "[1, 2, 4]"]),
    ("pipeline of -1 resolving to more stages than layers",
     ["train", "--mesh.pipeline", "-1", "--mesh.data", "1"],
     ["mesh.pipeline=8", "model.num_layers=4"]),
    ("PipeDream with a tied embedding",
     ["train", "--mesh.pipeline", "2", "--train.pipeline-schedule", "pipedream",
      "--train.out-dir", "runs/pd"],
     ["train.pipeline_schedule=pipedream", "model.tie_embeddings=True",
      "--model.no-tie-embeddings"]),
    ("resume with another model", ["train", *small(model__d_model=64)],
     ["model.d_model 32 -> 64", "--train.out-dir runs/default-2"]),
    ("resume with other data", ["train", *small(), "--data.seed", "1"],
     ["data.seed 0 -> 1", "--train.out-dir runs/default-2"]),
    ("no-resume over a finished run", ["train", *small(), "--train.no-resume"],
     ["train.resume=False", "--train.out-dir runs/default-2"]),
    ("mesh that does not fit the devices", ["train", "--mesh.data", "3"],
     ["multiply to 3 but there are 8 devices", "--mesh.data"]),
    ("heads not a multiple of kv heads", ["train", "--model.num-heads", "6"],
     ["model.num_heads=6", "model.num_kv_heads=4"]),
    ("tensor degree larger than the heads", ["train", "--mesh.tensor", "8"],
     ["model.num_heads=4 is not divisible by the 8 shards", "mesh.tensor"]),
    ("batch not divisible by the data shards", ["train", "--train.batch-size", "6"],
     ["train.batch_size=6", "multiple of 8"]),
    ("sequence longer than the model", ["train", "--train.seq-len", "512"],
     ["train.seq_len=512", "model.max_seq_len=256"]),
    ("missing corpus file", ["train", "--data.corpus", "nope.txt"],
     ["data.corpus: 'nope.txt' is not a file", "leave data.corpus empty"]),
    ("unknown preset", ["train", "--preset", "huge"], ["'huge'", "--preset", "tiny"]),
    ("generate without a checkpoint", ["generate"], ["--checkpoint DIR", "runs/default"]),
    ("generate from a missing directory", ["generate", "--checkpoint", "nowhere"],
     ["--checkpoint 'nowhere' is not a directory"]),
    ("generate from a directory without checkpoints", ["generate", "--checkpoint", "empty"],
     ["no checkpoint found", "--train.out-dir"]),
    ("plan with a malformed device count", ["plan", "--devices", "x"], ["--devices", "'x'"]),
    ("unknown attention backend", ["train", "--model.attention", "flash"],
     ["'flash'", "--model.attention", "('xla', 'cudnn', 'pallas')"]),
    ("steps that are not a number", ["train", "--train.steps", "many"],
     ["--train.steps", "'many'", "--help"]),
    ("unknown flag", ["train", "--train.stepz", "5"], ["--train.stepz", "--help"]),
    # The new user's mistakes: data that would be lost, input accepted silently, tracebacks.
    ("export into a folder that holds files", ["export", "--checkpoint", "runs/default",
                                               "--out", "my-model/"],
     ["--out 'my-model/' already holds config.json, model.safetensors, tokenizer.json",
      "--overwrite", "new --out"]),
    ("export over the run it exports", ["export", "--checkpoint", "runs/default", "--out",
                                        "runs", "--overwrite"],
     ["--out 'runs' holds the run being exported", "runs-hf"]),
    ("export of an unknown dtype", ["export", "--checkpoint", "runs/default", "--out", "new",
                                    "--dtype", "float8"], ["'float8'", "--dtype"]),
    ("export of a missing run", ["export", "--checkpoint", "nowhere", "--out", "new"],
     ["--checkpoint 'nowhere' is not a directory"]),
    ("a tokenizer larger than the model's vocabulary", ["generate", "--model-dir", "my-model",
                                                         "--max-new-tokens", "4"],
     ["my-model/tokenizer.json) has 533 tokens", "embeds only 512", "tokenizer the model"]),
    ("the same, the tokenizer given", ["generate", "--model-dir", "bare", "--tokenizer",
                                       "tok533.json"],
     ["--tokenizer tok533.json has 533 tokens", "embeds only 256"]),
    ("a model folder without a tokenizer", ["generate", "--model-dir", "bare"],
     ["--model-dir 'bare' has no tokenizer.json", "--tokenizer bytes"]),
    ("a model folder that is not there", ["generate", "--model-dir", "nowhere"],
     ["--model-dir 'nowhere' is not a directory"]),
    ("token ids beyond an explicit vocabulary", ["train", "--data.tokens", "tok533",
                                                 "--model.vocab-size", "512"],
     ["--model.vocab-size 512 is smaller than the 533-token vocabulary", "--data.tokens tok533",
      "ids up to 532", "--model.vocab-size 533 or more", "leave --model.vocab-size out"]),
    ("the same tokenizer on text", ["train", "--data.corpus", "text.txt", "--data.tokenizer",
                                    "tok533.json", "--model.vocab_size=300"],
     ["--model.vocab-size 300 is smaller", "--data.tokenizer tok533.json"]),
    ("negative learning rate", ["train", "--train.lr", "-1"],
     ["train.lr=-1.0 must be a finite number > 0", "--train.lr"]),
    ("NaN learning rate", ["train", "--train.lr", "nan"], ["train.lr=nan", "--train.lr"]),
    ("Adam beta of 1", ["train", "--train.b2", "1"], ["train.b2=1.0", "in [0, 1)"]),
    ("mesh axis of 0", ["train", "--mesh.data", "0"],
     ["mesh.data=0 must be -1 (the remaining devices) or", "--mesh.data"]),
    ("a Latin-1 text file", ["train", "--data.corpus", "latin.txt"],
     ["latin.txt is not UTF-8 text (byte 0xc7 at line 1, column 1)", "iconv -f latin1"]),
    ("a Latin-1 text file, tokenized", ["train", "--data.corpus", "latin.txt",
                                        "--data.tokenizer", "tok533.json"],
     ["latin.txt is not UTF-8 text"]),
    ("a Latin-1 text file to prepare", ["prepare", "--out", "tok", "--data.corpus",
                                        "latin.txt"], ["latin.txt is not UTF-8 text"]),
    ("an empty corpus to prepare", ["prepare", "--out", "tok", "--data.corpus", "empty.txt"],
     ["data.corpus=['empty.txt'] holds no text (0 tokens)", "give files with text"]),
    ("an empty corpus to prepare into a new folder tree",
     ["prepare", "--out", "new/deeper/tok", "--data.corpus", "empty.txt"], ["holds no text"]),
    ("an empty corpus to prepare over old token files",
     ["prepare", "--out", "tok533", "--data.corpus", "empty.txt"], ["holds no text"]),
    ("a glob matching nothing to prepare", ["prepare", "--out", "tok", "--data.corpus",
                                            "books/*.txt"],
     ["the glob 'books/*.txt' matches no file"]),
    ("prepare into a file", ["prepare", "--out", "afile", "--data.corpus", "text.txt"],
     ["--out 'afile' is a file"]),
    ("prepare with shards of no tokens", ["prepare", "--out", "tok", "--shard-tokens", "0"],
     ["--shard-tokens 0", "positive"]),
    ("an empty corpus to train on", ["train", "--data.corpus", "empty.txt"],
     ["holds no text (0 tokens)"]),
    ("a corpus too small to hold a validation split", ["train", "--data.corpus", "short.txt"],
     ["holds 12 tokens, leaving 12 to train on and 0 for validation", "give more text"]),
    ("a corpus shorter than a window of validation", ["train", "--data.corpus", "medium.txt"],
     ["train.seq_len=128 is longer than the val split (10 tokens)", "--train.seq-len 8"]),
    ("a .jsonl record without the text field", ["train", "--data.corpus", "rec.jsonl"],
     ["data.text_field='text' is not a field of the record at rec.jsonl:1", "--data.text-field"]),
    ("a float field given text in YAML", ["train", "--config", "lr_text.yaml"],
     ["train.lr='fast' in the config file must be a number"]),
    ("malformed YAML", ["train", "--config", "bad.yaml"],
     ["--config 'bad.yaml' is not valid YAML", "at line 3, column"]),
    ("YAML that is not sections", ["train", "--config", "afile"],
     ["--config 'afile': expected sections"]),
    ("a run directory that is a file", ["train", "--train.out-dir", "afile"],
     ["train.out_dir='afile' is a file", "--train.out-dir"]),
    ("a run directory below a file", ["train", "--train.out-dir", "afile/run"],
     ["train.out_dir='afile/run' lies below the file 'afile'"]),
    ("fine-tuning from a missing folder", ["train", "--init-from", "NoSuchDir/"],
     ["--init-from 'NoSuchDir/' is not a directory", "Hugging Face"]),
    ("fine-tuning from a folder with no model", ["train", "--init-from", "empty"],
     ["--init-from 'empty' holds neither config.json", "checkpoints/"]),
    ("a sample longer than the model", ["train", "--generate.max-new-tokens", "300"],
     ["--generate.max-new-tokens 300 after the 6-token prompt exceeds model.max_seq_len=256",
      "--generate.max-new-tokens 250 or less"]),
    ("an empty prompt", ["train", "--generate.prompt", ""], ["--generate.prompt is empty"]),
    ("a prompt the byte model cannot embed", ["train", "--model.vocab-size", "128",
                                              "--generate.prompt", "Ça"],
     ["--generate.prompt 'Ça' holds token id 195", "embeds only 128"]),
    ("launch of no processes", ["launch", "--nproc", "0", "--", "true"],
     ["--nproc 0: give a count from 1"]),
    ("launch of no devices per process", ["launch", "--nproc", "2", "--devices-per-process",
                                          "0", "--", "true"],
     ["--devices-per-process 0"]),
    ("plan on a negative device count", ["plan", "--devices", "-2"], ["--devices -2"]),
    ("LoRA targets that are not projections", ["train", "--train.lora-rank", "4",
                                               "--train.lora-targets", "q,x"],
     ["train.lora_targets='q,x'", "['x']", "--train.lora-targets", "q,k,v,o,gate,up,down"]),
    ("a LoRA rank past the adapted matrices", ["train", "--train.lora-rank", "4096"],
     ["train.lora_rank=4096", "--train.lora-rank 128 or less"]),
    ("LoRA with PipeDream", ["train", "--train.lora-rank", "4", "--mesh.pipeline", "2",
                             "--train.pipeline-schedule", "pipedream",
                             "--model.no-tie-embeddings"],
     ["train.lora_rank=4 with train.pipeline_schedule=pipedream", "synchronous schedule"]),
    ("FP8 current scaling on pipeline stages", ["train", "--train.matmul-precision", "fp8",
                                                "--train.fp8-recipe", "current",
                                                "--mesh.pipeline", "2"],
     ["train.matmul_precision=fp8 with train.fp8_recipe=current and mesh.pipeline=2",
      "--train.fp8-recipe delayed"]),
    ("FP8 products with collective matmuls", ["train", "--train.matmul-precision", "fp8",
                                              "--mesh.tensor", "2", "--mesh.sequence-parallel",
                                              "--train.tp-comm", "collective"],
     ["train.matmul_precision=fp8 with train.tp_comm=collective", "--train.tp-comm xla"]),
    ("DPO without preference pairs", ["train", "--train.objective", "dpo"],
     ["train.objective=dpo needs preference pairs", "--data.preferences FILE.jsonl"]),
    ("a preference record without a field", ["train", "--train.objective", "dpo",
                                              "--data.preferences", "prefs.jsonl"],
     ["prefs.jsonl:2 has no field 'rejected'"]),
    ("DPO on pipeline stages", ["train", "--train.objective", "dpo", "--data.preferences",
                                "pairs.jsonl", "--mesh.pipeline", "2"],
     ["train.objective=dpo with mesh.pipeline=2", "mesh.pipeline=1"]),
    ("generate with adapters that are not there", ["generate", "--checkpoint", "runs/default",
                                                   "--adapters", "nowhere"],
     ["--adapters 'nowhere' holds no adapter_config.json", "adapters"]),
]


@pytest.mark.parametrize("name, argv, want", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_line_exit_2_and_touches_nothing(done_run, monkeypatch, capsys,
                                                          name, argv, want):
    root, _ = done_run
    monkeypatch.chdir(root)
    monkeypatch.delenv("GENDIST_TRACEBACK", raising=False)
    before = digest(root)
    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("python -m gendist "), err
    assert "Traceback" not in err + out
    for w in want:
        assert w in err, f"{w!r} not in: {err}"
    assert digest(root) == before  # no checkpoint (or anything else) written or removed


def test_traceback_on_request(done_run, monkeypatch):
    monkeypatch.chdir(done_run[0])
    monkeypatch.setenv("GENDIST_TRACEBACK", "1")
    with pytest.raises(ValueError, match="train.steps=-5"):
        main(["train", "--train.steps", "-5"])


# --- every numeric field of every config section, fed values it cannot take ---------------
# What each field means (its help), written out here rather than read from gendist.config:
# the smallest value that means something (default 1 for integers, > 0 for floats), the
# fields capped at 1 (fractions, Adam's betas, a probability mass), and the -1 sentinels.
SECTIONS = {"model": config_module.ModelConfig, "mesh": config_module.MeshConfig,
            "data": config_module.DataConfig, "train": config_module.TrainConfig,
            "generate": config_module.GenerateConfig}
ZERO_MEANS_SOMETHING = {
    "model.moe_experts", "model.moe_d_ff", "model.moe_load_balance_weight",
    "model.moe_z_loss_weight", "data.seed", "train.min_lr_ratio", "train.warmup_steps",
    "train.weight_decay", "train.b1", "train.b2", "train.seed", "train.checkpoint_every",
    "train.checkpoint_every_minutes", "train.pipeline_microbatches", "train.pipedream_window",
    "train.terapipe_slices", "train.debug_nan_step", "train.lora_rank", "train.fp8_margin",
    "generate.max_new_tokens",
    "generate.temperature", "generate.top_k", "generate.seed", "generate.eos_id"}
MINUS_ONE_MEANS_SOMETHING = {"mesh.data", "mesh.pipeline", "mesh.expert", "mesh.tensor",
                             "train.debug_nan_step", "generate.eos_id"}
AT_MOST_ONE = {"data.val_fraction": False, "train.min_lr_ratio": True, "train.b1": False,
               "train.b2": False, "generate.top_p": True}  # field: 1 itself allowed
# Integers with a cap of their own (FP8: an amax history of at most 1024 steps, as Transformer
# Engine's amax_history_len is a short window; a margin of 2**16 already wastes E4M3's range).
INT_CAPS = {"train.fp8_history": 1024, "train.fp8_margin": 16}


def numeric_fields() -> list[tuple[str, type]]:
    """("section.field", int or float) of every number (or tuple of numbers) in a config."""
    out = []
    for sec, cls in SECTIONS.items():
        for name, hint in typing.get_type_hints(cls).items():
            if typing.get_origin(hint) is tuple:
                hint = typing.get_args(hint)[0]
            if hint in (int, float):
                out.append((f"{sec}.{name}", hint))
    return out


def bad_values(field: str, kind: type) -> list:
    """Negative, zero where it means nothing, NaN, infinite, huge, and past a cap of 1."""
    low = -1 if field in MINUS_ONE_MEANS_SOMETHING else 0 if field in ZERO_MEANS_SOMETHING \
        else 1 if kind is int else None
    if kind is int:
        return [low - 1, low - 10**6, 2**31, 10**30] + (
            [INT_CAPS[field] + 1] if field in INT_CAPS else [])
    out = [-1.0, float("nan"), float("inf"), float("-inf"), 1e39]
    if low is None:
        out.append(0.0)
    if field in AT_MOST_ONE:
        out.append(1.5 if AT_MOST_ONE[field] else 1.0)
    return out


def good_values(field: str, kind: type) -> list:
    """The edges of what a field takes (checked to pass, so the checks are not too strict)."""
    if field in MINUS_ONE_MEANS_SOMETHING:
        low = [-1, 0 if field in ZERO_MEANS_SOMETHING else 1]
    else:
        low = [0] if field in ZERO_MEANS_SOMETHING else [1] if kind is int else [1e-9]
    if field in AT_MOST_ONE:
        return [kind(v) for v in low] + [1.0 if AT_MOST_ONE[field] else 0.999]
    if kind is int:  # a model's sizes are bounded together (its parameter count) as well
        top = [INT_CAPS[field]] if field in INT_CAPS else [] if field.startswith("model.") \
            else [2**31 - 1]
        return [kind(v) for v in low] + top
    return [kind(v) for v in low] + [1e30]


NUMERIC = numeric_fields()


def with_value(field: str, value, **others):
    """The field's section built with `value` (and `others`): its check() runs."""
    sec, name = field.split(".")
    cls = SECTIONS[sec]
    is_tuple = typing.get_origin(typing.get_type_hints(cls)[name]) is tuple
    return cls(**{name: (value,) if is_tuple else value}, **others)


# Fields whose edges need another field moved too (1 query head: 1 kv head; one -1 axis).
EDGE_PARTNERS = {"model.num_heads": {"num_kv_heads": 1}, "mesh.pipeline": {"data": 1},
                 "mesh.expert": {"data": 1}, "mesh.tensor": {"data": 1}}


def test_the_generated_table_covers_every_numeric_field():
    assert len(NUMERIC) >= 59 and ("train.lr", float) in NUMERIC
    assert ("train.pipeline_stage_layers", int) in NUMERIC
    named = ZERO_MEANS_SOMETHING | MINUS_ONE_MEANS_SOMETHING | set(AT_MOST_ONE)
    assert named <= {f for f, _ in NUMERIC}, named - {f for f, _ in NUMERIC}
    for field, kind in NUMERIC:  # the edges pass
        for v in good_values(field, kind):
            if field == "train.pipeline_chunks" and v > 1:
                continue  # goes with pipeline_schedule interleaved-1f1b
            with_value(field, v, **EDGE_PARTNERS.get(field, {}))


@pytest.mark.parametrize("field, kind", NUMERIC, ids=[f for f, _ in NUMERIC])
def test_every_numeric_field_refuses_bad_values_in_one_line(field, kind, tmp_path,
                                                             monkeypatch, capsys):
    """`python -m gendist train --section.field=VALUE` for each bad value: exit 2, one line
    naming the field, the value and the flag, nothing written. The section's check() is
    asked first, so a missing check fails here at once instead of starting to train."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("GENDIST_TRACEBACK", raising=False)
    sec, name = field.split(".")
    flag = f"--{sec}.{name.replace('_', '-')}"
    for v in bad_values(field, kind):
        with pytest.raises(ValueError, match=rf"{sec}\.{name}=.* must be .*{flag} "):
            with_value(field, v)
        assert main(["train", f"{flag}={v}"]) == 2, (field, v)
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and "Traceback" not in err + out, err
        assert f"error: {field}=" in err and flag in err and "must be" in err, err
    assert list(tmp_path.iterdir()) == []


@st.composite
def _field_and_bad_value(draw):
    field, kind = draw(st.sampled_from(NUMERIC))
    low = -1 if field in MINUS_ONE_MEANS_SOMETHING else 0 if field in ZERO_MEANS_SOMETHING \
        else 1 if kind is int else None
    if kind is int:
        v = draw(st.integers(max_value=low - 1)
                 | st.integers(min_value=INT_CAPS.get(field, 2**31 - 1) + 1))
    else:
        cap = AT_MOST_ONE.get(field)
        below = st.floats(max_value=0.0, exclude_max=low is not None)
        above = st.floats(min_value=1.0, exclude_min=cap is True) if cap is not None \
            else st.floats(min_value=3.5e38)
        v = draw(below | above | st.just(float("nan")))
    return field, v


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_field_and_bad_value())
def test_check_refuses_any_value_outside_a_fields_range(field_value):
    """Hypothesis draws the bad values: any integer below a field's floor or past int32, any
    float below its floor, past its cap (or float32), NaN; the section's check() refuses it
    naming the field and its flag."""
    field, v = field_value
    sec, name = field.split(".")
    with pytest.raises(ValueError, match=rf"{sec}\.{name}=.* must be .*--{sec}\."
                                         rf"{name.replace('_', '-')} "):
        with_value(field, v)


def test_unawaited_orbax_read_is_quiet_at_exit():
    """A read orbax never started is a coroutine collected at exit ("sys:1: RuntimeWarning:
    coroutine ... was never awaited", seen once in the test below): quiet after a restore."""
    code = ("from gendist.training.checkpoint import _quiet_orbax_leftovers\n"
            "_quiet_orbax_leftovers()\n"
            "async def _read_array_index_and_device_put(): pass\n"
            "KEEP = [_read_array_index_and_device_put()]\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_unretrieved_tensorstore_error_is_quiet_at_exit():
    """A read TensorStore failed on its own thread leaves a future whose error (it names its
    tensorstore_spec) holds no orbax frame; asyncio logs "Future exception was never
    retrieved" when it is collected (seen once in the generate test below): quiet after a
    restore."""
    code = ("import asyncio, gc\n"
            "from gendist.training.checkpoint import _quiet_orbax_leftovers\n"
            "_quiet_orbax_leftovers()\n"
            "f = asyncio.new_event_loop().create_future()\n"
            "f.set_exception(ValueError('OUT_OF_RANGE: Error opening \"zarr\" driver '\n"
            "                           '[tensorstore_spec={}]'))\n"
            "del f\n"
            "gc.collect()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_damaged_checkpoint_one_line_in_a_real_process(done_run, tmp_path):
    """When a restore fails, orbax's other reads go on failing after it closed its event
    loop; Python printed dozens of their tracebacks ("Event loop is closed", "Exception
    ignored in") around the real message, some at exit: checked in a real process. The
    damage: step 2's metadata says d_model 64, its arrays are 32 wide (truncated array files
    fail the same way: tests/test_checkpoint_resume.py)."""
    shutil.copytree(done_run[0] / "runs", tmp_path / "runs")
    meta_file = tmp_path / "runs" / "default" / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["config"]["model"]["d_model"] = 64
    meta_file.write_text(json.dumps(meta))
    before = digest(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "GENDIST_TRACEBACK"}
    r = subprocess.run([sys.executable, "-m", "gendist", "train", *small(model__d_model=64)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert "cannot be read, it looks partial or damaged (arrays stored with shape" in r.stderr
    assert "--train.out-dir" in r.stderr and "Delete" not in r.stderr
    assert len(r.stderr) < 400 and "TensorStore" not in r.stderr, r.stderr
    assert digest(tmp_path) == before


def test_damaged_checkpoint_in_generate_is_one_short_line_in_a_real_process(done_run,
                                                                            tmp_path):
    """The array files of the run's step 2 cut short: generate names the checkpoint, what
    is wrong and the fix in one short line (no TensorStore text, no asyncio report of an
    unretrieved future at exit), and so does train --init-from."""
    shutil.copytree(done_run[0] / "runs", tmp_path / "runs")
    state = tmp_path / "runs" / "default" / "checkpoints" / "2" / "state"
    arrays = [p for p in state.rglob("*") if p.is_file() and p.parent.name == "d"]
    assert arrays
    for p in arrays:
        p.write_bytes(p.read_bytes()[:10])
    before = digest(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "GENDIST_TRACEBACK"}
    for argv, flag in ((["generate", "--checkpoint", "runs/default"], "--checkpoint"),
                       (["train", "--init-from", "runs/default", "--train.out-dir", "new"],
                        "--init-from")):
        r = subprocess.run([sys.executable, "-m", "gendist", *argv], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
        assert (f"error: {flag} 'runs/default': checkpoint step 2 in "
                f"{tmp_path / 'runs' / 'default' / 'checkpoints'} is damaged or partial (its "
                "array files cannot be read); train the run again into a new "
                "--train.out-dir.") in r.stderr, r.stderr
        assert "TensorStore" not in r.stderr and len(r.stderr) < 300 + len(str(tmp_path))
    assert digest(tmp_path) == before


def _export(*argv) -> int:
    return main(["export", "--checkpoint", "runs/default", *argv])


def test_export_never_overwrites_and_overwrite_replaces_the_folder_whole(
        done_run, tmp_path, monkeypatch, capsys):
    """The new user's lost data: an old export in my-model/ (another model, its
    tokenizer.json) is refused as --out, left byte for byte; --overwrite replaces it whole,
    the byte-level run's tokenizer written as gendist_tokenizer.json, which generate
    --model-dir reads back as bytes."""
    from gendist import hf
    from gendist.data.tokenizer import load_tokenizer
    root = done_run[0]
    monkeypatch.chdir(root)
    shutil.copytree(root / "my-model", tmp_path / "my-model")
    (tmp_path / "my-model" / "notes.txt").write_text("mine")
    before = digest(tmp_path)
    assert _export("--out", str(tmp_path / "my-model")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds config.json, model.safetensors, notes.txt" \
        in err and "--overwrite" in err, err
    assert digest(tmp_path) == before
    assert _export("--out", str(tmp_path / "my-model"), "--overwrite") == 0
    assert "exported step 2" in capsys.readouterr().out
    out = tmp_path / "my-model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-model"]  # no staging left
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "gendist_tokenizer.json",
                                                     "model.safetensors"]
    assert load_tokenizer(str(out)).name == "bytes"
    cfg, _ = hf.load(out)
    assert cfg.vocab_size == 256 and cfg.d_model == 32
    assert main(["generate", "--model-dir", str(out), "--prompt", "AB",
                 "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("AB")
    # An empty folder is written into; a new one (and its parents) made.
    (tmp_path / "empty").mkdir()
    for name in ("empty", "a/b/new"):
        assert _export("--out", str(tmp_path / name), "--dtype", "bfloat16") == 0
        assert (tmp_path / name / "gendist_tokenizer.json").is_file()
    capsys.readouterr()


def test_export_that_fails_midway_leaves_the_old_folder(done_run, tmp_path, monkeypatch):
    import safetensors.numpy

    from gendist import hf
    from gendist.training.serialize import load_params
    cfg, params, _ = load_params(done_run[0] / "runs" / "default")
    shutil.copytree(done_run[0] / "my-model", tmp_path / "my-model")
    before = digest(tmp_path)

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        hf.save(tmp_path / "my-model", cfg, params, overwrite=True)
    assert digest(tmp_path) == before  # the old folder whole, no staging folder left
    with pytest.raises(OSError, match="No space left"):
        hf.save(tmp_path / "x" / "y", cfg, params)
    assert digest(tmp_path) == before  # nor the folders it made


def test_launch_drops_gloo_lines_even_interleaved():
    """Gloo's threads print "connected" lines whose pieces interleave; their tails ("1")
    came out as a stray "[0] 1" line. Everything else passes through, prefixed."""
    from gendist.launcher import _pump
    gloo = (b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer "
            b"ranks is : ")

    class Proc:
        stdout = io.BytesIO(gloo + gloo + b"1\n1\nmodel: 0.03M params\n" + gloo + b"3\n"
                            + gloo + b"1\n4\n" + gloo + b"[Gloo] Rank 1 is connected to \n"
                            + b"2 peer ranks. Expected number of connected peer ranks is : 2\n"
                            + b"step 1/2: loss 5.5\n")
    out = io.StringIO()
    _pump(0, Proc(), out)
    assert out.getvalue() == "[0] model: 0.03M params\n[0] 4\n[0] step 1/2: loss 5.5\n"


def test_no_command_exits_2(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.rstrip("\n").splitlines()[-1] == ("python -m gendist: error: give a command "
                                                  "(train, generate, eval, prepare, export, "
                                                  "plan, launch)")


def test_header_and_footer_say_what_the_run_did(done_run):
    root, out = done_run
    for want in ["M params; 2 layers, d_model 32; float32, attention xla",
                 "devices: 8 x cpu; mesh data 8 x pipeline 1 x expert 1 x tensor 1; ZeRO stage 0",
                 "batch: 8 x 16 tokens per step, 1 sequence per device; steps 0 -> 2",
                 "checkpoints: runs/default/checkpoints (every 100 steps and at the end, keep 2)",
                 "metrics: runs/default/metrics.jsonl\n",  # no TensorBoard asked for
                 "step 1/2: loss ", "step 2: val_loss ",
                 "done: 2 steps (0 -> 2) in ", "; train loss ", "validation loss ",
                 "saved: latest checkpoint step 2 in runs/default/checkpoints"]:
        assert want in out, f"{want!r} not in:\n{out}"
    assert "\r" not in out and "sample:" not in out  # no bar in a log; --no-sample
    assert (root / "runs" / "default" / "checkpoints" / "2").is_dir()


def test_resume_on_another_mesh_and_a_finished_run_warns(done_run, tmp_path, monkeypatch,
                                                          capsys):
    shutil.copytree(done_run[0] / "runs", tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    before = digest(tmp_path / "runs" / "default" / "checkpoints")
    assert main(["train", *small()]) == 0  # the same config again: nothing left to do
    out = capsys.readouterr().out
    assert "WARNING: runs/default is already at step 2 of train.steps=2: nothing to train" in out
    assert "--train.out-dir runs/default-2" in out
    assert digest(tmp_path / "runs" / "default" / "checkpoints") == before
    # More steps on another mesh (allowed: restoring onto any mesh is exact).
    assert main(["train", *small(train__steps=3), "--mesh.data", "4", "--mesh.tensor", "2"]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "steps 2 -> 3" in out and "tensor 2;" in out


def test_every_command_has_help_and_one_naming(capsys):
    assert main(["--help"]) == 0
    top = capsys.readouterr().out
    assert "usage: python -m gendist COMMAND" in top and "--generate.top-k" in top
    for cmd, want in (("train", ["usage: python -m gendist train", "--preset NAME",
                                 "--no-sample", "--model.num-layers", "--generate.top-k"]),
                      ("generate", ["usage: python -m gendist generate", "--checkpoint",
                                    "--generate.top-k", "--prompt TEXT"]),
                      ("plan", ["usage: python -m gendist plan", "--devices INT", "--no-compile"])):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        for w in want:
            assert w in text, f"{cmd} --help lacks {w!r}"
        assert "__main__.py" not in text


def test_generate_takes_the_same_flags_as_train(done_run, monkeypatch, capsys):
    monkeypatch.chdir(done_run[0])
    for flags in (["--generate.top-k", "5"], ["--top-k", "5"]):
        assert main(["generate", "--checkpoint", "runs/default", "--prompt", "AB",
                     "--generate.max-new-tokens", "4", *flags]) == 0
        out = capsys.readouterr().out
        assert "runs/default step 2; 0.03M params" in out and "\nAB" in out
