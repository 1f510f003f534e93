"""`python -m gendist COMMAND ...`: train, generate, prepare, export, plan, launch.

One function per command (`cmd_*`, registered in `COMMANDS`); `main` runs it through
`run_command`, which turns a mistake in the input (config, data, checkpoint, run directory)
into one line on stderr and exit code 2. GENDIST_TRACEBACK=1 shows the traceback instead.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from gendist.cli_data import UsageError
from gendist.cli_data import pop_option as _pop_option
from gendist.config import GenerateConfig
from gendist.presets import PRESETS as _PRESETS

PROG = "python -m gendist"
TRACEBACK_ENV = "GENDIST_TRACEBACK"
PRESETS = ", ".join(_PRESETS)

USAGE = f"""usage: {PROG} COMMAND [--preset NAME] [--section.field VALUE ...]

commands:
  train      train a model (default: the `tiny` preset on the bundled Shakespeare corpus,
             all devices data-parallel), checkpoint it, print validation loss and a sample
             (--no-sample skips it)
  generate   sample from a checkpoint: --checkpoint DIR [--prompt TEXT] [--generate.top-k K ...],
             from a Hugging Face Llama directory: --model-dir DIR [--draft-dir DIR], or from
             a preset with random weights (a decode benchmark): --preset NAME
  prepare    tokenize a corpus into token files: --out DIR --data.corpus ... --data.tokenizer T
  export     write a checkpoint as a Hugging Face Llama directory: --checkpoint RUN --out DIR
  plan       predicted vs compiled per-device memory and communication (and the pipeline
             bubble) for a config: plan [--devices N] [--no-compile] [overrides]
  launch     run N local processes of one multi-process job:
             launch --nproc N [--devices-per-process D] -- {PROG} train ...

--preset NAME starts from a named config ({PRESETS}; default tiny); --config FILE from a
run's saved config.yaml (flags after it override it). `train --init-from DIR` fine-tunes a
Hugging Face Llama directory (or a gendist run).
Every config field is a flag: `{PROG} train --help` lists them with their meaning.
A CPU is one device: XLA_FLAGS=--xla_force_host_platform_device_count=8 simulates 8 for the
multi-device examples. Mistakes in the input print one line (exit code 2);
{TRACEBACK_ENV}=1 adds the traceback."""


def _pop_flag(argv: list[str], name: str) -> bool:
    found = name in argv
    argv[:] = [a for a in argv if a != name]
    return found


def _box_text(text: str) -> str:
    """The message inside tyro's error box, as one line (its help footer dropped)."""
    lines = []
    for raw in text.splitlines():
        line = raw.strip().strip("│").strip()
        if raw.strip().startswith(("╭", "╰")):
            continue
        if line and set(line) <= {"─"}:
            break  # below the rule: argument help and "For full helptext, ..."
        if line:
            lines.append(line)
    return " ".join(lines) or " ".join(text.split())


def tyro_cli(cls, argv: list[str], prog: str, **kw):
    """`tyro.cli`, with a rejected command line raised as one UsageError line, not a box."""
    import contextlib
    import io

    import tyro
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return tyro.cli(cls, args=argv, prog=prog, **kw)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        raise UsageError(f"{_box_text(err.getvalue())} (`{prog} --help` lists every flag)"
                         ) from None


def parse_config(argv: list[str], command: str = "train", default_preset: str = "tiny",
                 extra_help: str = ""):
    """A Config from `--preset NAME` (or `--config FILE`) plus field overrides (tyro reads
    the field comments)."""
    from gendist.cli_data import base_config
    from gendist.config import Config, deferred_checks
    with deferred_checks():  # tyro would wrap our ValueErrors in a box: check afterwards
        base, what = base_config(argv, default_preset)
        description = (f"gendist {command}. --preset NAME picks the starting config "
                       f"({PRESETS}), --config FILE a saved one; here {what}. Every field "
                       f"below can be set.{extra_help}")
        cfg = tyro_cli(Config, argv, f"{PROG} {command}", default=base,
                       description=description)
    cfg.check()
    return cfg


