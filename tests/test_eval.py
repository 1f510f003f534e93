"""`python -m gendist eval`: perplexity and multiple-choice evaluation (gendist.evaluation).

- Perplexity is the training loss: on a stream cut into the rows of a batch, nats per token
  equal `train.loss_fn` on that batch (fp32 rtol 1e-6); overlapping windows score every
  target once.
- A choice's score is the sum of log p(choice tokens | context), read from the unpadded
  forward; a model built by hand to know the alphabet (a bigram table: each letter predicts
  the next) solves the bundled alphabet task (acc = acc_norm = 1, 0- and 2-shot), and with
  the gold labels shuffled its accuracy lies within the binomial bounds of chance.
- Batches split over data 4, or data 2 x tensor 2, give one device's numbers (rtol 1e-5).
- A bad task file is one line naming the file, the line and the field, exit 2 (in process
  for each mistake, and once through `python -m gendist eval` in a subprocess).
- The command end to end from a run's checkpoint: its summary lines and JSON report.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import llama_config, random_weights, write_llama

from gendist.cli.main import main
from gendist.config import Config, ModelConfig, TrainConfig
from gendist.data.tokenizer import ByteTokenizer
from gendist.evaluation import multiple_choice, tasks
from gendist.evaluation.perplexity import perplexity, windows
from gendist.evaluation.scorer import make_scorer
from gendist.models import transformer
from gendist.sharding import make_mesh
from gendist.training.train import loss_fn

SMALL = ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=2, num_kv_heads=2,
                    head_dim=16, d_ff=64, max_seq_len=64)


def mesh_of(data: int, tensor: int = 1):
    from gendist.config import MeshConfig
    return make_mesh(MeshConfig(data=data, tensor=tensor), jax.devices()[: data * tensor])


@pytest.fixture(scope="module")
def small_params():
    return jax.device_get(transformer.init_params(SMALL, 3))


def alphabet_model():
    """A model that knows the alphabet and nothing else: blocks zeroed (the residual stream
    is the token's embedding), one-hot embeddings, and an output table giving the next
    letter (z -> a) a logit of 10 and every other token 0 (other tokens: uniform)."""
    cfg = dataclasses.replace(SMALL, d_model=128, num_layers=1, d_ff=32, tie_embeddings=False)
    params = jax.device_get(transformer.init_params(cfg, 0))
    params["blocks"] = jax.tree.map(np.zeros_like, params["blocks"])
    params["embed"] = np.eye(128, dtype=np.float32)
    head = np.zeros((128, 128), np.float32)
    for i in range(26):  # rms_norm(one-hot) = sqrt(D) * one-hot
        head[ord("a") + i, ord("a") + (i + 1) % 26] = 10.0 / math.sqrt(128)
    params["head"] = head
    return cfg, params


def test_windows_score_every_target_once():
    for n, seq_len, stride in ((2, 4, 4), (50, 8, 8), (50, 8, 3), (51, 8, 1), (9, 8, 8)):
        scored = []
        for begin, end, first in windows(n, seq_len, stride):
            assert end - begin <= seq_len and begin < first <= end
            scored += range(first, end + 1)
        assert scored == list(range(1, n)), (n, seq_len, stride)


def test_perplexity_equals_the_training_loss_on_the_same_batch(small_params):
    B, T = 4, 16
    stream = np.random.default_rng(0).integers(0, 128, B * T + 1).astype(np.int32)
    batch = {"inputs": stream[:-1].reshape(B, T), "targets": stream[1:].reshape(B, T)}
    want = float(loss_fn(Config(model=SMALL), small_params, batch))
    scorer = make_scorer(SMALL, small_params, mesh_of(1), batch_size=B)
    r = perplexity(scorer, stream, ByteTokenizer(), seq_len=T)
    assert r["tokens"] == r["bytes"] == B * T and r["windows"] == B
    np.testing.assert_allclose(r["nats_per_token"], want, rtol=1e-6)
    np.testing.assert_allclose(r["nats_per_byte"], want, rtol=1e-6)
    assert r["perplexity"] == pytest.approx(math.exp(want), rel=1e-5)
    # Overlapping windows over a stream that ends mid-window: each target's loss in the
    # window that keeps it, from the unpadded forward.
    n, stride = 45, 6
    want, count, last, begin = 0.0, 0, 0, 0
    while last < n - 1:
        end = min(begin + T, n - 1)
        logits = transformer.forward(SMALL, small_params, jnp.asarray(stream[None, begin:end]))
        logp = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
        want -= sum(logp[p - begin - 1, stream[p]] for p in range(last + 1, end + 1))
        count, last, begin = count + end - last, end, begin + stride
    over = perplexity(scorer, stream[:n], ByteTokenizer(), seq_len=T, stride=stride)
    assert over["tokens"] == count == n - 1 and over["windows"] == 6
    np.testing.assert_allclose(over["nll_sum"], want, rtol=1e-5)
    assert scorer.traces["score"] == 1  # one compile for every window and both strides


def test_a_choice_scores_the_sum_of_its_tokens_log_probabilities(small_params):
    """Against the unpadded forward of each sequence (padding, buckets, masks, rows)."""
    tok = ByteTokenizer()
    task = tasks.Task("t", "t.jsonl", (
        tasks.Example(1, "abc ", ("de", "fgh ij"), 0),
        tasks.Example(2, "", ("x",), 0),
        tasks.Example(3, "q" * 70, ("rs",), 0)))  # longer than the window: cut on the left
    reqs, cut = multiple_choice.requests(task, tok, SMALL.max_seq_len, 128, "{context}{choice}",
                                         0, 0, "\n\n")
    assert cut == 1 and [n for _, n in reqs] == [3, 7, 1, 2]  # the space moved to the choice
    assert reqs[2][0] == [ord("\n"), ord("x")]  # an empty context: the prefix token
    lls = multiple_choice.loglikelihoods(make_scorer(SMALL, small_params, mesh_of(1), 2), reqs)
    for (seq, n), ll in zip(reqs, lls, strict=True):
        logits = transformer.forward(SMALL, small_params, jnp.asarray([seq[:-1]]))
        logp = jax.nn.log_softmax(logits[0], axis=-1)
        want = sum(float(logp[t, seq[t + 1]]) for t in range(len(seq) - 1 - n, len(seq) - 1))
        np.testing.assert_allclose(ll, want, rtol=1e-5)


def binomial_tail_bounds(n: int, p: float, alpha: float = 1e-6) -> tuple[int, int]:
    """The smallest and largest counts each tail of Binomial(n, p) holds with probability
    above alpha: a count outside them is not chance."""
    pmf = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]
    lo = next(k for k in range(n + 1) if sum(pmf[: k + 1]) > alpha)
    hi = next(k for k in range(n, -1, -1) if sum(pmf[k:]) > alpha)
    return lo, hi


def test_a_model_that_knows_the_alphabet_solves_it_and_shuffled_gold_is_chance(tmp_path):
    cfg, params = alphabet_model()
    scorer = make_scorer(cfg, params, mesh_of(1), batch_size=32)
    task = tasks.read_task("alphabet")
    n = len(task.examples)
    assert n == 128 and {e.gold for e in task.examples} == {0, 1, 2, 3}
    for k in (0, 2):
        r = multiple_choice.evaluate(scorer, task, ByteTokenizer(), num_fewshot=k)
        assert r["acc"] == r["acc_norm"] == 1.0 and r["examples"] == n, (k, r)
    rng = np.random.default_rng(7)
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("".join(json.dumps({"context": e.context, "choices": list(e.choices),
                                            "gold": int(rng.integers(len(e.choices)))}) + "\n"
                                for e in task.examples))
    r = multiple_choice.evaluate(scorer, tasks.read_task(str(shuffled)), ByteTokenizer())
    lo, hi = binomial_tail_bounds(n, r["chance"])
    assert r["chance"] == 0.25 and lo <= r["acc"] * n <= hi, (r["acc"], lo, hi)


def test_fewshot_contexts_are_other_examples_with_their_gold_choices():
    task = tasks.Task("t", "t.jsonl", tuple(
        tasks.Example(i + 1, f"c{i}", (f"a{i}", f"b{i}"), i % 2) for i in range(6)))
    tpl = "Q: {context}\nA: {choice}"
    ctxs = tasks.contexts(task, tpl, k=3, seed=5, delimiter="\n\n")
    for i, ctx in enumerate(ctxs):
        *demos, last = ctx.split("\n\n")
        assert last == f"Q: c{i}\nA: " and len(demos) == 3
        js = [int(d.split("\n")[0][4:]) for d in demos]
        assert i not in js and len(set(js)) == 3
        assert demos == [f"Q: c{j}\nA: {'ab'[j % 2]}{j}" for j in js]
    assert tasks.contexts(task, tpl, k=3, seed=5, limit=2) == ctxs[:2]  # a function of (seed, i)
    assert tasks.contexts(task, tpl, k=3, seed=6) != ctxs
    assert tasks.fill("{context}{choice}", "{choice}", "x") == "{choice}x"


@pytest.mark.parametrize("data, tensor", [(4, 1), (2, 2)])
def test_sharded_over_the_mesh_equals_one_device(small_params, data, tensor):
    stream = np.random.default_rng(1).integers(0, 128, 200).astype(np.int32)
    task = tasks.read_task("alphabet")
    out = {}
    for shape in ((1, 1), (data, tensor)):
        scorer = make_scorer(SMALL, small_params, mesh_of(*shape), batch_size=8)
        ppl = perplexity(scorer, stream, ByteTokenizer(), seq_len=16)
        reqs, _ = multiple_choice.requests(task, ByteTokenizer(), SMALL.max_seq_len, 128,
                                           "{context}{choice}", 0, 0, "\n\n", limit=24)
        out[shape] = ppl["nats_per_token"], multiple_choice.loglikelihoods(scorer, reqs)
    (p1, ll1), (p2, ll2) = out.values()
    np.testing.assert_allclose(p2, p1, rtol=1e-5)
    np.testing.assert_allclose(ll2, ll1, rtol=1e-5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny byte-level Hugging Face Llama directory and a text file beside it."""
    root = tmp_path_factory.mktemp("eval")
    cfg = llama_config(vocab=256, hidden=32, heads=2, kv_heads=2, head_dim=16, ffn=64)
    write_llama(root / "llama", cfg, random_weights(cfg))
    (root / "llama" / "gendist_tokenizer.json").write_text('{"tokenizer": "bytes"}')
    (root / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    return root


GOOD = '{"context": "abc", "choices": ["d", "e"], "gold": 0}\n'
# (name, task file text, what the one line must name besides the file)
BAD_TASKS = [
    ("not JSON", GOOD + '{"context": "abc", "choices": ["d"], gold: 0}\n',
     ["line 2", "not a JSON record"]),
    ("not an object", GOOD + '["abc", ["d"], 0]\n', ["line 2", "not an object"]),
    ("missing field", GOOD * 2 + '{"context": "abc", "gold": 0}\n', ["line 3", "'choices'",
                                                                   "missing"]),
    ("gold out of range", GOOD + '{"context": "a", "choices": ["b", "c"], "gold": 2}\n',
     ["line 2", "'gold'", "out of range", "0 to 1"]),
    ("gold not an integer", '{"context": "a", "choices": ["b"], "gold": true}\n',
     ["line 1", "'gold'"]),
    ("empty choices", '\n{"context": "a", "choices": [], "gold": 0}\n', ["line 2", "'choices'",
                                                                       "empty"]),
    ("a choice not text", '{"context": "a", "choices": ["b", 3], "gold": 0}\n',
     ["line 1", "'choices' item 1"]),
    ("context not text", '{"context": null, "choices": ["b"], "gold": 0}\n',
     ["line 1", "'context'"]),
    ("no examples", "\n\n", ["holds no examples"]),
]


@pytest.mark.parametrize("name, text, want", BAD_TASKS, ids=[c[0] for c in BAD_TASKS])
def test_a_bad_task_file_is_one_line_naming_the_line_and_field(model_dir, tmp_path, capsys,
                                                               monkeypatch, name, text, want):
    monkeypatch.delenv("GENDIST_TRACEBACK", raising=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    assert main(["eval", "--model-dir", str(model_dir / "llama"), "--tasks", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("python -m gendist eval: error: --tasks "), err
    assert str(bad) in err and "Traceback" not in err + out
    for w in want:
        assert w in err, f"{w!r} not in: {err}"


@pytest.mark.parametrize("argv, want", [
    (["--tasks", "alphabet", "--num-fewshot", "128"], ["--num-fewshot 128", "127 or less"]),
    (["--tasks", "alphabet", "--template", "{choice}: {context}"], ["--template"]),
    (["--tasks", "nosuch.jsonl"], ["--tasks 'nosuch.jsonl'", "alphabet"]),
    (["--batch-size", "0"], ["--batch-size 0"]),
    (["--seq-len", "4096"], ["--seq-len 4096", "max_seq_len (2048)"]),
    (["--mesh.pipeline", "2"], ["mesh.pipeline=2"]),
])
def test_bad_options_are_one_line(model_dir, capsys, monkeypatch, argv, want):
    monkeypatch.delenv("GENDIST_TRACEBACK", raising=False)
    monkeypatch.chdir(model_dir)
    assert main(["eval", "--model-dir", "llama", "--data.corpus", "text.txt", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in want:
        assert w in err, f"{w!r} not in: {err}"


def test_a_bad_task_file_through_the_command_line(model_dir, tmp_path):
    bad = tmp_path / "tasks.jsonl"
    bad.write_text(GOOD + '{"context": "a", "choices": ["b", "c"], "gold": 5}\n')
    env = {k: v for k, v in os.environ.items() if k != "GENDIST_TRACEBACK"}
    p = subprocess.run([sys.executable, "-m", "gendist", "eval", "--model-dir",
                        str(model_dir / "llama"), "--tasks", str(bad)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr == (f"python -m gendist eval: error: --tasks {bad}: line 2: field 'gold' = 5 "
                        "is out of range for 2 choices; give an index from 0 to 1.\n")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as `train` leaves it (checkpoints/ and config.yaml) holding SMALL
    with random weights at step 3, written without training."""
    from gendist import config_yaml
    from gendist.training import optim
    from gendist.training.checkpoint import Checkpointer
    from gendist.training.loop import _cfg_json
    root = tmp_path_factory.mktemp("run")
    cfg = Config(model=SMALL, train=TrainConfig(out_dir=str(root)))
    params = transformer.init_params(SMALL, 3)
    state = {"step": jnp.int32(3), "params": params,
             "opt_state": optim.make_optimizer(cfg.train).init(params)}
    ckpt = Checkpointer(root / "checkpoints")
    ckpt.save(3, state, {"config": _cfg_json(cfg)})
    ckpt.close()
    config_yaml.save(cfg, root / config_yaml.YAML_NAME)
    (root / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    return root


def test_eval_of_a_run_prints_summary_lines_and_writes_the_report(run_dir, small_params,
                                                                  capsys, monkeypatch):
    monkeypatch.chdir(run_dir)
    assert main(["eval", "--checkpoint", ".", "--data.corpus", "text.txt", "--seq-len", "16",
                 "--tasks", "alphabet", "--limit", "24", "--num-fewshot", "1",
                 "--template", "Q: {context}\\nA: {choice}",
                 "--mesh.data", "4", "--mesh.tensor", "2", "--batch-size", "7", "--out", "out/report.json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    report = json.loads((run_dir / "out" / "report.json").read_text())
    ppl, task = report["perplexity"], report["tasks"]["alphabet"]
    assert report["model"] == {"source": "--checkpoint .", "step": 3,
                               "params": SMALL.num_params, "tokenizer": "bytes"}
    assert report["batch_size"] == 8 and report["mesh"]["data"] == 4
    assert ppl["text"] == "--data.corpus text.txt" and ppl["split"] == "all"
    assert ppl["tokens"] == ppl["bytes"] == 44 * 20 - 1  # bytes: one token a byte
    stream = np.frombuffer((run_dir / "text.txt").read_bytes(), np.uint8)
    want = perplexity(make_scorer(SMALL, small_params, mesh_of(1)), stream, ByteTokenizer(), 16)
    assert ppl["nats_per_byte"] == pytest.approx(want["nats_per_byte"], rel=1e-5)
    assert task["examples"] == 24 and task["num_fewshot"] == 1 and 0 <= task["acc"] <= 1
    assert task["template"] == "Q: {context}\nA: {choice}"  # \n typed: a newline
    assert lines[0].startswith(f"perplexity: {ppl['nats_per_byte']:.4f} nats/byte")
    assert lines[1].startswith(f"task alphabet: acc {task['acc']:.4f} ± ")
    assert lines[1].endswith("on 24 examples, 1-shot") and lines[2] == "report: out/report.json"
    # No --data flag: the run's own text, its validation split (the bundled corpus here).
    assert main(["eval", "--checkpoint", ".", "--max-tokens", "300", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "over 299 tokens, 299 bytes of the val split of the bundled corpus" in out, out
    # Token files: their validation split, the same numbers as that text.
    from gendist.data.tokenfiles import prepare
    prepare(("text.txt",), "bytes", "tok", val_fraction=0.25, progress=False)
    assert main(["eval", "--checkpoint", ".", "--data.tokens", "tok", "--seq-len", "16",
                 "--out", "tok.json"]) == 0
    r = json.loads((run_dir / "tok.json").read_text())["perplexity"]
    val = stream[len(stream) - len(stream) // 4:]
    want = perplexity(make_scorer(SMALL, small_params, mesh_of(1)), val, ByteTokenizer(), 16)
    assert r["text"] == "the val split of --data.tokens tok" and r["tokens"] == len(val) - 1
    assert r["nats_per_byte"] == pytest.approx(want["nats_per_byte"], rel=1e-5)


def test_eval_of_a_hugging_face_directory(model_dir, capsys, monkeypatch):
    monkeypatch.chdir(model_dir)
    assert main(["eval", "--model-dir", "llama", "--data.corpus", "text.txt", "--seq-len", "16",
                 "--tasks", "alphabet", "--limit", "8", "--mesh.data", "4", "--mesh.tensor",
                 "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("over 879 tokens, 879 bytes of --data.corpus text.txt"), out
    assert out[1].startswith("task alphabet: acc ") and out[1].endswith("on 8 examples, 0-shot")


def test_bytes_and_pairs_with_a_subword_tokenizer(tmp_path):
    """A byte-level BPE: bytes are those of the decoded text (EOS counts none); a choice's
    tokens are those of context + choice after the context's, the space moved onto it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from gendist.data.tokenizer import load_tokenizer
    from gendist.evaluation.perplexity import count_bytes
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    text = "Answer: the château stands by the river; yes, the river. " * 50
    bpe.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    ids = np.concatenate([tok.encode(text), [tok.eos_id], tok.encode("é")])
    assert count_bytes(tok, ids) == len(text.encode()) + 2
    ctx, cont = multiple_choice.encode_pair(tok, "Answer: the ", "river")
    assert tok.decode(ctx) == "Answer: the" and tok.decode(cont) == " river"
    assert ctx + cont == [int(i) for i in tok.encode("Answer: the river")]
