"""`prepare`: tokenize a corpus into token-file shards plus a validation split."""

from __future__ import annotations

import dataclasses

from gendist.cli.args import parse
from gendist.config import DataConfig


@dataclasses.dataclass(frozen=True)
class PrepareArgs:
    """Tokenize a corpus into token-file shards plus a validation split (train on them with
    --data.tokens DIR)."""

    out: str  # folder for train_*.bin, val_*.bin, meta.json and a copy of the tokenizer
    data: DataConfig = dataclasses.field(default_factory=DataConfig)  # corpus, tokenizer, text field, split
    shard_tokens: int = 1 << 28  # tokens per shard file (uint16: 512 MiB)
    progress: bool = True  # show a progress bar


def cmd_prepare(argv: list[str]) -> int:
    from gendist.data.tokenfiles import prepare
    a = parse(PrepareArgs, argv, "prepare", description=PrepareArgs.__doc__)
    d = a.data
    meta = prepare(tuple(d.corpus), d.tokenizer, a.out, text_field=d.text_field,
                   val_fraction=d.val_fraction, shard_tokens=a.shard_tokens,
                   progress=a.progress)
    n = meta["num_tokens"]
    print(f"wrote {n['train']} train + {n['val']} validation tokens ({meta['dtype']}, "
          f"vocabulary {meta['vocab_size']}, {len(meta['train'])} + {len(meta['val'])} shards) "
          f"to {a.out}; train on them with --data.tokens {a.out}")
    return 0
