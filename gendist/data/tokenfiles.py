"""Pre-tokenized corpora as flat token files read with `np.memmap` (as nanoGPT does).

`prepare` streams a corpus through a tokenizer into shards of `uint16` (or `uint32` for
vocabularies over 65536) tokens: `train_000000.bin ...`, `val_000000.bin ...`, a copy of the
tokenizer, and `meta.json` (dtype, vocabulary, shard lengths, largest token id). The split
is the one `TextData` makes from the same text: the last `val_fraction` of the token stream.
A `TokenStream` views a list of shards as one array, so a training window may straddle two
shards and only the windows a process asks for are read from disk. A nanoGPT folder
(`train.bin`, `val.bin`, uint16, no meta.json) is read too.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np

from gendist.data import staging
from gendist.data.corpus import check_split_sizes, expand, token_chunks, token_dtype
from gendist.data.tokenizer import load_tokenizer

META = "meta.json"
FORMAT = "gendist-tokens-1"


class TokenStream:
    """Several 1-D token arrays (memmaps) seen as their concatenation."""

    def __init__(self, shards: list[np.ndarray]):
        self.shards = [s for s in shards if len(s)]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        self.dtype = self.shards[0].dtype if self.shards else np.dtype(np.uint16)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("TokenStream supports contiguous slices only")
        a, b, _ = key.indices(len(self))
        if b <= a:
            return np.zeros((0,), self.dtype)
        first = int(np.searchsorted(self.starts, a, side="right")) - 1
        parts = []
        i = first
        while i < len(self.shards) and self.starts[i] < b:
            lo = max(a - self.starts[i], 0)
            hi = min(b - self.starts[i], len(self.shards[i]))
            parts.append(np.asarray(self.shards[i][lo:hi]))
            i += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def max_id(self, chunk: int = 1 << 24) -> int:
        """Largest token id, read in chunks (a full pass over the files)."""
        m = -1
        for s in self.shards:
            for i in range(0, len(s), chunk):
                m = max(m, int(np.max(s[i: i + chunk])))
        return m


def open_token_dir(path: str | Path) -> tuple[TokenStream, TokenStream, dict]:
    """(train, val, meta) of a `prepare` folder (or a nanoGPT train.bin/val.bin folder)."""
    d = Path(path)
    if (d / META).is_file():
        meta = json.loads((d / META).read_text())
        dtype = np.dtype(meta["dtype"])
        train = TokenStream([_memmap(d / f, dtype) for f in meta["train"]])
        val = TokenStream([_memmap(d / f, dtype) for f in meta["val"]])
        for split, stream in (("train", train), ("val", val)):
            if len(stream) != meta["num_tokens"][split]:
                raise ValueError(f"data.tokens={str(path)!r}: the {split} files hold {len(stream)}"
                                 f" tokens but {META} says {meta['num_tokens'][split]}; the "
                                 "folder is incomplete or was changed: run prepare again.")
        return train, val, meta
    if (d / "train.bin").is_file() and (d / "val.bin").is_file():  # nanoGPT's layout
        train = TokenStream([_memmap(d / "train.bin", np.uint16)])
        val = TokenStream([_memmap(d / "val.bin", np.uint16)])
        return train, val, {"dtype": "uint16", "tokenizer": None, "max_token_id": None}
    raise FileNotFoundError(
        f"data.tokens={str(path)!r} holds neither {META} (python -m gendist prepare) nor "
        "nanoGPT's train.bin and val.bin; run prepare first or fix the path.")


def _memmap(path: Path, dtype) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros((0,), dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class _ShardWriter:
    """Appends tokens to <prefix>_000000.bin, <prefix>_000001.bin, ... of `size` tokens."""

    def __init__(self, out: Path, prefix: str, dtype, size: int):
        self.out, self.prefix, self.dtype, self.size = out, prefix, np.dtype(dtype), size
        self.files: list[str] = []
        self.lengths: list[int] = []
        self.f = None

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens).astype(self.dtype, copy=False)
        while len(tokens):
            if self.f is None or self.lengths[-1] == self.size:
                self._next()
            n = min(self.size - self.lengths[-1], len(tokens))
            self.f.write(tokens[:n].tobytes())
            self.lengths[-1] += n
            tokens = tokens[n:]

    def _next(self):
        if self.f is not None:
            self.f.close()
        name = f"{self.prefix}_{len(self.files):06d}.bin"
        self.files.append(name)
        self.lengths.append(0)
        self.f = open(self.out / name, "wb")  # noqa: SIM115

    def close(self):
        if self.f is not None:
            self.f.close()
            self.f = None


def _move_tail(train: _ShardWriter, val: _ShardWriter, n_val: int) -> None:
    """Move the last n_val tokens of the train shards into the val shards (chunked)."""
    cut = sum(train.lengths) - n_val
    start = 0
    keep_files, keep_lengths = [], []
    for name, n in zip(train.files, train.lengths, strict=True):
        lo = max(cut - start, 0)
        if lo < n:
            src = np.memmap(train.out / name, dtype=train.dtype, mode="r")
            for i in range(lo, n, 1 << 24):
                val.write(np.asarray(src[i: min(i + (1 << 24), n)]))
            del src
        if lo == 0:
            (train.out / name).unlink()
        else:
            if lo < n:
                with open(train.out / name, "r+b") as f:
                    f.truncate(lo * train.dtype.itemsize)
            keep_files.append(name)
            keep_lengths.append(min(lo, n))
        start += n
    train.files, train.lengths = keep_files, keep_lengths


def prepare(corpus: tuple[str, ...], tokenizer: str, out_dir: str | Path, *,
            text_field: str = "text", val_fraction: float = 0.05,
            shard_tokens: int = 1 << 28, progress: bool = True) -> dict:
    """Tokenize a corpus into train/val token files in `out_dir`; returns the meta dict.

    The files are written into a temporary folder beside `out_dir` and moved in when
    complete (replacing a previous prepare's files there): a refused or failed prepare (no
    text, a file that is not UTF-8) leaves `out_dir` as it was, and no folder it created.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 1); pass "
                         "--data.val-fraction 0.05, say.")
    if shard_tokens <= 0:
        raise ValueError(f"--shard-tokens {shard_tokens}: give a positive number of tokens "
                         f"per shard file (default {1 << 28}).")
    tok = load_tokenizer(tokenizer)
    expand(tuple(corpus))  # every file, folder and glob exists before anything is written
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out_dir)!r} is a file; give a folder for the token "
                         "files (a new one, or a previous prepare's).")
    with staging.staged(out, "prepare") as stage:
        meta = _write_tokens(stage, tuple(corpus), tok, text_field, val_fraction,
                             shard_tokens, progress)
        _move_into(stage, out)
    return meta


