"""Perplexity of a token stream: nats per token and per byte, through `Scorer`.

Every token after the first is predicted once. Windows of `seq_len` targets start every
`stride` tokens (stride = seq_len: disjoint windows, the way training sees text); with a
shorter stride each window keeps only the targets no earlier window scored, so every kept
target sees at least seq_len - stride tokens of context (the sliding-window evaluation of
Hugging Face's perplexity guide). Windows are padded to seq_len and batches to the scorer's
batch size with masked positions, so the whole stream costs one compile.

Bytes are the UTF-8 bytes the scored tokens decode to (for the byte tokenizer, one a token;
special tokens such as EOS between documents count no bytes; other tokenizers decode a few
thousand tokens at a time, so a character cut at such a boundary may count a few bytes more). Nats per byte compare models
with different tokenizers (bits per byte = nats per byte / ln 2; Gao et al. 2020, The Pile,
section 4.1).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from gendist.evaluation.scorer import Scorer


def windows(n_tokens: int, seq_len: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first) of each window over a stream of n_tokens: inputs are tokens
    [begin, end), targets [begin + 1, end + 1), and targets from position `first` (of the
    stream) on are scored; together the windows score positions 1 .. n_tokens - 1 once."""
    if seq_len < 1 or not 1 <= stride <= seq_len:
        raise ValueError(f"windows of {seq_len} tokens every {stride}: need 1 <= stride <= "
                         "seq_len.")
    last = 0  # the last target position scored so far
    begin = 0
    while last < n_tokens - 1:
        end = min(begin + seq_len, n_tokens - 1)
        yield begin, end, last + 1
        last = end
        begin += stride


def count_bytes(tok, ids: np.ndarray) -> int:
    """UTF-8 bytes of the text these token ids stand for (special tokens: none)."""
    if tok is None or tok.name == "bytes":
        return int(len(ids))
    special = [i for i in (tok.eos_id, tok.bos_id) if i is not None]
    ids = np.asarray(ids)
    if special:
        ids = ids[~np.isin(ids, special)]
    return len(tok.decode(ids.tolist()).encode("utf-8"))


def perplexity(scorer: Scorer, stream, tok, seq_len: int, stride: int = 0,
               progress: bool = False) -> dict:
    """Summed loss, tokens and bytes of `stream` (an array or TokenStream), and the rates:
    nats per token and per byte, bits per byte, token and byte perplexity."""
    n = len(stream)
    if n < 2:
        raise ValueError(f"perplexity needs at least 2 tokens of text, got {n}; give more "
                         "text (or a larger --max-tokens).")
    if seq_len > scorer.cfg.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} is longer than the model's max_seq_len "
                         f"({scorer.cfg.max_seq_len}); pass --seq-len "
                         f"{scorer.cfg.max_seq_len} or less.")
    stride = stride or seq_len
    if stride > seq_len:
        raise ValueError(f"--stride {stride} is longer than the window (--seq-len "
                         f"{seq_len}); pass a stride of at most {seq_len}.")
    all_windows = list(windows(n, seq_len, stride))
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(all_windows), desc="perplexity", unit=" windows",
                   dynamic_ncols=True)
    nll, tokens, nbytes = 0.0, 0, 0
    per_call = scorer.batch_size * 8  # windows read from the stream at a time
    try:
        for lo in range(0, len(all_windows), per_call):
            chunk = all_windows[lo: lo + per_call]
            inputs = np.zeros((len(chunk), seq_len), np.int32)
            targets = np.zeros_like(inputs)
            mask = np.zeros((len(chunk), seq_len), np.float32)
            for r, (begin, end, first) in enumerate(chunk):
                win = np.asarray(stream[begin: end + 1]).astype(np.int32)
                L = end - begin
                inputs[r, :L], targets[r, :L] = win[:-1], win[1:]
                mask[r, first - begin - 1: L] = 1.0
            nll += float(np.sum(scorer.row_nll(inputs, targets, mask, bar)))
            tokens += int(mask.sum())
            first, last = chunk[0][2], chunk[-1][1]
            nbytes += count_bytes(tok, np.asarray(stream[first: last + 1]))
    finally:
        if bar is not None:
            bar.close()
    per_token = nll / tokens
    per_byte = nll / nbytes if nbytes else float("nan")
    return {"tokens": tokens, "bytes": nbytes, "nll_sum": nll, "seq_len": seq_len,
            "stride": stride, "windows": len(all_windows), "nats_per_token": per_token,
            "nats_per_byte": per_byte, "bits_per_byte": per_byte / math.log(2),
            "perplexity": math.exp(per_token), "byte_perplexity": math.exp(per_byte)}
