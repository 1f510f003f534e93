"""Evaluating a model: perplexity and multiple-choice tasks (`python -m gendist eval`).

    scorer           the model on the mesh and its one jitted masked loss (the training
                     loss's per-token form), batches padded to a few lengths
    perplexity       nats per token and per byte of a token stream, in windows
    tasks            multiple-choice task files (JSONL), templates, few-shot contexts
    multiple_choice  log-likelihood scoring of the choices, acc and acc_norm
"""
