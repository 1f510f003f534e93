"""`python -m gendist {train,generate,prepare,export,plan,launch} [--preset NAME | --config FILE]
[--section.field VALUE ...]`.

Every config field is a flag (tyro reads the field comments as help): try
`python -m gendist train --help`.
"""

from __future__ import annotations

import dataclasses
import sys

USAGE = """usage: python -m gendist COMMAND [--preset NAME] [overrides]

commands:
  train      train a model (default: the `tiny` preset on the bundled Shakespeare corpus,
             all devices data-parallel), checkpoint it, print validation loss and a sample
  generate   sample from a checkpoint: --checkpoint DIR --prompt TEXT [--generate.* ...],
             or from a Hugging Face Llama directory: --model-dir DIR [--draft-dir DIR]
  prepare    tokenize a corpus into token files: --out DIR --data.corpus ... --data.tokenizer T
  export     write a checkpoint as a Hugging Face Llama directory: --checkpoint RUN --out DIR
  plan       predicted vs compiled per-device memory and communication (and the pipeline
             bubble) for a config: plan [--devices N] [--no-compile] [overrides]
  launch     run N local processes of one multi-process job:
             launch --nproc N [--devices-per-process D] -- python -m gendist train ...

`train --init-from DIR` fine-tunes a Hugging Face Llama directory (or a gendist run);
`--config run.yaml` starts from a run's saved config (flags after it override it).
`python -m gendist COMMAND --help` lists every field and its meaning."""


def _pop_option(argv: list[str], name: str, default: str | None = None) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
            del argv[i: i + 2]
            return value
        if a.startswith(name + "="):
            del argv[i]
            return a.split("=", 1)[1]
    return default


def parse_config(argv: list[str], default_preset: str = "tiny"):
    """A Config from `--preset NAME` plus field overrides (tyro)."""
    import tyro

    from gendist.cli_data import base_config
    from gendist.config import Config
    base, what = base_config(argv, default_preset)
    return tyro.cli(Config, default=base, args=argv,
                    description=f"gendist config ({what}); every field can be set.")


def cmd_train(argv: list[str]) -> int:
    from gendist import loop
    from gendist.cli_data import loss_unit, resolve_train, sample

    init_from = _pop_option(argv, "--init-from")
    cfg = parse_config(argv)
    cfg, init_params, tok = resolve_train(cfg, init_from)
    from gendist import distributed
    distributed.maybe_initialize()  # a multi-process job (launch, SLURM, MPI): join it first
    import jax
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}; "
          f"model: {cfg.model.num_params / 1e6:.2f}M params")
    result = loop.run(cfg, init_params=init_params)
    g = cfg.generate
    print(f"final validation loss: {result.val_loss:.4f} {loss_unit(tok)}")
    params = result.state["params"]
    if jax.process_count() > 1:  # every process takes part in gathering the shards
        from jax.experimental import multihost_utils
        params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
        text = sample(cfg.model, jax.device_get(params), tok, g, [g.prompt])[0]
        print("sample:\n" + g.prompt + text)
    return 0


def cmd_generate(argv: list[str]) -> int:
    import jax
    import tyro

    from gendist.cli_data import run_tokenizer, sample
    from gendist.config import GenerateConfig
    from gendist.serialize import load_params

    model_dir = _pop_option(argv, "--model-dir")
    if model_dir is not None:
        from gendist.cli_data import cmd_generate_model_dir
        return cmd_generate_model_dir(argv, model_dir)
    ckpt = _pop_option(argv, "--checkpoint")
    if ckpt is None:
        print("generate needs --checkpoint DIR (a run's out_dir or its checkpoints/ folder) "
              "or --model-dir DIR (a Hugging Face Llama directory)", file=sys.stderr)
        return 2
    prompt = _pop_option(argv, "--prompt")
    g = tyro.cli(GenerateConfig, args=argv, description="sampling options")
    if prompt is not None:
        g = dataclasses.replace(g, prompt=prompt)
    model_cfg, params, step = load_params(ckpt)
    print(f"checkpoint step {step}; {model_cfg.num_params / 1e6:.2f}M params")
    text = sample(model_cfg, jax.device_get(params), run_tokenizer(ckpt), g, [g.prompt])[0]
    print(g.prompt + text)
    return 0


COMMANDS = {"train": cmd_train, "generate": cmd_generate}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "plan":
        from gendist.accounting import cmd_plan
        return cmd_plan(rest, parse_config)
    if cmd in ("prepare", "export"):
        from gendist import cli_data
        return {"prepare": cli_data.cmd_prepare, "export": cli_data.cmd_export}[cmd](rest)
    if cmd == "launch":
        from gendist.distributed import cmd_launch
        return cmd_launch(rest)
    if cmd not in COMMANDS:
        print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return COMMANDS[cmd](rest)


if __name__ == "__main__":
    sys.exit(main())