def cmd_train(argv: list[str]) -> int:
    """Train (resuming train.out_dir's checkpoint of the same config), then print a sample."""
    argv = list(argv)
    sample = not _pop_flag(argv, "--no-sample")
    init_from = _pop_option(argv, "--init-from")
    cfg = parse_config(argv, "train", extra_help=" --no-sample (or --generate.max-new-tokens"
                       " 0) skips the sample printed at the end; --init-from DIR fine-tunes a"
                       " Hugging Face Llama directory or a gendist run.")
    from gendist.cli_data import resolve_train
    cfg, init_params, tok = resolve_train(cfg, init_from)
    from gendist import distributed
    from gendist.output import console
    distributed.maybe_initialize()  # a multi-process job (launch, SLURM, MPI): join it first
    console.route_logging()
    from gendist.training import loop
    result = loop.run(cfg, init_params=init_params)
    if sample and cfg.generate.max_new_tokens > 0:
        _print_sample(cfg, result.state["params"], tok)
    return 0


def _print_sample(cfg, params, tok) -> None:
    import jax

    from gendist.cli_data import sample
    from gendist.output import console
    if jax.process_count() > 1:  # every process takes part in gathering the shards
        from jax.experimental import multihost_utils
        params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
        g = cfg.generate
        text = sample(cfg.model, jax.device_get(params), tok, g, [g.prompt])[0]
        console.say("sample:\n" + g.prompt + text)


@dataclasses.dataclass(frozen=True)
class GenerateArgs:
    """Sample from a trained checkpoint (or a preset's random weights: --preset NAME). --prompt
    TEXT is short for --generate.prompt TEXT."""

    checkpoint: str = ""  # a run's train.out_dir (e.g. runs/default) or its checkpoints/ folder
    generate: GenerateConfig = dataclasses.field(default_factory=GenerateConfig)


def cmd_generate(argv: list[str]) -> int:
    """Sample from a checkpoint: --checkpoint DIR [--prompt TEXT] [--generate.* ...], from
    a Hugging Face directory: --model-dir DIR [--draft-dir DIR], or from a preset's random
    weights: --preset NAME (the decode path line and tokens/s on stderr: a benchmark)."""
    argv = list(argv)
    model_dir = _pop_option(argv, "--model-dir")
    if model_dir is not None:
        from gendist.cli_data import cmd_generate_model_dir
        return cmd_generate_model_dir(argv, model_dir)
    preset_name = _pop_option(argv, "--preset")
    prompt = _pop_option(argv, "--prompt")
    fields = {f.name.replace("_", "-") for f in dataclasses.fields(GenerateConfig)}
    argv = [f"--generate.{a[2:]}" if a.startswith("--") and a[2:].split("=")[0] in fields
            else a for a in argv]  # `--top-k 5` is accepted as `--generate.top-k 5`
    args = tyro_cli(GenerateArgs, argv, f"{PROG} generate")
    if not args.checkpoint and preset_name is None:
        raise UsageError("generate needs --checkpoint DIR (a run's train.out_dir, e.g. "
                         "runs/default, or its checkpoints/ folder), --model-dir DIR (a Hugging "
                         "Face Llama directory) or --preset NAME (random weights)")
    if args.checkpoint and preset_name is not None:
        raise UsageError("generate takes --checkpoint DIR or --preset NAME, not both: a "
                         "checkpoint holds its own config")
    g = args.generate if prompt is None else dataclasses.replace(args.generate, prompt=prompt)

    import jax

    from gendist.cli_data import run_tokenizer, sample
    if preset_name is not None:
        from gendist.data.tokenizer import load_tokenizer
        from gendist.models.params import init_params
        from gendist.presets import preset
        cfg = preset(preset_name)
        model_cfg, tok = cfg.model, load_tokenizer(cfg.data.tokenizer)
        params = init_params(model_cfg, g.seed)
        print(f"weights: random (preset {preset_name}; {model_cfg.params_text()}); give "
              "--checkpoint DIR for a trained model", flush=True)
    else:
        from gendist.training.serialize import load_params
        model_cfg, params, step = load_params(args.checkpoint)
        print(f"checkpoint {Path(args.checkpoint)} step {step}; {model_cfg.params_text()}",
              flush=True)
        params, tok = jax.device_get(params), run_tokenizer(args.checkpoint)
    text = sample(model_cfg, params, tok, g, [g.prompt])[0]
    print(g.prompt + text)
    return 0


