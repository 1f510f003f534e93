"""`train`: train a config (resuming its run directory), optionally from a Hugging Face
Llama directory or another run (`--init-from`), then print a sample."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Annotated

import tyro

from gendist.cli.args import PROG, parse_with_config
from gendist.config import Config


@dataclasses.dataclass(frozen=True)
class TrainArgs:
    config: Annotated[Config, tyro.conf.arg(name="")]
    no_sample: bool = False  # skip the sample printed at the end (so does --generate.max-new-tokens 0)
    init_from: str = ""  # fine-tune from a Hugging Face Llama directory or a gendist run directory


def cmd_train(argv: list[str]) -> int:
    """Train (resuming train.out_dir's checkpoint of the same config), then print a sample."""
    args = parse_with_config(TrainArgs, argv, "train", "gendist train: train a model, "
                             "checkpoint it, print the validation loss and a sample.")
    cfg, init_params, tok = resolve_train(args.config, args.init_from or None,
                                          vocab_given=_given(argv, "--model.vocab-size"))
    if not args.no_sample and cfg.generate.max_new_tokens > 0:  # not only after training
        from gendist.cli.generate import check_prompt
        check_prompt(cfg.model, tok, cfg.generate, [cfg.generate.prompt])
    from gendist import distributed
    from gendist.output import console
    distributed.maybe_initialize()  # a multi-process job (launch, SLURM, MPI): join it first
    console.route_logging()
    from gendist.training import loop
    try:
        result = loop.run(cfg, init_params=init_params)
    except loop.Preempted as e:  # checkpointed on SIGINT/SIGTERM: exit 130/143 with one line
        print(f"{PROG} train: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    if not args.no_sample and cfg.generate.max_new_tokens > 0:
        print_sample(cfg, result.setup.model_params(result.state), tok)  # LoRA: merged
    return 0


def print_sample(cfg: Config, params, tok) -> None:
    """A sample of `cfg.generate` from a run's params (gathered from every process)."""
    import jax

    from gendist.cli.generate import sample
    from gendist.output import console
    if jax.process_count() > 1:  # every process takes part in gathering the shards
        from jax.experimental import multihost_utils
        params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
        g = cfg.generate
        text = sample(cfg.model, jax.device_get(params), tok, g, [g.prompt])[0]
        console.say("sample:\n" + g.prompt + text)


def _given(argv: list[str], flag: str) -> bool:
    """Whether the command line sets `flag` (either spelling: --a.b-c or --a.b_c)."""
    spellings = {flag, flag.replace("-", "_").replace("__", "--", 1)}
    return any(a.split("=", 1)[0] in spellings for a in argv)


def check_out_dir(out_dir: str) -> None:
    """train.out_dir must be a folder or not exist yet (nor sit below a file)."""
    p = Path(out_dir)
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                what = "is a file" if q == p else f"lies below the file {str(q)!r}"
                raise ValueError(f"train.out_dir={out_dir!r} {what}; pass --train.out-dir "
                                 "with a folder for the run (e.g. runs/default).")
            return


def resolve_train(cfg: Config, init_from: str | None = None, vocab_given: bool = False):
    """(config, init_params or None, tokenizer) for a training run.

    `init_from`: a Hugging Face model directory (config.json + safetensors) or a gendist
    run directory; the architecture comes from it (runtime fields such as dtype from the
    flags), and so does the tokenizer when data.tokenizer is left at bytes. Then
    model.vocab_size follows the tokenizer: raised to its vocabulary when smaller (a larger
    value is kept, e.g. padded to a multiple of mesh.tensor) unless the user set it
    (`vocab_given`: --model.vocab-size on the command line), when a smaller one is refused;
    a loaded model's vocabulary is fixed, so a larger tokenizer is refused.
    """
    from gendist import hf
    from gendist.data.tokenfiles import META
    from gendist.data.tokenizer import find_tokenizer_file, load_tokenizer
    check_out_dir(cfg.train.out_dir)
    init = None
    m, d = cfg.model, cfg.data
    max_id = None
    if d.tokens and (Path(d.tokens) / META).is_file():
        from gendist.data.tokenfiles import open_token_dir, tokenizer_of
        meta = open_token_dir(d.tokens)[2]
        d = dataclasses.replace(d, tokenizer=tokenizer_of(d.tokens, meta))
        max_id = meta.get("max_token_id")
    if init_from is not None:
        src = Path(init_from)
        if not src.is_dir():
            raise FileNotFoundError(
                f"--init-from {init_from!r} is not a directory; give a Hugging Face Llama "
                "directory (config.json + *.safetensors) or a gendist run (its train.out_dir).")
        if (src / hf.CONFIG).is_file():
            m = hf.model_config_from_hf(hf.read_config(src), m)
            init = lambda shardings: hf.load_params(src, m, shardings)  # noqa: E731
        elif (src / "checkpoints").is_dir() or src.name == "checkpoints":
            import jax

            from gendist.training.serialize import load_params
            loaded_cfg, params, _ = load_params(src, flag="--init-from")
            m = dataclasses.replace(loaded_cfg, **{f: getattr(m, f) for f in hf.RUNTIME_FIELDS})
            init = jax.device_get(params)  # host arrays: placed per shard by loop.run
        else:
            raise FileNotFoundError(
                f"--init-from {init_from!r} holds neither {hf.CONFIG} (a Hugging Face Llama "
                "directory) nor checkpoints/ (a gendist run); give one of those.")
        if d.tokenizer == "bytes" and not d.tokens and find_tokenizer_file(src):
            d = dataclasses.replace(d, tokenizer=str(src))
    tok = load_tokenizer(d.tokenizer)
    # Bytes: the model's vocabulary is the user's (text that uses only ASCII trains with 128;
    # the data check refuses ids it cannot embed). A tokenizer's vocabulary is followed.
    if m.vocab_size < tok.vocab_size and tok.name != "bytes":
        if init is not None:
            raise ValueError(
                f"data.tokenizer={d.tokenizer!r} has {tok.vocab_size} tokens but the model "
                f"from {init_from} embeds only {m.vocab_size}; use the model's own tokenizer.")
        if vocab_given:
            source = (f"the token files of --data.tokens {d.tokens} (ids up to {max_id}, "
                      f"tokenizer {tok.name})" if d.tokens else f"--data.tokenizer {d.tokenizer}")
            raise ValueError(
                f"--model.vocab-size {m.vocab_size} is smaller than the {tok.vocab_size}-token "
                f"vocabulary of {source}; pass --model.vocab-size {tok.vocab_size} or more, "
                "or leave --model.vocab-size out to follow the tokenizer.")
        m = dataclasses.replace(m, vocab_size=tok.vocab_size)
    return dataclasses.replace(cfg, model=m, data=d), init, tok
