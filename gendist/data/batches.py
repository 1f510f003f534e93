"""Training data: token windows from text (any tokenizer) or from token files.

Batches are a pure function of (seed, step, split), so a resumed run sees exactly the
batches it would have seen, on any number of devices or processes. Each batch lands on
the mesh sharded over the `batch` logical axis (mesh axes `data` and `expert`). Where the
tokens come from: `gendist.data.corpus` (text files, .jsonl, Parquet/Arrow, tokenized in
memory) or `gendist.data.tokenfiles` (shards written by `prepare`, memory-mapped).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import jax
import numpy as np

from gendist.config import DataConfig
from gendist.data.corpus import check_split_sizes, load_tokens
from gendist.data.tokenizer import ByteTokenizer, load_tokenizer
from gendist.sharding import named_sharding


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes as uint8 token ids (vocabulary of 256)."""
    return ByteTokenizer().encode(text)


def decode(tokens) -> str:
    return ByteTokenizer().decode(tokens)


def load_corpus(paths: tuple[str, ...] = ()) -> np.ndarray:
    """All bytes of the given text files (.gz read transparently), or the bundled corpus."""
    return load_tokens(tuple(paths), ByteTokenizer())


@dataclass
class TextData:
    """Train/validation token streams with deterministic random windows.

    `train`/`val` are arrays or `tokenfiles.TokenStream`s (anything with len and slices);
    `tokenizer` is the data.tokenizer string the tokens came from; `max_id` the largest
    token id when known (token files record it), else computed on first need.
    """

    train: np.ndarray
    val: np.ndarray
    seed: int
    tokenizer: str = "bytes"
    max_id: int | None = None

    @classmethod
    def from_config(cls, cfg: DataConfig) -> TextData:
        if not 0.0 < cfg.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction={cfg.val_fraction} must be in (0, 1).")
        if cfg.tokens:
            return cls.from_token_files(cfg.tokens, cfg.seed)
        tokens = load_tokens(tuple(cfg.corpus), load_tokenizer(cfg.tokenizer), cfg.text_field)
        n_val = int(len(tokens) * cfg.val_fraction)
        check_split_sizes(len(tokens) - n_val, n_val, f"data.corpus={list(cfg.corpus)}",
                          cfg.val_fraction)
        return cls(tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:], cfg.seed,
                   cfg.tokenizer)

    @classmethod
    def from_token_files(cls, path: str, seed: int = 0) -> TextData:
        """Memory-mapped shards from `python -m gendist prepare` (or nanoGPT's .bin files)."""
        from gendist.data.tokenfiles import open_token_dir, tokenizer_of
        train, val, meta = open_token_dir(path)
        check_split_sizes(len(train), len(val), f"data.tokens={path!r}",
                          meta.get("val_fraction"))
        return cls(train, val, seed, tokenizer_of(path, meta) if meta.get("tokenizer")
                   else "", meta.get("max_token_id"))

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.train[:1 << 20].tobytes()).hexdigest()[:16]

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse token ids the model has no embedding for (they would turn into NaN)."""
        if self.max_id is None:
            self.max_id = max(_max_id(self.train), _max_id(self.val))
        if self.max_id >= vocab_size:
            need = max(self.max_id + 1, 256) if self.tokenizer == "bytes" else self.max_id + 1
            raise ValueError(
                f"model.vocab_size={vocab_size} is too small for the data, which holds token "
                f"id {self.max_id} (data.tokenizer={self.tokenizer!r}); pass "
                f"--model.vocab-size {need} or more, or the tokenizer the model was trained "
                "with.")

    def check_windows(self, seq_len: int) -> None:
        """Both splits must hold a window of seq_len + 1 tokens (checked before any work:
        else the first batch, or the first validation, fails mid-run)."""
        for split in ("train", "val"):
            n = len(getattr(self, split))
            if n <= seq_len + 1:
                raise ValueError(
                    f"train.seq_len={seq_len} is longer than the {split} split ({n} tokens); "
                    f"pass --train.seq-len {max(n - 2, 1)} or less, or give more text.")

    def batch_indices(self, step: int, batch_size: int, seq_len: int, split: str) -> np.ndarray:
        """Start offsets of the windows of one global batch: a function of (seed, step)."""
        data = self.train if split == "train" else self.val
        if len(data) <= seq_len + 1:
            raise ValueError(f"train.seq_len={seq_len} is longer than the {split} split "
                             f"({len(data)} tokens); use a shorter seq_len or more text.")
        salt = 0 if split == "train" else 1
        rng = np.random.default_rng([self.seed, salt, step])
        return rng.integers(0, len(data) - seq_len - 1, size=batch_size)

    def global_batch(self, step: int, batch_size: int, seq_len: int, split: str = "train",
                     rows: slice | np.ndarray | None = None) -> dict[str, np.ndarray]:
        """inputs/targets [B, T] int32 for rows `rows` of the global batch (all by default).

        Only the selected windows are read, so each process touches just its own rows.
        """
        data = self.train if split == "train" else self.val
        starts = self.batch_indices(step, batch_size, seq_len, split)
        if rows is not None:
            starts = starts[rows]
        win = np.stack([data[s: s + seq_len + 1] for s in starts]).astype(np.int32)
        return {"inputs": win[:, :-1], "targets": win[:, 1:]}


def _max_id(tokens) -> int:
    if hasattr(tokens, "max_id"):
        return tokens.max_id()
    return int(np.max(tokens)) if len(tokens) else -1


def shard_batch(batch: dict[str, np.ndarray], mesh, global_batch_size: int | None = None):
    """Place a batch on the mesh, rows split over the `batch` logical axis.

    Single process: `batch` is the whole global batch. Several processes: each passes
    only its rows (see `process_rows`) and the global array is assembled without copies.
    """
    sharding = named_sharding(mesh, ("batch", "seq"))
    if jax.process_count() == 1:
        return {k: jax.device_put(v, sharding) for k, v in batch.items()}
    if global_batch_size is None:
        raise ValueError("shard_batch: with several processes pass global_batch_size "
                         "(train.batch_size); each process holds only its rows.")
    out = {}
    for k, v in batch.items():
        shape = (global_batch_size, *v.shape[1:])
        out[k] = jax.make_array_from_process_local_data(sharding, v, shape)
    return out


def random_batches(cfg, mesh, n: int = 2, seed: int = 0) -> list[dict]:
    """`n` batches of uniform random tokens shaped as `cfg.train` asks, on the mesh: what a
    timing of the train step feeds it (the step's speed does not depend on the text)."""
    rng = np.random.default_rng(seed)
    t, out = cfg.train, []
    for _ in range(n):
        tok = rng.integers(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), np.int32)
        out.append(shard_batch({"inputs": tok[:, :-1], "targets": tok[:, 1:]}, mesh))
    return out


def process_rows(mesh, global_batch_size: int) -> slice | np.ndarray:
    """The rows of the global batch that this process's devices hold, in the order
    `jax.make_array_from_process_local_data` expects them (its shards by ascending start).

    A slice when they are contiguous; an index array when the mesh interleaves processes
    along `batch` (e.g. devices of process 0 on data rows 0 and 2, process 1 on 1 and 3).
    """
    if jax.process_count() == 1:
        return slice(0, global_batch_size)
    sharding = named_sharding(mesh, ("batch", "seq"))
    idx = sharding.addressable_devices_indices_map((global_batch_size, 1))
    return rows_of_shards([i[0] for i in idx.values()], global_batch_size)


def rows_of_shards(shards, global_batch_size: int) -> slice | np.ndarray:
    """Rows covered by a set of row slices (duplicates = replicas), ascending."""
    spans = sorted({(s.start or 0, global_batch_size if s.stop is None else s.stop)
                    for s in shards})
    if all(a[1] == b[0] for a, b in zip(spans[:-1], spans[1:], strict=True)):
        return slice(spans[0][0], spans[-1][1])
    return np.concatenate([np.arange(a, b) for a, b in spans])
