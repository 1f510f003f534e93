"""`python -m gendist {train,generate,plan,launch} [--preset NAME] [--section.field VALUE ...]`.

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
  generate   sample from a checkpoint: --checkpoint DIR --prompt TEXT [--generate.* ...]
  plan       predicted vs compiled per-device memory and communication (and the pipeline
             bubble) for a config: plan [--devices N] [--no-compile] [overrides]
  launch     run N local processes of one multi-process job:
             launch --nproc N [--devices-per-process D] -- python -m gendist train ...

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

    from gendist.config import Config, preset
    name = _pop_option(argv, "--preset", default_preset)
    return tyro.cli(Config, default=preset(name), args=argv,
                    description=f"gendist config (preset {name!r}); every field can be set.")


def cmd_train(argv: list[str]) -> int:
    from gendist import loop
    from gendist.inference.generate import generate_text
    from gendist.inference.sampling import SamplingParams

    cfg = parse_config(argv)
    from gendist import distributed
    distributed.maybe_initialize()  # a multi-process job (launch, SLURM, MPI): join it first
    import jax
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}; "
          f"model: {cfg.model.num_params / 1e6:.2f}M params")
    result = loop.run(cfg)
    g = cfg.generate
    print(f"final validation loss: {result.val_loss:.4f} nats/byte (uniform: 5.545)")
    params = result.state["params"]
    if jax.process_count() > 1:  # every process takes part in gathering the shards
        from jax.experimental import multihost_utils
        params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
        sp = SamplingParams(g.temperature, g.top_k, g.top_p)
        text = generate_text(cfg.model, jax.device_get(params), [g.prompt],
                             max_new_tokens=g.max_new_tokens, sp=sp, seed=g.seed,
                             eos_id=g.eos_id)[0]
        print("sample:\n" + g.prompt + text)
    return 0


def cmd_generate(argv: list[str]) -> int:
    import jax
    import tyro

    from gendist.config import GenerateConfig
    from gendist.inference.generate import generate_text
    from gendist.inference.sampling import SamplingParams
    from gendist.serialize import load_params

    ckpt = _pop_option(argv, "--checkpoint")
    if ckpt is None:
        print("generate needs --checkpoint DIR (a run's out_dir or its checkpoints/ folder)",
              file=sys.stderr)
        return 2
    prompt = _pop_option(argv, "--prompt")
    g = tyro.cli(GenerateConfig, args=argv, description="sampling options")
    if prompt is not None:
        g = dataclasses.replace(g, prompt=prompt)
    model_cfg, params, step = load_params(ckpt)
    print(f"checkpoint step {step}; {model_cfg.num_params / 1e6:.2f}M params")
    text = generate_text(model_cfg, jax.device_get(params), [g.prompt],
                         max_new_tokens=g.max_new_tokens,
                         sp=SamplingParams(g.temperature, g.top_k, g.top_p), seed=g.seed,
                         eos_id=g.eos_id)[0]
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
    if cmd == "launch":
        from gendist.distributed import cmd_launch
        return cmd_launch(rest)
    if cmd not in COMMANDS:
        print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return COMMANDS[cmd](rest)


if __name__ == "__main__":
    sys.exit(main())
