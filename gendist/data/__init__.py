"""Where tokens come from and how they become batches.

    corpus      text sources (files, globs, .jsonl, Parquet/Arrow) and the bundled corpus
    tokenizer   byte-level, Hugging Face tokenizer.json and SentencePiece tokenizers
    tokenfiles  `prepare`: token shards on disk, read back with np.memmap
    batches     token windows, train/validation splits, batches sharded over `data`
"""
