"""Multiple-choice tasks scored by log-likelihood, as lm-evaluation-harness scores them.

Each choice is a continuation of the example's context; its score is the summed log
probability of the choice's tokens given the context (Gao et al. 2021, "A framework for
few-shot language model evaluation", lm-evaluation-harness `loglikelihood` requests):

- tokens: trailing whitespace of the context moves onto the continuation, the continuation's
  tokens are those of (context + continuation) after the context's (the harness's
  `_encode_pair`); an empty context is replaced by one BOS (else EOS, else the byte
  tokenizer's newline) token, as the harness uses its prefix token;
- a sequence longer than the model's window loses tokens on the left (the context's);
- acc: the choice of highest summed log-likelihood is the gold one; acc_norm: of highest
  log-likelihood per UTF-8 byte of the choice text (byte-length normalisation, Gao 2021,
  "Multiple Choice Normalization in LM Evaluation", blog.eleuther.ai; the harness's code
  divides by len(choice) in characters, the same for ASCII text). Ties go to the first.

Requests are sorted by length and padded to `bucket_lengths`, batched and split over the
mesh's batch axes by the scorer.
"""

from __future__ import annotations

import math

import numpy as np

from gendist.evaluation.scorer import Scorer, bucket, bucket_lengths
from gendist.evaluation.tasks import Task, TaskError, contexts


def prefix_ids(tok) -> list[int]:
    """The token that stands for an empty context."""
    for i in (tok.bos_id, tok.eos_id):
        if i is not None:
            return [int(i)]
    sep = np.asarray(tok.separator)
    if len(sep):
        return [int(sep[-1])]
    raise ValueError(f"the tokenizer {tok.name} has no BOS, EOS or separator token to stand "
                     "for an empty context; give examples with a context.")


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-evaluation-harness tokenizes a request."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = [int(i) for i in tok.encode(context + continuation)]
    ctx = [int(i) for i in tok.encode(context)] if context else []
    cont = whole[len(ctx):]
    return (ctx or prefix_ids(tok)), cont


def requests(task: Task, tok, max_len: int, vocab_size: int, template: str, k: int,
             seed: int, delimiter: str, limit: int = 0) -> tuple[list[tuple[list[int], int]], int]:
    """(tokens of context + choice cut to max_len + 1, number of choice tokens) for every
    choice of the first `limit` examples (0: all), in order; and how many were cut."""
    out, cut = [], 0
    ctxs = contexts(task, template, k, seed, delimiter, limit)
    for e, ctx in zip(task.examples[: len(ctxs)], ctxs, strict=True):
        for j, choice in enumerate(e.choices):
            c, cont = encode_pair(tok, ctx, choice)
            where = f"--tasks {task.path}: line {e.line}: field 'choices' item {j}"
            if len(cont) > max_len:
                raise TaskError(f"{where} is {len(cont)} tokens, more than the model's "
                                f"window of {max_len}; shorten the choice.")
            seq = (c + cont)[-(max_len + 1):]
            cut += len(c) + len(cont) > len(seq)
            if max(seq) >= vocab_size:
                raise TaskError(f"{where}: its text holds token id {max(seq)} but the model "
                                f"embeds only {vocab_size}; give text of the characters it "
                                "was trained on.")
            out.append((seq, len(cont)))
    return out, cut


def loglikelihoods(scorer: Scorer, reqs: list[tuple[list[int], int]],
                   progress: bool = False) -> np.ndarray:
    """Summed log p(choice tokens | context) of each request (float64)."""
    lengths = bucket_lengths(scorer.cfg.max_seq_len)
    order = sorted(range(len(reqs)), key=lambda r: len(reqs[r][0]))
    groups: dict[int, list[int]] = {}
    for r in order:
        groups.setdefault(bucket(len(reqs[r][0]) - 1, lengths), []).append(r)
    out = np.zeros((len(reqs),), np.float64)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(reqs), desc="choices", unit=" choices", dynamic_ncols=True)
    try:
        for T, members in groups.items():
            inputs = np.zeros((len(members), T), np.int32)
            targets = np.zeros_like(inputs)
            mask = np.zeros((len(members), T), np.float32)
            for row, r in enumerate(members):
                seq, n_cont = reqs[r]
                L = len(seq) - 1
                inputs[row, :L], targets[row, :L] = seq[:-1], seq[1:]
                mask[row, L - n_cont: L] = 1.0
            out[members] = -scorer.row_nll(inputs, targets, mask, bar)
    finally:
        if bar is not None:
            bar.close()
    return out


def metrics(examples, lls: np.ndarray) -> dict:
    """acc and acc_norm (with the standard errors of their means) from the log-likelihoods
    of every choice of every example, in order."""
    acc, acc_norm, chance = [], [], []
    i = 0
    for e in examples:
        ll = lls[i: i + len(e.choices)]
        i += len(e.choices)
        nbytes = np.array([len(c.encode("utf-8")) for c in e.choices], np.float64)
        acc.append(float(np.argmax(ll) == e.gold))
        acc_norm.append(float(np.argmax(ll / nbytes) == e.gold))
        chance.append(1.0 / len(e.choices))
    return {"examples": len(acc), "acc": float(np.mean(acc)), "acc_stderr": _stderr(acc),
            "acc_norm": float(np.mean(acc_norm)), "acc_norm_stderr": _stderr(acc_norm),
            "chance": float(np.mean(chance))}


def _stderr(x: list[float]) -> float | None:
    """Standard error of the mean (sample standard deviation / sqrt(n)), as the harness."""
    if len(x) < 2:
        return None
    return float(np.std(x, ddof=1) / math.sqrt(len(x)))


def evaluate(scorer: Scorer, task: Task, tok, template: str = "{context}{choice}",
             num_fewshot: int = 0, seed: int = 1234, delimiter: str = "\n\n", limit: int = 0,
             progress: bool = False) -> dict:
    """acc and acc_norm of `task`'s first `limit` examples (0: all; few-shot examples come
    from the whole file) and the settings, the model given by `scorer`."""
    reqs, cut = requests(task, tok, scorer.cfg.max_seq_len, scorer.cfg.vocab_size, template,
                         num_fewshot, seed, delimiter, limit)
    lls = loglikelihoods(scorer, reqs, progress)
    n = limit or len(task.examples)
    return {"file": task.path, **metrics(task.examples[:n], lls), "num_fewshot": num_fewshot,
            "template": template, "seed": seed, "choices_scored": len(reqs),
            "truncated": cut}
