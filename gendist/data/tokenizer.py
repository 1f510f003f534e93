"""Tokenizers: UTF-8 bytes (the default), a Hugging Face `tokenizer.json`, a SentencePiece model.

All three meet one small interface: `encode` / `encode_batch` (plain text, no special
tokens), `encode_prompt` (what a model sees at the start of generation: BOS where the
tokenizer adds one), `decode`, `vocab_size`, `eos_id` / `bos_id` (None where absent) and
`separator` (the tokens placed between documents of a corpus: EOS, or a blank line for
bytes). `load_tokenizer` takes the `data.tokenizer` string: `bytes`, a file, or a model
directory holding `tokenizer.json`, `tokenizer.model` or (a byte-level model exported by
gendist) `gendist_tokenizer.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HF_FILE, SP_FILE = "tokenizer.json", "tokenizer.model"
# Written beside a byte-level model (`export`): says "bytes", since there is no vocabulary file.
BYTES_FILE = "gendist_tokenizer.json"
BYTES_MARKER = {"tokenizer": "bytes", "vocab_size": 256,
                "about": "UTF-8 bytes as token ids 0-255 (gendist's byte-level tokenizer)"}
# Token strings that mean end/begin of text in common vocabularies, tried in order when
# no tokenizer_config.json / config.json names them.
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")


def _as_text(x) -> str:
    return x.decode("utf-8", errors="replace") if isinstance(x, (bytes, bytearray)) else x


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; no special tokens."""

    name = "bytes"
    vocab_size = 256
    eos_id = bos_id = None
    files: tuple[Path, ...] = ()

    def encode(self, text) -> np.ndarray:
        raw = text if isinstance(text, (bytes, bytearray)) else text.encode("utf-8")
        return np.frombuffer(raw, dtype=np.uint8)

    def encode_batch(self, texts) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def encode_prompt(self, text) -> np.ndarray:
        return self.encode(text)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")

    @property
    def separator(self) -> np.ndarray:
        return self.encode("\n\n")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` library (Rust, batched)."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError("data.tokenizer: a tokenizer.json needs the `tokenizers` "
                              "package: pip install 'gendist[data]'") from e
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the Rust library raises plain Exceptions
            raise ValueError(f"data.tokenizer={str(path)!r} is not a tokenizer.json the "
                             f"`tokenizers` library reads ({' '.join(str(e).split())[:120]})"
                             "; give the tokenizer.json saved with the model.") from None
        self.name, self.files = str(path), (Path(path),)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        named = _special_tokens_named_beside(Path(path))
        self.eos_id = self._find(named.get("eos"), EOS_NAMES)
        self.bos_id = self._find(named.get("bos"), BOS_NAMES)

    def _find(self, named, fallbacks) -> int | None:
        if isinstance(named, int):
            return named
        for t in ((named,) if named else ()) + fallbacks:
            i = self.tok.token_to_id(t)
            if i is not None:
                return i
        return None

    def encode(self, text) -> np.ndarray:
        return np.asarray(self.tok.encode(_as_text(text), add_special_tokens=False).ids,
                          np.int64)

    def encode_batch(self, texts) -> list[np.ndarray]:
        enc = self.tok.encode_batch([_as_text(t) for t in texts], add_special_tokens=False)
        return [np.asarray(e.ids, np.int64) for e in enc]

    def encode_prompt(self, text) -> np.ndarray:
        """With the tokenizer's post-processor (Llama's adds BOS)."""
        return np.asarray(self.tok.encode(_as_text(text), add_special_tokens=True).ids, np.int64)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def separator(self) -> np.ndarray:
        return np.asarray([self.eos_id] if self.eos_id is not None else [], np.int64)


class SentencePieceTokenizer:
    """A SentencePiece model file (`tokenizer.model`, Llama 2 / TinyLlama style)."""

    def __init__(self, path: Path):
        try:
            import sentencepiece as spm
        except ImportError as e:
            raise ImportError("data.tokenizer: a SentencePiece model needs the `sentencepiece` "
                              "package: pip install 'gendist[data]'") from e
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"data.tokenizer={str(path)!r} is not a SentencePiece model "
                             f"({' '.join(str(e).split())[:120]}); give the tokenizer.model "
                             "saved with the model.") from None
        self.name, self.files = str(path), (Path(path),)
        self.vocab_size = self.sp.get_piece_size()
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None

    def encode(self, text) -> np.ndarray:
        return np.asarray(self.sp.encode(_as_text(text)), np.int64)

    def encode_batch(self, texts) -> list[np.ndarray]:
        return [np.asarray(ids, np.int64) for ids in self.sp.encode([_as_text(t) for t in texts])]

    def encode_prompt(self, text) -> np.ndarray:
        ids = self.encode(text)
        return ids if self.bos_id is None else np.concatenate([[self.bos_id], ids])

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    @property
    def separator(self) -> np.ndarray:
        return np.asarray([self.eos_id] if self.eos_id is not None else [], np.int64)


Tokenizer = ByteTokenizer | HFTokenizer | SentencePieceTokenizer


def _special_tokens_named_beside(path: Path) -> dict:
    """eos/bos as named by tokenizer_config.json or config.json next to the tokenizer."""
    out: dict = {}
    cfg = path.parent / "tokenizer_config.json"
    if cfg.is_file():
        d = json.loads(cfg.read_text())
        for k in ("eos", "bos"):
            v = d.get(f"{k}_token")
            out[k] = v.get("content") if isinstance(v, dict) else v
    model_cfg = path.parent / "config.json"
    if model_cfg.is_file():
        d = json.loads(model_cfg.read_text())
        for k in ("eos", "bos"):
            v = d.get(f"{k}_token_id")
            if isinstance(v, list):  # Llama 3 instruct lists several EOS ids; the first
                v = v[0] if v else None
            if out.get(k) is None and isinstance(v, int):
                out[k] = v
    return out


def find_tokenizer_file(directory: Path) -> Path | None:
    """tokenizer.json (preferred), tokenizer.model or gendist_tokenizer.json (bytes) in a
    directory, or None."""
    for name in (HF_FILE, SP_FILE, BYTES_FILE):
        if (directory / name).is_file():
            return directory / name
    return None


def write_bytes_marker(directory: Path) -> Path:
    """gendist_tokenizer.json in `directory`: its model reads UTF-8 bytes."""
    path = Path(directory) / BYTES_FILE
    path.write_text(json.dumps(BYTES_MARKER, indent=1) + "\n")
    return path


def _read_bytes_marker(path: Path) -> ByteTokenizer:
    try:
        kind = json.loads(path.read_text()).get("tokenizer")
    except (ValueError, AttributeError, UnicodeDecodeError):
        kind = None
    if kind != "bytes":
        raise ValueError(f"data.tokenizer={str(path)!r} is not gendist's byte-level marker "
                         f"({json.dumps(BYTES_MARKER)}); give bytes, or the model's "
                         "tokenizer file.")
    return ByteTokenizer()


def load_tokenizer(spec: str = "bytes") -> Tokenizer:
    """`bytes`, a tokenizer.json, a SentencePiece .model file, or a directory holding one."""
    if spec in ("", "bytes"):
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        found = find_tokenizer_file(path)
        if found is None:
            raise FileNotFoundError(
                f"data.tokenizer={spec!r}: the directory holds no {HF_FILE}, {SP_FILE} or "
                f"{BYTES_FILE}; point at the tokenizer file, or use bytes.")
        path = found
    if path.name == BYTES_FILE and path.is_file():
        return _read_bytes_marker(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.tokenizer={spec!r} is not a file or directory; give "
                                f"bytes, a {HF_FILE}, a SentencePiece .model, or a model dir.")
    if path.suffix == ".json":
        return HFTokenizer(path)
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    raise ValueError(f"data.tokenizer={spec!r}: unknown kind; give bytes, a .json "
                     "(Hugging Face tokenizers) or a .model (SentencePiece) file.")
