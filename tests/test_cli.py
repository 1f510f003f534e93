"""The command line as a user meets it.

Bad input (each mistake a user reported plus those of tests/test_errors.py): exit code 2, one
line on stderr naming the field and the fix, no traceback, nothing on disk deleted or
overwritten. Mostly `gendist.cli.main.main` in-process; a subprocess where the process's
own shutdown matters (orbax's leftovers after a failed restore). Also: the header and footer
of a run, resuming, `--help` of every command, `--no-sample`, generate's flag names.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    """A finished 2-step run in <root>/runs/default, made by the CLI; (root, its stdout)."""
    root = tmp_path_factory.mktemp("cli")
    (root / "utf8.txt").write_text("Ça été très réussi, à côté du château. " * 40)
    (root / "empty").mkdir()
    cwd = os.getcwd()
    os.chdir(root)
    try:
        import io
        from contextlib import redirect_stdout
        buf = io.StringIO()
        with redirect_stdout(buf):
            assert main(["train", *small()]) == 0
    finally:
        os.chdir(cwd)
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


def test_unawaited_orbax_read_is_quiet_at_exit():
    """A read orbax never started is a coroutine collected at exit ("sys:1: RuntimeWarning:
    coroutine ... was never awaited", seen once in the test below): quiet after a restore."""
    code = ("from gendist.training.checkpoint import _quiet_orbax_leftovers\n"
            "_quiet_orbax_leftovers()\n"
            "async def _read_array_index_and_device_put(): pass\n"
            "KEEP = [_read_array_index_and_device_put()]\n")
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
    assert "cannot be read, it looks partial or damaged" in r.stderr
    assert "--train.out-dir" in r.stderr and "Delete" not in r.stderr
    assert digest(tmp_path) == before


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
