"""Where text comes from: files, directories, globs, .jsonl, Parquet/Arrow, the bundled corpus.

A corpus is a sequence of documents. A text file is one document (UTF-8, read in pieces of
about 1 MiB cut at line ends, so a file larger than memory streams; another encoding is
refused with the line of its first bad byte, not read as U+FFFD); each record of a .jsonl,
Parquet or Arrow file (or a `datasets.save_to_disk` folder) is one document, its text in
`data.text_field`. Parquet and Arrow go through the `datasets` library, from local files
only. `token_chunks` turns the documents into token arrays with the tokenizer's separator
between documents: the one token stream that training on text and `prepare` both see.
"""

from __future__ import annotations

import glob
import gzip
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import numpy as np

from gendist.data import jsonl

BUNDLED = "shakespeare.txt.gz"
TEXT_SUFFIXES = (".txt", ".text", ".md", ".gz")
RECORD_SUFFIXES = (".jsonl", ".parquet", ".arrow")
PIECE_BYTES = 1 << 20  # text files are tokenized in pieces of about this many bytes


def expand(paths: tuple[str, ...]) -> list[Path]:
    """Files (and `save_to_disk` folders) named by paths, directories and globs, in order.

    A directory contributes its files with known suffixes, recursively and sorted; a glob
    (`*`, `?`, `[`) its sorted matches. An empty tuple means the bundled corpus.
    """
    out: list[Path] = []
    for p in paths:
        if any(c in p for c in "*?["):
            hits = sorted(Path(h) for h in glob.glob(p, recursive=True) if Path(h).is_file())
            if not hits:
                raise FileNotFoundError(f"data.corpus: the glob {p!r} matches no file.")
            out += hits
            continue
        path = Path(p)
        if path.is_dir() and _is_saved_dataset(path):
            out.append(path)
        elif path.is_dir():
            hits = sorted(f for f in path.rglob("*") if f.is_file()
                          and f.suffix in TEXT_SUFFIXES + RECORD_SUFFIXES
                          and not any(part.startswith(".") for part in f.relative_to(path).parts))
            if not hits:
                raise FileNotFoundError(
                    f"data.corpus: the directory {p!r} holds no file ending in "
                    f"{', '.join(TEXT_SUFFIXES + RECORD_SUFFIXES)}.")
            out += hits
        elif path.is_file():
            out.append(path)
        else:
            raise FileNotFoundError(
                f"data.corpus: {p!r} is not a file, directory or glob; give existing text, "
                ".jsonl, .parquet or .arrow files, or leave data.corpus empty to train on "
                "the bundled Shakespeare corpus.")
    return out


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


def _text_pieces(f) -> Iterator[bytes]:
    """~PIECE_BYTES pieces of a binary stream, each ending at a line end (or the end)."""
    rest = b""
    while True:
        block = f.read(PIECE_BYTES)
        if not block:
            break
        block = rest + block
        cut = block.rfind(b"\n") + 1
        if cut == 0:  # one very long line: keep reading
            rest = block
            continue
        rest = block[cut:]
        yield block[:cut]
    if rest:
        yield rest


def _check_utf8(piece: bytes, path: Path, lines_before: int) -> None:
    """Refuse a text file that is not UTF-8 (a tokenizer would read U+FFFD in its place),
    naming the line and column of the first bad byte and how to convert the file."""
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError as e:
        line = lines_before + piece.count(b"\n", 0, e.start) + 1
        column = e.start - (piece.rfind(b"\n", 0, e.start) + 1) + 1
        fix = (f"zcat {path} | iconv -f latin1 -t utf-8 > {path.with_suffix('')}.utf8.txt"
               if path.suffix == ".gz" else
               f"iconv -f latin1 -t utf-8 {path} > {path.with_suffix('')}.utf8{path.suffix}")
        raise ValueError(
            f"data.corpus: {path} is not UTF-8 text (byte 0x{piece[e.start]:02x} at line "
            f"{line}, column {column}); convert it to UTF-8 and give the converted file, "
            f"e.g. {fix} (latin1: the file's encoding).") from None


def _records(path: Path, text_field: str) -> Iterator[str]:
    if path.suffix == ".jsonl":
        for n, _, rec in jsonl.objects(path, lambda n: f"data.corpus: {path}:{n}",
                                       '{"text": "..."}'):
            yield _field(rec, text_field, f"{path}:{n}")
        return
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"data.corpus: reading {path} needs the `datasets` package: "
                          "pip install 'gendist[data]'") from e
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
    else:
        kind = path.suffix.lstrip(".")
        ds = datasets.load_dataset(kind, data_files=[str(path)], split="train", streaming=True)
    columns = getattr(ds, "column_names", None)
    if columns is not None and text_field not in columns:
        raise ValueError(f"data.text_field={text_field!r} is not a column of {path}; its "
                       f"columns are {columns}. Set --data.text-field.")
    for rec in ds:
        yield _field(rec, text_field, str(path))


