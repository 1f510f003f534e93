"""Preference pairs for DPO (`train.objective=dpo`): a JSONL file of records

    {"prompt": "...", "chosen": "...", "rejected": "..."}

each tokenized as prompt + response. A batch of B pairs is 2B rows, chosen and rejected
interleaved (row 2i the chosen answer of pair i, row 2i + 1 its rejected one) so that
gradient accumulation and the data-parallel split keep the two halves of a pair together:

    inputs, targets  [2B, T] int32   the window ids[:-1], ids[1:] (zero-padded)
    mask             [2B, T] fp32    1 where the target is a response token, else 0

A pair longer than T + 1 tokens keeps its response (then as much of the prompt's end as
fits); a response longer than T + 1 is cut at the end. Batches are a pure function of
(seed, step, split), like `batches.TextData`; the last val_fraction of the pairs (at least
one) is held out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gendist.config import DataConfig
from gendist.data import jsonl
from gendist.data.tokenizer import load_tokenizer

FIELDS = ("prompt", "chosen", "rejected")


def read_pairs(path: str | Path) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected) of every record; a bad line is one ValueError naming the
    file, the line and the field."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data.preferences={str(path)!r} is not a file; give a JSONL "
                                "file of {\"prompt\", \"chosen\", \"rejected\"} records.")
    out = []
    for _, where, rec in jsonl.objects(p, lambda n: f"data.preferences: {p}:{n}",
                                       '{"prompt": "...", "chosen": "...", "rejected": "..."}'):
        for k in FIELDS:
            if k not in rec:
                raise ValueError(f"{where} has no field {k!r} (its fields: {sorted(rec)}); "
                                 "each record needs \"prompt\", \"chosen\" and \"rejected\".")
            if not isinstance(rec[k], str):
                raise ValueError(f"{where}: field {k!r} is a {type(rec[k]).__name__}, not "
                                 "text.")
        for k in ("chosen", "rejected"):
            if not rec[k]:
                raise ValueError(f"{where}: field {k!r} is empty; a response needs at "
                                 "least one token.")
        out.append(tuple(rec[k] for k in FIELDS))
    if len(out) < 2:
        raise ValueError(f"data.preferences={str(path)!r} holds {len(out)} pair(s); give at "
                         "least 2 (one is held out for validation).")
    return out


def window(prompt: np.ndarray, response: np.ndarray, seq_len: int):
    """(inputs [T], targets [T], mask [T]) of one prompt + response (see the module doc)."""
    response = response[: seq_len + 1]
    keep = max(0, seq_len + 1 - len(response))
    prompt = prompt[max(0, len(prompt) - keep):] if keep else prompt[:0]
    ids = np.concatenate([prompt, response]).astype(np.int32)
    n = len(ids)
    full = np.zeros(seq_len + 1, np.int32)
    full[:n] = ids
    mask = np.zeros(seq_len, np.float32)
    # target t is ids[t + 1]: a response token when t + 1 >= len(prompt)
    mask[max(len(prompt) - 1, 0): n - 1] = 1.0  # no prompt: the first token is not predicted
    return full[:-1], full[1:], mask


@dataclass
class PreferenceData:
    """Tokenized pairs, split into train and validation; `global_batch` as TextData's."""

    train: list  # [(prompt ids, chosen ids, rejected ids)]
    val: list
    seed: int
    max_id: int

    @classmethod
    def from_config(cls, cfg: DataConfig) -> PreferenceData:
        if not cfg.preferences:
            raise ValueError("train.objective=dpo needs preference pairs; pass "
                             "--data.preferences FILE.jsonl ({\"prompt\", \"chosen\", "
                             "\"rejected\"} records).")
        tok = load_tokenizer(cfg.tokenizer)
        pairs = [tuple(np.asarray(tok.encode(x), np.int32) for x in rec)
                 for rec in read_pairs(cfg.preferences)]
        n_val = max(1, int(len(pairs) * cfg.val_fraction))
        top = max(int(a.max(initial=0)) for rec in pairs for a in rec)
        return cls(pairs[: len(pairs) - n_val], pairs[len(pairs) - n_val:], cfg.seed, top)

    def check_vocab(self, vocab_size: int) -> None:
        if self.max_id >= vocab_size:
            raise ValueError(f"model.vocab_size={vocab_size} is too small for "
                             f"data.preferences, which holds token id {self.max_id}; pass "
                             f"--model.vocab-size {self.max_id + 1} or more.")

    def global_batch(self, step: int, batch_size: int, seq_len: int, split: str = "train",
                     rows: slice | np.ndarray | None = None) -> dict[str, np.ndarray]:
        """2 x batch_size rows (pairs interleaved); `rows` selects rows of that batch."""
        pairs = self.train if split == "train" else self.val
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1, step])
        pick = rng.integers(0, len(pairs), size=batch_size)
        out = {"inputs": [], "targets": [], "mask": []}
        for i in pick:
            prompt, chosen, rejected = pairs[i]
            for resp in (chosen, rejected):
                x, y, m = window(prompt, resp, seq_len)
                out["inputs"].append(x)
                out["targets"].append(y)
                out["mask"].append(m)
        batch = {k: np.stack(v) for k, v in out.items()}
        return batch if rows is None else {k: v[rows] for k, v in batch.items()}