def _write_tokens(out: Path, corpus: tuple[str, ...], tok, text_field: str,
                  val_fraction: float, shard_tokens: int, progress: bool) -> dict:
    dtype = token_dtype(tok.vocab_size)
    train = _ShardWriter(out, "train", dtype, shard_tokens)
    val = _ShardWriter(out, "val", dtype, shard_tokens)
    bar = _Bar(progress)
    max_id = -1
    try:
        for chunk in token_chunks(corpus, tok, text_field):
            if len(chunk):
                max_id = max(max_id, int(np.max(chunk)))
                train.write(chunk)
                bar.update(len(chunk))
    except BaseException:
        bar.close(leave=False)
        train.close()
        raise
    bar.close()
    total = sum(train.lengths)
    train.close()
    n_val = int(total * val_fraction)
    check_split_sizes(total - n_val, n_val, f"data.corpus={list(corpus)}", val_fraction)
    _move_tail(train, val, n_val)
    val.close()
    tok_file = None
    for f in tok.files:  # the tokenizer travels with its tokens
        shutil.copyfile(f, out / f.name)
        tok_file = f.name
    meta = {"format": FORMAT, "dtype": dtype.name, "vocab_size": tok.vocab_size,
            "tokenizer": tok_file or "bytes", "eos_id": tok.eos_id, "max_token_id": max_id,
            "val_fraction": val_fraction, "text_field": text_field,
            "corpus": list(corpus) or ["(bundled)"],
            "num_tokens": {"train": total - n_val, "val": n_val},
            "train": train.files, "val": val.files,
            "shard_lengths": {"train": train.lengths, "val": val.lengths}}
    (out / META).write_text(json.dumps(meta, indent=1))
    return meta


def _move_into(stage: Path, out: Path) -> None:
    """Make `out` hold the files of `stage` (then removed): a rename when `out` is new;
    else a previous prepare's files there (shards, meta.json, its tokenizer) give way."""
    if not out.exists():
        stage.rename(out)
        return
    old = out / META
    if old.is_file():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            prev = json.loads(old.read_text())
            for name in [*prev["train"], *prev["val"], prev.get("tokenizer") or ""]:
                if name and name != "bytes" and "/" not in name:
                    (out / name).unlink(missing_ok=True)
    for f in list(out.glob("train_*.bin")) + list(out.glob("val_*.bin")) + [old]:
        f.unlink(missing_ok=True)
    for f in sorted(stage.iterdir(), key=lambda f: f.name == META):  # meta.json last
        f.replace(out / f.name)
    stage.rmdir()


def tokenizer_of(path: str | Path, meta: dict) -> str:
    """The data.tokenizer string for a token folder: its copied tokenizer, or bytes."""
    name = meta.get("tokenizer")
    return "bytes" if name in (None, "bytes") else str(Path(path) / name)


class _Bar:
    """prepare's progress bar, shown from the first tokens on (a refused corpus prints
    none); closed without a trace on an error."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar = enabled, None

    def update(self, n: int) -> None:
        if self.enabled and self.bar is None:
            from tqdm.auto import tqdm
            self.bar = tqdm(desc="prepare", unit=" tok", unit_scale=True, dynamic_ncols=True)
        if self.bar is not None:
            self.bar.update(n)

    def close(self, leave: bool = True) -> None:
        if self.bar is not None:
            self.bar.leave = leave
            self.bar.close()
