"""Corpora, tokenizers and token files: sources read as documents, tokenizers round-trip,
`prepare` + token files train exactly as the text does, bad token ids are refused."""

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import mesh_of, small_config

from gendist.cli.train import resolve_train
from gendist.config import DataConfig
from gendist.data.batches import TextData, load_corpus
from gendist.data.corpus import documents, expand, load_tokens
from gendist.data.tokenfiles import TokenStream, open_token_dir
from gendist.data.tokenizer import ByteTokenizer, load_tokenizer
from gendist.presets import replace
from gendist.training import loop

TEXT = bytes(load_corpus()[:120_000]).decode("utf-8", errors="ignore")


def train_bpe(path, vocab=320):
    """A byte-level BPE trained here with the `tokenizers` library, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return str(train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two text files in a folder, a .jsonl with its text under `body`, and a Parquet file."""
    d = tmp_path_factory.mktemp("corpus")
    (d / "books").mkdir()
    (d / "books" / "a.txt").write_text(TEXT[:30_000])
    (d / "books" / "b.txt").write_text(TEXT[30_000:70_000])
    with open(d / "rec.jsonl", "w") as f:
        for i in range(20):
            f.write(json.dumps({"id": i, "body": TEXT[70_000 + 1000 * i: 71_000 + 1000 * i]}))
            f.write("\n")
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": [TEXT[90_000 + 2000 * i: 92_000 + 2000 * i]
                                      for i in range(10)]}), d / "more.parquet")
    return d


def test_tokenizer_json_round_trips(bpe):
    tok = load_tokenizer(bpe)
    assert tok.vocab_size == 320 and tok.eos_id == 0
    for s in ["ROMEO: But soft, what light\n\n  through yonder window breaks?",
              "ünïcödé, emoji 🙂 and\ttabs", ""]:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        assert ids.max(initial=0) < tok.vocab_size
    assert len(tok.encode(TEXT[:5000])) < 0.8 * 5000  # 63 merges already compress English
    assert [a.tolist() for a in tok.encode_batch(["to be", "or not"])] == \
        [tok.encode("to be").tolist(), tok.encode("or not").tolist()]


def test_sentencepiece_model(tmp_path):
    import sentencepiece as spm
    (tmp_path / "t.txt").write_text(TEXT[:40_000])
    spm.SentencePieceTrainer.train(input=str(tmp_path / "t.txt"), vocab_size=200,
                                   model_prefix=str(tmp_path / "sp"), model_type="bpe",
                                   minloglevel=2)
    tok = load_tokenizer(str(tmp_path / "sp.model"))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (200, 1, 2)
    s = "KING HENRY: Once more unto the breach, dear friends"
    assert tok.decode(tok.encode(s)) == s
    assert tok.encode_prompt(s)[0] == 1 and tok.separator.tolist() == [2]


def test_sources_dirs_globs_records(corpus):
    paths = expand((str(corpus / "books"), str(corpus / "*.jsonl"), str(corpus / "more.parquet")))
    assert [p.name for p in paths] == ["a.txt", "b.txt", "rec.jsonl", "more.parquet"]
    docs = [(p.decode() if isinstance(p, bytes) else p)
            for p, end in documents((str(corpus / "books"),)) if p]
    assert "".join(docs) == TEXT[:70_000]
    recs = [p for p, end in documents((str(corpus / "rec.jsonl"), str(corpus / "more.parquet")),
                                      "body")]
    assert recs[0] == TEXT[70_000:71_000] and recs[-1] == TEXT[108_000:110_000]
    assert len(recs) == 30
    # bytes: documents joined by a blank line; one file reads exactly as before
    tokens = load_tokens((str(corpus / "books"),), ByteTokenizer())
    assert bytes(tokens) == (TEXT[:30_000] + "\n\n" + TEXT[30_000:70_000]).encode()
    with pytest.raises(ValueError, match=r"data.text_field='text' is not a field"):
        list(documents((str(corpus / "rec.jsonl"),)))
    with pytest.raises(ValueError, match=r"data.text_field='text' is not a column"):
        list(documents((str(corpus / "more.parquet"),)))
    with pytest.raises(FileNotFoundError, match=r"glob .* matches no file"):
        expand((str(corpus / "*.nothing"),))