def _field(rec: dict, text_field: str, where: str) -> str:
    if text_field not in rec:
        raise ValueError(f"data.text_field={text_field!r} is not a field of the record at "
                         f"{where}; its fields are {sorted(rec)}. Set --data.text-field.")
    text = rec[text_field]
    if text is None:  # a missing value in a table: an empty document
        return ""
    if not isinstance(text, str):
        raise ValueError(f"data.text_field={text_field!r} of the record at {where} is a "
                         f"{type(text).__name__}, not text; set --data.text-field to the "
                         "field holding the text.")
    return text


def documents(paths: tuple[str, ...], text_field: str = "text"
              ) -> Iterator[tuple[str | bytes, bool]]:
    """(piece, ends_document) over the whole corpus; text files yield bytes, records str."""
    if not paths:
        with resources.files("gendist.assets").joinpath(BUNDLED).open("rb") as f:
            raw = gzip.decompress(f.read())
        for piece in _text_pieces(_BytesReader(raw)):
            yield piece, False
        yield b"", True
        return
    for path in expand(paths):
        if path.suffix in RECORD_SUFFIXES or path.is_dir():
            for text in _records(path, text_field):
                yield text, True
            continue
        opener = gzip.open if path.suffix == ".gz" else open
        lines = 0
        with opener(path, "rb") as f:
            try:
                for piece in _text_pieces(f):
                    _check_utf8(piece, path, lines)
                    lines += piece.count(b"\n")
                    yield piece, False
            except (gzip.BadGzipFile, EOFError) as e:
                raise ValueError(f"data.corpus: {path} is not a complete gzip file ({e}); "
                                 "give it without the .gz suffix if it is plain text, or "
                                 "download it again.") from None
        yield b"", True


class _BytesReader:
    def __init__(self, raw: bytes):
        self.raw, self.pos = raw, 0

    def read(self, n: int) -> bytes:
        out = self.raw[self.pos: self.pos + n]
        self.pos += len(out)
        return out


def token_chunks(paths: tuple[str, ...], tokenizer, text_field: str = "text",
                 batch: int = 64) -> Iterator[np.ndarray]:
    """Token arrays of the corpus in order, `tokenizer.separator` between documents.

    Pieces are encoded `batch` at a time (the `tokenizers` library runs a batch in parallel).
    """
    sep = np.asarray(tokenizer.separator)
    pending: list[tuple[str | bytes, bool]] = []
    started = False

    def flush():
        nonlocal started
        texts = [p for p, _ in pending if len(p)]
        encoded = iter(tokenizer.encode_batch(texts)) if texts else iter(())
        for piece, ends in pending:
            if len(piece):
                if started is None:  # a document ended before this piece: separate them
                    yield sep
                started = True
                yield next(encoded)
            if ends and started:
                started = None
        pending.clear()

    for item in documents(paths, text_field):
        pending.append(item)
        if len(pending) >= batch:
            yield from flush()
    yield from flush()


def check_split_sizes(n_train: int, n_val: int, what: str, val_fraction=None) -> None:
    """Refuse a corpus with no text, or too little to leave tokens for both splits."""
    if n_train + n_val == 0:
        raise ValueError(f"{what} holds no text (0 tokens); give files with text in them, "
                         "or leave data.corpus empty to train on the bundled corpus.")
    if n_val == 0 or n_train == 0:
        split = "" if val_fraction is None else f" (data.val_fraction={val_fraction})"
        raise ValueError(f"{what} holds {n_train + n_val} tokens, leaving {n_train} to train "
                         f"on and {n_val} for validation{split}; give more text.")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type for token files (nanoGPT's uint16 when it fits)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def load_tokens(paths: tuple[str, ...], tokenizer, text_field: str = "text") -> np.ndarray:
    """The corpus's whole token stream in memory (uint8 for bytes, else token_dtype)."""
    dtype = np.uint8 if tokenizer.vocab_size <= 256 else token_dtype(tokenizer.vocab_size)
    chunks = [np.asarray(c).astype(dtype, copy=False)
              for c in token_chunks(paths, tokenizer, text_field)]
    return np.concatenate(chunks) if chunks else np.zeros((0,), dtype)
