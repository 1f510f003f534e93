"""`eval`: perplexity (nats per byte and per token) of text and multiple-choice tasks of a
run's checkpoint or a Hugging Face Llama directory, batched and sharded over the mesh
(`gendist.evaluation`); a summary line for each, and a JSON report with `--out FILE`."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Literal

from gendist.cli.args import UsageError, parse
from gendist.config import INT32_MAX, DataConfig, MeshConfig


@dataclasses.dataclass(frozen=True)
class EvalArgs:
    """Evaluate a run (--checkpoint DIR) or a Hugging Face Llama directory (--model-dir DIR):
    the perplexity of text, in nats per byte and per token, and multiple-choice tasks
    (--tasks FILE ...: JSONL lines {"context": str, "choices": [str, ...], "gold": index},
    each choice scored by log p(choice | context) as lm-evaluation-harness does; acc and
    acc_norm, normalised by the choice's bytes). The text: --data.corpus FILES (all of it)
    or --data.tokens DIR (its validation split); by default the run's own validation text
    (with --model-dir, the bundled corpus's). --template 'Question: {context}\\nAnswer:
    {choice}' shapes each example (default '{context}{choice}': the choice continues the
    context directly; the template must end with {choice}); --num-fewshot k puts k other
    examples of the same file before each one, filled in with their gold choices and joined
    by --fewshot-delimiter, drawn with --seed."""

    checkpoint: str = ""  # a run's train.out_dir (e.g. runs/default) or its checkpoints/ folder
    model_dir: str = ""  # a Hugging Face Llama directory (config.json + safetensors)
    tokenizer: str = ""  # with --model-dir: a tokenizer file or "bytes" (default: the directory's)
    dtype: Literal["float32", "bfloat16"] = "float32"  # with --model-dir: compute dtype
    data: DataConfig = dataclasses.field(default_factory=DataConfig)  # the text for perplexity (tokenized with the model's tokenizer)
    split: Literal["auto", "val", "train", "all"] = "auto"  # auto: all of --data.corpus, else the validation split
    perplexity: bool = True  # --no-perplexity: only the tasks
    seq_len: int = 0  # tokens a perplexity window predicts (0 = the model's max_seq_len, at most 2048)
    stride: int = 0  # tokens between window starts (0 = seq_len: disjoint windows)
    max_tokens: int = 0  # score at most the first this many tokens of the text (0 = all)
    tasks: tuple[str, ...] = ()  # multiple-choice JSONL files, or bundled names (alphabet)
    template: str = "{context}{choice}"  # text of one example: {context}, then ending in {choice} (\n: a newline)
    num_fewshot: int = 0  # examples of the same file put before each one (k-shot)
    fewshot_delimiter: str = "\\n\\n"  # text after each few-shot example (\n: a newline, \t: a tab)
    seed: int = 1234  # which few-shot examples: a function of (seed, example)
    limit: int = 0  # evaluate the first this many examples of each task (0 = all)
    batch_size: int = 16  # sequences per forward (rounded up to a multiple of the data shards; lower it when the logits do not fit)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)  # devices: batches split over data
    out: str = ""  # write the JSON report to this file
    progress: bool = True  # show progress bars


DEFAULT_MAX_WINDOW = 2048  # logits of a batch are batch x window x vocabulary floats

_COUNTS = {"seq_len": 0, "stride": 0, "max_tokens": 0, "num_fewshot": 0, "seed": 0,
           "limit": 0, "batch_size": 1}  # smallest value of each count


def check_counts(args: EvalArgs) -> None:
    for name, lo in _COUNTS.items():
        v = getattr(args, name)
        if not lo <= v <= INT32_MAX:
            flag = f"--{name.replace('_', '-')}"
            raise UsageError(f"{flag} {v}: give an integer from {lo} to {INT32_MAX} "
                             f"(default {getattr(EvalArgs, name)}).")


def cmd_eval(argv: list[str]) -> int:
    args = parse(EvalArgs, argv, "eval", description=EvalArgs.__doc__)
    check_counts(args)
    sources = [f"--{n.replace('_', '-')}" for n in ("checkpoint", "model_dir") if getattr(args, n)]
    if len(sources) != 1:
        raise UsageError("eval takes one of --checkpoint DIR (a run's train.out_dir, e.g. "
                         "runs/default) / --model-dir DIR (a Hugging Face Llama directory)"
                         + (f", not {' and '.join(sources)}" if sources else ""))
    if not args.perplexity and not args.tasks:
        raise UsageError("--no-perplexity leaves nothing to evaluate; give --tasks FILE ...")
    if args.data.tokenizer != "bytes":
        raise UsageError(f"--data.tokenizer {args.data.tokenizer}: eval tokenizes text with the "
                         "model's own tokenizer; drop it (with --model-dir, --tokenizer FILE "
                         "names the model's).")
    if args.out and Path(args.out).is_dir():
        raise UsageError(f"--out {args.out!r} is a folder; give a file name for the JSON "
                         "report, e.g. --out eval.json.")
    template, delimiter = unescape(args.template), unescape(args.fewshot_delimiter)
    from gendist.evaluation import tasks as task_lib
    task_lib.check_template(template)
    tasks = [task_lib.read_task(t) for t in args.tasks]  # every file checked before the model
    for t in tasks:
        task_lib.check_fewshot(t, args.num_fewshot)

    model_cfg, params, tok, about, run_data = _load_model(args)
    from gendist.evaluation.scorer import make_scorer
    from gendist.sharding import make_mesh
    mesh = make_mesh(args.mesh)
    scorer = make_scorer(model_cfg, params, mesh, args.batch_size)
    report = {"model": about, "mesh": dict(mesh.shape), "batch_size": scorer.batch_size}
    progress = args.progress and sys.stderr.isatty()
    if args.perplexity:
        given = any(a.startswith("--data.") for a in argv)
        data = args.data if given or run_data is None else run_data
        stream, text_tok, what, split = eval_text(data, args.split, given, tok, model_cfg)
        if args.max_tokens:
            stream = stream[: args.max_tokens]
        from gendist.evaluation.perplexity import perplexity
        seq_len = args.seq_len or min(model_cfg.max_seq_len, DEFAULT_MAX_WINDOW)
        r = perplexity(scorer, stream, text_tok, seq_len, args.stride, progress)
        report["perplexity"] = {"text": what, "split": split, **r}
        print(f"perplexity: {r['nats_per_byte']:.4f} nats/byte ({r['bits_per_byte']:.4f} "
              f"bits/byte), {r['nats_per_token']:.4f} nats/token (perplexity "
              f"{r['perplexity']:.3f}) over {r['tokens']} tokens, {r['bytes']} bytes of {what}",
              flush=True)
    if tasks:
        from gendist.evaluation.multiple_choice import evaluate
        report["tasks"] = {}
        for t in tasks:
            r = evaluate(scorer, t, tok, template, args.num_fewshot, args.seed, delimiter,
                         args.limit, progress)
            name = t.name if t.name not in report["tasks"] else t.path
            report["tasks"][name] = r
            print(f"task {name}: acc {r['acc']:.4f}{_pm(r['acc_stderr'])}, acc_norm "
                  f"{r['acc_norm']:.4f}{_pm(r['acc_norm_stderr'])} (chance {r['chance']:.4f}) "
                  f"on {r['examples']} examples, {args.num_fewshot}-shot", flush=True)
    if args.out:
        write_report(report, args.out)
        print(f"report: {args.out}")
    return 0


def unescape(text: str) -> str:
    """\\n and \\t typed on a command line as a newline and a tab (\\\\: a backslash)."""
    out, i = [], 0
    while i < len(text):
        pair = text[i: i + 2]
        if pair in ("\\n", "\\t", "\\\\"):
            out.append({"\\n": "\n", "\\t": "\t", "\\\\": "\\"}[pair])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _pm(stderr) -> str:
    return "" if stderr is None else f" ± {stderr:.4f}"


def _load_model(args: EvalArgs):
    """(model config, params, tokenizer, a description, the run's data config or None)."""
    from gendist.cli.generate import check_tokenizer_fits
    if args.model_dir:
        from gendist import hf
        from gendist.cli.generate import _model_dir_config
        from gendist.config import ModelConfig
        from gendist.data.tokenizer import find_tokenizer_file, load_tokenizer
        cfg = _model_dir_config(args.model_dir, "--model-dir", ModelConfig(dtype=args.dtype))
        if not args.tokenizer and find_tokenizer_file(Path(args.model_dir)) is None:
            raise FileNotFoundError(f"--model-dir {args.model_dir!r} has no tokenizer.json, "
                                    "tokenizer.model or gendist_tokenizer.json; pass "
                                    "--tokenizer FILE (or --tokenizer bytes).")
        tok = load_tokenizer(args.tokenizer or args.model_dir)
        check_tokenizer_fits(cfg, tok, f"the tokenizer ({tok.name})",
                             f"--model-dir {args.model_dir}")
        params = hf.load_params(args.model_dir, cfg)
        about = {"source": f"--model-dir {args.model_dir}", "params": cfg.num_params,
                 "tokenizer": tok.name}
        return cfg, params, tok, about, None
    from gendist import config_yaml
    from gendist.cli.generate import run_tokenizer
    from gendist.training.serialize import find_checkpoint_dir, load_params
    ckpt = find_checkpoint_dir(args.checkpoint)
    tok = run_tokenizer(args.checkpoint)
    cfg, params, step = load_params(args.checkpoint)
    check_tokenizer_fits(cfg, tok, f"the run's tokenizer ({tok.name})",
                         f"--checkpoint {args.checkpoint}")
    saved = ckpt.parent / config_yaml.YAML_NAME
    run_data = config_yaml.load(saved).data if saved.is_file() else None
    about = {"source": f"--checkpoint {args.checkpoint}", "step": step,
             "params": cfg.num_params, "tokenizer": tok.name}
    return cfg, params, tok, about, run_data


def eval_text(data: DataConfig, split: str, given: bool, tok, model_cfg):
    """(token stream, tokenizer that decodes it, a description, the split) of the text to
    score: --data.tokens' files (auto: the validation split) or a corpus tokenized with the
    model's tokenizer (auto: all of a --data.corpus the user gave, else the validation
    split, cut as training cuts it: the last data.val_fraction)."""
    import numpy as np
    if data.tokens:
        from gendist.data.tokenfiles import TokenStream, open_token_dir, tokenizer_of
        from gendist.data.tokenizer import load_tokenizer
        train, val, meta = open_token_dir(data.tokens)
        files_tok = load_tokenizer(tokenizer_of(data.tokens, meta)) if meta.get("tokenizer") \
            else tok
        if files_tok.vocab_size != tok.vocab_size or (files_tok.name == "bytes") != (
                tok.name == "bytes"):
            raise ValueError(f"--data.tokens {data.tokens}: its tokens come from the tokenizer "
                             f"{files_tok.name} ({files_tok.vocab_size} tokens) but the model "
                             f"reads {tok.name} ({tok.vocab_size}); prepare the text with the "
                             "model's tokenizer.")
        split = "val" if split == "auto" else split
        stream = {"val": val, "train": train,
                  "all": TokenStream([*train.shards, *val.shards])}[split]
        top = meta.get("max_token_id")
        top = stream.max_id() if top is None else top
        what, tok = f"the {split} split of --data.tokens {data.tokens}", files_tok
    else:
        from gendist.data.corpus import load_tokens
        tokens = load_tokens(tuple(data.corpus), tok, data.text_field)
        split = ("all" if given and data.corpus else "val") if split == "auto" else split
        n_val = int(len(tokens) * data.val_fraction)
        cut = len(tokens) - n_val
        stream = {"all": tokens, "train": tokens[:cut], "val": tokens[cut:]}[split]
        source = (f"--data.corpus {' '.join(data.corpus)}" if data.corpus
                  else "the bundled corpus")
        what = source if split == "all" else f"the {split} split of {source}"
        top = int(np.max(stream)) if len(stream) else -1
    if top >= model_cfg.vocab_size:
        raise ValueError(f"{what} holds token id {top} but the model embeds only "
                         f"{model_cfg.vocab_size}; give text of the characters it was "
                         "trained on.")
    return stream, tok, what, split


def write_report(report: dict, out: str) -> None:
    """The JSON report, written whole (a temporary file beside it, then renamed)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(_finite(report), indent=1, allow_nan=False) + "\n")
    tmp.replace(path)


def _finite(x):
    """NaN and infinities as null (JSON has no such numbers)."""
    import math
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x