def test_text_that_is_not_utf8_is_refused_with_its_line(tmp_path):
    """Latin-1 bytes would reach a tokenizer as U+FFFD: refused, naming the first bad byte,
    also past a 1 MiB piece boundary, in a .gz and in a .jsonl record."""
    import gzip
    good = "Ça va, à côté du château.\n" * 45_000  # > 1 MiB: several pieces
    (tmp_path / "ok.txt").write_text(good)
    assert bytes(load_tokens((str(tmp_path / "ok.txt"),), ByteTokenizer())) == good.encode()
    (tmp_path / "latin.txt").write_bytes(good.encode() + "déjà vu\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.txt is not UTF-8 text \(byte 0xe9 at line "
                                         r"45001, column 2\).*iconv -f latin1 -t utf-8"):
        load_tokens((str(tmp_path / "latin.txt"),), ByteTokenizer())
    (tmp_path / "latin.txt.gz").write_bytes(gzip.compress("naïve\n".encode("latin-1")))
    with pytest.raises(ValueError, match=r"latin.txt.gz is not UTF-8 text \(byte 0xef at "
                                         r"line 1, column 3\).*zcat"):
        list(documents((str(tmp_path / "latin.txt.gz"),)))
    (tmp_path / "not.gz").write_bytes(b"plain text")
    with pytest.raises(ValueError, match=r"not.gz is not a complete gzip file"):
        list(documents((str(tmp_path / "not.gz"),)))
    for line, want in ((b'{"text": "caf\xe9"}', r"rec.jsonl:2 is not UTF-8"),
                       (b'{"text": 1', r"rec.jsonl:2 is not a JSON record"),
                       (b'["text"]', r"rec.jsonl:2 holds a JSON list, not an object"),
                       (b'{"text": 7}', r"data.text_field='text' of the record at .*rec.jsonl:2 "
                                        r"is a int, not text")):
        (tmp_path / "rec.jsonl").write_bytes(b'{"text": "ok"}\n' + line + b"\n")
        with pytest.raises(ValueError, match=want):
            list(documents((str(tmp_path / "rec.jsonl"),)))


def test_empty_or_too_small_corpus_is_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "short.txt").write_text("a few bytes")
    with pytest.raises(ValueError, match=r"holds no text \(0 tokens\)"):
        TextData.from_config(DataConfig(corpus=(str(tmp_path / "empty.txt"),)))
    with pytest.raises(ValueError, match=r"holds 11 tokens, leaving 11 to train on and 0 for "
                                         r"validation \(data.val_fraction=0.05\)"):
        TextData.from_config(DataConfig(corpus=(str(tmp_path / "short.txt"),)))