def cmd_plan(argv: list[str]) -> int:
    """Predicted vs compiled memory and communication: [--devices N] [--no-compile] [overrides]."""
    argv = list(argv)
    devices = _pop_option(argv, "--devices")
    if devices is not None:
        if not devices.isdigit() or int(devices) < 1:
            raise UsageError(f"--devices {devices!r}: give a number of devices, e.g. 8")
        # Simulated CPU devices; must be set before the first backend call.
        from gendist.distributed import host_device_flags
        os.environ["XLA_FLAGS"] = host_device_flags(os.environ.get("XLA_FLAGS", ""), int(devices))
    compile_step = not _pop_flag(argv, "--no-compile")
    cfg = parse_config(argv, "plan", extra_help=" --devices N simulates N CPU devices; "
                       "--no-compile prints the predictions only.")
    from gendist.accounting import plan_report
    print(plan_report(cfg, compile_step=compile_step))
    return 0


def cmd_launch(argv: list[str]) -> int:
    """N local processes of one job: --nproc N [options] -- COMMAND ..."""
    from gendist.distributed import cmd_launch as launch
    return launch(argv)


def cmd_prepare(argv: list[str]) -> int:
    """Tokenize a corpus into token-file shards: --out DIR --data.corpus ... --data.tokenizer T."""
    from gendist.cli_data import cmd_prepare as prepare
    return prepare(argv)


def cmd_export(argv: list[str]) -> int:
    """A checkpoint as a Hugging Face Llama directory: --checkpoint RUN --out DIR."""
    from gendist.cli_data import cmd_export as export
    return export(argv)


COMMANDS = {"train": cmd_train, "generate": cmd_generate, "prepare": cmd_prepare,
            "export": cmd_export, "plan": cmd_plan, "launch": cmd_launch}


def _user_error_types():
    from gendist.training.checkpoint import CheckpointError
    return (ValueError, FileNotFoundError, NotADirectoryError, CheckpointError)


def _failure_types():
    """Runs that stopped for a reason worth one line, not a traceback (exit code 1)."""
    from gendist.distributed import DistributedError
    from gendist.training.train import NonFiniteLoss
    return (NonFiniteLoss, DistributedError)


_OURS = (str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] /
                                                    "pallas_kernels"))


def _raised_by_gendist(e: BaseException) -> bool:
    """The exception came from a check in gendist's own code, not from inside a library
    (a ValueError deep in jax is a bug to report, with its traceback)."""
    tb = e.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is not None and str(Path(last).resolve()).startswith(_OURS)


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def run_command(command: str, argv: list[str]) -> int:
    """Run one command; input mistakes end it with one line on stderr and exit code 2."""
    try:
        return COMMANDS[command](argv)
    except KeyboardInterrupt:
        print(f"{PROG} {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        if isinstance(e, _failure_types()):
            code = 1
        elif isinstance(e, _user_error_types()) and _raised_by_gendist(e):
            code = 2
        else:
            raise
        print(f"{PROG} {command}: error: {one_line(e)}", file=sys.stderr, flush=True)
        return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{PROG}: unknown command {command!r}; choose one of {', '.join(COMMANDS)} "
              f"(`{PROG} --help`)", file=sys.stderr)
        return 2
    return run_command(command, rest)


if __name__ == "__main__":
    sys.exit(main())