def test_prepare_refused_leaves_no_folder_and_keeps_an_old_one(tmp_path):
    from gendist.data.tokenfiles import prepare
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "text.txt").write_text(TEXT[:20_000])
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match="holds no text"):
        prepare((str(tmp_path / "empty.txt"),), "bytes", tmp_path / "new" / "tok",
                progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # not even new/
    prepare((str(tmp_path / "text.txt"),), "bytes", tmp_path / "tok", progress=False)
    (tmp_path / "tok" / "NOTES").write_text("mine")
    old = {p.name: p.read_bytes() for p in (tmp_path / "tok").iterdir()}
    with pytest.raises(ValueError, match="holds no text"):
        prepare((str(tmp_path / "empty.txt"),), "bytes", tmp_path / "tok", progress=False)
    assert {p.name: p.read_bytes() for p in (tmp_path / "tok").iterdir()} == old
    # A new prepare replaces the old one's files (shards, meta.json) and keeps the others.
    meta = prepare((str(tmp_path / "text.txt"),), "bytes", tmp_path / "tok", progress=False,
                   shard_tokens=5000)
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == sorted(
        ["NOTES", "meta.json", *meta["train"], *meta["val"]])
    assert len(meta["train"]) == 4 and not list(tmp_path.glob(".tok.prepare-*"))


def test_arrow_and_saved_datasets(tmp_path):
    import datasets
    ds = datasets.Dataset.from_dict({"text": ["first doc", "second doc"]})
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = sorted((tmp_path / "saved").glob("*.arrow"))[0]
    for src in (tmp_path / "saved", arrow):
        assert [p for p, _ in documents((str(src),))] == ["first doc", "second doc"]


def test_token_stream_reads_across_shards(tmp_path):
    a = np.arange(10, dtype=np.uint16)
    s = TokenStream([a[:3], a[3:4], a[4:9], a[9:]])
    for lo in range(10):
        for hi in range(lo, 11):
            assert np.array_equal(s[lo:hi], a[lo:hi])
    assert len(s) == 10 and s.max_id() == 9
    # nanoGPT's layout: train.bin / val.bin of uint16, no meta.json
    a.tofile(tmp_path / "train.bin")
    a[:4].tofile(tmp_path / "val.bin")
    train, val, _ = open_token_dir(tmp_path)
    assert np.array_equal(train[0:10], a) and len(val) == 4


def prepare_cli(out, *args):
    r = subprocess.run([sys.executable, "-m", "gendist", "prepare", "--out", str(out), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus, bpe):
    out = tmp_path_factory.mktemp("tokens")
    r = prepare_cli(out, "--data.corpus", str(corpus / "books"), str(corpus / "rec.jsonl"),
                    "--data.text-field", "body", "--data.tokenizer", bpe,
                    "--shard-tokens", "4000", "--data.val-fraction", "0.1")
    assert "prepare" in r.stderr and "tok/s" in r.stderr  # the progress bar
    assert "--data.tokens" in r.stdout
    return out


def test_prepare_writes_shards_meta_and_tokenizer(prepared, corpus, bpe):
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 320
    assert len(meta["train"]) > 3 and (prepared / "tokenizer.json").is_file()
    text = TextData.from_config(DataConfig(corpus=(str(corpus / "books"),
                                                   str(corpus / "rec.jsonl")),
                                           text_field="body", tokenizer=bpe, val_fraction=0.1))
    files = TextData.from_token_files(str(prepared))
    for split in ("train", "val"):
        a, b = getattr(text, split), getattr(files, split)
        assert len(a) == len(b) and np.array_equal(a, b[0:len(b)])
    assert files.max_id == int(text.train.max()) and files.tokenizer.endswith("tokenizer.json")
    # EOS between the 22 documents (2 files, 20 records), none after the last
    assert (text.train == 0).sum() + (text.val == 0).sum() == 21


def test_prepare_then_train_equals_training_on_text(prepared, corpus, bpe, tmp_path):
    """Same tokenizer, same split, same windows: the same losses, step by step (one compiled
    step fed by both sources)."""
    from gendist.data.batches import shard_batch
    from gendist.training import train
    data_cfg = DataConfig(corpus=(str(corpus / "books"), str(corpus / "rec.jsonl")),
                          text_field="body", tokenizer=bpe, val_fraction=0.1)
    cfg = replace(small_config(str(tmp_path)), data=data_cfg)
    cfg, _, tok = resolve_train(cfg)
    assert cfg.model.vocab_size == 320 and tok.vocab_size == 320  # follows the tokenizer
    files_cfg, _, _ = resolve_train(replace(cfg, data=DataConfig(tokens=str(prepared))))
    assert files_cfg.model == cfg.model and files_cfg.data.tokenizer.endswith("tokenizer.json")
    setup = train.build(cfg, mesh_of(1))
    losses = []
    for data in (TextData.from_config(cfg.data), TextData.from_config(files_cfg.data)):
        data.check_vocab(cfg.model.vocab_size)
        state, run = setup.init_state(), []
        for step in range(3):
            batch = shard_batch(data.global_batch(step, 8, 16), setup.mesh)
            state, m = setup.step_fn(state, batch)
            run.append(float(m["loss"]))
        losses.append(run)
    assert losses[0] == losses[1] and losses[0][2] < losses[0][0]
    assert setup.traces["step"] == 1


def test_vocabulary_follows_the_tokenizer_unless_the_user_set_it(prepared, bpe, tmp_path):
    """Left alone, model.vocab_size rises to the tokenizer's 320 without a word; set on the
    command line (vocab_given) and smaller, it is refused naming both."""
    for data in (DataConfig(tokens=str(prepared)), DataConfig(tokenizer=bpe)):
        cfg = replace(small_config(str(tmp_path)), data=data)
        assert resolve_train(cfg)[0].model.vocab_size == 320
        with pytest.raises(ValueError, match=r"--model.vocab-size 256 is smaller than the "
                                             r"320-token vocabulary of .*--model.vocab-size 320 "
                                             r"or more, or leave --model.vocab-size out"):
            resolve_train(cfg, vocab_given=True)
        bigger = replace(cfg, **{"model.vocab_size": 384})
        assert resolve_train(bigger, vocab_given=True)[0].model.vocab_size == 384  # padded


def test_token_ids_beyond_vocab_refused_before_any_step(prepared, tmp_path):
    cfg = small_config(str(tmp_path / "bad"), steps=2)
    cfg = replace(cfg, data=DataConfig(tokens=str(prepared)))  # ids up to 319, vocab 256
    with pytest.raises(ValueError, match=r"model.vocab_size=256 is too small.*token id 319.*tokenizer.json.*--model.vocab-size 320"):
        loop.run(cfg, mesh=mesh_of(1), log=lambda *a: None)
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
    assert not (tmp_path / "bad" / "checkpoints").exists() or \
        not any((tmp_path / "bad" / "checkpoints").iterdir())
